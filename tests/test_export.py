"""Export to serving engines (`kvbits.export`): FP8 KV-cache scales as vLLM loads them from a
compressed-tensors checkpoint. Tiny random-weight Llama built from a config (no network)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvbits.calibrate import artifact_from_samples, calibrate
from kvbits.export import KV_CACHE_SCHEME, export_vllm, kv_cache_scheme, quantization_config
from kvbits.schemes import KVScheme, TensorSpec

transformers = pytest.importorskip("transformers")


def tiny_llama(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=512,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(model, artifact, calibration folder, sharded checkpoint folder)."""
    model = tiny_llama()
    root = tmp_path_factory.mktemp("export")
    ids = torch.randint(0, 96, (800,), generator=torch.Generator().manual_seed(0))
    art = calibrate(model, ids, "fp8-e4m3", context=128, windows=2, fisher=False, out_dir=str(root / "cal"))
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt, max_shard_size="60KB")  # sharded: an index names the files
    return model, art, root / "cal", ckpt


def test_scales_named_and_valued_as_vllm_loads_them(fp8, tmp_path):
    model, art, cal, _ = fp8
    rec = export_vllm(cal, tmp_path / "out")
    scales = load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))
    attn = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaAttention"]
    assert set(scales) == {f"{n}.{s}_scale" for n in attn for s in ("k", "v")}
    assert "model.layers.1.self_attn.v_scale" in scales
    for i, n in enumerate(attn):
        for s, side in (("k", "key"), ("v", "value")):
            t = scales[f"{n}.{s}_scale"]
            assert t.dtype == torch.float32 and t.shape == (1,)
            assert float(t) == float(art.tensors[f"layers.{i}.{side}_scale"])  # bit for bit
            assert rec["layers"][i][f"{s}_scale"] == float(t)
            # the default (mse) scale: from absmax / 448 up to twice that
            assert rec["layers"][i][f"{s}_absmax"] <= float(t) * 448 < 2 * rec["layers"][i][f"{s}_absmax"]
    qc = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["quantization_config"]
    assert qc == quantization_config() and qc["quant_method"] == "compressed-tensors"
    # what vLLM's CompressedTensorsKVCacheMethod accepts: 8-bit float, symmetric, static, per tensor
    assert qc["kv_cache_scheme"] == KV_CACHE_SCHEME == {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
    }  # fmt: skip
    assert json.loads((tmp_path / "out" / "kvbits_export.json").read_text()) == rec
    assert rec["calibration"]["context"] == 128 and rec["calibration"]["scheme"] == "fp8-e4m3"


def test_checkpoint_export_is_servable_and_leaves_the_original_alone(fp8, tmp_path):
    model, _, cal, ckpt = fp8
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    out = tmp_path / "served"
    rec = export_vllm(cal, out, checkpoint=ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # untouched
    cfg = json.loads((out / "config.json").read_text())
    orig = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"] == KV_CACHE_SCHEME
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == orig
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    orig_index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    scale_names = {n for n in index if n.endswith(("k_scale", "v_scale"))}
    assert len(scale_names) == 4 and all(index[n] == "kv_cache_scales.safetensors" for n in scale_names)
    assert {k: v for k, v in index.items() if k not in scale_names} == orig_index
    shards = sorted(set(orig_index.values()))
    assert len(shards) > 1 and all((out / s).is_symlink() for s in shards)
    # every tensor the index names is in the file it names (what vLLM's loader reads)
    for name, file in index.items():
        assert name in load_file(str(out / file))
    # the weights load from the new folder as from the old one
    state = {}
    for s in shards:
        state.update(load_file(str(out / s)))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items() if k in state)
    assert rec["serve"] == f"vllm serve {out} --kv-cache-dtype fp8"
    assert set(rec["checkpoint"]["written"]) == {"config.json", "model.safetensors.index.json",
                                                 "kv_cache_scales.safetensors"}  # fmt: skip
    # re-running into the same folder is fine; exporting into the checkpoint itself is refused
    export_vllm(cal, out, checkpoint=ckpt)
    with pytest.raises(ValueError, match="must differ"):
        export_vllm(cal, ckpt, checkpoint=ckpt)


def test_export_refuses_what_vllm_can_not_use(fp8, tmp_path):
    _, _, cal, _ = fp8
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=gen) for _ in range(2)]

    def fp8_scheme(name: str, **key: object) -> KVScheme:
        spec = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True)
        return KVScheme(name, key=TensorSpec(**{**spec.to_dict(), **key}), value=spec)

    # the spec in words, not a TensorSpec(...) repr
    with pytest.raises(ValueError, match=r"static per-tensor or per-head FP8 scales; its keys are static 4-bit nuq per "
                       r"channel\. Calibrate an FP8 scheme"):
        export_vllm(artifact_from_samples("kvquant-4", k, k), tmp_path / "a")
    with pytest.raises(ValueError, match="e5m2 cache takes no scales"):
        export_vllm(artifact_from_samples(fp8_scheme("e5", fmt="e5m2"), k, k), tmp_path / "b")
    with pytest.raises(ValueError, match="mixes schemes per layer"):
        export_vllm(artifact_from_samples("fp8-e4m3,1=fp16", k, k), tmp_path / "m")
    with pytest.raises(ValueError, match="after RoPE"):
        export_vllm(artifact_from_samples(fp8_scheme("pre", pre_rope=True), k, k), tmp_path / "c")
    # outliers kept in float16: vLLM stores every value in FP8 (exported silently before)
    with pytest.raises(ValueError, match=r"keeps a fraction of its keys in float16 \(outliers\)"):
        export_vllm(artifact_from_samples(fp8_scheme("outl", outlier_frac=0.01), k, k), tmp_path / "o")
    # a checkpoint of another shape
    other = tmp_path / "other"
    tiny_llama(layers=3).save_pretrained(other)
    with pytest.raises(ValueError, match="3 layers, the calibration has 2"):
        export_vllm(cal, tmp_path / "d", checkpoint=other)
    assert not (tmp_path / "d").exists()  # a refused export leaves no empty --out behind
    with pytest.raises(ValueError, match="no config.json"):
        export_vllm(cal, tmp_path / "e" / "f", checkpoint=tmp_path / "missing")
    assert not (tmp_path / "e" / "f").exists()
    (tmp_path / "g").mkdir()  # a folder the user made stays
    with pytest.raises(ValueError, match="no config.json"):
        export_vllm(cal, tmp_path / "g", checkpoint=tmp_path / "missing")
    assert (tmp_path / "g").is_dir()
    # a checkpoint quantized by another method: vLLM reads one quant_method
    gptq = tmp_path / "gptq"
    tiny_llama().save_pretrained(gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        export_vllm(cal, tmp_path / "e", checkpoint=gptq)
    assert not (tmp_path / "e" / "kv_cache_scales.safetensors").exists()  # refused before writing
    # an existing compressed-tensors config keeps its weight groups and gains the KV scheme
    ct = tmp_path / "ct"
    tiny_llama().save_pretrained(ct)
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"targets": ["Linear"]}},
    }
    (ct / "config.json").write_text(json.dumps(cfg))
    export_vllm(cal, tmp_path / "f", checkpoint=ct)
    qc = json.loads((tmp_path / "f" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"] == {"g": {"targets": ["Linear"]}} and qc["kv_cache_scheme"] == KV_CACHE_SCHEME
    with pytest.raises(ValueError, match="must contain"):
        export_vllm(cal, tmp_path / "g", module_template="model.layers.self_attn")


def test_per_head_scales_export_as_attn_head(fp8, tmp_path):
    """fp8-e4m3-head: one scale per KV head, written (H_kv, 1, 1) as llm-compressor does (vLLM flattens
    it to (H_kv,)), strategy attn_head, served with the FlashAttention backend."""
    model, _, _, ckpt = fp8
    ids = torch.randint(0, 96, (800,), generator=torch.Generator().manual_seed(0))
    art = calibrate(model, ids, "fp8-e4m3-head", context=128, windows=2, fisher=False)
    rec = export_vllm(art, tmp_path / "out", checkpoint=ckpt)
    scales = load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))
    for i in range(2):
        for s, side in (("k", "key"), ("v", "value")):
            t = scales[f"model.layers.{i}.self_attn.{s}_scale"]
            want = art.tensors[f"layers.{i}.{side}_scale"]
            assert t.dtype == torch.float32 and t.shape == (2, 1, 1) and torch.equal(t.flatten(), want)
            assert rec["layers"][i][f"{s}_scale"] == want.tolist()
    # the heads really differ: a per-tensor scale would be their maximum
    assert any(len(set(r["k_scale"])) == 2 for r in rec["layers"])
    want = kv_cache_scheme("attn_head")
    assert want == {**KV_CACHE_SCHEME, "strategy": "attn_head"}
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"] == want == rec["kv_cache_scheme"]
    assert rec["serve"].endswith("--kv-cache-dtype fp8 --attention-backend FLASH_ATTN")
    # a checkpoint that already declares per-tensor KV scales is not silently switched to per-head
    served = tmp_path / "tensor"
    # from the saved folder (per-head scales round-trip as (H_kv,)): the same file
    export_vllm(_saved(art, tmp_path / "cal"), tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "kv_cache_scales.safetensors"))
    assert all(torch.equal(again[n], t) for n, t in scales.items())
    tensor_ckpt = tmp_path / "tensor_ckpt"
    tiny_llama().save_pretrained(tensor_ckpt)
    cfg = json.loads((tensor_ckpt / "config.json").read_text())
    cfg["quantization_config"] = quantization_config("tensor")
    (tensor_ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="different kv_cache_scheme"):
        export_vllm(art, served, checkpoint=tensor_ckpt)
    # keys per head, values per tensor: vLLM has one strategy for both
    k = [torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    head = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="head", static=True)
    tensor = TensorSpec(kind="fp8", bits=8, fmt="e4m3", granularity="tensor", static=True)
    with pytest.raises(ValueError, match="one strategy for both"):
        export_vllm(artifact_from_samples(KVScheme("mixed", key=head, value=tensor), k, k), tmp_path / "m")


def _saved(art, where: Path) -> Path:
    art.save(where)
    return where


def test_module_template_for_artifacts_without_recorded_names(tmp_path):
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=gen) for _ in range(3)]
    art = artifact_from_samples("fp8-e4m3", k, k)
    export_vllm(art, tmp_path / "a")
    assert "model.layers.2.self_attn.k_scale" in load_file(
        str(tmp_path / "a" / "kv_cache_scales.safetensors")
    )
    export_vllm(art, tmp_path / "b", module_template="model.language_model.layers.{i}.self_attn")
    names = load_file(str(tmp_path / "b" / "kv_cache_scales.safetensors"))
    assert set(names) == {
        f"model.language_model.layers.{i}.self_attn.{s}_scale" for i in range(3) for s in "kv"
    }


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("model.layers.{{i}}.self_attn", "must contain the field '{i}'"),  # a literal brace: one name for all
        ("model.layers.self_attn", "must contain the field '{i}'"),
        ("model.layers.{i}.{j}", r"no other field \(it has \{j\}\)"),  # was KeyError
        ("model.{0}.layers.{i}", r"no other field \(it has \{0\}\)"),  # was IndexError
        ("model.{}.layers.{i}", r"no other field \(it has \{\}\)"),
        ("model.layers.{i:{w}}", r"no other field \(it has \{w\}\)"),
        ("model.layers.{i", "not a valid format string"),
        ("model.layers.{i:s}", "can not format a layer index"),
    ],
)
def test_module_template_must_name_each_layer_once(tmp_path, template, why):
    """A template without an ``{i}`` field (or with other fields) is refused before anything is
    written: ``{{i}}`` formats to one name for every layer, whose scales would overwrite each other."""
    k = [torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    art = artifact_from_samples("fp8-e4m3", k, k)
    with pytest.raises(ValueError, match=why):
        export_vllm(art, tmp_path / "out", module_template=template)
    assert not (tmp_path / "out").exists()
    # a format spec is fine: still one name per layer
    export_vllm(art, tmp_path / "ok", module_template="model.layers.{i:02d}.self_attn")
    names = load_file(str(tmp_path / "ok" / "kv_cache_scales.safetensors"))
    assert set(names) == {f"model.layers.0{i}.self_attn.{s}_scale" for i in range(3) for s in "kv"}


def test_recorded_module_names_must_be_unique(tmp_path):
    k = [torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    art = artifact_from_samples("fp8-e4m3", k, k)
    art.meta["model"]["attention_modules"] = ["model.layers.0.self_attn"] * 2 + ["model.layers.2.self_attn"]
    art.save(tmp_path / "cal")
    with pytest.raises(ValueError, match=r"calibration\.json name the 3 layers with only 2 distinct") as err:
        export_vllm(tmp_path / "cal", tmp_path / "out")
    assert "model.layers.0.self_attn" in str(err.value) and "--module-template" in str(err.value)
    assert not (tmp_path / "out").exists()
    # an explicit template replaces the recorded names
    export_vllm(tmp_path / "cal", tmp_path / "out", module_template="model.layers.{i}.self_attn")
    assert len(load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))) == 6


@pytest.mark.parametrize(
    "recorded",
    [["model.language_model.layers.0.self_attn"], "model.layers.{i}.self_attn", [0, 1, 2], ["a", "b", ""]],
)
def test_recorded_module_names_that_are_not_one_per_layer_are_refused(tmp_path, recorded):
    """Recorded names of the wrong length or type (an edited file) were replaced by model.layers.{i}.self_attn
    without a word, naming scales for modules the calibration never saw; now refused unless a template is given."""
    k = [torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    art = artifact_from_samples("fp8-e4m3", k, k)
    art.meta["model"]["attention_modules"] = recorded
    art.save(tmp_path / "cal")
    with pytest.raises(ValueError, match=r"attention_modules recorded in .*calibration\.json is .*expected a list of "
                       r"3 module names.*--module-template"):  # fmt: skip
        export_vllm(tmp_path / "cal", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_vllm(tmp_path / "cal", tmp_path / "out", module_template="model.layers.{i}.self_attn")
    assert len(load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))) == 6


def _copy(ckpt: Path, where: Path) -> Path:
    shutil.copytree(ckpt, where)
    return where


def _edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize(
    ("file", "content", "why"),
    [
        ("config.json", "[1, 2]", r"config\.json holds a list; expected a Hugging Face model config \(a JSON object\)"),
        ("config.json", lambda c: {**c, "num_hidden_layers": "2"},
         r"config\.json: num_hidden_layers is a string \('2'\); expected a positive whole number"),
        ("config.json", lambda c: {**c, "num_key_value_heads": 2.0},
         r"config\.json: num_key_value_heads is a number \(2\.0\); expected a positive whole number"),
        ("model.safetensors.index.json", "[]",
         r"model\.safetensors\.index\.json holds a list; expected a safetensors index .*\(a JSON object\)"),
        ("model.safetensors.index.json", lambda x: {**x, "weight_map": list(x["weight_map"])},
         r"model\.safetensors\.index\.json: weight_map is a list; expected an object \{tensor name: file\}"),
        ("model.safetensors.index.json", '{"weight_map": {',
         r"model\.safetensors\.index\.json is not valid JSON \(a safetensors index"),
    ],
)  # fmt: skip
def test_checkpoint_files_of_the_wrong_shape_are_refused(fp8, tmp_path, file, content, why):
    """A config or index that is not the JSON object expected: a ValueError naming the file and what it
    should hold (not an AttributeError, nor "2 layers, the calibration has 2")."""
    _, _, cal, ckpt = fp8
    ck = _copy(ckpt, tmp_path / "ck")
    if callable(content):
        _edit_json(ck / file, content)
    else:
        (ck / file).write_text(content)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    with pytest.raises(ValueError, match=why):
        export_vllm(cal, tmp_path / "out", checkpoint=ck)
    assert not (tmp_path / "out").exists()
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


def test_checkpoint_of_another_model_with_the_same_layers_and_kv_heads_is_refused(fp8, tmp_path):
    """Same layer and KV head counts, another model (type, heads, head dim, sizes): refused, naming each
    field artifact vs checkpoint. An artifact fitted from samples records only its shape: the fields it
    leaves None are not compared."""
    _, _, cal, ckpt = fp8
    other = tmp_path / "qwen"
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=200,
    )).save_pretrained(other)  # fmt: skip
    with pytest.raises(ValueError, match=r"config\.json: .*differs \(model_type: llama vs qwen2; head_dim: 16 vs 32; "
                       r"hidden_size: 64 vs 128; vocab_size: 96 vs 200 \[artifact vs model\]\)"):
        export_vllm(cal, tmp_path / "out", checkpoint=other)
    assert not (tmp_path / "out").exists()
    k = [torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    rec = export_vllm(artifact_from_samples("fp8-e4m3", k, k), tmp_path / "samples", checkpoint=ckpt)
    assert "kv_cache_scales.safetensors" in rec["checkpoint"]["written"]


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644)])
def test_exported_files_follow_the_umask(fp8, tmp_path, umask, mode):
    """The files export writes get the permissions of a normally created file (0666 & ~umask), as
    calibration artifacts and metrics do: not a fixed 0644, which a private umask (0077) did not ask for."""
    _, _, cal, ckpt = fp8
    old = os.umask(umask)
    try:
        export_vllm(cal, tmp_path / "plain")
        export_vllm(cal, tmp_path / "served", checkpoint=ckpt)
    finally:
        os.umask(old)
    written = {
        "plain": ("kv_cache_scales.safetensors", "quantization_config.json", "kvbits_export.json"),
        "served": ("kv_cache_scales.safetensors", "quantization_config.json", "kvbits_export.json",
                   "config.json", "model.safetensors.index.json"),
    }  # fmt: skip
    for folder, names in written.items():
        for name in names:
            p = tmp_path / folder / name
            assert not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) == mode, (p, oct(p.stat().st_mode))


def test_out_inside_the_checkpoint_is_refused(fp8, tmp_path):
    """The checkpoint is left untouched: no --out folder in it (which would also link into itself)."""
    _, _, cal, ckpt = fp8
    ck = _copy(ckpt, tmp_path / "ck")
    (tmp_path / "alias").symlink_to(ck)
    before = sorted(p.name for p in ck.iterdir())
    for out in (ck / "servable", ck / "a" / "b", tmp_path / "alias" / "servable", ck / ".." / "ck" / "s"):
        with pytest.raises(ValueError, match="is inside the checkpoint"):
            export_vllm(cal, out, checkpoint=ck)
        assert sorted(p.name for p in ck.iterdir()) == before
    with pytest.raises(ValueError, match="must differ"):
        export_vllm(cal, tmp_path / "alias", checkpoint=ck)
    # beside it is fine
    export_vllm(cal, tmp_path / "servable", checkpoint=ck)
    assert sorted(p.name for p in ck.iterdir()) == before


def test_scales_alone_into_an_earlier_checkpoint_export_are_refused(fp8, tmp_path):
    """An export without --checkpoint into the --out of an earlier --checkpoint export replaced its scales and
    left its config.json: per-tensor scales exported over a per-head export gave a folder whose config.json said
    strategy attn_head while model.layers.0.self_attn.k_scale was (1,) (vLLM loads (H_kv,) per-head scales).
    Refused, the folder left as it was; with --checkpoint it is updated."""
    _, _, cal, ckpt = fp8
    out = tmp_path / "servable"
    k = [torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    head = artifact_from_samples("fp8-e4m3-head", k, k, meta={"model": {"num_attention_heads": 4}})
    export_vllm(head, out, checkpoint=ckpt)
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.is_symlink()}
    with pytest.raises(ValueError, match=r"holds a config\.json .* pass --checkpoint"):
        export_vllm(cal, out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.is_symlink()} == before
    export_vllm(cal, out, checkpoint=ckpt)  # the per-tensor scales, with the config that describes them
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == KV_CACHE_SCHEME


def test_cli_export(fp8, tmp_path):
    _, art, cal, _ = fp8
    cmd = [sys.executable, "-m", "kvbits", "export", "--calibration", str(cal), "--out", str(tmp_path / "x")]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True)
    rec = json.loads(out.stdout)
    assert rec["layers"][1]["v_scale"] == float(art.tensors["layers.1.value_scale"])
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "2 layers: k_scale" in text and "--kv-cache-dtype fp8" in text
    bad = subprocess.run(
        [*cmd[:-2], "--out", str(Path(cal) / "calibration.json")], check=False, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "not a folder" in bad.stderr
    # a template with a literal {{i}}: refused with a message, not 2 layers written as one pair
    braces = [*cmd[:-2], "--out", str(tmp_path / "y"), "--module-template", "model.layers.{{i}}.self_attn"]
    bad = subprocess.run(braces, check=False, capture_output=True, text=True)
    assert bad.returncode != 0 and "must contain the field '{i}'" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "y").exists()


def test_single_file_checkpoint_already_holding_scales_is_refused(fp8, tmp_path):
    """Without an index vLLM loads every *.safetensors file: scales already in model.safetensors (an
    llm-compressor FP8-KV checkpoint) and the exported file beside them both named
    model.layers.0.self_attn.k_scale, whichever vLLM read last won. Refused, as an index mapping them is."""
    from safetensors.torch import save_file

    model, _, cal, _ = fp8
    single = tmp_path / "single"
    model.save_pretrained(single)  # one model.safetensors, no index
    assert not (single / "model.safetensors.index.json").exists()
    export_vllm(cal, tmp_path / "ok", checkpoint=single)  # the plain single-file checkpoint exports
    state = load_file(str(single / "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor([0.5])
    save_file(state, str(single / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors already holds \['model\.layers\.0\.self_attn\.k_scale'\]"):
        export_vllm(cal, tmp_path / "out", checkpoint=single)
    assert not (tmp_path / "out").exists()


def test_scales_named_for_modules_the_checkpoint_lacks_are_refused(fp8, tmp_path):
    """A mistyped --module-template exported "successfully": vLLM skips scales of modules it does not have
    (a warning) and serves those layers at scale 1.0. Refused with the checkpoint's names that end alike."""
    _, _, cal, ckpt = fp8
    with pytest.raises(ValueError, match=r"2 of 2 attention modules .* \(e\.g\. 'model\.layer\.0\.self_attn'\).*"
                       r"ending alike: \['model\.layers\.0\.self_attn', 'model\.layers\.1\.self_attn'\]"):
        export_vllm(cal, tmp_path / "out", checkpoint=ckpt, module_template="model.layer.{i}.self_attn")
    assert not (tmp_path / "out").exists()
    export_vllm(cal, tmp_path / "plain", module_template="model.layer.{i}.self_attn")  # no checkpoint: not checked


@pytest.mark.parametrize("template", ["model.layers.{i}", "model.layers.{i}.mlp", "model.layers.{i}.input_layernorm"])
def test_scales_named_for_modules_that_are_not_attention_modules_are_refused(fp8, tmp_path, template):
    """--module-template 'model.layers.{i}' (the layer, not its self_attn) named modules the checkpoint has, so
    the export was accepted; vLLM loads model.layers.0.k_scale into model.layers.0.attn.k_scale, which does not
    exist: 0 of the 4 scales reached a parameter, every layer served at scale 1.0. Refused, naming the
    checkpoint's attention modules."""
    _, _, cal, ckpt = fp8
    with pytest.raises(ValueError, match=r"2 of 2 modules .* are not attention modules \(e\.g\. 'model\.layers\.0.*' "
                       r"has no k_proj\).*Attention modules of the checkpoint: \['model\.layers\.0\.self_attn', "
                       r"'model\.layers\.1\.self_attn'\]"):
        export_vllm(cal, tmp_path / "out", checkpoint=ckpt, module_template=template)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (torch.tensor(float("nan")), "holds non-finite values"),
        (torch.tensor(0.0), "an FP8 scale divides, it must be > 0"),
        (torch.tensor([0.01, 0.02]), r"is torch\.float32 \(2,\), expected float32 \(\)"),
    ],
)
def test_an_in_memory_artifact_with_a_bad_scale_is_refused(tmp_path, bad, why):
    """An artifact built or edited in memory was exported unchecked: a NaN or 0.0 scale was written to
    kv_cache_scales.safetensors as is (vLLM divides by it), a (2,) per-tensor scale raised "RuntimeError: shape
    '[1]' is invalid for input of size 2". Validated as load_calibration validates a folder."""
    k = [torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    art = artifact_from_samples("fp8-e4m3", k, k)
    art.tensors["layers.1.key_scale"] = bad
    with pytest.raises(ValueError, match=rf"calibration \(in memory\): layers\.1\.key_scale .*{why}"):
        export_vllm(art, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_scales_write_leaves_no_config_naming_it(fp8, tmp_path, monkeypatch):
    """config.json and the index (which names kv_cache_scales.safetensors) were written before the scales: a
    write that failed (disk full) left a folder that looked servable and named a missing file."""
    from kvbits.export import vllm

    _, _, cal, ckpt = fp8

    def full(path, tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vllm, "_save_tensors", full)
    with pytest.raises(OSError, match="No space left"):
        export_vllm(cal, tmp_path / "out", checkpoint=ckpt)
    assert not (tmp_path / "out" / "config.json").exists()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


LLAVA_15 = {  # llava-hf/llava-1.5-7b-hf's config.json (vision_config cut): text_config holds only what differs from Llama's defaults
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
    "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
        "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064,
    },
    "tie_word_embeddings": False, "torch_dtype": "float16", "vision_config": {"model_type": "clip_vision_model"},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
}  # fmt: skip


def test_checkpoint_whose_text_config_leaves_the_defaults_out_is_checked_with_them(tmp_path):
    """llava-1.5's config.json names no layer or head count in its text_config (transformers and vLLM fill in
    Llama's defaults: 32 layers, 32 heads, hidden 4096). Export of a calibration of that very model was refused:
    "config.json: config has no attention heads ... got keys ['_name_or_path', 'architectures', ...]". The
    checkpoint is now read as transformers reads it: accepted, and a calibration of another shape still refused."""
    from safetensors.torch import save_file

    from kvbits.calibrate.artifact import describe_model

    ck = tmp_path / "llava"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(LLAVA_15))
    weights = {f"language_model.model.layers.{i}.self_attn.{p}_proj.weight": torch.zeros(1)
               for i in range(32) for p in "qkv"}  # fmt: skip
    save_file(weights, str(ck / "model.safetensors"))
    model = describe_model(transformers.AutoConfig.for_model(**LLAVA_15))  # what calibrate records for it
    assert (model["num_layers"], model["num_kv_heads"], model["head_dim"]) == (32, 32, 128)
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(32, 8, 128, generator=gen) for _ in range(32)]
    art = artifact_from_samples("fp8-e4m3", k, k, meta={"model": model, "data": {"context": 8}})
    template = "language_model.model.layers.{i}.self_attn"
    rec = export_vllm(art, tmp_path / "out", checkpoint=ck, module_template=template)
    assert len(rec["layers"]) == 32
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == LLAVA_15  # written as it was
    fewer = artifact_from_samples("fp8-e4m3", k[:24], k[:24], meta={"model": {**model, "num_layers": 24}})
    with pytest.raises(ValueError, match=r"config\.json: 32 layers, the calibration has 24; wrong model\?"):
        export_vllm(fewer, tmp_path / "other", checkpoint=ck, module_template=template)


@pytest.mark.parametrize(
    ("held", "loaded_as"),
    [
        ("model.layers.1.self_attn.k_proj.output_scale", "model.layers.1.self_attn.k_scale"),  # older llm-compressor
        ("model.layers.1.self_attn.v_proj.v_scale", "model.layers.1.self_attn.v_scale"),  # ModelOpt
        ("model.layers.1.self_attn.kv_scale", "model.layers.1.self_attn.k_scale"),  # deprecated single scale
        ("model.layers.1.self_attn.attn.v_scale", "model.layers.1.self_attn.v_scale"),  # vLLM's parameter name
    ],
)
@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_holding_scales_under_names_vllm_maps_is_refused(fp8, tmp_path, held, loaded_as, sharded):
    """vLLM loads a checkpoint's KV scales under several names into one attention parameter (get_cache_scale:
    k_proj.output_scale -> attn.k_scale; maybe_remap_kv_scale_name: k_proj.k_scale, kv_scale, ...). Only the
    exported names were compared: a checkpoint holding model.layers.1.self_attn.k_proj.output_scale = 1.0 was
    exported, and vLLM's loader restated (files in sorted order) served that 1.0 over the calibrated scale
    (0.00138 on a 2-layer Llama). Refused, as a scale under the exported name is."""
    from safetensors.torch import save_file

    model, _, cal, _ = fp8
    ck = tmp_path / "ck"
    model.save_pretrained(ck, **({"max_shard_size": "60KB"} if sharded else {}))
    state = {held: torch.tensor([1.0])}
    if sharded:  # the scale in a shard of its own, named by the index
        save_file(state, str(ck / "old-scales.safetensors"), metadata={"format": "pt"})
        _edit_json(ck / "model.safetensors.index.json",
                   lambda x: {**x, "weight_map": {**x["weight_map"], held: "old-scales.safetensors"}})  # fmt: skip
    else:
        state.update(load_file(str(ck / "model.safetensors")))
        save_file(state, str(ck / "model.safetensors"), metadata={"format": "pt"})
    where = r"model\.safetensors\.index\.json already maps" if sharded else r"model\.safetensors already holds"
    found = re.escape(f"['{held}' (vLLM loads it as '{loaded_as}')")  # kv_scale: then as v_scale too
    with pytest.raises(ValueError, match=rf"{where} {found}[,\]]"):
        export_vllm(cal, tmp_path / "out", checkpoint=ck)
    assert not (tmp_path / "out").exists()


def test_calibration_with_sinks_is_refused(tmp_path):
    """A scheme with sinks takes its FP8 scales without the first tokens of each window, which vLLM's cache
    stores in FP8 too: with sink K/V three times the rest, the exported scale was about half the range vLLM
    stores (the sinks saturated), with only a warning. Refused; a residual window (no effect on the scale) is not."""
    import dataclasses

    from kvbits.schemes import get_scheme

    model = tiny_llama()

    def sink_hook(module: torch.nn.Module, inputs: object, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, 0] *= 3  # position 0: an attention sink with outsized K/V
        return out

    for layer in model.model.layers:
        layer.self_attn.k_proj.register_forward_hook(sink_hook)
        layer.self_attn.v_proj.register_forward_hook(sink_hook)
    ids = torch.randint(1, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    base = get_scheme("fp8-e4m3")
    sinks = dataclasses.replace(base, name="fp8-sinks", sinks=1)
    every = calibrate(model, ids, base, context=64, windows=2, fisher=False, fp8_scale="amax")
    art = calibrate(model, ids, sinks, context=64, windows=2, fisher=False, fp8_scale="amax")
    # the sink calibration's scale leaves position 0 out: well below the range of every token
    assert float(art.tensors["layers.0.key_scale"]) < 0.7 * float(every.tensors["layers.0.key_scale"])
    with pytest.raises(ValueError, match=r"without the first 1 token\(s\).*calibrate without sinks \(fp8-e4m3\)"):
        export_vllm(art, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    window = dataclasses.replace(base, name="fp8-window", residual=16)
    rec = export_vllm(calibrate(model, ids, window, context=64, windows=2, fisher=False, fp8_scale="amax"),
                      tmp_path / "w")  # fmt: skip
    assert rec["layers"][0]["k_scale"] == float(every.tensors["layers.0.key_scale"])


def test_export_reads_the_sinks_the_scales_were_fitted_without(tmp_path, caplog):
    """check_exportable refused by the scheme's sinks, not by what the scales left out (``fitted_sinks``): a
    calibration fitted over every token composed into a scheme with sinks=1 (data.excluded_sink_tokens 0, its
    scale the full range vLLM stores) was refused as "without the first 1 token(s)"; and scales fitted without
    position 0 under a scheme recording sinks=0 were exported. Now the first is exported (with a warning that kvbits'
    figures kept the sinks exact), the second refused."""
    import dataclasses

    from kvbits.calibrate import compose_artifact
    from kvbits.schemes import get_scheme

    model = tiny_llama()
    ids = torch.randint(1, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    base = get_scheme("fp8-e4m3")
    every = calibrate(model, ids, base, context=64, windows=2, fisher=False, fp8_scale="amax")
    sinks = dataclasses.replace(base, name="fp8-sinks", sinks=1)
    composed = compose_artifact(sinks, [every])
    assert composed.scheme.sinks == 1 and composed.fitted_sinks(0) == 0
    with caplog.at_level("WARNING", logger="kvbits"):
        rec = export_vllm(composed, tmp_path / "c")
    assert rec["layers"][0]["k_scale"] == float(every.tensors["layers.0.key_scale"])
    assert "keeps its first 1 token(s) in full precision" in caplog.text
    fitted = calibrate(model, ids, sinks, context=64, windows=2, fisher=False, fp8_scale="amax")
    relabeled = dataclasses.replace(fitted, scheme=base)  # excluded_sink_tokens 1 recorded, scheme sinks 0
    assert relabeled.fitted_sinks(0) == 1
    with pytest.raises(ValueError, match=r"without the first 1 token\(s\)"):
        export_vllm(relabeled, tmp_path / "r")


def test_a_failed_checkpoint_export_leaves_no_links_behind(fp8, tmp_path, monkeypatch):
    """A file of the user's under the last shard's name was refused only after the six shards before it (and
    generation_config.json) were linked into --out, and they stayed; a write that failed after the links kept
    them too. Now every clash is refused before the first link, and a later failure removes this call's links."""
    from kvbits.export import vllm

    _, _, cal, ckpt = fp8
    out = tmp_path / "out"
    out.mkdir()
    last = max(ckpt.glob("*.safetensors")).name
    (out / last).write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a link"):
        export_vllm(cal, out, checkpoint=ckpt)
    assert [p.name for p in out.iterdir()] == [last] and (out / last).read_text() == "mine"
    (out / last).unlink()
    (out / "notes.txt").write_text("kept")

    def broken(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(vllm, "_save_tensors", broken)
    with pytest.raises(OSError, match="disk full"):
        export_vllm(cal, out, checkpoint=ckpt)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    monkeypatch.undo()
    rec = export_vllm(cal, out, checkpoint=ckpt)
    assert last in rec["checkpoint"]["linked"] and (out / last).is_symlink()


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_an_export_failing_at_its_last_write_leaves_out_as_it_was(fp8, tmp_path, monkeypatch, with_checkpoint):
    """A failure after the first file (here: the record, written last) left the scales, quantization_config.json
    and, with --checkpoint, the links, config.json and index in --out: a folder vLLM would serve, from an export
    that reported failure. Now every file is staged and moved in at the end: a failure leaves --out as it was, a
    new one absent, a previous export's files (and the user's other files) byte for byte."""
    from kvbits.export import vllm

    _, _, cal, ckpt = fp8
    ck = ckpt if with_checkpoint else None
    real = vllm.write_text_atomic

    def full(path, text):
        if path.name == "kvbits_export.json":
            raise OSError(28, "No space left on device")
        return real(path, text)

    out = tmp_path / "out"
    monkeypatch.setattr(vllm, "write_text_atomic", full)
    with pytest.raises(OSError, match="No space left"):
        export_vllm(cal, out, checkpoint=ck)
    assert not out.exists()
    monkeypatch.undo()
    export_vllm(cal, out, checkpoint=ck)
    (out / "notes.txt").write_text("kept")
    (out / "kv_cache_scales.safetensors").write_bytes(b"a previous export's scales")

    def snapshot():
        return {p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes()) for p in out.iterdir()}

    before = snapshot()
    monkeypatch.setattr(vllm, "write_text_atomic", full)
    with pytest.raises(OSError, match="No space left"):
        export_vllm(cal, out, checkpoint=ck)
    assert snapshot() == before
    monkeypatch.undo()
    (out / "config.json").unlink(missing_ok=True)
    (out / "config.json").mkdir()  # a folder under a name the export writes is refused, not replaced (and lost)
    with pytest.raises(ValueError, match="is a folder"):
        export_vllm(cal, out, checkpoint=ckpt)
    assert (out / "config.json").is_dir() and (out / "notes.txt").read_text() == "kept"


def test_checkpoint_export_says_its_weights_are_not_compared(fp8, tmp_path, caplog):
    """A checkpoint of the same config with other weights (a fine-tune) was accepted silently: only config.json
    is compared. The log now says what was checked and that the weights were not."""
    import logging

    _, art, cal, _ = fp8
    other = tmp_path / "finetune"
    with torch.no_grad():
        tuned = tiny_llama()
        for p in tuned.parameters():
            p.mul_(3.0)  # other weights, same config
    tuned.save_pretrained(other)
    with caplog.at_level(logging.INFO, logger="kvbits.export.vllm"):
        export_vllm(cal, tmp_path / "out", checkpoint=other)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "its weights are not compared" in said and art.fingerprint in said


@pytest.mark.parametrize(("residual", "block", "newest"), [(16, 1, 16), (0, 8, 7), (4, 8, 11)])
def test_export_of_a_scheme_keeping_recent_tokens_unquantized_warns(tmp_path, caplog, residual, block, newest):
    """vLLM's FP8 cache quantizes every token; a scheme with a residual window, or quantizing ``block`` tokens at a
    time (up to ``block - 1`` newest kept in full precision), measures another cache. The export warned for the
    residual window only: a block-8 calibration exported without a word."""
    import dataclasses

    from kvbits.schemes import get_scheme

    ids = torch.randint(1, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    scheme = dataclasses.replace(get_scheme("fp8-e4m3"), name="fp8-recent", residual=residual, block=block)
    art = calibrate(tiny_llama(), ids, scheme, context=64, windows=2, fisher=False, fp8_scale="amax")
    with caplog.at_level("WARNING", logger="kvbits.export.vllm"):
        export_vllm(art, tmp_path / "out")
    assert any(f"keeps up to {newest} most recent tokens in full precision" in r.getMessage() for r in caplog.records)


def test_a_mix_vllm_serves_with_skipped_layers_is_refused_with_how_to_serve_it(tmp_path):
    """A calibration of ``fp8-e4m3,0=fp16`` (what kvbits tune can pick) was refused with only "calibrate a uniform FP8
    scheme", though ``kvbits export --scheme`` maps that mix to vLLM's fp8 cache with layer 0 skipped: the refusal now
    says so, with the flags; a mix vLLM can not serve keeps the plain refusal."""
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=gen) for _ in range(2)]
    art = artifact_from_samples("fp8-e4m3,0=fp16", k, k)
    with pytest.raises(ValueError, match=r"mixes schemes per layer.*serves this mix as fp8-e4m3 with layers \[0\] "
                                         r"unquantized.*--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0$"):
        export_vllm(art, tmp_path / "out")
    other = artifact_from_samples("fp8-e4m3,0=fp8-e4m3-head", k, k)
    with pytest.raises(ValueError, match=r"uniform FP8 scheme \(fp8-e4m3\)$"):
        export_vllm(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tuned_mix_on_an_fp16_base_is_refused_with_how_to_serve_it(tmp_path):
    """kvbits tune takes as base the candidate most layers use, so a loose budget writes ``fp16,1=fp8-e4m3``: its
    calibration's refusal said only "calibrate a uniform FP8 scheme" (the hint needed the layer count, which the
    calibration records), though vLLM serves the mix as fp8 with layers 0 and 2 skipped: it now says so."""
    gen = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 64, 16, generator=gen) for _ in range(3)]
    art = artifact_from_samples("fp16,1=fp8-e4m3", k, k, meta={"data": {"context": 64}})
    with pytest.raises(ValueError, match=r"serves this mix as fp8-e4m3 with layers \[0, 2\] unquantized.*"
                                         r"--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 2$"):
        export_vllm(art, tmp_path / "out")
    head = artifact_from_samples("fp16,0=fp8-e4m3-head", k, k, meta={"data": {"context": 64}})
    with pytest.raises(ValueError, match=r"serves this mix as fp8-e4m3-head with layers \[1, 2\] unquantized.*"
                                         r"--kv-cache-dtype-skip-layers 1 2 --attention-backend FLASH_ATTN$"):
        export_vllm(head, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_record_and_cli_warn_against_calculate_kv_scales(fp8, tmp_path, capsys):
    """The export's serve line left out that ``--calculate-kv-scales`` would make vLLM skip the exported scales (it
    computes its own from the first batch); the record's notes and the printed output now say so."""
    from kvbits.cli import main

    _, _, cal, _ = fp8
    rec = export_vllm(cal, tmp_path / "x")
    assert any("--calculate-kv-scales" in n for n in rec["notes"])
    assert main(["export", "--calibration", str(cal), "--out", str(tmp_path / "y")]) == 0
    assert "note: do not add --calculate-kv-scales" in capsys.readouterr().out


def test_export_record_and_cli_say_the_scales_assume_ocp_e4m3(fp8, tmp_path, capsys):
    """The exported scales are absmax / 448 (OCP E4M3); on ROCm MI300 vLLM's fp8 is E4M3FNUZ (max 240). The record
    and the printed advice did not say which FP8 the scales are for, nor that kvbits can not know the target GPU."""
    from kvbits.cli import main

    _, _, cal, _ = fp8
    rec = export_vllm(cal, tmp_path / "x")
    assert sum("E4M3FNUZ" in n and "absmax / 448" in n for n in rec["notes"]) == 1
    assert main(["export", "--calibration", str(cal), "--out", str(tmp_path / "y")]) == 0
    assert "note: kvbits' FP8 scales are for OCP E4M3" in capsys.readouterr().out


def _tiny_hybrid(kind: str) -> torch.nn.Module:
    """A 4-layer hybrid decoder: layers 1 and 3 attend, 0 and 2 are linear attention (Qwen3-Next) or convolutions
    (LFM2)."""
    torch.manual_seed(0)
    if kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, full_attention_interval=2,
        )  # fmt: skip
    else:
        cfg = transformers.Lfm2Config(
            vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
        )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(artifact, calibration folder, checkpoint folder) of a tiny Qwen3-Next calibrated for fp8-e4m3."""
    model = _tiny_hybrid("qwen3_next")
    root = tmp_path_factory.mktemp("hybrid")
    ids = torch.randint(1, 96, (400,), generator=torch.Generator().manual_seed(0))
    art = calibrate(model, ids, "fp8-e4m3", context=64, windows=2, fisher=False, out_dir=str(root / "cal"))
    model.save_pretrained(root / "ckpt", max_shard_size="200KB")
    return art, root / "cal", root / "ckpt"


def test_hybrid_calibration_exports_its_attention_layers_under_their_model_indices(hybrid, tmp_path):
    """Was: ``ValueError: ... exporting it for vLLM is not supported yet``. vLLM (like transformers) names a hybrid
    model's attention modules by their index among all layers (``make_layers``; Qwen3-Next's ``load_weights`` maps
    ``model.layers.3.self_attn.k_scale`` to ``...self_attn.attn.k_scale``): the scales of layers 1 and 3 are written
    under those indices, none for the linear-attention layers 0 and 2, bit for bit the artifact's."""
    art, cal, ckpt = hybrid
    assert art.kv_layers == [1, 3]
    rec = export_vllm(cal, tmp_path / "out")
    scales = load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))
    assert set(scales) == {f"model.layers.{i}.self_attn.{s}_scale" for i in (1, 3) for s in "kv"}
    for j, i in enumerate((1, 3)):
        for s, side in (("k", "key"), ("v", "value")):
            assert float(scales[f"model.layers.{i}.self_attn.{s}_scale"]) == float(art.tensors[f"layers.{i}.{side}_scale"])
            assert rec["layers"][j][f"{s}_absmax"] == art.layer_stats[j][f"{side}_absmax"]  # stats: one row per held layer
        assert rec["layers"][j]["layer"] == i and rec["layers"][j]["module"] == f"model.layers.{i}.self_attn"
    # a template is formatted at the same indices
    export_vllm(art, tmp_path / "t", module_template="model.language_model.layers.{i}.self_attn")
    named = load_file(str(tmp_path / "t" / "kv_cache_scales.safetensors"))
    assert set(named) == {f"model.language_model.layers.{i}.self_attn.{s}_scale" for i in (1, 3) for s in "kv"}
    # as a servable checkpoint: its config (4 layers, attention layers 1 and 3) matches, the index names the scales
    out = tmp_path / "served"
    export_vllm(cal, out, checkpoint=ckpt)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n in index if n.endswith(("k_scale", "v_scale"))} == set(scales)


def test_hybrid_export_warns_where_vllm_has_no_scale_parameters(tmp_path, caplog):
    """vLLM's LFM2 (and Jamba) class builds its ``Attention`` without ``quant_config``: no k_scale parameter, so the
    exported scales may not load there; the export says so (and still writes layers 1 and 3 only)."""
    model = _tiny_hybrid("lfm2")
    ids = torch.randint(1, 96, (300,), generator=torch.Generator().manual_seed(0))
    art = calibrate(model, ids, "fp8-e4m3", context=64, windows=2, fisher=False)
    with caplog.at_level("WARNING", logger="kvbits.export.vllm"):
        export_vllm(art, tmp_path / "out")
    assert "model type 'lfm2'" in caplog.text and "no k_scale / v_scale parameters" in caplog.text
    scales = load_file(str(tmp_path / "out" / "kv_cache_scales.safetensors"))
    assert set(scales) == {f"model.layers.{i}.self_attn.{s}_scale" for i in (1, 3) for s in "kv"}


def test_hybrid_calibrations_compose(hybrid):
    """Was: ``ValueError: ... composing such calibrations is not supported yet``. A mix on a hybrid model takes each
    attention layer's tensors and stats row from its scheme's artifact; the linear-attention layers take nothing; a
    mix whose calibrated layers are all linear-attention layers is refused with why."""
    from kvbits.calibrate import compose_artifact

    art, _, _ = hybrid
    mix = compose_artifact("fp8-e4m3,1=fp16", [art])
    assert mix.kv_layers == [1, 3] and sorted(mix.tensors) == ["layers.3.key_scale", "layers.3.value_scale"]
    assert torch.equal(mix.tensors["layers.3.key_scale"], art.tensors["layers.3.key_scale"])
    assert mix.meta["stats"] == [{}, art.layer_stats[1]]
    assert [x is not None for x in mix.meta["composed"]["layers"]] == [False, False, False, True]
    assert compose_artifact("fp8-e4m3,0=fp16", [art]).tensors.keys() == art.tensors.keys()  # layer 0 holds no K/V
    with pytest.raises(ValueError, match=r"calibrates only layers that store no K/V .* \[1, 3\] of 4"):
        compose_artifact("fp16,0=fp8-e4m3", [art])


def test_cli_summary_counts_every_calibration_window(fp8, tmp_path, capsys):
    """The export summary said "calibrated on DATA, 128 tokens" for 2 windows of 128 (smollm2-135m: "512 tokens" for
    2 x 512 = 1,024): the window count was left out. It now reads "2 x 128 tokens"."""
    from kvbits.cli import main

    _, _, cal, _ = fp8
    assert main(["export", "--calibration", str(cal), "--out", str(tmp_path / "y")]) == 0
    assert ", 2 x 128 tokens)" in capsys.readouterr().out


def test_cli_without_checkpoint_says_how_to_serve(fp8, tmp_path, capsys):
    """Without --checkpoint the export printed "serve: vllm serve <checkpoint> --kv-cache-dtype fp8", though --out holds
    the scales alone and no checkpoint was named: it now says to rerun with --checkpoint, then serve --out."""
    from kvbits.cli import main

    _, _, cal, _ = fp8
    out = tmp_path / "y"
    assert main(["export", "--calibration", str(cal), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "<checkpoint>" not in printed
    assert f"serve: {out} holds the scales only" in printed and "rerun with --checkpoint DIR" in printed
    assert f"then: vllm serve {out} --kv-cache-dtype fp8\n" in printed


def test_re_export_of_a_resaved_checkpoint_replaces_the_old_links(fp8, tmp_path):
    """A re-export into the same --out kept the links of files the checkpoint no longer has: re-saved as one file,
    seven dangling shard links and the old model.safetensors.index.json (naming those shards, not model.safetensors)
    stayed, so vLLM would read the index and find none of its files. Now the files an earlier export made and this one
    does not are removed (in the record's "removed"); weights it did not make are refused, by name."""
    model, _, cal, sharded = fp8
    ck, out = _copy(sharded, tmp_path / "ck"), tmp_path / "out"
    export_vllm(cal, out, checkpoint=ck)
    shards = sorted(p.name for p in ck.glob("model-*.safetensors"))
    shutil.rmtree(ck)
    model.save_pretrained(ck)  # one model.safetensors, no index
    rec = export_vllm(cal, out, checkpoint=ck)
    assert sorted(rec["checkpoint"]["removed"]) == sorted([*shards, "model.safetensors.index.json"])
    assert not [p.name for p in out.iterdir() if p.is_symlink() and not p.exists()]  # no dangling link
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["kv_cache_scales.safetensors", "model.safetensors"]
    # another checkpoint's export into the same folder replaces its links too
    rec = export_vllm(cal, out, checkpoint=sharded)
    assert "model.safetensors" in rec["checkpoint"]["removed"]
    assert all((out / s).resolve() == (sharded / s).resolve() for s in shards)
    (out / "extra.safetensors").write_bytes(b"weights of mine")
    with pytest.raises(ValueError, match=r"holds \['extra\.safetensors'\].*vLLM would load them"):
        export_vllm(cal, out, checkpoint=sharded)
    assert (out / "extra.safetensors").read_bytes() == b"weights of mine"
