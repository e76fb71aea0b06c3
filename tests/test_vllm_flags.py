"""``kvbits.export.vllm_flags`` and ``kvbits export --scheme``: a scheme as vLLM's KV-cache settings, or a refusal
that says why vLLM would store something else."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvbits.cli import main
from kvbits.export.vllm_flags import vllm_cache_args
from kvbits.schemes import get_scheme


@pytest.mark.parametrize(
    ("scheme", "dtype", "skip", "cli"),
    [
        ("vllm-int4", "int4_per_token_head", (), ["--kv-cache-dtype", "int4_per_token_head", "--attention-backend", "TRITON_ATTN"]),
        ("vllm-int4,0=fp16", "int4_per_token_head", (0,),
         ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-dtype-skip-layers", "0", "--attention-backend", "TRITON_ATTN"]),
        ("vllm-int4,5=bf16,0-1=fp16", "int4_per_token_head", (0, 1, 5),
         ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-dtype-skip-layers", "0", "1", "5", "--attention-backend", "TRITON_ATTN"]),
        ("fp8-e4m3,23=fp16", "fp8", (23,), ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "23"]),
        ("fp8-e4m3-head", "fp8", (), ["--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN"]),
        ("fp8-e4m3-head,0=fp16", "fp8", (0,),
         ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0", "--attention-backend", "FLASH_ATTN"]),
        ("vllm-int8,0=fp16", "int8_per_token_head", (0,),
         ["--kv-cache-dtype", "int8_per_token_head", "--kv-cache-dtype-skip-layers", "0", "--attention-backend", "TRITON_ATTN"]),
        ("fp8-e4m3-token", "fp8_per_token_head", (), ["--kv-cache-dtype", "fp8_per_token_head", "--attention-backend", "TRITON_ATTN"]),
        ("vllm-fp8-token,2=fp16", "fp8_per_token_head", (2,),
         ["--kv-cache-dtype", "fp8_per_token_head", "--kv-cache-dtype-skip-layers", "2", "--attention-backend", "TRITON_ATTN"]),
        ("fp16", "auto", (), []),
        ("bf16", "auto", (), []),
    ],
)  # fmt: skip
def test_schemes_vllm_stores_map_to_its_settings(scheme, dtype, skip, cli):
    got = vllm_cache_args(scheme)
    assert (got.kv_cache_dtype, got.skip_layers, got.cli()) == (dtype, skip, cli)
    kwargs = got.engine_kwargs()
    assert kwargs["kv_cache_dtype"] == dtype
    assert kwargs.get("kv_cache_dtype_skip_layers", []) == [str(i) for i in skip]  # vLLM's list[str]


def test_fp8_notes_say_where_calibrated_scales_come_from():
    tensor, head = vllm_cache_args("fp8-e4m3"), vllm_cache_args("fp8-e4m3-head")
    assert any("scales are 1.0 unless" in n and "kvbits export --calibration" in n for n in tensor.notes)
    assert any("FLASH_ATTN" in n for n in head.notes) and not any("FLASH_ATTN" in n for n in tensor.notes)


def test_per_head_fp8_serves_with_the_backend_the_export_names(fp8_head_cal, tmp_path):
    """Per-head FP8 scales reach vLLM's FlashAttention backend only (the others take each layer's largest head
    scale: a per-tensor cache). ``kvbits export --calibration`` of an fp8-e4m3-head calibration printed ``vllm serve
    ... --kv-cache-dtype fp8 --attention-backend FLASH_ATTN``, ``kvbits export --scheme fp8-e4m3-head`` only
    ``--kv-cache-dtype fp8`` (the backend in a note): two serve lines for one scheme, one of them serving another
    cache. Both now give the backend, and the engine kwargs carry it (vLLM's EngineArgs.attention_backend)."""
    from kvbits.export import export_vllm

    got = vllm_cache_args("fp8-e4m3-head")
    record = export_vllm(fp8_head_cal, tmp_path / "out")
    assert record["serve"] == f"vllm serve <checkpoint> {' '.join(got.cli())}"
    assert got.engine_kwargs() == {"kv_cache_dtype": "fp8", "attention_backend": "FLASH_ATTN"}
    assert got.to_dict()["attention_backend"] == "FLASH_ATTN"
    assert vllm_cache_args("fp8-e4m3").attention_backend is None


@pytest.fixture
def fp8_head_cal():
    """An fp8-e4m3-head artifact fitted from random samples (2 layers, 2 KV heads, head dim 16)."""
    import torch

    from kvbits.calibrate import artifact_from_samples

    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=gen) for _ in range(2)]
    return artifact_from_samples("fp8-e4m3-head", k, k)


def test_fp8_notes_say_the_query_scale_is_not_exported():
    """vLLM's FlashAttention backend, given an fp8 cache, quantizes queries to FP8 at a static q_scale (its attention
    layer's query_quant; kv_cache.py loads {module}.q_scale); kvbits exports only k_scale/v_scale and measures with
    queries unquantized, which the notes did not say."""
    for scheme in ("fp8-e4m3", "fp8-e4m3-head"):
        assert any("q_scale" in n and "queries at the model's precision" in n for n in vllm_cache_args(scheme).notes)
    assert not any("q_scale" in n for n in vllm_cache_args("vllm-fp8-token").notes)


def test_layers_are_matched_by_storage_not_by_name(tmp_path):
    """A scheme JSON with vllm-int4's content under another name maps as vllm-int4; one field changed does not."""
    same = dataclasses.replace(get_scheme("vllm-int4"), name="my-int4", description="renamed")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(same.to_dict()))
    assert vllm_cache_args(str(path)).kv_cache_dtype == "int4_per_token_head"
    float_zero = dataclasses.replace(same, key=dataclasses.replace(same.key, integer_zero=False))
    with pytest.raises(ValueError, match="vLLM has no KV-cache format storing 'my-int4'"):
        vllm_cache_args(float_zero)
    # kvbits' own Hadamard signs are another rotation than vLLM's (BENCHMARKS.md §23c): not what vLLM stores
    ours = dataclasses.replace(same.key, rotate="hadamard")
    with pytest.raises(ValueError, match="vLLM has no KV-cache format storing 'my-int4'"):
        vllm_cache_args(dataclasses.replace(same, key=ours, value=ours))


@pytest.mark.parametrize(
    ("scheme", "why"),
    [
        ("int4-token-hadamard", r"storing 'int4-token-hadamard': kvbits maps only vllm-int4, vllm-int8, vllm-fp8-token, fp8-e4m3-token, fp8-e4m3"),
        ("kivi-4", "storing 'kivi-4'"),
        ("fp8-e4m3-hadamard", "storing 'fp8-e4m3-hadamard'"),  # vLLM stores K/V unrotated
        ("int4-token-hadamard,0=fp16", "the layers of 'int4-token-hadamard,0=fp16' that no override names"),
        ("vllm-int4,0=int8-token-hadamard",
         (r"stores layer 0 as 'int8-token-hadamard': vLLM can only leave a layer unquantized .*"
          r"kvbits tune --candidates vllm-int4 --candidates fp16")),
        ("fp8-e4m3,3=vllm-int4", "stores layer 3 as 'vllm-int4'.* beside one fp8 format"),
    ],
)  # fmt: skip
def test_what_vllm_can_not_store_is_refused_with_the_reason(scheme, why):
    with pytest.raises(ValueError, match=why):
        vllm_cache_args(scheme)


@pytest.mark.parametrize("field", ["sinks", "residual"])
def test_full_precision_tokens_are_refused(field):
    """vLLM has no sink or residual-window setting: vllm-int4 with either is not what vLLM stores."""
    s = dataclasses.replace(get_scheme("vllm-int4"), name="with-tokens", **{field: 4})
    with pytest.raises(ValueError, match=r"storing 'with-tokens' \(it keeps .* full precision; vLLM can not\)"):
        vllm_cache_args(s)


def test_a_mixed_override_equal_to_the_base_is_no_skip():
    """``vllm-int4,2=vllm-int4`` overrides layer 2 with the base itself: served as plain int4_per_token_head."""
    assert vllm_cache_args("vllm-int4,2=vllm-int4").skip_layers == ()


def test_an_unquantized_base_with_one_vllm_format_on_some_layers_needs_the_layer_count(capsys):
    """``kvbits tune --candidates vllm-int4 --candidates fp16`` with a roomy budget takes fp16 as base (most
    layers) and vllm-int4 on a few: vLLM serves that as int4_per_token_head with the other layers skipped. It
    was refused, suggesting ``--candidates fp16 --candidates fp16``; the layer count lists the skipped layers."""
    mix = "fp16,1=vllm-int4,3=vllm-int4"
    with pytest.raises(ValueError, match=r"stores layers \[1, 3\] as vllm-int4: vLLM serves that as int4_per_token_head "
                       r"with every other layer skipped, which needs the model's layer count.*--layers N"):
        vllm_cache_args(mix)
    args = vllm_cache_args(mix, num_layers=5)
    assert (args.kv_cache_dtype, args.skip_layers) == ("int4_per_token_head", (0, 2, 4))
    assert args.to_dict() == {**vllm_cache_args("vllm-int4,0=fp16,2=fp16,4=fp16").to_dict(), "scheme": mix}
    with pytest.raises(ValueError, match=r"overrides layers \[3\], beyond the given 3 layers"):
        vllm_cache_args(mix, num_layers=3)
    with pytest.raises(ValueError, match=r"stores its quantized layers as vllm-int4, vllm-int8: vLLM serves one "
                       r"quantized format per engine.*--candidates vllm-int4 --candidates fp16\)"):  # fmt: skip
        vllm_cache_args("fp16,1=vllm-int4,3=vllm-int8", num_layers=5)
    assert main(["export", "--scheme", mix, "--layers", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skip_layers"] == [0, 2, 4]
    assert main(["export", "--calibration", "cal", "--out", "o", "--layers", "5"]) == 2
    assert "--layers goes with --scheme" in capsys.readouterr().err


def test_cli_prints_the_flags_and_json(capsys):
    assert main(["export", "--format", "vllm", "--scheme", "vllm-int4,0=fp16"]) == 0
    out = capsys.readouterr().out
    assert ("serve: vllm serve <model> --kv-cache-dtype int4_per_token_head --kv-cache-dtype-skip-layers 0 "
            "--attention-backend TRITON_ATTN\n") in out
    assert "kv_cache_dtype_skip_layers=['0']" in out and "note: " in out
    assert main(["export", "--scheme", "vllm-int4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["kv_cache_dtype"] == "int4_per_token_head" and record["skip_layers"] == []
    assert record["cli"] == ["--kv-cache-dtype", "int4_per_token_head", "--attention-backend", "TRITON_ATTN"]
    assert record["scheme"] == "vllm-int4"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scheme", "kivi-4"], "vLLM has no KV-cache format storing 'kivi-4'"),
        (["--scheme", "vllm-int4", "--checkpoint", "ck"], "--checkpoint go with --calibration, not --scheme"),
        (["--calibration", "cal"], "--calibration needs --out DIR"),
    ],
)
def test_cli_usage_errors(capsys, argv, message):
    assert main(["export", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_needs_a_calibration_or_a_scheme(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["export", "--scheme", "vllm-int4", "--calibration", "cal"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_fp8_per_token_codes_are_vllms():
    """``fp8-e4m3-token`` against vLLM's ``fp8_per_token_head`` write restated: a float32 scale ``max(absmax /
    448, 1e-6)`` per token and head, ``clamp(x * (1 / scale), -448, 448)`` stored into an E4M3 cache, which
    Triton converts to the nearest (``cvt.rn.satfinite``, read from the sm_90 compile like the int8 store in
    tests/test_aot.py). kvbits' float16 scale (rounded up) moves a code by one E4M3 step only near a rounding
    boundary, and the decoded values agree to a small fraction of a step."""
    import torch

    from kvbits.quant import quantize

    x = torch.randn(2, 4, 128, 64, generator=torch.Generator().manual_seed(8))
    x[:, 1, :, 3] += 30.0  # an outlier channel
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-6)
    want = (xf * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    qt = quantize(x, get_scheme("fp8-e4m3-token").key)
    got = qt.data.view(torch.float8_e4m3fn)
    same = got.view(torch.uint8) == want.view(torch.uint8)
    assert same.float().mean() > 0.99, same.float().mean()
    # where they differ, by one E4M3 code (adjacent bit patterns of the same sign)
    diff = (got.view(torch.uint8).long() - want.view(torch.uint8).long()).abs()
    assert diff.max() == 1
    err_vllm = (want.float() * scale - xf).pow(2).mean()
    err_kvbits = (qt.dequantize(torch.float32) - xf).pow(2).mean()
    assert abs(err_kvbits / err_vllm - 1) < 0.02, (err_kvbits, err_vllm)
    # vllm-fp8-token keeps vLLM's float32 scale: every code, every scale and the decode are vLLM's, and the row
    # maxima that saturate onto 448 within a float32 ulp are not counted as clipped
    exact = quantize(x, get_scheme("vllm-fp8-token").key)
    assert exact.scale.dtype == torch.float32 and torch.equal(exact.scale, scale)
    assert torch.equal(exact.data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(exact.dequantize(torch.float32), want.float() * scale)
    assert exact.clipped == 0 and (xf / scale).abs().max() > 448  # such a row is there (the test can tell)
    assert "same bytes" in vllm_cache_args("vllm-fp8-token").notes[0]
    assert "vllm-fp8-token counts them" in vllm_cache_args("fp8-e4m3-token").notes[0]


def test_skipped_layers_beside_per_token_head_formats_warn_about_vllms_pages():
    """A 16-bit page (4D bytes per head and token) is never a whole multiple of a per-token-head one (int8 / fp8:
    2D + 8, int4: D + 8, for the head dims served), which vLLM needs when it unifies page sizes across KV cache
    groups (models with sliding-window layers): the export says so, only where it applies."""
    for D in (64, 80, 96, 128, 256):
        assert (4 * D) % (2 * D + 8) and (4 * D) % (D + 8)
    for scheme in ("vllm-int8,0=fp16", "vllm-int4,0-1=fp16", "vllm-fp8-token,3=bf16"):
        notes = vllm_cache_args(scheme).notes
        assert sum("uniform-type KV cache group" in n and "sliding-window" in n for n in notes) == 1, scheme
    for scheme in ("vllm-int8", "fp8-e4m3,23=fp16"):  # no skipped layer; FP8 pages (2D) divide 4D
        assert not any("uniform-type" in n for n in vllm_cache_args(scheme).notes), scheme



def test_static_fp8_notes_warn_against_calculate_kv_scales():
    """``vllm serve ... --calculate-kv-scales`` makes vLLM compute k/v scales from the first batch and skip the
    checkpoint's: the calibrated scales kvbits exports would be silently unused. Nothing said so; now the static fp8
    notes do (the per-token-head formats' scales are dynamic, unaffected: no note there)."""
    from kvbits.export.vllm_flags import CALCULATE_KV_SCALES_NOTE

    for scheme in ("fp8-e4m3", "fp8-e4m3-head", "fp8-e4m3,0=fp16"):
        assert CALCULATE_KV_SCALES_NOTE in vllm_cache_args(scheme).notes
        assert "--calculate-kv-scales" in CALCULATE_KV_SCALES_NOTE
    for scheme in ("vllm-fp8-token", "vllm-int8", "vllm-int4", "fp16"):
        assert not any("calculate-kv-scales" in n for n in vllm_cache_args(scheme).notes)


@pytest.mark.parametrize(("scheme", "num_layers"), [("fp16,3=bf16", None), ("bf16,0-1=fp16", 4)])
def test_an_auto_cache_lists_no_skipped_layer(scheme, num_layers):
    """vLLM's Attention layer turns a skipped layer's kv_cache_dtype into ``auto`` (vllm-project/vllm
    vllm/model_executor/layers/attention/attention.py): with ``auto`` for every layer the flag is a no-op. ``fp16,3=bf16``
    printed ``--kv-cache-dtype-skip-layers 3`` with no ``--kv-cache-dtype``, as if layer 3 were kept apart."""
    got = vllm_cache_args(scheme, num_layers)
    assert (got.kv_cache_dtype, got.skip_layers, got.cli()) == ("auto", (), [])
    assert got.engine_kwargs() == {"kv_cache_dtype": "auto"}


@pytest.mark.parametrize("scheme", ["vllm-int4,0-3=fp16", "fp8-e4m3-head,0-3=bf16"])
def test_every_layer_skipped_is_an_auto_cache(scheme):
    """A mix whose every layer (of ``num_layers``) is fp16/bf16 is the 16-bit cache kvbits measured: vLLM's
    ``auto``. It printed ``--kv-cache-dtype int4_per_token_head --kv-cache-dtype-skip-layers 0 1 2 3`` (fp8-e4m3-head
    also ``--attention-backend FLASH_ATTN``): an engine configured for a format no layer stores."""
    got = vllm_cache_args(scheme, 4)
    assert (got.kv_cache_dtype, got.skip_layers, got.cli(), got.attention_backend) == ("auto", (), [], None)
    assert vllm_cache_args(scheme).skip_layers == (0, 1, 2, 3)  # without the layer count: as written
    assert vllm_cache_args(scheme, 5).skip_layers == (0, 1, 2, 3)  # layer 4 quantized


def test_skip_indices_are_the_models_layer_indices_on_a_hybrid_model():
    """vLLM matches ``str(extract_layer_index(prefix))`` of each Attention module (``model.layers.3.self_attn.attn``
    -> 3) against the list, the decoder index and not the index among attention layers; kvbits numbers layers the
    same way (its cache's ``layer_idx``). A hybrid model with attention at layers 1 and 3 skips layer 3 as ``3``."""
    got = vllm_cache_args("fp8-e4m3,3=fp16", 4)
    assert got.cli() == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "3"]


def test_skip_pages_note_says_newer_vllm_pads_skipped_layers_on_any_model():
    """vLLM's CacheConfig.skip_page_size_padded (vllm/config/cache.py) pads skipped layers to the quantized layers'
    page during block-size alignment, on any model; the note said a full-attention model keeps each layer's own
    bytes, without that caveat."""
    notes = vllm_cache_args("vllm-int4,0=fp16").notes
    assert any("skip_page_size_padded" in n and "full-attention layers too" in n for n in notes)


@pytest.mark.parametrize(
    ("scheme", "lost"),
    [
        ("kivi-2", ["the 128 most recent tokens in full precision", "keys and values at 2 bits, not 4 or 8",
                    "keys scaled per channel", "values scaled per group of 32 channels"]),
        ("kvquant-4", ["the first token in full precision", "keys and values on a 4-bit non-uniform codebook",
                       "keys scaled per channel", "1% kept as float16 outliers", "keys quantized before RoPE"]),
        ("int4-channel", ["keys scaled per channel"]),
        ("int4-token-smooth", ["keys centred or smoothed per channel"]),
    ],
)  # fmt: skip
def test_a_refusal_names_everything_vllm_would_lose(scheme, lost):
    """The refusal named only sinks and the residual window: kivi-2's said "(it keeps 0 sink and 128 recent tokens in
    full precision; vLLM can not)", as if dropping the window would do, and kvquant-4's named only its sink, not its
    non-uniform codebook, per-channel pre-RoPE keys or outliers; int4-channel's gave no reason at all."""
    with pytest.raises(ValueError, match=f"storing '{scheme}' \\(") as exc:
        vllm_cache_args(scheme)
    assert all(x in str(exc.value) for x in lost), str(exc.value)
    assert "0 sink" not in str(exc.value)


@pytest.mark.parametrize("scheme", ["fp16,1=kivi-2", "bf16,0=kvquant-4,2=vllm-int4"])
def test_an_unquantized_base_with_a_layer_vllm_has_no_format_for_says_so(scheme):
    """``fp16,1=kivi-2`` (one quantized format) was refused with "vLLM serves one quantized format per engine": the
    layer's format is what vLLM lacks, not a second one."""
    with pytest.raises(ValueError, match=r"vLLM has no KV-cache format storing '(kivi-2|kvquant-4)' \(") as exc:
        vllm_cache_args(scheme, 4)
    assert "one quantized format per engine" not in str(exc.value)


@pytest.mark.parametrize("scheme", ["vllm-int4", "vllm-int8,0=fp16", "vllm-fp8-token", "fp8-e4m3-token", "fp16,1=vllm-int4"])
def test_per_token_head_dtypes_name_the_triton_backend_vllm_requires(scheme):
    """vLLM's quantized KV cache page says the ``*_per_token_head`` dtypes need the Triton attention backend, and
    ``fp8_per_token_head`` compute capability 8.9: kvbits printed ``--kv-cache-dtype int4_per_token_head`` alone, no
    backend and no capability note. Both are now given (the backend in the CLI, the engine kwargs and the JSON)."""
    got = vllm_cache_args(scheme, 4)
    assert got.attention_backend == "TRITON_ATTN"
    assert got.cli()[-2:] == ["--attention-backend", "TRITON_ATTN"]
    assert got.engine_kwargs()["attention_backend"] == "TRITON_ATTN"
    assert any("Triton attention backend" in n and "quantized_kvcache" in n for n in got.notes)
    fp8 = got.kv_cache_dtype == "fp8_per_token_head"
    assert any("compute capability 8.9" in n for n in got.notes) == fp8
    for other in ("fp8-e4m3", "fp16"):  # no per-token-head dtype: no Triton backend, no capability note
        assert vllm_cache_args(other).attention_backend is None
        assert not any("Triton" in n or "8.9" in n for n in vllm_cache_args(other).notes)


@pytest.mark.parametrize(
    ("scheme", "lost"),
    [("vllm-int4,1=kivi-2", ["128 most recent tokens in full precision", "at 2 bits, not 4 or 8", "keys scaled per channel"]),
     ("fp8-e4m3,0=kvquant-4", ["4-bit non-uniform codebook", "keys quantized before RoPE"])],
)  # fmt: skip
def test_a_quantized_base_with_a_layer_vllm_has_no_format_for_says_what_it_loses(scheme, lost):
    """``vllm-int4,1=kivi-2`` was refused with only "give that layer fp16 or bf16", not what kivi-2 keeps that
    vLLM would lose (its residual window, 2-bit codes, per-channel keys); the refusal now names them."""
    with pytest.raises(ValueError, match=r"stores layer \d as '(kivi-2|kvquant-4)' \(.*vLLM can not\)") as exc:
        vllm_cache_args(scheme)
    assert all(x in str(exc.value) for x in lost), str(exc.value)
    assert "give that layer fp16 or bf16" in str(exc.value)


def test_static_fp8_notes_say_the_scales_assume_ocp_e4m3():
    """On ROCm MI300 vLLM's fp8 is E4M3FNUZ (max 240, not 448): nothing said kvbits' scales are for OCP E4M3, nor that
    kvbits can not know the target GPU."""
    for scheme in ("fp8-e4m3", "fp8-e4m3-head,0=fp16"):
        assert sum("E4M3FNUZ" in n and "absmax / 448" in n for n in vllm_cache_args(scheme).notes) == 1
    assert not any("FNUZ" in n for n in vllm_cache_args("vllm-fp8-token").notes)  # vLLM's own dynamic scales


def test_a_tune_record_gives_the_layer_count(tmp_path, capsys):
    """``kvbits export --scheme tuned.json`` of an fp16 mix with vllm-int4 on some layers still asked for
    ``--layers N`` though ``tuned.json.tune.json`` (written beside it by ``kvbits tune``) holds it as meta.layers: it is
    now read, and a ``--layers`` that disagrees with it is refused."""
    from kvbits.schemes import get_scheme

    mix = tmp_path / "tuned.json"
    mix.write_text(get_scheme("fp16,1=vllm-int4,3=vllm-int4").to_json() + "\n")
    record = tmp_path / "tuned.json.tune.json"
    record.write_text(json.dumps({"scheme": "tuned", "meta": {"layers": 5}}))
    assert main(["export", "--scheme", str(mix), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skip_layers"] == [0, 2, 4]
    assert main(["export", "--scheme", str(mix), "--layers", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skip_layers"] == [0, 2, 4]
    assert main(["export", "--scheme", str(mix), "--layers", "6"]) == 2
    assert "--layers 6 disagrees with" in capsys.readouterr().err
    record.write_text(json.dumps({"meta": {}}))
    assert main(["export", "--scheme", str(mix)]) == 2
    assert "expected a kvbits tune record with meta.layers" in capsys.readouterr().err
