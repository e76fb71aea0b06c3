"""Resolving schemes from user input: mixed-scheme layer ranges, scheme files and dicts named like presets."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvbits.plan import ModelShape, plan
from kvbits.schemes import KVScheme, TensorSpec, get_scheme
from kvbits.schemes.presets import MAX_LAYERS

# ------------------------------------------------------------------------------ mixed-scheme layer ranges


def test_huge_layer_range_is_refused_before_it_is_expanded():
    """'0-99999999' was expanded into one override per layer before the layer count was checked: the
    process never returned and kept allocating. Run in a child with a memory cap and a timeout, so the
    old behaviour fails the test instead of the machine."""
    code = textwrap.dedent(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from kvbits.schemes import get_scheme
        try:
            get_scheme("int8-token,0-99999999=fp16")
        except ValueError as exc:
            print(exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "layer 99999999 (in '0-99999999') is out of range" in out.stdout
    assert f"at most {MAX_LAYERS} layers" in out.stdout


@pytest.mark.parametrize(
    "spec, bad",
    [
        (f"int4-token,{MAX_LAYERS}=fp16", str(MAX_LAYERS)),
        (f"int4-token,0-{MAX_LAYERS}=fp16", str(MAX_LAYERS)),
        # int() refuses over 4300 digits; the index and its range are cut as the scheme string is (SHOWN_CHARS)
        ("int4-token,0-" + "9" * 5000 + "=fp16", "9" * 120 + r"\.\.\. \(5000 digits\)"),
    ],
)
def test_layer_indices_beyond_the_limit_are_a_clear_error(spec, bad):
    with pytest.raises(ValueError, match=rf"layer {bad} \(in '.*'(\.\.\. \(\d+ characters\))?\) is out of range") as info:
        get_scheme(spec)
    assert len(str(info.value)) < 800  # a 5000-digit index was echoed whole, twice: a 10,296-character message


def test_non_ascii_digits_are_not_layer_indices():
    """str.isdigit() took '²', which int() then refused with a bare 'invalid literal' error."""
    with pytest.raises(ValueError, match=r"expected BASE,LAYER=SCHEME.*got '0-²=fp16'"):
        get_scheme("int4-token,0-²=fp16")


def test_the_last_allowed_layer_index_parses():
    m = get_scheme(f"int4-token,{MAX_LAYERS - 1}=fp16")
    assert [i for i, _ in m.layers] == [MAX_LAYERS - 1]


def test_a_range_past_the_model_keeps_its_message_and_a_long_one_is_shortened():
    shape = ModelShape.from_dims(2, 2, 64)
    with pytest.raises(ValueError, match=r"overrides layers \[2, 3, 4, 5\], beyond the model's 2 layers"):
        plan(shape, context=1024, scheme="int8-token,0-5=fp16")
    with pytest.raises(ValueError) as info:
        plan(shape, context=1024, scheme="int8-token,0-60000=fp16")
    assert str(info.value) == (
        "mixed scheme 'int8-token,0-60000=fp16' overrides layers [2, 3, 4, ..., 60000] (59999 layers), "
        "beyond the model's 2 layers"
    )


# ------------------------------------------------------------------------------ preset names taken by files


def _int2_named(name: str) -> dict:
    return {**get_scheme("int2-token").to_dict(), "name": name}


def test_scheme_file_named_like_a_preset_but_different_is_refused(tmp_path):
    """A file holding int2-token under the name 'fp16' was planned, reported and resolved by name as the
    unquantized baseline."""
    path = tmp_path / "fakefp16.json"
    path.write_text(json.dumps(_int2_named("fp16")))
    with pytest.raises(ValueError, match=r"fakefp16\.json: scheme name 'fp16' is the name of a kvbits preset.*"
                       r"differs from it \(key, value\); rename it"):  # fmt: skip
        get_scheme(str(path))
    with pytest.raises(ValueError, match="rename it"):
        plan(ModelShape.from_dims(2, 2, 64), context=1024, scheme=str(path))


def test_scheme_dict_named_like_a_preset_but_different_is_refused():
    with pytest.raises(ValueError, match=r"scheme dict: scheme name 'fp16' is the name of a kvbits preset"):
        get_scheme(_int2_named("fp16"))
    # a per-layer override under a preset's name, and a name that is a mixed scheme string of presets
    with pytest.raises(ValueError, match=r"layer 0's override scheme name 'fp16'"):
        get_scheme({"name": "my-mix", "layers": {"0": _int2_named("fp16")}})
    with pytest.raises(ValueError, match=r"'fp16,0=bf16' is the name of a kvbits mixed scheme of presets"):
        get_scheme(_int2_named("fp16,0=bf16"))


def test_scheme_file_with_a_preset_name_and_the_same_content_is_accepted(tmp_path):
    for name in ("fp16", "kivi-2", "int4-token,0-1=int8-token,5=fp16"):
        preset = get_scheme(name)
        path = tmp_path / "same.json"
        path.write_text(preset.to_json())
        assert get_scheme(str(path)) == preset
        # the description and reference are for people: an edited one stores the same cache
        assert get_scheme({**preset.to_dict(), "description": "mine", "reference": ""}).name == name
    renamed = get_scheme(_int2_named("int2-mine"))
    assert isinstance(renamed, KVScheme) and renamed.key == get_scheme("int2-token").key


def test_a_spec_dict_of_codes_without_fmt_is_the_presets():
    """An int / NUQ spec written without ``fmt`` took the dataclass default ``"fp16"``, which the presets do not
    have: ``{"kind": "int", "bits": 4}`` named int4-token was refused as differing from the preset it stores."""
    d = {"name": "int4-token", "key": {"kind": "int", "bits": 4}, "value": {"kind": "int", "bits": 4}}
    assert get_scheme(d).replace(description="") == get_scheme("int4-token").replace(description="")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"kind": "int", "bits": 4, "fmt": "bogus"}, "a int TensorSpec stores codes, not a float format"),
        ({"kind": "nuq", "bits": 4, "fmt": "e5m2"}, "a nuq TensorSpec stores codes"),
        ({"kind": "float", "outlier_frac": 0.2}, "outlier_frac, static and pre_rope apply to quantized specs"),
        ({"kind": "float", "static": True}, "apply to quantized specs"),
        ({"kind": "float", "pre_rope": True}, "apply to quantized specs"),
        ({"kind": "float", "symmetric": True}, "symmetric and granularity apply to quantized specs"),
        ({"kind": "float", "granularity": "channel"}, "symmetric and granularity apply to quantized specs"),
        ({"kind": "fp8", "bits": 8, "fmt": "e4m3", "symmetric": True}, "fp8 TensorSpec is symmetric by construction"),
    ],
)
def test_spec_fields_that_would_be_ignored_are_refused(spec, match):
    """Each was accepted and then ignored: a float spec stored no outliers, an int spec had no float format, a
    float spec with symmetric=True and granularity='channel' stored the same 10,240 bytes exactly as fp16, an
    fp8 spec with symmetric=True the same codes as fp8-e4m3-token (and its JSON named so was then refused)."""
    from kvbits.schemes import TensorSpec

    with pytest.raises(ValueError, match=match):
        TensorSpec.from_dict(spec)


def test_a_scheme_version_of_another_type_is_named_with_its_type():
    with pytest.raises(ValueError, match=r"scheme format version '1' is not supported \(expected 1\)"):
        KVScheme.from_dict({"name": "x", "version": "1"})


def test_spaces_around_a_mixed_schemes_parts_are_not_part_of_the_names():
    """'int4-token,0= fp16' was refused as "unknown scheme ' fp16'"; spaces around the commas were already stripped."""
    for spec in ("int4-token,0= fp16", "int4-token, 0 = fp16 ", "int4-token,0=fp16"):
        s = get_scheme(spec)
        assert s.for_layer(0).name == "fp16" and s.for_layer(1).key == get_scheme("int4-token").key


def test_a_python_spec_of_codes_without_fmt_equals_the_presets():
    """``TensorSpec(kind="int", ...)`` written in Python without ``fmt=None`` kept the dataclass default ``"fp16"``,
    so it stored what the preset stores yet compared unequal to it: ``kvbits export`` refused a scheme of
    ``vllm-int8``'s own specs ("vLLM has no KV-cache format storing 'mine'"), a calibration made for
    ``kvquant-4`` was refused for the same specs, and a scheme JSON with ``"fmt": "fp16"`` named ``int4-token``
    was refused as differing from the preset."""
    from kvbits.export.vllm_flags import vllm_cache_args

    k = TensorSpec(kind="int", bits=8, symmetric=True, rounding="trunc", scale_dtype="fp32")
    assert k.fmt is None and k == get_scheme("vllm-int8").key and "fmt" in k.to_dict()
    assert vllm_cache_args(KVScheme("mine", key=k, value=k)).kv_cache_dtype == "int8_per_token_head"
    nuq = TensorSpec(kind="nuq", bits=4, granularity="channel", static=True, outlier_frac=0.01, pre_rope=True)
    assert nuq == get_scheme("kvquant-4").key
    spec = {"kind": "int", "bits": 4, "fmt": "fp16"}
    named = get_scheme({"name": "int4-token", "key": spec, "value": spec})
    assert named.key == get_scheme("int4-token").key and TensorSpec.from_dict(named.key.to_dict()) == named.key


def test_a_scheme_file_that_is_not_text_is_named_in_the_error(tmp_path):
    """A ``--scheme x.json`` holding binary bytes (a safetensors file renamed, a UTF-16 export) failed with
    ``'utf-8' codec can't decode byte 0xff in position 0: invalid start byte``, naming no file."""
    path = tmp_path / "mix.json"
    path.write_bytes(b"\xff\xfe{\x00}\x00")
    with pytest.raises(ValueError, match=r"mix\.json is not a valid kvbits scheme JSON: 'utf-8' codec"):
        get_scheme(str(path))


@pytest.mark.parametrize(
    "content, said",
    [
        ({"name": "b5", "key": {"kind": "int", "bits": 5}}, r"needs bits in \(2, 3, 4, 8\), got 5"),
        ({"name": "neg", "sinks": -1}, r"need sinks >= 0"),
        ({"name": "lay", "layers": {"x": {"name": "a"}}}, r"keys are layer indices"),
    ],
    ids=["bits", "sinks", "layers"],
)
def test_a_scheme_file_refused_by_a_field_check_is_named_in_the_error(tmp_path, content, said):
    """A scheme file whose field a check refuses (bits=5, sinks=-1) gave the check's message alone (``TensorSpec(
    kind='int') needs bits in (2, 3, 4, 8), got 5``): with several ``--scheme`` files, which one was not said."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"mine\.json is not a valid kvbits scheme JSON: .*" + said):
        get_scheme(str(path))


def test_a_utf8_scheme_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    """Scheme files were read in the locale's encoding: under ``LC_ALL=C`` a description with one non-ASCII
    character ('café') was refused (``'ascii' codec can't decode``)."""
    import os

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "description": "café", "key": {"kind": "int", "bits": 4}},
                               ensure_ascii=False), encoding="utf-8")  # fmt: skip
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = "import sys; from kvbits.schemes import get_scheme; assert get_scheme(sys.argv[1]).description == 'caf\\u00e9'"
    run = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-500:]


@pytest.mark.parametrize("window", [0, -5])
def test_a_window_below_one_is_refused_by_the_accounting(window):
    """``token_split(int4-token, 10, sliding_window=0)`` held ``full=-1`` token and ``layer_bytes`` -128 bytes per
    side (-768 at a window of -5): a negative window count passed as storage. The cache refuses windows below 1."""
    from kvbits.schemes import layer_bytes, token_split

    scheme = get_scheme("int4-token")
    with pytest.raises(ValueError, match=rf"sliding_window must be >= 1 .*got {window}"):
        token_split(scheme, 10, window)
    with pytest.raises(ValueError, match=r"sliding_window must be >= 1"):
        layer_bytes(scheme, 10, batch=1, n_heads=1, head_dim=64, sliding_window=window)
    assert token_split(scheme, 10, 1).stored == 0  # a window of 1 keeps W - 1 = 0 tokens, as the cache does


def test_a_scheme_file_whose_path_holds_commas_and_equals_is_read(tmp_path):
    """A scheme file in a folder named as sweeps name them (``lr=0.1,bs=2/mine.json``) was parsed as a mixed
    scheme string and refused (``expected BASE,LAYER=SCHEME ... got 'bs=2/mine.json'``)."""
    folder = tmp_path / "lr=0.1,bs=2"
    folder.mkdir()
    path = folder / "mine.json"
    path.write_text(KVScheme("mine", key=TensorSpec(kind="int", bits=4, fmt=None)).to_json())
    assert get_scheme(str(path)).name == "mine"
    assert get_scheme("int4-token,0=fp16").layers[0][1].name == "fp16"  # a mixed string still parses


def test_outlier_count_is_the_ceiling_of_the_exact_product():
    """``ceil(frac * D)`` without the float artefact: 0.07 * 100 is 7.000000000000001 in floats, and 8 outliers
    were kept (and counted) per row of 100 for a 7 % request; a fraction truly above a whole count still rounds up.
    ``quantize`` keeps exactly the count the accounting prices."""
    import torch

    from kvbits.quant import quantize
    from kvbits.schemes.accounting import outlier_count

    assert [outlier_count(100, 0.07), outlier_count(200, 0.07), outlier_count(128, 0.01)] == [7, 14, 2]
    assert outlier_count(100, 0.0700001) == 8 and outlier_count(100, 0.0) == 0
    spec = TensorSpec(kind="int", bits=4, fmt=None, granularity="token", outlier_frac=0.07)
    qt = quantize(torch.randn(1, 1, 4, 100, generator=torch.Generator().manual_seed(0)), spec)
    assert qt.outlier_values.shape[-1] == 7


@pytest.mark.parametrize(
    ("typo", "preset"), [("kivi2", "kivi-2"), ("KIVI-2", "kivi-2"), ("int4_token", "int4-token"), ("kvquant4", "kvquant-4")]
)
def test_a_mistyped_preset_name_is_answered_with_the_preset_it_is_near(typo, preset):
    """'kvbits eval --scheme kivi2' answered with the list of 39 presets alone; it now names the one meant
    (as a mistyped model name is answered), and a name near none (int5) still gets the list without a guess."""
    with pytest.raises(ValueError, match=rf"unknown scheme '{typo}' \(did you mean '{preset}'\?\); known presets: fp16"):
        get_scheme(typo)
    with pytest.raises(ValueError, match=r"unknown scheme 'int5'; known presets: fp16"):
        get_scheme("int5")


@pytest.mark.parametrize("key", ["1_0", "+1", " 1", "\u0661"])
def test_a_scheme_json_layer_key_that_is_not_plain_digits_is_refused(key):
    """``int()`` read the layer key ``"1_0"`` as layer 10, ``"+1"``, ``" 1"`` and ``"١"`` (Arabic-Indic one) as
    layer 1: a typo silently overrode another layer, where the mixed scheme string refuses all four."""
    with pytest.raises(ValueError, match=r"keys are layer indices written in ASCII digits"):
        KVScheme.from_dict({"name": "mine", "layers": {key: {"name": "int8", "key": {"kind": "int", "bits": 8}}}})


@pytest.mark.parametrize(("typo", "preset"), [("int4-token-g64", "int4-g64"), ("int2-token-g64", None), ("int5-token", None)])
def test_a_mistyped_preset_name_is_not_answered_with_a_preset_storing_other_bits_or_groups(typo, preset):
    """'int4-token-g64' (INT4, groups of 64 channels) was answered 'did you mean int4-token?', a preset with no
    groups (0.82 near by spelling; 4.25 bits per element at D=128, int4-g64 4.5): a suggestion keeps every
    number of the name typed (bits, group size), or there is none."""
    hint = rf" \(did you mean '{preset}'\?\)" if preset else ""
    with pytest.raises(ValueError, match=rf"unknown scheme '{typo}'{hint}; known presets: fp16"):
        get_scheme(typo)
