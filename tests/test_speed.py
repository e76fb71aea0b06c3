"""``kvbits speed``: decode throughput and cache memory by scheme against ``DynamicCache``.

Tiny random-weight models (token ids or a byte-level tokenizer) for the mechanics; one real-model check.
Times themselves are not asserted (benchmarks record them); what is asserted is that each run times what
it says (a slowed cache shows up in its step times), holds the bytes the planner says, and decodes
through the path it reports.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest
import torch
import transformers
from _bytelevel import VOCAB, save_byte_tokenizer, write_sentences
from _tinyllama import EXACT, SMALL_KIVI, tiny_llama

from kvbits.evaluate.speed import significant, speed_eval, step_stats
from kvbits.schemes import KVScheme, get_scheme

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (4000,), generator=torch.Generator().manual_seed(0))


def _runs(s: dict, cache: str) -> list[dict]:
    return [r for r in s["runs"] if r["cache"] == cache]


def test_step_stats():
    st = step_stats([4.0, 1.0, 3.0, 2.0, 5.0], batch=4)
    assert st["ms_per_step"] == 3.0 and st["ms_mean"] == 3.0
    assert st["ms_p10"] == pytest.approx(1.4) and st["ms_p90"] == pytest.approx(4.6)
    assert st["tokens_per_s"] == pytest.approx(4 * 1000 / 3.0, abs=0.01)
    for bad in ([], [1.0, float("nan")], [-1.0]):
        with pytest.raises(ValueError):
            step_stats(bad, batch=1)


def test_runs_bytes_and_paths(model, ids):
    s = speed_eval(
        model, [64, 96], [EXACT, SMALL_KIVI, "int4-token"], batches=[1, 2], tokens=5, warmup=2, data=ids
    )
    assert s["contexts"] == [64, 96] and s["batches"] == [1, 2] and s["data"] == "tokens"
    assert len(s["runs"]) == 2 * 2 * 4  # contexts x batches x (DynamicCache + 3 schemes)
    assert [x["scheme"] for x in s["schemes"]] == ["exact32", "t-kivi", "int4-token"]
    assert all(x["calibration"] == {} for x in s["schemes"])  # nothing calibrated, nothing to flag
    # every key of the summary and of a run is in `kvbits speed --help`'s list (it left out kernel_settings,
    # tuned_launches, layers and host_ms_per_step)
    import re

    from kvbits.evaluate.speed_cli import EPILOG

    listed = set(re.findall(r'"(\w+)"', EPILOG.split("--json prints the summary:")[1]))
    assert set(s) <= listed, set(s) - listed
    assert set(s["runs"][0]) <= listed, set(s["runs"][0]) - listed
    for r in s["runs"]:
        assert len(r["step_ms"]) == 5 and r["cached_tokens"] == r["context"] + 7
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"], rel=1e-3)
        assert r["cache_bytes"] == r["planned_bytes"], r  # real bytes are the planner's, DynamicCache's too
        assert r["cuda_peak_bytes"] is None  # CPU
    for r in _runs(s, "DynamicCache"):
        assert r["path"] == "dynamic" and r["speedup"] == 1.0 and r["decode"] is None
        # float32 model: 2 layers x (K, V) x 2 heads x 16 channels x 4 bytes per token and sequence
        assert r["cache_bytes"] == r["batch"] * r["cached_tokens"] * 2 * 2 * 2 * 16 * 4
    for r in _runs(s, "exact32"):  # stores what DynamicCache stores: the same bytes, the same greedy tokens
        base = next(
            b for b in _runs(s, "DynamicCache") if (b["context"], b["batch"]) == (r["context"], r["batch"])
        )
        assert r["cache_bytes"] == base["cache_bytes"]
        assert r["agreement"] == 1.0 and r["first_divergence"] is None
    for r in _runs(s, "t-kivi"):
        assert r["path"] == "dequantize" and r["workspace_bytes"] == 0
        assert r["decode"] == {
            **dict.fromkeys(("fused_steps", "fallback_steps", "timed_fused_steps", "timed_fallback_steps"), 0),
            "counted_layers": 2,
            "kernel_calls": {"triton": 0, "reference": 0},
        }
        base = next(
            b for b in _runs(s, "DynamicCache") if (b["context"], b["batch"]) == (r["context"], r["batch"])
        )
        assert r["cache_bytes"] < base["cache_bytes"] / 2
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"], rel=1e-3)


def test_workspace_and_fused_paths(model, ids):
    ws = speed_eval(model, 64, [SMALL_KIVI], tokens=3, warmup=1, data=ids, workspace=True)
    (r,) = _runs(ws, "t-kivi")
    assert r["path"] == "workspace" and r["workspace_bytes"] > 0  # the float history it keeps, reported apart
    assert ws["schemes"][0]["path"] == "workspace"
    _workspace_is_printed(ws)
    fu = speed_eval(model, 64, [SMALL_KIVI], tokens=3, warmup=1, data=ids, fused_decode=True)
    (r,) = _runs(fu, "t-kivi")
    # every decode step of every layer through the fused path (the torch reference on CPU) but the first,
    # which attends over real K/V and claims the layer (kvbits.cache.fused): a warm-up step here
    assert r["path"] == "fused"
    assert r["decode"] == {
        "fused_steps": 2 * 3,
        "fallback_steps": 0,
        "timed_fused_steps": 2 * 3,
        "timed_fallback_steps": 0,
        "counted_layers": 2,
        "kernel_calls": {"triton": 0, "reference": 2 * 3},  # on this CPU: the torch reference served them all
    }
    assert r["workspace_bytes"] == 0 and fu["layers"] == 2
    from kvbits.report.speed import speed_markdown

    md = speed_markdown(fu)
    assert "not all fused" not in md
    # said as such: a run of the reference is not the fused kernel's timing
    assert "- `t-kivi`: `fused`, decode attention over the packed store" in md
    assert "attended by the torch reference" in md and "not the fused kernel's" in md
    w0 = speed_eval(model, 64, [SMALL_KIVI], tokens=3, warmup=0, data=ids, fused_decode=True)
    assert _runs(w0, "t-kivi")[0]["decode"]["timed_fused_steps"] == 2 * 2  # the claiming step was timed
    assert "- t-kivi at 64 × 1: 4 fused of 2 × 3, 0 fallback" in speed_markdown(w0)
    assert (_runs(fu, "DynamicCache")[0]["path"], model.config._attn_implementation) == ("dynamic", "sdpa")


def test_step_times_cover_the_cache(model, ids, monkeypatch):
    """A cache slowed by 50 ms per update shows it in every timed step (2 layers: >= 100 ms), the
    baseline does not: the timing covers the cache's own work. (The margin is half the injected time, so a
    baseline step slowed by another process on the machine, e.g. a second test worker, does not fail it.)"""
    from kvbits.cache import QuantizedKVCache

    real = QuantizedKVCache.update

    def slow(self, *a, **kw):
        time.sleep(0.05)
        return real(self, *a, **kw)

    monkeypatch.setattr(QuantizedKVCache, "update", slow)
    s = speed_eval(model, 32, ["int4-token"], tokens=3, warmup=1, data=ids)
    (base,) = _runs(s, "DynamicCache")
    (slowed,) = _runs(s, "int4-token")
    assert min(slowed["step_ms"]) >= 100.0
    assert slowed["ms_per_step"] > base["ms_per_step"] + 50.0 and slowed["speedup"] < 1.0


def test_speedup_comes_from_the_step_times(model, ids, monkeypatch):
    """``speedup`` is the DynamicCache run's ms per step over the scheme's, not a ratio of tokens/s rounded to 0.01:
    at ~1.7 tokens/s (steps slowed to ~0.6 s) that rounding moved it by up to 0.3 %, 0.004 of a 1.5x speed-up."""
    from transformers import DynamicCache

    from kvbits.cache import QuantizedKVCache

    def slowed(cls, seconds):
        real = cls.update

        def update(self, *a, **kw):
            time.sleep(seconds)
            return real(self, *a, **kw)

        monkeypatch.setattr(cls, "update", update)

    slowed(DynamicCache, 0.3)
    slowed(QuantizedKVCache, 0.2)
    s = speed_eval(model, 32, ["int4-token"], tokens=2, warmup=0, data=ids)
    (base,) = _runs(s, "DynamicCache")
    (quant,) = _runs(s, "int4-token")
    assert base["tokens_per_s"] < 2.0 and quant["speedup"] > 1.2
    assert quant["speedup"] == significant(base["ms_per_step"] / quant["ms_per_step"], 4)


def test_host_time_stops_before_the_device_sync(model, ids, monkeypatch):
    """``host_ms_per_step`` is the step's Python before the sync: a sync that waits 30 ms (a busy device, simulated)
    lengthens every step time and no host time. On CUDA the record keeps its median and the report shows it; off
    CUDA the two times are the same by construction, so the record says ``None`` and the report nothing."""
    from transformers import DynamicCache

    from kvbits.evaluate import speed
    from kvbits.report.speed import speed_markdown

    def busy_device(device):
        time.sleep(0.03)

    monkeypatch.setattr(speed, "_sync", busy_device)
    first = ids[:2].reshape(2, 1)
    _, times, host = speed._decode(model, DynamicCache(config=model.config), first, steps=3, warmup=1)
    assert len(times) == len(host) == 3
    assert all(t - h >= 25.0 for t, h in zip(times, host)), (times, host)
    assert speed.host_ms_per_step(host, torch.device("cpu")) is None
    assert speed.host_ms_per_step([3.0, 1.0, 2.0], torch.device("cuda")) == 2.0
    monkeypatch.undo()

    s = speed_eval(model, 32, ["int4-token"], tokens=2, warmup=1, data=ids)
    assert {r["host_ms_per_step"] for r in s["runs"]} == {None}
    assert ", host " not in speed_markdown(s) and "before the device sync" not in speed_markdown(s)
    on_gpu = {**s, "runs": [{**r, "host_ms_per_step": 0.5 * r["ms_per_step"]} for r in s["runs"]]}
    md = speed_markdown(on_gpu)
    assert f"{on_gpu['runs'][0]['ms_per_step']:.2f} [" in md and ", host " in md and "before the device sync" in md


def test_batch_beyond_the_text_repeats_rows(model):
    few = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1))
    s = speed_eval(model, 64, ["int4-token"], batches=3, tokens=2, warmup=0, data=few)
    assert {r["distinct_rows"] for r in s["runs"]} == {2} and {r["batch"] for r in s["runs"]} == {3}


def test_prompt_text_is_read_before_the_model_loads_and_a_path_is_a_file(model, tmp_path, monkeypatch):
    # a missing or misspelt text failed only after the model had loaded, and a pathlib.Path was refused
    # ("text spec must be a non-empty str") after it too
    from _bytelevel import byte_tokenizer

    from kvbits.evaluate import inputs
    from kvbits.evaluate.models import LoadedModel, ModelSource

    path = write_sentences(tmp_path / "prompts.txt", 60)
    lm = LoadedModel(model, byte_tokenizer(), ModelSource(name="tiny-bytes", path="tiny-bytes"), "tinybytes0000000")
    s, s_str = (speed_eval(lm, 64, [EXACT], tokens=2, warmup=0, data=d) for d in (path, str(path)))
    assert s["data"] == s_str["data"] == str(path) and s["fingerprint"] == s_str["fingerprint"]

    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(inputs, "_load_checked_model", no_load)
    for bad, match in (("no-such-text", "unknown text"), (str(tmp_path / "missing.txt"), "does not exist")):
        with pytest.raises(ValueError, match=match):
            speed_eval(lm, 64, [EXACT], data=bad)


def test_errors(model, ids):
    for kw, match in (
        ({"tokens": 0}, "tokens must be an int >= 1"),
        ({"warmup": -1}, "warmup must be an int >= 0"),
        ({"batches": []}, "at least one batch"),
        ({"batches": [0]}, "batch must be an int >= 1"),
        ({"workspace": True, "fused_decode": True}, "never reads it"),
        ({"fused_decode": "yes"}, "fused_decode must be"),
    ):
        with pytest.raises(ValueError, match=match):
            speed_eval(model, 64, ["int4-token"], data=ids, **kw)
    with pytest.raises(ValueError, match="scheme 'int4-token' is listed twice; each scheme is timed once"):
        speed_eval(model, 64, ["int4-token", "int4-token"], data=ids)
    with pytest.raises(ValueError, match="baseline"):
        speed_eval(model, 64, [KVScheme("DynamicCache")], data=ids)
    with pytest.raises(ValueError, match="context must be an int >= 1"):
        speed_eval(model, [0], ["int4-token"], data=ids)
    with pytest.raises(ValueError, match="context must be an int or a list of ints, got 3.5"):
        speed_eval(model, 3.5, ["int4-token"], data=ids)
    with pytest.raises(ValueError, match="output embedding"):
        speed_eval(model.model, 64, ["int4-token"], data=ids)
    with pytest.raises(ValueError, match="fewer than one window"):
        speed_eval(model, 5000, ["int4-token"], data=ids)


def test_report_and_folder(model, ids, tmp_path):
    from kvbits.report.fmt import fmt_float_sig
    from kvbits.report.speed import speed_markdown, write_speed

    s = speed_eval(model, [32, 64], ["int4-token", SMALL_KIVI], batches=[1, 2], tokens=2, warmup=0, data=ids)
    out = write_speed(s, tmp_path / "run")
    assert json.loads((out / "speed.json").read_text())["runs"] == json.loads(json.dumps(s["runs"]))
    md = (out / "report.md").read_text()
    figure = (out / "speed.png").is_file()  # written where matplotlib is installed (kvbits[plot])
    assert md == speed_markdown(s, figure=figure)
    assert "## Batch 1" in md and "## Batch 2" in md and "≠ plan" not in md
    r = _runs(s, "t-kivi")[0]
    # as the renderer prints them: a speed-up below 0.1 (a loaded CPU) gets 3 significant digits, not .2f
    tps, speedup = fmt_float_sig(r["tokens_per_s"], 1), fmt_float_sig(r["speedup"], 2)
    assert f"| t-kivi | {tps} ({speedup}x) |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not figure and "speed.png" not in md
    else:
        assert (out / "speed.png").stat().st_size > 1000
    # a cache that holds other bytes than the plan is marked, not hidden
    bad = json.loads(json.dumps(s))
    bad["runs"][1]["planned_bytes"] += 1
    assert "≠ plan" in speed_markdown(bad)
    write_speed(s, out)  # a speed run's own folder is rewritten
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no kvbits speed run"):
        write_speed(s, foreign)
    write_speed(s, foreign, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "mine" and (foreign / "speed.json").is_file()


_UNTIMED = ("cache", "path", "context", "batch", "cached_tokens", "cache_bytes", "planned_bytes", "workspace_bytes",
            "agreement", "first_divergence", "distinct_rows", "decode")  # fmt: skip


def test_merging_speed_runs_equals_running_them_together(model, ids, tmp_path, capsys):
    """Runs of other contexts and batches merge into the report one run of them all gives, timings aside
    (a cell no run timed reads n/a); each cell keeps its own run's baseline. Refused: a cell in two runs,
    other schemes or steps, another model, a run without a fingerprint, a needle run among speed runs."""
    from kvbits.cli import main
    from kvbits.report.merge_speed import merge_speed
    from kvbits.report.speed import write_speed

    kw = {"tokens": 2, "warmup": 0, "data": ids}
    schemes = ["int4-token", SMALL_KIVI]
    a = speed_eval(model, [32], schemes, batches=[1, 2], **kw)
    b = speed_eval(model, [64], schemes, batches=[1], **kw)
    both = speed_eval(model, [32, 64], schemes, batches=[1, 2], **kw)
    ra, rb = write_speed(a, tmp_path / "a"), write_speed(b, tmp_path / "b")
    assert main(["report", str(ra), str(rb), "--out", str(tmp_path / "m"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["merged_from"] == [str(ra), str(rb)]
    m = json.loads((tmp_path / "m" / "speed.json").read_text())
    assert (m["contexts"], m["batches"], m["schemes"]) == ([32, 64], [1, 2], both["schemes"])
    want = {(r["cache"], r["context"], r["batch"]): {k: r[k] for k in _UNTIMED} for r in both["runs"]}
    got = {(r["cache"], r["context"], r["batch"]): {k: r[k] for k in _UNTIMED} for r in m["runs"]}
    assert got == {key: json.loads(json.dumps(v)) for key, v in want.items() if key[1:] != (64, 2)}
    for r in m["runs"]:  # each speed-up is against the baseline of its own run
        own = a if r["context"] == 32 else b
        assert r["speedup"] == next(x["speedup"] for x in own["runs"] if x["cache"] == r["cache"]
                                    and (x["context"], x["batch"]) == (r["context"], r["batch"]))  # fmt: skip
    assert m["fingerprint"]["prompts"] == {**a["fingerprint"]["prompts"], **b["fingerprint"]["prompts"]}
    md = (tmp_path / "m" / "report.md").read_text()
    assert "## Runs merged" in md and "| n/a | n/a |" not in md.split("## Batch 2")[0]
    assert "| DynamicCache | " in md.split("## Batch 2")[1] and "| n/a |" in md.split("## Batch 2")[1]
    assert main(["report", str(ra), str(rb), "--out", str(tmp_path / "m")]) == 0  # an earlier merge: rewritten

    with pytest.raises(ValueError, match="context 32 x batch 1 was timed in both"):
        merge_speed([a, a])
    with pytest.raises(ValueError, match="runs timed other schemes"):
        merge_speed([a, speed_eval(model, [64], ["int4-token"], batches=[1], **kw)])
    with pytest.raises(ValueError, match="runs differ in tokens"):
        merge_speed([a, {**b, "tokens": 3}])
    with pytest.raises(ValueError, match="differ in their model weights"):
        merge_speed([a, {**b, "fingerprint": {"model": "0" * 16}}])
    with pytest.raises(ValueError, match="records no model fingerprint"):
        merge_speed([a, {**b, "fingerprint": {}}])
    with pytest.raises(ValueError, match="two or more"):
        merge_speed([a])
    needle = tmp_path / "needle"
    needle.mkdir()
    (needle / "needle.json").write_text("{}")
    assert main(["report", str(ra), str(needle), "--out", str(tmp_path / "x")]) == 2
    assert "these runs are of kinds ['needle', 'speed']" in capsys.readouterr().err
    (tmp_path / "own").mkdir()
    write_speed(b, tmp_path / "own")
    assert main(["report", str(ra), str(rb), "--out", str(tmp_path / "own")]) == 2
    assert "holds a kvbits speed run of its own" in capsys.readouterr().err


def test_cli_end_to_end(tmp_path, capsys):
    from kvbits.cli import main

    text = write_sentences(tmp_path / "text.txt", 200)
    model_dir = tmp_path / "tiny"
    tiny_llama().save_pretrained(model_dir)
    save_byte_tokenizer(model_dir)
    argv = ["speed", "--model", str(model_dir), "--data", str(text), "--context", "64", "--batch", "1",
            "--batch", "2", "--scheme", "int4-token", "--tokens", "2", "--warmup", "1"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["batches"] == [1, 2] and len(s["runs"]) == 4 and s["data"] == str(text) and s["reserve"] is True
    assert main([*argv, "--grow", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reserve"] is False
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert "decode tokens/s" in capsys.readouterr().out
    assert (tmp_path / "out" / "report.md").is_file()
    for bad in (["--tokens", "0"], ["--batch", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, *bad])
        assert exc.value.code == 2
    capsys.readouterr()
    assert main([*argv, "--workspace", "--fused-decode", "on"]) != 0
    assert "never reads it" in capsys.readouterr().err


def test_a_model_folder_without_tokenizer_files_times_token_ids(ids, tmp_path):
    """A model folder of weights and config alone, timed on token ids (as the docstring offers models
    without a tokenizer). Before, loading it failed inside transformers' tokenizer ("Couldn't instantiate
    the backend tokenizer from one of ...") whatever the data; text data now fails with the reason."""
    folder = tmp_path / "no-tokenizer"
    tiny_llama().save_pretrained(folder)
    s = speed_eval(str(folder), 64, ["int4-token"], tokens=2, warmup=1, data=ids)
    assert s["data"] == "tokens" and len(s["runs"]) == 2
    text = write_sentences(tmp_path / "text.txt", 50)
    with pytest.raises(ValueError, match="model has no tokenizer .*model folder without tokenizer files"):
        speed_eval(str(folder), 64, ["int4-token"], tokens=2, warmup=1, data=str(text))


@pytest.mark.realmodel
def test_realmodel_speed_smollm2():
    """SmolLM2-135M on War and Peace: every cache holds the planner's bytes, INT8 per-token decodes the
    baseline's greedy tokens, INT2 per-token (no residual window) leaves them at once."""
    s = speed_eval("smollm2-135m", 256, ["int8-token", "int2-token"], tokens=6, warmup=1)
    base, int8, int2 = (_runs(s, c)[0] for c in ("DynamicCache", "int8-token", "int2-token"))
    assert all(r["cache_bytes"] == r["planned_bytes"] for r in (base, int8, int2))
    assert int8["agreement"] == 1.0 and int2["first_divergence"] is not None and int2["first_divergence"] <= 2
    assert base["cache_bytes"] / int8["cache_bytes"] > 3.5  # float32 model: 32 bits vs 8.5


def test_cache_bytes_counts_only_what_it_can(model, ids):
    """DynamicCache: every K/V tensor; transformers' QuantizedCache (quanto): its codes, scales and residual, not
    its residual alone (``keys`` / ``values`` of its layers), nor None as before."""
    from transformers import DynamicCache

    from kvbits.evaluate.stream import cache_bytes

    dyn = DynamicCache()
    k = torch.zeros(1, 2, 10, 16)
    dyn.update(k, k, 0)
    assert cache_bytes(dyn) == 2 * k.numel() * 4
    pytest.importorskip("optimum.quanto")
    # 2 KV heads of 32 channels: whole groups of 64 per token, as quanto needs (tiny_llama's 2 x 16 is refused)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, head_dim=32)  # fmt: skip
    lm = transformers.LlamaForCausalLM(cfg).eval()
    s = speed_eval(lm, 160, ["hf-quanto-int4"], tokens=2, warmup=1, data=ids)
    (peer,) = _runs(s, "hf-quanto-int4")
    assert peer["path"] == "peer" and peer["planned_bytes"] is None
    # 163 tokens (160 + warm-up + 2) of 2 layers x 2 heads x 32 channels, K and V: the prefill's 160 quantized
    # (4-bit codes and a float32 scale and zero-point per 64 elements), the 3 decoded ones in the float32 residual
    quantized = 2 * 2 * (160 * 64 // 2 + 2 * 160 * 64 // 64 * 4)
    assert peer["cache_bytes"] == quantized + 2 * 2 * 3 * 64 * 4


def test_sliding_window_bytes_are_the_plan(ids):
    """Gemma 2 (sliding and global layers alternate): what DynamicCache and a kvbits cache hold past the
    window is what the planner counts for them."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, sliding_window=48,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    s = speed_eval(model, [32, 200], ["int4-token"], tokens=2, warmup=1, data=ids)
    for r in s["runs"]:
        assert r["cache_bytes"] == r["planned_bytes"], r
    short, long = (r["cache_bytes"] for r in _runs(s, "DynamicCache"))
    # 3 decode steps after each prompt: the global layer holds every token, the sliding one the last W - 1
    per_token = 2 * 2 * 16 * 4  # one layer's K and V: 2 heads, 16 channels, float32
    assert short == 2 * 35 * per_token and long == (203 + 47) * per_token


def test_commit_is_the_tree_the_run_started_from(model, ids, checkout_when_model_loads):
    s = speed_eval(model, [64], ["int4-token"], batches=[1], tokens=2, warmup=1, data=ids)
    assert s["commit"] == {"sha": "started", "dirty": False}


def test_reservation_is_recorded_and_changes_no_result(model, ids, tmp_path):
    """``reserve`` (default) builds each kvbits cache with ``max_cache_len`` = the run's tokens: the same greedy
    tokens and held bytes as a growing cache (``reserve=False``), said in the record and the report; runs of
    the two settings do not merge, and a folder from before the key counts as growing."""
    from kvbits.report.merge_speed import _load, merge_speed
    from kvbits.report.speed import speed_markdown, write_speed

    kw = {"tokens": 3, "warmup": 1, "data": ids}
    r = speed_eval(model, 64, ["int8-token", SMALL_KIVI], **kw)
    g = speed_eval(model, 64, ["int8-token", SMALL_KIVI], reserve=False, **kw)
    assert r["reserve"] is True and g["reserve"] is False
    for name in ("int8-token", "t-kivi"):
        (a,), (b,) = _runs(r, name), _runs(g, name)
        assert a["cache_bytes"] == b["cache_bytes"] == a["planned_bytes"]
        assert (a["agreement"], a["first_divergence"]) == (b["agreement"], b["first_divergence"])
    assert "kvbits caches reserve quantized storage" in speed_markdown(r)
    assert "returns views" not in speed_markdown(r) and "returns views" in speed_markdown({**r, "workspace": True})
    assert "kvbits caches grow by concatenation" in speed_markdown(g)
    with pytest.raises(ValueError, match="runs differ in reserve"):
        merge_speed([r, {**g, "contexts": [32], "runs": [{**x, "context": 32} for x in g["runs"]]}])
    old = {k: v for k, v in g.items() if k != "reserve"}
    write_speed(old, tmp_path / "old")
    assert _load(tmp_path / "old")["reserve"] is False
    with pytest.raises(TypeError, match="reserve must be True or False"):
        speed_eval(model, 64, ["int8-token"], reserve="yes", **kw)


def test_kernel_settings_are_recorded_and_keep_runs_apart(model, ids, tmp_path, monkeypatch):
    """The decode-kernel settings (``KVBITS_KERNEL``, ``KVBITS_DEQUANT``, ``KVBITS_AUTOTUNE``) go into the record and
    the report, with the autotuner's launches when it is on; runs of other settings do not merge, a folder from
    before the field counts as the defaults, and a bad value fails before the model runs."""
    from kvbits.kernels import autotune
    from kvbits.report.merge_speed import _load, merge_speed
    from kvbits.report.speed import speed_markdown, write_speed

    for var in ("KVBITS_KERNEL", "KVBITS_DEQUANT", "KVBITS_AUTOTUNE"):
        monkeypatch.delenv(var, raising=False)
    kw = {"tokens": 2, "warmup": 1, "data": ids}
    plain = speed_eval(model, 64, ["int8-token"], **kw)
    assert plain["kernel_settings"] == {"kernel": "auto", "dequant": "f32", "autotune": "off"}
    assert plain["tuned_launches"] == {}
    assert "`KVBITS_KERNEL=auto`, `KVBITS_DEQUANT=f32`, `KVBITS_AUTOTUNE=off`" in speed_markdown(plain)

    monkeypatch.setenv("KVBITS_DEQUANT", "f16")
    monkeypatch.setenv("KVBITS_AUTOTUNE", "on")
    monkeypatch.setattr(autotune, "chosen_launches",
                        lambda since=None: {"a": "f16-w2-s3", "b": "f16-w2-s3", "c": "default"})  # fmt: skip
    tuned = speed_eval(model, 32, ["int8-token"], **kw)
    assert tuned["kernel_settings"] == {"kernel": "auto", "dequant": "f16", "autotune": "on"}
    assert "tuned launches: default (1 key), f16-w2-s3 (2 keys)" in speed_markdown(tuned)
    with pytest.raises(ValueError, match="runs differ in kernel_settings"):
        merge_speed([plain, tuned])
    old = {k: v for k, v in plain.items() if k not in ("kernel_settings", "tuned_launches")}
    write_speed(old, tmp_path / "old")
    assert _load(tmp_path / "old")["kernel_settings"] == plain["kernel_settings"]
    assert "Decode kernel" not in speed_markdown(old)

    monkeypatch.setenv("KVBITS_AUTOTUNE", "fast")
    loads = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: loads.append(1))
    with pytest.raises(ValueError, match="KVBITS_AUTOTUNE must be one of"):
        speed_eval(model, 64, ["int8-token"], **kw)
    assert not loads


def test_sdpa_backends_are_applied_recorded_and_keep_runs_apart(model, ids, monkeypatch):
    """``sdpa="no-cudnn"`` keeps SDPA off cuDNN's backend while every run decodes (the baseline's SDPA included), and
    ``auto`` leaves torch's flags alone; the setting goes into the record and the report, runs of different settings
    do not merge, a folder from before the field counts as ``auto``, and a bad value fails before the model runs."""
    from kvbits.evaluate import speed
    from kvbits.report.merge_speed import merge_speed
    from kvbits.report.speed import speed_markdown

    seen = []
    real = speed._decode

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(speed, "_decode", spy)
    kw = {"tokens": 2, "warmup": 1, "data": ids}
    assert torch.backends.cuda.cudnn_sdp_enabled()
    off = speed_eval(model, 64, ["int8-token"], sdpa="no-cudnn", **kw)
    assert seen and not any(seen), seen  # the warm-up run, the baseline and the scheme: cuDNN off in each
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the run
    seen.clear()
    auto = speed_eval(model, 64, ["int8-token"], **kw)
    assert seen and all(seen)
    assert off["sdpa"] == "no-cudnn" and auto["sdpa"] == "auto"
    assert "flash, memory-efficient or math, not cuDNN" in speed_markdown(off)
    assert "`--sdpa no-cudnn` times the baseline without it" in speed_markdown(auto)
    with pytest.raises(ValueError, match="runs differ in sdpa"):
        merge_speed([off, auto])
    old = {k: v for k, v in auto.items() if k != "sdpa"}
    assert "**SDPA**" not in speed_markdown(old)
    loads = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: loads.append(1))
    with pytest.raises(ValueError, match="sdpa must be one of"):
        speed_eval(model, 64, ["int8-token"], sdpa="flash", **kw)
    assert not loads


def test_static_caches_time_against_both_baselines(model, ids, tmp_path, monkeypatch):
    """``static=True``: kvbits schemes decode through ``StaticQuantizedKVCache`` and transformers' ``StaticCache`` is
    timed as a second baseline. The static cache decodes the greedy tokens ``QuantizedKVCache`` decodes, holds the
    planner's bytes for every reserved slot (a windowed scheme more: its ring and one block ahead), goes through the
    fused path when asked, and says so in the record and the report; static and non-static runs do not merge.
    Pre-RoPE keys (per channel over blocks of 8 tokens, no window: ``int4-channel-prerope``'s shape) included."""
    from kvbits.cache import StaticQuantizedKVCache
    from kvbits.report.merge_speed import _load, merge_speed
    from kvbits.report.speed import speed_markdown, write_speed

    kw = {"tokens": 4, "warmup": 1, "data": ids, "batches": [1, 2]}
    pre_rope = KVScheme("t-channel-prerope", key=replace(SMALL_KIVI.key, bits=4, pre_rope=True),
                        value=replace(SMALL_KIVI.value, bits=4, group_size=None), block=8)  # fmt: skip
    schemes = ["int4-token", SMALL_KIVI, "int8-token,0=fp16", pre_rope]
    st = speed_eval(model, 64, schemes, static=True, **kw)
    qu = speed_eval(model, 64, schemes, **kw)
    assert (st["static"], st["graphs"], st["baselines"]) == (True, False, ["DynamicCache", "StaticCache"])
    assert (qu["static"], qu["baselines"]) == (False, ["DynamicCache"])
    assert len(st["runs"]) == 2 * 6 and [x["path"] for x in st["schemes"]] == ["static-dequantize"] * 4
    for r in _runs(st, "StaticCache"):  # float K/V in every reserved slot: DynamicCache's bytes and tokens
        base = next(b for b in _runs(st, "DynamicCache") if b["batch"] == r["batch"])
        assert r["path"] == "static-float" and r["decode"] is None and r["workspace_bytes"] == 0
        assert r["cache_bytes"] == r["planned_bytes"] == base["cache_bytes"]
        assert r["agreement"] == 1.0 and r["speedup"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"], rel=1e-3)
    for name in ("int4-token", "t-kivi", "int8-token,0=fp16", "t-channel-prerope"):
        for r, q in zip(_runs(st, name), _runs(qu, name), strict=True):
            assert r["path"] == "static-dequantize" and r["workspace_bytes"] == 0
            assert (r["agreement"], r["first_divergence"]) == (q["agreement"], q["first_divergence"])
            if name in ("t-kivi", "t-channel-prerope"):  # the ring of residual + block slots and one block written ahead
                assert r["cache_bytes"] > r["planned_bytes"] == q["cache_bytes"]
            else:
                assert r["cache_bytes"] == r["planned_bytes"] == q["cache_bytes"]
    assert min(r["agreement"] for r in _runs(st, "int4-token")) < 1.0  # the codes' error reaches the tokens
    md = speed_markdown(st)
    assert "`StaticCache`: `static-float`" in md and "`int4-token`: `static-dequantize`, `StaticQuantizedKVCache`" in md
    assert "| StaticCache | " in md and "kvbits caches reserve" not in md and "captured CUDA graph" not in md
    assert "holds more than the plan by design" in md and "by design" not in speed_markdown(qu)
    with pytest.raises(ValueError, match="runs differ in static"):
        merge_speed([st, {**qu, "batches": [3], "runs": [{**x, "batch": 3} for x in qu["runs"]]}])

    calls = []
    real = StaticQuantizedKVCache.__init__

    def spy(self, *a, **k):
        calls.append(k["max_cache_len"])
        real(self, *a, **k)

    monkeypatch.setattr(StaticQuantizedKVCache, "__init__", spy)
    fu = speed_eval(model, 64, [SMALL_KIVI], static=True, fused_decode=True, tokens=3, warmup=1, data=ids)
    assert calls == [64 + 1 + 3] * 2  # checked before any run (check_static_model), then the run's
    (r,) = _runs(fu, "t-kivi")
    assert r["path"] == "static-fused" and fu["schemes"][0]["path"] == "static-fused"
    assert r["decode"] == {"fused_steps": 2 * 3, "fallback_steps": 0, "timed_fused_steps": 2 * 3,
                           "timed_fallback_steps": 0, "counted_layers": 2,
                           "kernel_calls": {"triton": 0, "reference": 2 * 3}}  # fmt: skip
    old = {k: v for k, v in qu.items() if k not in ("static", "graphs", "baselines")}
    write_speed(old, tmp_path / "old")  # a run from before the options: QuantizedKVCache, no graphs
    loaded = _load(tmp_path / "old")
    assert (loaded["static"], loaded["graphs"], loaded["baselines"]) == (False, False, ["DynamicCache"])


def test_graphs_replay_the_static_steps(model, ids, monkeypatch):
    """``graphs=True``: the static caches' decode steps after 2 eager ones and the captured one are replayed (here
    through ``benchmarks/graph_replay.py``'s emulation of a CUDA graph, registered for the CPU): the same greedy tokens
    as the same caches run eagerly, the layers' Python run only for the steps before the replays, and the record and the
    report say so. Without a capture for the device, or with too few warm-up steps, it is refused before any decode."""
    from pathlib import Path

    from kvbits.report.speed import speed_markdown

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import emulated_graphs

    kw = {"tokens": 6, "warmup": 3, "data": ids, "batches": [2], "static": True, "fused_decode": True}
    eager = speed_eval(model, 64, ["int4-token", SMALL_KIVI], **kw)
    with emulated_graphs():
        g = speed_eval(model, 64, ["int4-token", SMALL_KIVI], graphs=True, **kw)
    assert g["graphs"] is True and [x["path"] for x in g["schemes"]] == ["static-fused-graphs"] * 2
    for name in ("StaticCache", "int4-token", "t-kivi"):
        (r,), (e,) = _runs(g, name), _runs(eager, name)
        assert r["path"] == e["path"] + "-graphs"
        # t-kivi's window (16 + 8 tokens after a 64-token prompt holding 16) flushes at step 7, the first flush: run
        # eagerly (timed), as a variant's first step is; the other steps replay the step captured at step 2
        flushes = name == "t-kivi"
        assert r["graph"] == {"eager_steps": 2, "captured_steps": [2], "python_steps": 3 + flushes,
                              "replayed_steps": 9 - 3 - flushes}, (name, r["graph"])  # fmt: skip
        assert (r["agreement"], r["first_divergence"], r["cache_bytes"]) == (
            e["agreement"], e["first_divergence"], e["cache_bytes"])  # fmt: skip
        if name != "StaticCache":  # the claiming step, then one eager and the captured one through the kernel
            assert r["decode"]["fused_steps"] == 2 * (2 + flushes) and r["decode"]["timed_fused_steps"] == 2 * flushes
    assert "graph" not in _runs(g, "DynamicCache")[0]
    md = speed_markdown(g)
    assert "replayed from a captured CUDA graph after 2 eager steps" in md and "not all fused" not in md

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the model is on cpu"):
        speed_eval(model, 64, ["int4-token"], graphs=True, **kw)
    from kvbits.evaluate.graphs import GraphedDecode

    with pytest.raises(ValueError, match="eager must be an int >= 1"):
        GraphedDecode(model, eager=0)
    with pytest.raises(ValueError, match=r"tokens \(B, 1\) and cache_position \(1,\), got \(1, 2\)"):
        GraphedDecode(model)(torch.zeros(1, 2, dtype=torch.long), cache_position=torch.zeros(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):  # no capture for the CPU: said, not run
        step = GraphedDecode(lambda *a, **k: None, eager=1)
        for _ in range(2):
            step(torch.zeros(1, 1, dtype=torch.long), cache_position=torch.zeros(1, dtype=torch.long))
    with emulated_graphs(), pytest.raises(ValueError, match="warmup must be at least 3, got 2"):
        speed_eval(model, 64, ["int4-token"], graphs=True, **{**kw, "warmup": 2})


def test_graph_runs_resident_bytes_are_read_after_the_graphs_are_freed(model, ids, monkeypatch):
    """``cuda_resident_bytes`` of a ``graphs`` run was read while its ``GraphedDecode`` was alive: on CUDA each captured
    variant's logits ``(B, 1, V)`` and the step's inputs sit in the graphs' pool, counted as the cache's. The graphs are
    freed first now, and what they held is ``cuda_graph_bytes``. CUDA's allocated bytes are emulated: 1000, plus 500
    while a ``GraphedDecode`` lives; the peak 1600."""
    import weakref
    from pathlib import Path

    from kvbits.evaluate import graphs, speed

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import emulated_graphs

    made: list[weakref.ref] = []
    real = graphs.GraphedDecode

    def tracked(*args, **kwargs):
        g = real(*args, **kwargs)
        made.append(weakref.ref(g))
        return g

    monkeypatch.setattr(graphs, "GraphedDecode", tracked)
    monkeypatch.setattr(speed, "_cuda_allocated", lambda dev: 1000 + 500 * sum(r() is not None for r in made))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1600)
    kw = {"tokens": 2, "warmup": 3, "data": ids, "batches": [1], "static": True, "fused_decode": True}
    with emulated_graphs():
        g = speed_eval(model, 64, ["int4-token"], graphs=True, **kw)
    assert len(made) == 2  # StaticCache's run and int4-token's
    for name in ("StaticCache", "int4-token"):
        (r,) = _runs(g, name)
        assert (r["cuda_resident_bytes"], r["cuda_graph_bytes"], r["cuda_peak_bytes"]) == (0, 500, 600), (name, r)
    (r,) = _runs(g, "DynamicCache")
    assert (r["cuda_resident_bytes"], r["cuda_graph_bytes"]) == (0, None)


def test_static_errors(model, ids, monkeypatch):
    """Settings a static run can not have, and schemes ``StaticQuantizedKVCache`` does not hold, fail before any
    decode step, naming why."""
    from kvbits.evaluate import speed

    decodes = []
    monkeypatch.setattr(speed, "_decode", lambda *a, **k: decodes.append(1))
    kw = {"tokens": 2, "warmup": 3, "data": ids}
    for extra, match in (
        ({"graphs": True}, "graphs=True replays the steps of a static cache: it needs static=True"),
        ({"static": True, "reserve": False}, "reserve=False asks for growing caches"),
        ({"static": True, "workspace": True}, "holds no dequantized workspace"),
        ({"static": "yes"}, "static must be True or False"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            speed_eval(model, 64, ["int4-token"], **kw, **extra)
    hadamard = get_scheme("int4-token-hadamard")  # rotated pre-RoPE keys: QuantizedKVCache's
    rotated = replace(hadamard, name="rotated-prerope", key=replace(hadamard.key, pre_rope=True))
    with pytest.raises(ValueError, match=r"does not hold 'rotated-prerope' \(keys: pre-RoPE keys with a hadamard"):
        speed_eval(model, 64, ["int4-token", rotated], static=True, **kw)
    mixed = replace(get_scheme("int4-token"), name="int4-token,1=rotated-prerope", layers=((1, rotated),))
    with pytest.raises(ValueError, match=r"'int4-token,1=rotated-prerope' \(layer 1: keys: pre-RoPE keys with"):
        speed_eval(model, 64, [mixed], static=True, **kw)
    with pytest.raises(ValueError, match="'StaticCache' is a baseline"):
        speed_eval(model, 64, [KVScheme("StaticCache")], static=True, **kw)
    assert not decodes


def test_cli_static_and_graphs(tmp_path, capsys):
    from kvbits.cli import main

    model_dir = tmp_path / "tiny"
    tiny_llama().save_pretrained(model_dir)
    save_byte_tokenizer(model_dir)
    text = write_sentences(tmp_path / "text.txt", 200)
    argv = ["speed", "--model", str(model_dir), "--data", str(text), "--context", "64", "--scheme", "int4-token",
            "--tokens", "2", "--warmup", "3"]  # fmt: skip
    assert main([*argv, "--static", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["static"] is True and [r["cache"] for r in s["runs"]] == ["DynamicCache", "StaticCache", "int4-token"]
    assert main([*argv, "--static"]) == 0
    assert "StaticCache" in capsys.readouterr().out
    for bad, match in ((["--graphs"], "add --static"), (["--static", "--grow"], "drop --grow"),
                       (["--static", "--graphs"], "--graphs replays decode steps from captured CUDA graphs: it needs --device cuda")):  # fmt: skip
        assert main([*argv, *bad]) != 0
        assert match in capsys.readouterr().err


def test_a_hybrid_model_runs_static_too_and_graphs_are_refused_by_name():
    """A hybrid model (LFM2: convolution layers 0 and 2): the run failed inside transformers (IndexError in
    ``get_conv_state``), then was refused; ``QuantizedKVCache`` now holds it, so it runs (the K/V bytes are the plan's,
    the conv states reported apart). ``static=True`` was refused ('full-attention layers only'): now
    ``StaticQuantizedKVCache`` holds the states beside its slabs, and the static run decodes ``StaticCache``'s tokens
    with the plan's bytes; ``graphs=True`` is refused before any run, naming the state layers and the model."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    torch.manual_seed(0)
    cfg = Lfm2Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024, layer_types=["conv", "full_attention"] * 2)  # fmt: skip
    hybrid = AutoModelForCausalLM.from_config(cfg).eval()
    s = speed_eval(hybrid, 32, ["int4-token"], tokens=2, warmup=0, data=torch.randint(0, 256, (200,)))
    assert all(r["cache_bytes"] == r["planned_bytes"] and r["linear_state_bytes"] > 0 for r in s["runs"])
    _linear_states_are_reported(s)
    s = speed_eval(hybrid, 32, ["fp16", "int4-token"], tokens=2, warmup=0, data=torch.randint(0, 256, (200,)),
                   static=True)  # fmt: skip
    assert [r["cache"] for r in s["runs"]] == ["DynamicCache", "StaticCache", "fp16", "int4-token"]
    assert all(r["linear_state_bytes"] == s["runs"][0]["linear_state_bytes"] > 0 for r in s["runs"])
    assert all(r["cache_bytes"] == r["planned_bytes"] for r in s["runs"][2:]) and s["runs"][2]["agreement"] == 1.0
    # it named "layers [0, 2] of StaticCache": the throwaway baseline cache speed_eval probes, not the model or kvbits'
    held = r"layers \[0, 2\] of Lfm2ForCausalLM \(held by StaticQuantizedKVCache and the StaticCache baseline\) keep"
    with pytest.raises(ValueError, match=r"graphs=True: " + held + " convolution"):
        speed_eval(hybrid, 32, ["int4-token"], tokens=2, warmup=3, data=torch.randint(0, 256, (200,)), static=True,
                   graphs=True)  # fmt: skip


def test_a_hybrid_models_fused_runs_are_not_listed_as_not_all_fused():
    """LFM2 with 2 convolution and 2 attention layers, every timed step of both attention layers fused (4 of 2 x 2,
    0 fallback): the report compared the 4 with ``layers`` x ``tokens`` = 4 x 2 and listed the run under "Timed steps
    not all fused". Now against the layers the cache counts (``decode.counted_layers``)."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    from kvbits.report.speed import check_speed, speed_markdown

    torch.manual_seed(0)
    cfg = Lfm2Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024, layer_types=["conv", "full_attention"] * 2)  # fmt: skip
    hybrid = AutoModelForCausalLM.from_config(cfg).eval()
    s = speed_eval(hybrid, 32, ["int4-token"], tokens=2, warmup=1, data=torch.randint(0, 256, (200,)),
                   fused_decode=True)  # fmt: skip
    (r,) = _runs(s, "int4-token")
    assert s["layers"] == 4 and r["decode"]["counted_layers"] == 2
    assert r["decode"]["timed_fused_steps"] == 2 * 2 and r["decode"]["timed_fallback_steps"] == 0
    assert "not all fused" not in speed_markdown(s)
    short = {**s, "runs": [{**x, "decode": {**x["decode"], "timed_fused_steps": 3, "timed_fallback_steps": 1}}
                           if x["decode"] else x for x in s["runs"]]}  # fmt: skip
    assert "- int4-token at 32 × 1: 3 fused of 2 × 2, 1 fallback" in speed_markdown(short)
    with pytest.raises(ValueError, match="counted_layers"):
        check_speed({**s, "runs": [{**r, "decode": {**r["decode"], "counted_layers": -1}}]}, "speed.json")


def _console(s: dict) -> str:
    """What ``kvbits speed`` prints for summary ``s`` (its rich tables, wide enough not to wrap a cell)."""
    import io

    from rich.console import Console

    from kvbits.evaluate import speed_cli

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvbits._console.stdout_console", lambda: Console(file=buf, width=400))
        speed_cli._print(s, None)
    return buf.getvalue()


def _workspace_is_printed(s: dict) -> None:
    """A ``--workspace`` run's dequantized history (``workspace_bytes``: t-kivi at 64 tokens, 34816 bytes beside a
    14080-byte cache) was in report.md's table and speed.png's bytes but not in the console's table, which showed the
    K/V bytes alone. Now added there as the report adds it."""
    from kvbits.report.fmt import fmt_bytes
    from kvbits.report.speed import speed_markdown

    (r,) = _runs(s, "t-kivi")
    shown = f"+ workspace {fmt_bytes(r['workspace_bytes'])}"
    assert shown in speed_markdown(s, figure=False) and _console(s).count(shown) == 1
    assert "+ workspace" not in _console({**s, "runs": [{**x, "workspace_bytes": 0} for x in s["runs"]]})


def _linear_states_are_reported(s: dict) -> None:
    """A hybrid run's ``linear_state_bytes`` were in speed.json only: report.md's bytes table and the CLI's table
    showed the K/V bytes alone, understating what the cache holds. Now beside them, and refused when not bytes."""
    import io

    from rich.console import Console

    from kvbits.evaluate import speed_cli
    from kvbits.report.fmt import fmt_bytes
    from kvbits.report.speed import check_speed, speed_markdown

    shown = f"+ linear states {fmt_bytes(s['runs'][0]['linear_state_bytes'])}"
    md = speed_markdown(s, figure=False)
    assert md.count(shown) == len(s["runs"]) and "*Linear states: the hybrid model's" in md
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvbits._console.stdout_console", lambda: Console(file=buf, width=400))
        speed_cli._print(s, None)
    assert buf.getvalue().count(shown) == len(s["runs"])
    plain = {**s, "runs": [{**r, "linear_state_bytes": 0} for r in s["runs"]]}  # a model whose every layer attends
    assert "linear states" not in speed_markdown(plain, figure=False).lower()
    with pytest.raises(ValueError, match="linear_state_bytes"):
        check_speed({**s, "runs": [{**s["runs"][0], "linear_state_bytes": -1}]}, "speed.json")


def test_static_fused_counts_the_float_layers_of_a_mixed_scheme(model, ids):
    """A mixed scheme's fp16 layer in a ``StaticQuantizedKVCache`` is served by the fused kernel like the others (its
    ``kernel_calls``), but ``fused_report`` left it out: ``int8-token,0=fp16`` counted 3 fused steps of 2 layers x 3,
    and the report listed the run under "Timed steps not all fused" (3 fused, 0 fallback). Counted as
    ``QuantizedKVCache`` counts it."""
    from kvbits.report.speed import speed_markdown

    kw = {"tokens": 3, "warmup": 1, "data": ids, "fused_decode": True}
    for static in (False, True):
        s = speed_eval(model, 64, ["int8-token,0=fp16"], static=static, **kw)
        (r,) = _runs(s, "int8-token,0=fp16")
        assert r["decode"]["timed_fused_steps"] == 2 * 3 == sum(r["decode"]["kernel_calls"].values()), (static, r)
        assert "not all fused" not in speed_markdown(s)


def test_workspace_is_not_kept_by_runs_auto_sends_through_the_fused_path(model, ids, monkeypatch):
    """``workspace=True`` with ``fused_decode="auto"`` where auto picks the fused path (CUDA with Triton; here
    ``fuses`` answers as there): the fused steps never read a dequantized history, but the cache kept and appended to
    one (t-kivi at 64 tokens: 34816 workspace bytes beside a 14080-byte cache, in the timed steps' work). Those runs
    keep none; the dequantizing runs of the same call still do."""
    from kvbits.evaluate import stream

    monkeypatch.setattr(stream, "fuses", lambda model, mode, device: True)
    s = speed_eval(model, 64, [SMALL_KIVI], workspace=True, tokens=3, warmup=1, data=ids)
    (r,) = _runs(s, "t-kivi")
    assert r["path"] == "fused" and r["decode"]["timed_fused_steps"] == 2 * 3
    assert r["workspace_bytes"] == 0
    monkeypatch.setattr(stream, "fuses", lambda model, mode, device: False)
    (r,) = _runs(speed_eval(model, 64, [SMALL_KIVI], workspace=True, tokens=3, warmup=1, data=ids), "t-kivi")
    assert r["path"] == "workspace" and r["workspace_bytes"] > 0


def test_a_float32_model_whose_first_parameter_is_int8_is_timed_as_float32(ids):
    """speed read the model's dtype from its first parameter: with an int8 one first a float32 model was refused
    (ValueError "the model's dtype must be float16, bfloat16 or float32, got torch.int8") and its schemes' planned
    bytes counted 1 byte a full-precision value. Now the first floating parameter's dtype counts (as eval's)."""
    model = tiny_llama()
    model.model.register_parameter("qweight", torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False))
    s = speed_eval(model, [64], [SMALL_KIVI], batches=[1], tokens=3, warmup=1, data=ids)
    assert s["dtype"] == "float32"
    for r in s["runs"]:
        assert r["cache_bytes"] == r["planned_bytes"], r
    dyn = _runs(s, "DynamicCache")[0]
    assert dyn["cache_bytes"] == dyn["cached_tokens"] * 2 * 2 * 2 * 16 * 4  # float32: 4 bytes a value


def test_slow_steps_keep_their_rate_and_speedup_to_significant_digits():
    """tokens/s was rounded to 2 decimals and the speed-up to 4: a step of 30 s (a loaded CPU) gave 0.03 tokens/s
    for 0.0329 and a speed-up of 0.0329 for 0.032935 (1.1e-3 off, past the figures' own 1e-3 checks)."""
    assert step_stats([30363.0], 1)["tokens_per_s"] == pytest.approx(1e3 / 30363.0, rel=1e-5)
    assert step_stats([0.01234], 8)["tokens_per_s"] == pytest.approx(8e3 / 0.01234, rel=1e-5)
    assert significant(0.032935418, 4) == 0.03294 and significant(123456.789, 6) == 123457.0


def test_slow_runs_print_their_rate_and_speedup_to_significant_digits():
    """report.md and the console printed tokens/s with one decimal and the speed-up with two: a run at 0.0331
    tokens/s, 0.0329x DynamicCache, printed as ``0.0 (0.03x)``. Now three significant digits below the fixed
    format's resolution; ordinary figures (12.3 tokens/s, 1.48x) print as before."""
    import io
    from pathlib import Path

    from rich.console import Console

    from kvbits.evaluate import speed_cli
    from kvbits.report.fmt import fmt_float_sig
    from kvbits.report.speed import speed_markdown

    assert [fmt_float_sig(x, 1) for x in (0.03312, 12.34, 0.0, 100.0)] == ["0.0331", "12.3", "0.0", "100.0"]
    assert [fmt_float_sig(x, 2) for x in (0.032935, 1.482, 0.95, math.nan)] == ["0.0329", "1.48", "0.95", "n/a"]
    s = json.loads((Path(__file__).parents[1] / "benchmarks/results/speed-smollm2/speed.json").read_text())
    r = s["runs"][-1]
    s["runs"][-1] = {**r, "tokens_per_s": 0.03312, "speedup": 0.032935}
    assert "0.0331 (0.0329x)" in speed_markdown(s, figure=False)
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvbits._console.stdout_console", lambda: Console(file=buf, width=400))
        speed_cli._print(s, None)
    assert "0.0331 (0.0329x)" in buf.getvalue()


def _raise_for(monkeypatch, exc: BaseException, cache: str, context: int) -> None:
    """``_run_one`` raises ``exc`` for ``cache`` (``"DynamicCache"`` for the baseline) at ``context``."""
    from kvbits.evaluate import speed

    run_one = speed._run_one

    def run(model, scheme, *a, **k):
        name = speed._cache_name(scheme)
        if name == cache and k["context"] == context and k["tokens"] > 1:  # not the untimed warm-up decode
            raise exc
        return run_one(model, scheme, *a, **k)

    monkeypatch.setattr(speed, "_run_one", run)


def test_a_failed_run_is_recorded_and_the_others_go_on(model, ids, tmp_path, monkeypatch):
    """One scheme running out of memory at one context ended speed_eval, every other run lost: it is recorded
    (its error's type and message), the device's memory freed, the others timed; the report reads 'failed:
    <type>' in its cells and lists the message, speed.json reads back, and the merge keeps the record."""
    from kvbits.evaluate import speed
    from kvbits.report.merge_speed import merge_speed
    from kvbits.report.speed import load_speed, speed_markdown, write_speed

    freed = []
    monkeypatch.setattr(speed, "free_device", lambda dev: freed.append(dev))
    _raise_for(monkeypatch, torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2.00 GiB"), "int4-token", 64)
    kw = {"tokens": 2, "warmup": 1, "data": ids}
    s = speed_eval(model, [32, 64], ["int4-token", SMALL_KIVI], **kw)
    assert len(s["runs"]) == 2 * 3 and len(freed) == 1
    bad = next(r for r in s["runs"] if r.get("error"))
    assert (bad["cache"], bad["context"], bad["batch"], bad["path"]) == ("int4-token", 64, 1, "dequantize")
    assert bad["error"] == {"type": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert "tokens_per_s" not in bad and bad["prefill_seconds"] is not None
    assert all(r["tokens_per_s"] > 0 and r["speedup"] > 0 for r in s["runs"] if r is not bad)
    out = write_speed(s, tmp_path / "run")
    assert load_speed(out / "speed.json")["runs"] == json.loads(json.dumps(s["runs"]))
    md = speed_markdown(s)
    row = next(line for line in md.split("## Batch 1")[1].splitlines() if line.startswith("| int4-token |"))
    assert row.endswith("| failed: OutOfMemoryError |") and "| 0 " not in row
    assert "- int4-token at 64 × 1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in md
    assert "failed: OutOfMemoryError" in _console(s)
    monkeypatch.undo()
    other = speed_eval(model, [96], ["int4-token", SMALL_KIVI], **kw)
    merged = merge_speed([s, other])
    assert [r["error"] for r in merged["runs"] if r.get("error")] == [bad["error"]]
    assert "| failed: OutOfMemoryError | " in speed_markdown(merged)


def test_a_failed_baseline_leaves_the_schemes_without_a_factor(model, ids, monkeypatch):
    """The DynamicCache run failing at a cell (a quantized cache fits where it does not): the schemes are timed,
    their speed-up and agreement null (nothing to divide by or compare with), not 1.0 against nothing."""
    from kvbits.report.speed import check_speed, speed_markdown

    _raise_for(monkeypatch, RuntimeError("no room"), "DynamicCache", 32)
    s = speed_eval(model, [32], ["int4-token"], tokens=2, warmup=1, data=ids)
    base, run = s["runs"]
    assert base["error"]["type"] == "RuntimeError" and run["tokens_per_s"] > 0
    assert run["speedup"] is None and run["agreement"] is None and run["first_divergence"] is None
    check_speed(s, "speed.json")
    md = speed_markdown(s)
    assert "| DynamicCache | failed: RuntimeError |" in md and "n/a (no baseline)" in md
    _console(s)


def test_a_failed_prefill_fails_its_cells_runs_and_interrupts_still_stop(model, ids, monkeypatch):
    from kvbits.evaluate import stream

    prefill = stream.prefill_kv

    def failing(model, ids):
        if ids.shape[1] == 64:
            raise ValueError("too long")
        return prefill(model, ids)

    monkeypatch.setattr(stream, "prefill_kv", failing)
    s = speed_eval(model, [32, 64], ["int4-token"], tokens=2, warmup=1, data=ids)
    assert [(r["context"], r.get("error", {}).get("type"), r["prefill_seconds"] is None) for r in s["runs"]] == [
        (32, None, False), (32, None, False), (64, "ValueError", True), (64, "ValueError", True)]
    monkeypatch.undo()
    _raise_for(monkeypatch, KeyboardInterrupt(), "int4-token", 32)
    with pytest.raises(KeyboardInterrupt):
        speed_eval(model, [32], ["int4-token"], tokens=2, warmup=1, data=ids)


def test_failed_runs_free_cuda_memory():
    from kvbits.evaluate.speed import free_device, run_error

    with pytest.MonkeyPatch.context() as mp:
        emptied = []
        mp.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
        free_device(torch.device("cpu"))
        assert emptied == []
        free_device(torch.device("cuda"))
        assert emptied == [1]
    err = run_error(RuntimeError("x" * 2000))
    assert err["type"] == "RuntimeError" and len(err["message"]) <= 500


def test_cli_exits_non_zero_after_writing_a_run_with_failures(model, ids, tmp_path, monkeypatch, capsys):
    from kvbits.cli import main
    from kvbits.evaluate import speed

    _raise_for(monkeypatch, torch.OutOfMemoryError("CUDA out of memory"), "int4-token", 32)
    s = speed_eval(model, [32], ["int4-token"], tokens=2, warmup=1, data=ids)
    monkeypatch.setattr(speed, "speed_eval", lambda *a, **k: s)
    out = tmp_path / "out"
    assert main(["speed", "--model", "m", "--context", "32", "--scheme", "int4-token", "--out", str(out)]) == 1
    assert "1 of 2 runs failed: int4-token at 32 x 1 (OutOfMemoryError)" in capsys.readouterr().err
    assert json.loads((out / "speed.json").read_text())["runs"][1]["error"]["type"] == "OutOfMemoryError"


def test_cli_says_how_many_runs_failed_once(model, ids, tmp_path, monkeypatch, capsys):
    """`kvbits speed` with a failed run said 'N of M runs failed' twice: speed_eval's log line
    ('kvbits: ERROR: speed: 1 of 2 runs failed: ...') and the command's closing line. Now once, the closing line
    (after the report is written, with where the messages are); the failed run's own error line stays."""
    from kvbits.cli import main
    from kvbits.evaluate import speed

    _raise_for(monkeypatch, torch.OutOfMemoryError("CUDA out of memory"), "int4-token", 32)
    real = speed.speed_eval
    monkeypatch.setattr(speed, "speed_eval", lambda _model, contexts, schemes, **k: real(
        model, contexts, schemes, **{**k, "data": ids, "tokens": 2, "warmup": 1, "progress": False}))
    argv = ["speed", "--model", "m", "--context", "32", "--scheme", "int4-token", "--out", str(tmp_path / "out")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("runs failed") == 1, err
    assert err.rstrip().splitlines()[-1].startswith("kvbits speed: 1 of 2 runs failed: int4-token at 32 x 1 (OutOf")
    assert "speed int4-token: context 32, batch 1 failed: OutOfMemoryError" in err  # the run's own line


def test_the_first_cell_prefill_is_warmed_up(model, ids, monkeypatch):
    """The first cell's prefill_seconds included the process's one-off set-up (0.011 s against 0.006 s for a later
    cell): an untimed short prefill runs before it, once."""
    from kvbits.evaluate import stream

    prefill, shapes = stream.prefill_kv, []

    def spy(model, ids):
        shapes.append(tuple(ids.shape))
        return prefill(model, ids)

    monkeypatch.setattr(stream, "prefill_kv", spy)
    speed_eval(model, [32, 64], ["int4-token"], batches=[1, 2], tokens=2, warmup=1, data=ids)
    assert shapes[0][1] < 32 and shapes[1:] == [(1, 32), (2, 32), (1, 64), (2, 64)]  # a short one, once
