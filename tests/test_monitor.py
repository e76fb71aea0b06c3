"""kvbits.monitor: the online flush error is the real error, policies hold layers, metrics parse."""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import re
import stat
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from kvbits.cache import QuantizedKVCache
from kvbits.evaluate.stream import stream_hidden
from kvbits.monitor import (
    ERROR_BUCKETS,
    CacheMonitor,
    FallbackPolicy,
    MetricFamily,
    flush_error,
    prometheus_text,
)
from kvbits.monitor.export import strict_json, write_textfile

transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.usefixtures("one_thread")

CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
VOCAB = 128


@functools.cache
def llama() -> LlamaForCausalLM:
    """2 layers, 4 query heads, 2 KV heads, head dim 32 (kivi's 32-channel value groups fit)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def run(model: torch.nn.Module, cache: object, ids: torch.Tensor, decode: int = 0) -> None:
    """Prefill ``ids`` then ``decode`` greedy-free steps (fresh random tokens) through ``cache``."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{CACHE_KW: cache})
        for _ in range(decode):
            step = torch.randint(0, VOCAB, (ids.shape[0], 1), generator=g)
            model(input_ids=step, use_cache=True, **{CACHE_KW: cache})


def ids_of(batch: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- signal


def test_flush_error_values_and_edge_cases() -> None:
    x = torch.randn(3, 2, 5, 8)
    assert torch.equal(flush_error(x, x), torch.zeros(3))
    assert torch.allclose(flush_error(x, torch.zeros_like(x)), torch.ones(3))
    assert torch.allclose(flush_error(x, 1.1 * x), torch.full((3,), 0.1), atol=1e-6)
    z = torch.zeros(2, 1, 4, 4)
    assert torch.equal(flush_error(z, z), torch.zeros(2))  # constant zero block, reproduced: no error
    assert flush_error(z, z + 1e-3).isinf().all()  # nothing to compare against, but wrong: infinite
    bad = x.clone()
    bad[1, 0, 0, 0] = float("nan")
    e = flush_error(bad, x)
    assert e[1].isnan() and e[0] == 0 and e[2] == 0  # per sequence: NaN stays in its own row
    with pytest.raises(ValueError, match="same"):
        flush_error(x, x[:, :, :4])
    with pytest.raises(ValueError, match="same"):
        flush_error(x[0], x[0])


def test_monitor_error_is_the_stored_error() -> None:
    """The monitor's number equals ||K - dequant(stored K)|| / ||K|| measured independently: the model's own
    K/V (a DynamicCache run) against what the quantized cache returns for the flushed tokens. Layer 0 only:
    its K/V do not depend on the cache, while layer 1's already follow layer 0's quantized attention."""
    model, ids = llama(), ids_of(2, 200)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache)
    run(model, cache, ids)
    ref = DynamicCache()
    run(model, ref, ids)
    n_q = cache.memory_report()["layers"][0]["quantized_tokens"]
    assert n_q == 64  # residual 128, blocks of 32: 200 - 128 = 72 -> 2 blocks
    for i in range(1):
        k_hat, v_hat = cache.materialize(i)
        for side, orig, got in (("key", ref.layers[i].keys, k_hat), ("value", ref.layers[i].values, v_hat)):
            # one flush quantized both blocks (kivi's per-channel keys merge); the monitor saw that chunk
            expect = flush_error(orig[:, :, :n_q], got[:, :, :n_q], cache.scheme.block).max().item()
            sig = mon.signals[(i, side)]
            assert sig.flushes == 1 and sig.tokens == n_q and sig.count == 2
            assert sig.last == pytest.approx(expect, rel=1e-4)
            assert 0.05 < sig.last < 1.0  # int2 loses visibly; a quantizer that did not quantize reads 0
    # the tokens after the flush are untouched
    assert torch.equal(cache.materialize(0)[0][:, :, n_q:], ref.layers[0].keys[:, :, n_q:])


def test_a_chunk_reads_as_its_blocks_read_one_at_a_time() -> None:
    """int4-token (blocks of 1 token), one token whose int4 error is large: one prefill of 64 tokens and 64 single
    tokens now measure the same worst error and both hold the layer. Before, the prefill was one measurement over
    the whole chunk (0.080, no hold) against 0.190 and a hold token by token, although the policy holds "when a
    flushed block's relative error exceeds" its threshold."""
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)
    k[:, :, 40] = torch.linspace(-1, 1, 32) ** 9  # values crowd near 0: int4 per token loses them
    worst, held = [], []
    for chunked in (True, False):
        cache = QuantizedKVCache(num_layers=1, scheme="int4-token")
        mon = CacheMonitor(cache, FallbackPolicy(key_error=0.15))
        for t0, t1 in [(0, 64)] if chunked else [(t, t + 1) for t in range(64)]:
            cache.update(k[:, :, t0:t1], v[:, :, t0:t1], 0)
        worst.append(mon.signals[(0, "key")].worst)
        held.append(mon.held_layers())
    assert worst[0] == pytest.approx(worst[1], rel=1e-5) and worst[0] > 0.15
    assert held == [[0], [0]]
    x = torch.randn(2, 1, 6, 4)
    bad = x.clone()
    bad[1, :, 3] *= 2  # block 1 of sequence 1 (blocks of 3 tokens)
    per_block = flush_error(x, bad, 3)
    assert per_block[0] == 0 and per_block[1] == pytest.approx(float(flush_error(x[:, :, 3:], bad[:, :, 3:])[1]))
    assert flush_error(x, bad, 3)[1] > flush_error(x, bad)[1]  # the whole chunk dilutes it
    assert torch.equal(flush_error(x, bad, 4), flush_error(x, bad))  # a block that does not divide: the chunk


def test_a_hold_from_the_monitor_gives_back_the_reserved_slots() -> None:
    """``max_cache_len=1024``: a layer the monitor holds gives back the slots it will not fill, as a hold made
    between steps does. Before, the flushes still running after the monitor's hold reserved them again: 1024
    reserved tokens stayed (166,912 bytes reported against 35,072, workspace 1 MiB against 200 KiB)."""
    model, ids = llama(), ids_of(1, 200)
    reports = []
    for by_monitor in (True, False):
        cache = QuantizedKVCache(config=model.config, scheme="kivi-2", max_cache_len=1024, workspace=True)
        mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0)) if by_monitor else None
        run(model, cache, ids[:, :160])
        if mon is None:
            for layer in cache.layers:
                layer.hold_full_precision()
        else:
            assert mon.held_layers() == [0, 1]
        run(model, cache, ids[:, 160:], decode=10)
        rep = cache.memory_report()
        assert [r["reserved_tokens"] for r in rep["layers"]] == [0, 0]
        for layer_rep, layer in zip(rep["layers"], cache.layers, strict=True):
            comp = layer.components()
            assert sum(t.nbytes for ts in comp.values() for t in ts) == layer_rep["key_bytes"] + layer_rep["value_bytes"]
        reports.append((rep["total_bytes"], rep["workspace_bytes"]))
    assert reports[0] == reports[1]


def test_a_reset_cache_starts_its_monitor_afresh() -> None:
    """One monitor across ``cache.reset()`` (a new request): patience counts from 0 again and the calibrated-length
    notice is given again. Before, request 2's first crossing flush held both layers (patience 2), carried over
    from request 1's crossing."""
    model = llama()
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, patience=2))
    run(model, cache, ids_of(1, 160))  # one crossing flush per layer: no hold yet
    assert mon.held_layers() == [] and mon.signals[(0, "key")].over == 1
    cache.reset()
    run(model, cache, ids_of(1, 160, seed=2))
    assert mon.held_layers() == [] and mon.signals[(0, "key")].over == 1


def test_int8_error_is_small_and_int2_larger() -> None:
    model, ids = llama(), ids_of(1, 300)
    errs = {}
    for scheme in ("int8-token", "kivi-4", "kivi-2"):
        cache = QuantizedKVCache(config=model.config, scheme=scheme)
        mon = CacheMonitor(cache)
        run(model, cache, ids)
        errs[scheme] = max(s.worst for s in mon.signals.values())
    assert errs["int8-token"] < 0.02 < errs["kivi-4"] < errs["kivi-2"]


# ------------------------------------------------------------------------------------------- policy


def test_policy_validation() -> None:
    for bad in ({"key_error": -1}, {"value_error": float("nan")}, {"key_error": True}, {"clipped_fraction": 2.0},
                {"scope": "batch"}, {"patience": 0}, {"sample_every": 1.5}):  # fmt: skip
        (field, value), = bad.items()
        with pytest.raises(ValueError, match=rf"^{field} .*got {value!r}$"):
            FallbackPolicy(**bad)
    with pytest.raises(TypeError, match="beyond_calibration must be a bool"):
        FallbackPolicy(beyond_calibration="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="FallbackPolicy"):
        CacheMonitor(QuantizedKVCache(config=llama().config, scheme="kivi-2"), {"key_error": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config="):
        CacheMonitor(QuantizedKVCache(scheme="kivi-2", num_layers=None, config=None))
    # found by a review session: an unquantized scheme was watched without a word (nothing is ever measured);
    # numpy's float32 threshold was refused while float64 was taken; a static cache was told to pass config=
    with pytest.raises(ValueError, match="scheme 'fp16' stores K/V unquantized"):
        CacheMonitor(QuantizedKVCache(config=llama().config, scheme="fp16"))
    assert FallbackPolicy(value_error=np.float32(0.25)).value_error == pytest.approx(0.25)
    from kvbits.cache.static import StaticQuantizedKVCache

    with pytest.raises(ValueError, match="StaticQuantizedKVCache is not supported"):
        CacheMonitor(StaticQuantizedKVCache(llama().config, "kivi-2", max_cache_len=64))

    class ServerCache(StaticQuantizedKVCache):  # was told to "pass config=" (the check read the class name)
        pass

    with pytest.raises(ValueError, match="StaticQuantizedKVCache is not supported"):
        CacheMonitor(ServerCache(llama().config, "kivi-2", max_cache_len=64))


def test_numpy_thresholds_are_json_numbers_in_the_snapshot_and_events(tmp_path) -> None:
    """Was: a policy with numpy thresholds (taken, as documented) kept them as numpy scalars, and ``snapshot()``,
    ``write_events`` and ``kvbits monitor --json`` raised ``TypeError: Object of type float32 is not JSON
    serializable`` once a threshold was crossed. Now the policy holds Python floats."""
    pol = FallbackPolicy(key_error=np.float32(0.01), value_error=np.float64(0.01), clipped_fraction=np.float32(0.5))
    assert all(type(getattr(pol, name)) is float for name in ("key_error", "value_error", "clipped_fraction"))
    cache = QuantizedKVCache(config=llama().config, scheme="int4-token")
    mon = CacheMonitor(cache, pol)
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(1, 2, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g), 0)
    assert mon.events and mon.events[0]["threshold"] == pytest.approx(0.01)
    snap = json.loads(strict_json(mon.snapshot()))
    assert snap["policy"]["key_error"] == pytest.approx(0.01)
    lines = mon.write_events(tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == len(mon.events) and json.loads(lines[0])["threshold"] == pytest.approx(0.01)


def test_hold_layer_keeps_later_tokens_exact_and_counts_their_bytes() -> None:
    model, ids = llama(), ids_of(1, 200)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(value_error=0.0))  # any error crosses: every layer holds
    run(model, cache, ids, decode=70)
    ref = DynamicCache()
    run(model, ref, ids, decode=70)
    assert mon.held_layers() == [0, 1]
    actions = {e["action"] for e in mon.events}
    assert "hold_layer" in actions and all(e["signal"] == "value_error" for e in mon.events)
    rep = cache.memory_report()
    for layer_rep, layer in zip(rep["layers"], cache.layers, strict=True):
        assert layer_rep["held_at"] == 200
        assert layer_rep["quantized_tokens"] == 64  # nothing flushed after the hold
        assert layer_rep["full_tokens"] == 270 - 64
        split = layer.expected_split()
        assert (split.sink, split.quantized, split.full) == (0, 64, 270 - 64)
        # real bytes = reported bytes: every stored tensor counted
        comp = layer.components()
        assert sum(t.nbytes for ts in comp.values() for t in ts) == layer_rep["key_bytes"] + layer_rep["value_bytes"]
    k, v = cache.materialize(0)  # layer 0's K/V do not depend on the cache: exact from token 64 on
    assert torch.equal(k[:, :, 64:], ref.layers[0].keys[:, :, 64:])
    assert torch.equal(v[:, :, 64:], ref.layers[0].values[:, :, 64:])
    # without the policy the same run keeps quantizing: more tokens quantized, fewer bytes
    plain = QuantizedKVCache(config=model.config, scheme="kivi-2")
    run(model, plain, ids, decode=70)
    assert plain.memory_report()["layers"][0]["quantized_tokens"] == 128
    assert plain.memory_report()["total_bytes"] < rep["total_bytes"]
    cache.reset()  # a new request quantizes again
    assert mon.held_layers() == []


def test_request_scope_holds_every_layer_and_patience_waits() -> None:
    model, ids = llama(), ids_of(1, 160)
    # keys of layer 1 only can cross an impossible-for-layer-0 threshold? use the layer's own first error
    probe = QuantizedKVCache(config=model.config, scheme="kivi-2")
    pmon = CacheMonitor(probe)
    run(model, probe, ids)
    e0, e1 = pmon.signals[(0, "key")].last, pmon.signals[(1, "key")].last
    assert e0 != e1
    cut = (e0 + e1) / 2  # exactly one layer's keys cross it
    crossing = 0 if e0 > cut else 1
    for scope, held in (("layer", [crossing]), ("request", [0, 1])):
        cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
        mon = CacheMonitor(cache, FallbackPolicy(key_error=cut, scope=scope))
        run(model, cache, ids)
        assert mon.held_layers() == held, scope
        assert [e["layer"] for e in mon.events] == [crossing]
    # patience 2: one crossing flush is not enough; the second (32 decode steps later) holds
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, patience=2))
    run(model, cache, ids)
    assert mon.held_layers() == [] and {e["action"] for e in mon.events} == {"none"}
    run_more = ids_of(1, 32, seed=3)
    with torch.no_grad():
        for t in range(32):
            model(input_ids=run_more[:, t : t + 1], use_cache=True, **{CACHE_KW: cache})
    assert mon.held_layers() == [0, 1]


def test_thresholds_not_crossed_do_nothing_and_sampling_thins() -> None:
    model, ids = llama(), ids_of(1, 160)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=5.0, value_error=5.0, sample_every=2))
    run(model, cache, ids, decode=96)  # flushes at tokens 160, 192, 224, 256: 4 per layer and side
    assert mon.events == [] and mon.held_layers() == []
    snap = mon.snapshot()
    row = next(r for r in snap["signals"] if r["layer"] == 0 and r["side"] == "key")
    assert row["flushes"] == 4 and row["measured"] == 2
    mon.detach()
    run(model, cache, ids_of(1, 32, seed=4))
    assert mon.snapshot()["signals"][0]["flushes"] == 4  # detached: nothing more observed


def test_flushes_count_the_blocks_a_prefill_quantizes() -> None:
    """kvbits_flushes_total ("Blocks quantized") and the snapshot's flushes count blocks. Before, they counted
    the store's quantize calls: a 512-token prefill of kivi-2 (block 32, residual 128) quantizes 12 blocks in one
    call, and a decode flush one more, read 2 where 13 blocks (416 tokens) were quantized."""
    model = llama()
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache)
    run(model, cache, ids_of(1, 512), decode=32)
    for row in mon.snapshot()["signals"]:
        assert row["flushes"] == 13 and row["measured"] == 2 and row["tokens_measured"] == 416
    counts = re.findall(r'^kvbits_flushes_total\{.*\} (\d+)$', mon.prometheus(), flags=re.MULTILINE)
    assert counts == ["13"] * 4


def sliding_gemma3(window: int) -> Gemma3ForCausalLM:
    """2 layers: a sliding-window one (``window`` tokens, which can not be held), then a full-attention one."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return Gemma3ForCausalLM(cfg).eval()


def test_sliding_layers_are_not_held() -> None:
    model = sliding_gemma3(window=200)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-4")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    run(model, cache, ids_of(1, 190))
    assert mon.held_layers() == [1]  # the full-attention layer; the sliding one keeps its bounded window
    assert {e["layer"]: e["action"] for e in mon.events} == {0: "none", 1: "hold_layer"}


def test_a_crossing_that_does_nothing_is_said_once_per_run_of_crossings() -> None:
    """A sliding-window layer can not be held, so its crossings do nothing. Before, each of its crossing flushes
    added an event (and an INFO log line): 5 events for layer 0 over 190 + 128 tokens (blocks of 32), one per
    flush, and so on for the rest of a long request. Now one per run of consecutive crossing flushes; a flush
    under the threshold ends the run, and the next crossing is said again."""
    model = sliding_gemma3(window=400)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-4")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    run(model, cache, ids_of(1, 190), decode=128)
    sliding = [e for e in mon.events if e["layer"] == 0]
    assert mon.signals[(0, "key")].flushes >= 4 and mon.signals[(0, "key")].over >= 4
    assert [(e["signal"], e["action"]) for e in sliding] == [("key_error", "none")]
    # a flush under the threshold ends the run; the next crossing starts another, said again
    mon.policy = FallbackPolicy(key_error=1e9)
    run(model, cache, ids_of(1, 32, seed=5))
    assert mon.signals[(0, "key")].over == 0 and len([e for e in mon.events if e["layer"] == 0]) == 1
    mon.policy = FallbackPolicy(key_error=0.0)
    run(model, cache, ids_of(1, 64, seed=6))
    assert [(e["signal"], e["action"]) for e in mon.events if e["layer"] == 0] == [("key_error", "none")] * 2


def test_a_nan_error_stays_out_of_the_histogram_sum() -> None:
    """One NaN (or inf) error is counted apart (``nonfinite``, ``kvbits_flush_nonfinite_errors_total``) and kept
    out of the histogram. Before, it went into ``total``: the histogram's ``_sum`` and ``mean_error`` read NaN
    for the rest of the request, whatever the later flushes measured."""
    model, ids = llama(), ids_of(2, 160)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache)
    run(model, cache, ids)
    sig = mon.signals[(0, "key")]
    before = (sig.total, sig.count)
    sig.add([math.nan, math.inf], tokens=32, clipped=0, elements=1)  # a flush whose both sequences read non-finite
    assert math.isnan(sig.worst) and sig.nonfinite == 2 and (sig.total, sig.count) == before
    run(model, cache, ids_of(2, 32, seed=2))  # later finite flushes
    assert math.isfinite(sig.total) and sig.count > before[1]
    m = parse(mon.prometheus())
    lab0 = {"layer": "0", "side": "key"}

    def one(name: str) -> float:
        (v,) = [v for lab, v in m[name] if {k: lab.get(k) for k in lab0} == lab0 and "le" not in lab]
        return v

    assert math.isfinite(one("kvbits_flush_relative_error_per_sequence_sum"))
    assert one("kvbits_flush_relative_error_per_sequence_count") == sig.count
    assert one("kvbits_flush_nonfinite_errors_total") == 2
    row = next(r for r in mon.snapshot()["signals"] if r["layer"] == 0 and r["side"] == "key")
    assert math.isfinite(row["mean_error"]) and row["nonfinite_errors"] == 2


def narrow_kvquant(model: torch.nn.Module):
    """A kvquant-4 calibration of ``model`` (2 layers, 2 KV heads, D = 32) on keys far narrower than the model serves
    (0.01x), over 64 tokens: its keys clip and its calibrated length is passed."""
    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    g = torch.Generator().manual_seed(0)
    keys = [0.01 * torch.randn(1, 2, 64, 32, generator=g) for _ in range(2)]
    values = [torch.randn(1, 2, 64, 32, generator=g) for _ in range(2)]
    art = artifact_from_samples("kvquant-4", keys, values, meta={"model": describe_model(model.config)})
    art.meta["data"]["context"] = 64
    return art


def test_printed_table_shows_clipping_and_the_calibrated_length(capsys, caplog) -> None:
    """kvquant-4 calibrated on keys far narrower than served, over 64 tokens, watched over 120: the printed
    table gains clipped columns (keys clipped, values never: they have no static scales) and the summary
    says the calibrated length was passed and which events fired. kivi-2 (no static scales): no columns."""
    from kvbits.monitor import watch
    from kvbits.monitor.cli import _print

    model = llama()
    art = narrow_kvquant(model)
    with caplog.at_level("WARNING", logger="kvbits"):
        snap = watch(model, ids_of(1, 200)[0], 120, "kvquant-4", FallbackPolicy(), calibration=art).snapshot()
    assert "QuantizedKVCache" not in caplog.text  # said once, by the monitor, not by the cache too
    side = {(r["layer"], r["side"]): r for r in snap["signals"]}
    assert all(side[i, "key"]["clipped_fraction"] > 0.5 and side[i, "value"]["clipped"] == 0 for i in (0, 1))
    _print(snap)
    out = " ".join(capsys.readouterr().out.split())
    assert "K clipped" in out and "V clipped" in out and "0.000%" in out
    assert f"{100 * side[0, 'key']['clipped_fraction']:.3f}%" in out
    assert "served 120 tokens, past the 64 the calibration saw" in out
    assert "events: 2 (beyond_calibration 2)" in out
    snap = watch(model, ids_of(1, 200)[0], 120, "kivi-2").snapshot()  # residual 128: nothing flushed yet
    assert all(r["measured"] == 0 and r["max_error"] is r["last_error"] is r["mean_error"] is None
               for r in snap["signals"])  # fmt: skip
    _print(snap)
    out = " ".join(capsys.readouterr().out.split())
    assert "clipped" not in out and "calibration saw" not in out and out.endswith("events: 0")
    assert "0.000" not in out  # no error measured: "-", not 0.000


def test_beyond_calibration_is_reported_once_per_layer() -> None:
    model, ids = llama(), ids_of(1, 160)
    for hold in (False, True):
        cache = QuantizedKVCache(config=model.config, scheme="kivi-4")
        cache.calibration = SimpleNamespace(max_calibrated_length=100)  # what an artifact carries
        mon = CacheMonitor(cache, FallbackPolicy(beyond_calibration=hold))
        run(model, cache, ids, decode=40)
        beyond = [e for e in mon.events if e["signal"] == "beyond_calibration"]
        assert [e["layer"] for e in beyond] == [0, 1]
        assert all(e["threshold"] == 100 and e["value"] == 160 for e in beyond)
        assert mon.held_layers() == ([0, 1] if hold else [])
        assert "kvbits_tokens_beyond_calibration{" in mon.prometheus()


def test_beyond_calibration_without_a_calibrated_length_is_said_at_start(caplog) -> None:
    """An artifact that does not record its longest context (``max_calibrated_length`` None), or none at all: the
    beyond_calibration signal can never fire, and the monitor says so once when it is attached, not silently."""
    model, ids = llama(), ids_of(1, 160)
    for calibration, why in ((SimpleNamespace(max_calibrated_length=None), "does not record"), (None, "is missing")):
        cache = QuantizedKVCache(config=model.config, scheme="kivi-4")
        cache.calibration = calibration
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvbits"):
            mon = CacheMonitor(cache, FallbackPolicy(beyond_calibration=True))
            run(model, cache, ids, decode=40)
        said = [r.getMessage() for r in caplog.records if "beyond_calibration" in r.getMessage()]
        assert len(said) == 1 and why in said[0] and "max_calibrated_length" in said[0]
        assert mon.held_layers() == [] and not mon.events
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvbits"):  # the signal off: nothing to say
        CacheMonitor(QuantizedKVCache(config=model.config, scheme="kivi-4"), FallbackPolicy())
    assert not caplog.records


def test_beyond_calibration_holds_after_patience_flushes() -> None:
    """Every flush past the calibrated length counts towards ``patience``: with 2, the layer is held at its second
    such flush (said then, besides the first report), not never."""
    model, ids = llama(), ids_of(1, 160)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-4")  # flushes at 160 (the prompt), then every 32
    cache.calibration = SimpleNamespace(max_calibrated_length=100)
    mon = CacheMonitor(cache, FallbackPolicy(beyond_calibration=True, patience=2))
    run(model, cache, ids, decode=40)
    said = [(e["layer"], e["tokens"], e["action"]) for e in mon.events if e["signal"] == "beyond_calibration"]
    assert said == [(0, 160, "none"), (1, 160, "none"), (0, 192, "hold_layer"), (1, 192, "hold_layer")]
    assert mon.held_layers() == [0, 1]


def test_beyond_calibration_is_read_at_every_flush_however_sampled() -> None:
    """``sample_every=2``: the flush at 160 (the prompt) is measured, the one at 192, past the calibrated 170, is
    not. The position is the host's count, so it is read there all the same. Before, the check ran on measured
    flushes only: a request ending at 200 was never said to pass the calibration, nor held for it."""
    model, ids = llama(), ids_of(1, 160)
    for hold in (False, True):
        cache = QuantizedKVCache(config=model.config, scheme="kivi-4")
        cache.calibration = SimpleNamespace(max_calibrated_length=170)
        mon = CacheMonitor(cache, FallbackPolicy(beyond_calibration=hold, sample_every=2))
        run(model, cache, ids, decode=40)
        said = [(e["layer"], e["tokens"], e["action"]) for e in mon.events if e["signal"] == "beyond_calibration"]
        action = "hold_layer" if hold else "none"
        assert said == [(0, 192, action), (1, 192, action)]
        assert mon.held_layers() == ([0, 1] if hold else [])
        assert mon.snapshot()["signals"][0]["measured"] == 1  # still sampled: the 192 flush was not measured


def test_stream_hidden_hands_the_cache_over_before_tokens() -> None:
    model, ids = llama(), ids_of(1, 170)
    seen: list[CacheMonitor] = []
    stream_hidden(model, ids, "kivi-2", fused_decode=False, on_cache=lambda c: seen.append(CacheMonitor(c)))
    (mon,) = seen
    assert mon.signals[(0, "key")].flushes == 1 and mon.snapshot()["tokens"] == 170


# ------------------------------------------------------------------------------------------- export

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A strict reader of the text exposition format: every line is a comment or a sample."""
    out: dict[str, list] = {}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        m = LINE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        value = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(m.group(4)) or float(m.group(4))
        out.setdefault(m.group(1), []).append((labels, value))
    for name in out:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or base in types, f"{name} has no # TYPE"
    return out


def test_prometheus_text_parses_and_histograms_are_cumulative() -> None:
    model, ids = llama(), ids_of(2, 160)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(value_error=0.0), labels={"request": 'r"1\n'})
    run(model, cache, ids, decode=64)
    m = parse(mon.prometheus())
    buckets = [(lab, v) for lab, v in m["kvbits_flush_relative_error_per_sequence_bucket"]
               if lab["layer"] == "0" and lab["side"] == "key"]  # fmt: skip
    assert [lab["le"] for lab, _ in buckets] == [repr(b) for b in ERROR_BUCKETS] + ["+Inf"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts)  # cumulative
    (count,) = [v for lab, v in m["kvbits_flush_relative_error_per_sequence_count"] if lab["layer"] == "0" and lab["side"] == "key"]
    assert counts[-1] == count == 2  # one flush measured (then held), two sequences
    assert all(lab["request"] == 'r\\"1\\n' for lab, _ in m["kvbits_cache_bytes"])  # escaped
    assert m["kvbits_cache_bytes"][0][1] == cache.memory_report()["total_bytes"]
    assert {lab["layer"]: v for lab, v in m["kvbits_layer_held"]} == {"0": 1.0, "1": 1.0}
    assert sum(v for _, v in m["kvbits_fallback_events_total"]) == len(mon.events)


def test_metric_names_are_ascii() -> None:
    """Prometheus metric names are [a-zA-Z_:][a-zA-Z0-9_:]*. Before, any Unicode letter or digit passed
    (str.isalnum): 'kvbits_latência²' was rendered into an exposition Prometheus refuses to parse."""
    for bad in ("kvbits_latência", "kvbits_x²", "٣x"):
        with pytest.raises(ValueError, match="invalid Prometheus metric name"):
            MetricFamily(bad, "x", "gauge")
    assert MetricFamily("kvbits:x_1", "x", "gauge").name == "kvbits:x_1"


def test_prometheus_helpers_refuse_bad_names_and_write_atomically(tmp_path) -> None:
    with pytest.raises(ValueError, match="metric name"):
        MetricFamily("bad-name", "x", "gauge")
    with pytest.raises(ValueError, match="type"):
        MetricFamily("ok", "x", "summary")
    fam = MetricFamily("ok", "x", "gauge")
    fam.add(1.5, {"bad-label": 1})
    with pytest.raises(ValueError, match="label name"):
        prometheus_text([fam])
    fam = MetricFamily("ok", "help", "gauge")
    fam.add(float("nan"))
    fam.add(3.0, {"a": "b"})
    text = prometheus_text([fam])
    assert text == '# HELP ok help\n# TYPE ok gauge\nok NaN\nok{a="b"} 3\n'
    path = write_textfile(text, tmp_path / "sub" / "kvbits.prom")
    assert path.read_text() == text and [p.name for p in path.parent.iterdir()] == ["kvbits.prom"]
    # readable by node_exporter running as another user: a normal file's mode, not mkstemp's 0600
    umask = os.umask(0o022)
    try:
        assert stat.S_IMODE(write_textfile(text, tmp_path / "m.prom").stat().st_mode) == 0o644
    finally:
        os.umask(umask)
    with pytest.raises(ValueError, match="label name 'a b'"):  # refused when the monitor is made
        CacheMonitor(QuantizedKVCache(config=llama().config, scheme="kivi-2"), labels={"a b": "c"})
    # names the monitor sets itself would replace which layer, signal or bucket a sample or event is about
    for name in ("layer", "side", "signal", "action", "le", "scheme", "tokens", "__name__"):
        with pytest.raises(ValueError, match=f"label name '{name}'"):
            CacheMonitor(QuantizedKVCache(config=llama().config, scheme="kivi-2"), labels={name: "x"})
    with pytest.raises(ValueError, match="names starting with __ are Prometheus' own"):
        prometheus_text([MetricFamily("m", "h", "gauge", [("", {"__x": "1"}, 1.0)])])


def test_a_textfile_is_utf8_whatever_the_locale(tmp_path) -> None:
    """The exposition format is UTF-8. Before, write_textfile wrote in the locale's encoding: under a C locale
    (ASCII, coercion off) a label value 'Qwen–ü' raised UnicodeEncodeError after the whole run, and a Latin-1 or
    cp1252 locale would have written bytes Prometheus rejects."""
    import subprocess
    import sys

    path = tmp_path / "m.prom"
    code = ("import sys; from kvbits.monitor.export import MetricFamily, prometheus_text, write_textfile; "
            "f = MetricFamily('m', 'h', 'gauge'); f.add(1, {'model': 'Qwen' + chr(0x2013) + chr(0xfc)}); "
            "write_textfile(prometheus_text([f]), sys.argv[1])")  # fmt: skip
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert path.read_bytes().decode("utf-8").endswith('m{model="Qwen\u2013\u00fc"} 1\n')


def test_a_second_monitor_on_one_cache_is_refused_until_the_first_detaches() -> None:
    """The second monitor took the flushes over and the first went silent (0 events against 2)."""
    cache = QuantizedKVCache(config=llama().config, scheme="kivi-2")
    first = CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    with pytest.raises(ValueError, match="already has a CacheMonitor"):
        CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    first.detach()
    second = CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    run(llama(), cache, ids_of(1, 160))
    assert first.events == [] and len(second.events) == 2


def test_an_empty_batch_flushes_without_a_signal() -> None:
    cache = QuantizedKVCache(config=llama().config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, value_error=0.0))
    empty = torch.zeros(0, 2, 200, 32)
    cache.update(empty, empty, 0)  # 200 tokens: a block flushes, of no sequence
    assert mon.events == [] and mon.held_layers() == []


def test_events_go_to_json_lines_and_callback(tmp_path) -> None:
    import json

    model, ids = llama(), ids_of(1, 160)
    got: list[dict] = []
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0), on_event=got.append)
    run(model, cache, ids)
    lines = [json.loads(x) for x in mon.write_events(tmp_path / "ev.jsonl").read_text().splitlines()]
    assert lines == got == mon.events and len(got) == 2
    assert {e["scheme"] for e in got} == {"kivi-2"} and all(e["tokens"] == 160 for e in got)
    # written again after more steps (an exporter's loop): only the new events are appended. Before, every call
    # appended every event again (found by a review session)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, patience=100))  # crossings, never a hold
    run(model, cache, ids)
    first = mon.write_events(tmp_path / "loop.jsonl").read_text().count("\n")
    # one more block flushes in each layer; the key crossings go on (said once per run), values now cross too
    mon.policy = FallbackPolicy(key_error=0.0, value_error=0.0, patience=100)
    run(model, cache, ids_of(1, 40, seed=3))
    assert len(mon.events) > first == 2
    lines = [json.loads(x) for x in mon.write_events(tmp_path / "loop.jsonl").read_text().splitlines()]
    assert lines == mon.events
    assert mon.write_events(tmp_path / "loop.jsonl").read_text().count("\n") == len(mon.events)
    mon.write_events(tmp_path / "other" / "loop.jsonl")  # another file gets them all
    assert (tmp_path / "other" / "loop.jsonl").read_text().count("\n") == len(mon.events)


def test_an_exporter_that_empties_the_events_loses_none_and_its_counter_never_goes_down(tmp_path) -> None:
    """An exporter writes the events, then empties ``mon.events`` (as the docstring allows) and serves on. Before,
    write_events kept only how many events a file had: the second request's 2 events (as many as the first's) were
    taken for written and never appended (2 lines instead of 4), and ``kvbits_fallback_events_total``, counted from
    the list, went from 2 back to 0, which Prometheus reads as a counter reset."""
    import json

    model = llama()
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    path = tmp_path / "ev.jsonl"

    def counted() -> float:
        return sum(v for _, v in parse(mon.prometheus()).get("kvbits_fallback_events_total", []))

    written = []
    for seed in (0, 1):  # two requests, each holding both layers: 2 events each
        cache.reset()
        run(model, cache, ids_of(1, 160, seed=seed))
        assert len(mon.events) == 2
        written += mon.events
        mon.write_events(path)
        mon.events.clear()
        assert counted() == len(written)
    assert [json.loads(x)["tokens"] for x in path.read_text().splitlines()] == [e["tokens"] for e in written]
    assert len(path.read_text().splitlines()) == 4
    mon.write_events(path)  # nothing new
    assert len(path.read_text().splitlines()) == 4


def test_events_and_snapshots_are_strict_json(tmp_path) -> None:
    """An error of ``inf`` (a zero block not reproduced exactly) was written as the bare token ``Infinity``,
    which jq, Go and ``JSON.parse`` reject: it is the string ``"+Inf"``, as the exposition format spells it."""
    import json
    import math

    from kvbits.monitor.export import strict_json

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))

    assert strict(strict_json({"a": [math.inf, -math.inf, math.nan, 1.5], "b": (2, "x")})) == {
        "a": ["+Inf", "-Inf", "NaN", 1.5], "b": [2, "x"]}  # fmt: skip
    cache = QuantizedKVCache(config=llama().config, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0))
    mon.events.append({"layer": 0, "side": "key", "signal": "error", "value": math.inf, "threshold": 0.0})
    (line,) = mon.write_events(tmp_path / "ev.jsonl").read_text().splitlines()
    assert strict(line)["value"] == "+Inf"


# ------------------------------------------------------------------------------------------- watch / CLI


def test_watch_on_token_ids_and_refusals() -> None:
    from kvbits.monitor import watch

    model = llama()
    ids = ids_of(1, 400)[0]
    mon = watch(model, ids, 200, "kivi-2", FallbackPolicy(key_error=0.0), labels={"run": "t"})
    assert mon.held_layers() == [0, 1] and mon.snapshot()["tokens"] == 200
    assert mon.labels == {"scheme": "kivi-2", "run": "t"}
    for layer in mon.layers.values():  # detached after the run
        assert layer._k.observer is None and layer._v.observer is None
    with pytest.raises(ValueError, match="quantizing kvbits scheme"):
        watch(model, ids, 200, "fp16")
    with pytest.raises(ValueError, match="context"):
        watch(model, ids, 1, "kivi-2")


def test_watch_checks_the_context_against_the_models_positions(caplog) -> None:
    """README: a context past a model's max_position_embeddings runs with a logged warning, and one past a learned
    position table (GPT-2) is refused, in every command that runs a model. `kvbits monitor` did neither: GPT-2 at 100
    tokens of 64 positions ended in torch's `IndexError: index out of range in self` inside the model (a traceback
    from the CLI), and a RoPE model ran past its positions without a word."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvbits.monitor import watch

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()
    ids = ids_of(1, 300)[0]
    with pytest.raises(ValueError, match="exceeds the 64 positions of this gpt2 model's learned position table"):
        watch(gpt2, ids, 100, "int4-token")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    with caplog.at_level("WARNING", logger="kvbits"):
        watch(LlamaForCausalLM(cfg).eval(), ids, 100, "int4-token")
    assert "positions beyond it are extrapolation" in caplog.text


def test_watch_refuses_a_calibration_pinned_to_other_weights(tmp_path, monkeypatch) -> None:
    """A calibration made for model A (its weights' fingerprint) is refused for a model B of the same shape, as
    `kvbits eval` refuses it (before, `kvbits monitor` served it: only the shape was compared); one made for these
    weights, or for the architecture only (fitted on a bare module), is served, given as an object or a folder."""
    from dataclasses import replace

    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model
    from kvbits.evaluate.models import load_model
    from kvbits.monitor import watch

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    llama().save_pretrained(folder)
    fingerprint = load_model(str(folder)).fingerprint
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, 64, 32, generator=g) for _ in range(2)]
    art = artifact_from_samples("kvquant-4", keys, keys, meta={"model": describe_model(llama().config)})
    ids = ids_of(1, 200)[0]

    def pinned(fp: str):
        return replace(art, meta={**art.meta, "model": {**art.meta["model"], "fingerprint": fp}})

    other = pinned("0123456789abcdef").save(tmp_path / "other")
    with pytest.raises(ValueError, match="not for the model with fingerprint '[0-9a-f]{16}'"):
        watch(str(folder), ids, 40, "kvquant-4", calibration=other)
    for ok in (pinned(fingerprint), art.save(tmp_path / "arch")):  # these weights; the architecture only
        assert watch(str(folder), ids, 40, "kvquant-4", calibration=ok).snapshot()["tokens"] == 40


def test_cli_monitor_end_to_end(tmp_path, monkeypatch, capsys) -> None:
    import json

    from _wordlevel import save_word_tokenizer, write_word_text

    from kvbits.cli import main

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    save_word_tokenizer(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)  # fmt: skip
    text = write_word_text(tmp_path / "book.txt", 400)
    prom, events = tmp_path / "m" / "kvbits.prom", tmp_path / "new" / "ev.jsonl"  # missing folders are created
    argv = ["monitor", "--model", str(folder), "--data", str(text), "--context", "200", "--scheme", "kivi-2",
            "--value-error", "0", "--label", "request=r7", "--prom", str(prom), "--events", str(events), "--json"]  # fmt: skip
    assert main(argv) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["held_layers"] == [0, 1] and snap["policy"]["value_error"] == 0
    assert len(events.read_text().splitlines()) == len(snap["events"]) == 2
    m = parse(prom.read_text())
    assert {lab["request"] for lab, _ in m["kvbits_layer_held"]} == {"r7"}
    assert main(["monitor", "--model", str(folder), "--data", str(text), "--context", "200", "--scheme", "kivi-2",
                 "--label", "nokey"]) != 0  # fmt: skip
    assert "KEY=VALUE" in capsys.readouterr().err
    # what the end of a run would trip on is refused before the model loads (no model at "nowhere")
    for bad, msg in ((["--label", "a b=c"], "label name 'a b'"), (["--prom", str(tmp_path)], "is a folder"),
                     (["--label", "layer=all"], "label name 'layer' (--label) is set by kvbits itself"),
                     (["--label", "a=1", "--label", "a=2"], "--label a is given twice ('1' and '2')"),
                     (["--events", str(text / "ev.jsonl")], "can not write there")):  # fmt: skip
        assert main(["monitor", "--model", "nowhere", "--data", str(text), "--scheme", "kivi-2", *bad]) != 0
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["monitor", "--model", "m", "--data", "d", "--scheme", "kivi-2", "--key-error", "-1"])


def test_cli_refuses_a_policy_flag_that_can_never_fire(tmp_path, capsys) -> None:
    """--beyond-calibration without --calibration, and --clipped-fraction on a scheme with no static scales, were
    accepted and never fired: int4-token with --clipped-fraction 0 --beyond-calibration held nothing ("held layers:
    none; events: 0"), as if no layer needed holding. Refused before the model loads (no model at "nowhere")."""
    from kvbits.cli import main

    text = tmp_path / "t.txt"
    text.write_text("x")
    base = ["monitor", "--model", "nowhere", "--data", str(text)]
    for extra, msg in ((["--scheme", "int4-token", "--beyond-calibration"], "--beyond-calibration holds past"),
                       (["--scheme", "kivi-2", "--clipped-fraction", "0"], "scheme kivi-2 has none"),
                       (["--scheme", "int8-token,0=fp16", "--clipped-fraction", "0.1"], "has none")):  # fmt: skip
        assert main(base + extra) == 2
        assert msg in capsys.readouterr().err
    # a static side reads clipping: the flag passes this check (and the run fails later, on the missing model)
    assert main(base + ["--scheme", "fp8-e4m3", "--clipped-fraction", "0.1"]) != 0
    assert "--clipped-fraction" not in capsys.readouterr().err
    # so do vLLM's integer zero-points (vllm-int4, no calibration): a token whose range excludes 0 clips, and the
    # monitor counts it; the flag was refused as "nothing clips"
    assert main(base + ["--scheme", "vllm-int4", "--clipped-fraction", "0.1"]) != 0
    assert "--clipped-fraction" not in capsys.readouterr().err


def test_help_says_an_unset_threshold_is_none(capsys) -> None:
    """--key-error, --value-error and --clipped-fraction said what crossing them does, not what leaving them out
    does (no threshold: measured and reported, never held for)."""
    from kvbits.cli import main

    with pytest.raises(SystemExit):
        main(["monitor", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    for what in ("key-error", "value-error", "clipping"):
        assert f"default: unset, no {what} threshold" in said


def test_held_layers_decode_through_the_fused_path() -> None:
    """A held layer's growing full-precision tail is read by the fused decode path (the torch reference on
    CPU) as by dequantize + SDPA: the same hidden states, every step served fused."""
    model, ids = llama(), ids_of(1, 230)
    hidden, stats = {}, {}
    for fused in (False, True):
        seen: list[CacheMonitor] = []
        stats[fused] = {}
        hidden[fused] = stream_hidden(model, ids, "kivi-2", fused_decode=fused, stats=stats[fused],
                                      on_cache=lambda c, s=seen: s.append(CacheMonitor(c, FallbackPolicy(key_error=0.0))))  # fmt: skip
        assert seen[0].held_layers() == [0, 1]
    assert stats[True]["fused_steps"] > 0 and stats[True]["fallback_steps"] == 0
    assert torch.allclose(hidden[True], hidden[False], atol=1e-4, rtol=1e-4)


def test_a_failing_event_sink_is_logged_not_raised(caplog) -> None:
    model, ids = llama(), ids_of(1, 160)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-2")

    def broken(ev: dict) -> None:
        raise OSError("disk full")

    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0), on_event=broken)
    run(model, cache, ids)  # the forward pass completes
    assert mon.held_layers() == [0, 1] and len(mon.events) == 2
    assert "on_event callback failed" in caplog.text and "disk full" in caplog.text


def test_patience_counts_a_prefill_flush_once_as_documented() -> None:
    """``patience`` counts measured flushes, and a prefill's flush (12 blocks of kivi-2 here) counts once: with
    ``key_error=0`` and patience 3 it leaves the counter at 1 and holds nothing; two decode flushes later it holds.
    Before, the policy's docstring and ``--patience``'s help said "consecutive ... blocks", which this is not."""
    from kvbits.monitor.cli import add_parser

    doc = FallbackPolicy.__doc__.split("patience:")[1].split("sample_every:")[0]
    assert "flushes" in doc and "prefill" in doc and "blocks over" not in doc
    sub = argparse.ArgumentParser().add_subparsers()
    help_text = next(a.help for a in add_parser(sub)._actions if a.dest == "patience")
    assert "flushes" in help_text and "blocks" not in help_text
    torch.manual_seed(0)
    cache = QuantizedKVCache(num_layers=1, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, patience=3))
    cache.update(torch.randn(1, 2, 12 * 32 + 128, 32), torch.randn(1, 2, 12 * 32 + 128, 32), 0)
    assert mon.snapshot()["signals"][0]["flushes"] == 12 and mon.signals[(0, "key")].over == 1
    assert mon.held_layers() == []
    for _ in range(64):  # two decode flushes, one block each
        cache.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), 0)
    assert mon.signals[(0, "key")].over == 3 and mon.held_layers() == [0]


def test_prometheus_text_refuses_a_series_or_a_family_given_twice():
    """Two samples of one series (labels ``layer=0`` given as 0 and "0") and a family name given twice were written
    as they came: Prometheus' parser refuses the second ``TYPE`` line and its scrape drops the repeated series."""
    f = MetricFamily("kvbits_x", "x", "gauge")
    f.add(1, {"layer": 0})
    f.add(2, {"layer": "0"})
    with pytest.raises(ValueError, match=r"kvbits_x has two samples with labels \{'layer': '0'\}"):
        prometheus_text([f])
    h = MetricFamily("kvbits_h", "h", "histogram")
    h.add(1, {"le": "1.0"}, "_bucket")
    h.add(1, {}, "_count")
    h.add(0.5, {}, "_sum")  # one series per suffix: accepted
    g = MetricFamily("kvbits_h", "again", "counter")
    assert prometheus_text([h]).count("kvbits_h") == 5
    with pytest.raises(ValueError, match="metric family 'kvbits_h' is given twice"):
        prometheus_text([h, g])


def test_a_prefill_quantized_in_slices_is_one_flush() -> None:
    """A prefill past ``SLICE_TOKENS`` (4096) is quantized in several calls, each seen by the monitor: before, each
    counted as a flush, so a 2 * 4096 + 128-token kivi-2 prefill with ``key_error=0, patience=2`` held the layer
    (over 2, measured 2) though the policy says a prefill's flush counts once. Now: one measured flush; the next
    decode flush reaches patience 2 and holds."""
    from kvbits.cache.store import SLICE_TOKENS

    torch.manual_seed(0)
    cache = QuantizedKVCache(num_layers=1, scheme="kivi-2")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, patience=2))
    n = 2 * SLICE_TOKENS + 128
    cache.update(torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32), 0)
    row = mon.snapshot()["signals"][0]
    assert row["measured"] == 1 and row["flushes"] == 2 * SLICE_TOKENS // 32 and row["tokens_measured"] == n - 128
    assert mon.signals[(0, "key")].over == 1 and mon.held_layers() == []
    assert mon.signals[(0, "key")].last == mon.signals[(0, "key")].worst  # the worst of its slices
    for _ in range(32):  # one decode flush
        cache.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), 0)
    assert mon.signals[(0, "key")].over == 2 and mon.held_layers() == [0]


def test_a_prefill_quantized_in_slices_adds_one_histogram_entry_per_sequence() -> None:
    """The per-sequence histogram holds one entry per sequence and measured flush. A 2 * 4096 + 128-token kivi-2
    prefill of 2 sequences is quantized in 2 slices: before, each slice added its own entries (``_count`` 4 for one
    measured flush of 2 sequences, ``_sum`` over both slices); now 2, each sequence's worst slice, as a prefill
    quantized at once reads each sequence at its worst block."""
    from kvbits.cache.store import SLICE_TOKENS

    torch.manual_seed(0)
    cache = QuantizedKVCache(num_layers=1, scheme="kivi-2")
    mon = CacheMonitor(cache)
    n = 2 * SLICE_TOKENS + 128
    k, v = torch.randn(2, 2, n, 32), torch.randn(2, 2, n, 32)
    cache.update(k, v, 0)
    sig = mon.signals[(0, "key")]
    assert sig.flushes == 1 and sig.count == 2 and sig.buckets[-1] == 2 and sig.nonfinite == 0
    quantized = k[:, :, : n - 128]
    x_hat = cache.layers[0]._k.materialize(torch.float32)[:, :, : n - 128]
    per_sequence = flush_error(quantized, x_hat, 32)  # each sequence's worst block over the whole flush
    assert sig.total == pytest.approx(float(per_sequence.sum()), rel=1e-5)
    text = mon.prometheus()
    assert 'kvbits_flush_relative_error_per_sequence_count{scheme="kivi-2",layer="0",side="key"} 2' in text
    for _ in range(32):  # one decode flush: one more entry per sequence
        cache.update(torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32), 0)
    assert sig.flushes == 2 and sig.count == 4


def test_request_scope_says_hold_request_once_when_a_sliding_layer_keeps_crossing() -> None:
    """``scope="request"``: a sliding-window layer crossing holds the request's other layers, but can not be held
    itself, so it keeps flushing and crossing. Before, each of its later flushes held nothing new and still said
    ``hold_request`` (a WARNING each): 5 events over 190 + 128 tokens. Now the hold is said once; later crossings
    of that run hold nothing and are not said again."""
    model = sliding_gemma3(window=400)
    cache = QuantizedKVCache(config=model.config, scheme="kivi-4")
    mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, scope="request"))
    run(model, cache, ids_of(1, 190), decode=128)
    assert mon.held_layers() == [1] and mon.signals[(0, "key")].flushes >= 4
    assert [(e["layer"], e["action"]) for e in mon.events] == [(0, "hold_request")]


def test_batch_wide_events_name_no_sequence() -> None:
    """An error event names the batch row it read (the worst); clipping and the calibrated length are read over the
    whole batch, so their events say ``sequence: None`` instead of naming the row whose error was worst (which
    they do not depend on). A batch of 3, keys served 100x wider than calibrated, past its 64 tokens."""
    model = llama()
    art = narrow_kvquant(model)
    cache = QuantizedKVCache(config=model.config, scheme="kvquant-4", calibration=art, calibration_warnings=False)
    pol = FallbackPolicy(key_error=0.0, clipped_fraction=0.1, beyond_calibration=True)
    mon = CacheMonitor(cache, pol)
    run(model, cache, ids_of(3, 160))
    by_signal: dict[str, list] = {}
    for e in mon.events:
        by_signal.setdefault(e["signal"], []).append(e["sequence"])
    assert set(by_signal) == {"key_error", "clipped_fraction", "beyond_calibration"}
    assert all(s in (0, 1, 2) for s in by_signal["key_error"])
    assert by_signal["clipped_fraction"] == by_signal["beyond_calibration"] == [None, None]  # one per layer


def test_an_infinite_or_huge_value_does_not_read_as_no_error() -> None:
    """``flush_error`` read 0 (a perfect block) for a block holding an infinite value that was reproduced finite
    (``inf / inf`` is NaN, which ``nan_to_num`` turned into 0) and for finite values whose squares overflow float32
    (``|x|`` 1e20 reproduced at +10%: 0.0 instead of 0.1). Lazy checks (``"auto"`` on CUDA) let such K/V reach the
    flush before they raise. Now the infinite one reads NaN (over every threshold) and the huge one its error."""
    x = torch.randn(2, 2, 64, 8, generator=torch.Generator().manual_seed(0))
    inf_x, x_hat = x.clone(), x.clone()
    inf_x[0, 0, 3, 0], x_hat[0, 0, 3, 0] = math.inf, 1.0  # saturated to a finite value, as a static scale would
    err = flush_error(inf_x, x_hat, 32)
    assert math.isnan(err[0]) and err[1] == 0
    huge = 1e20 * x
    assert flush_error(huge, 1.1 * huge, 32).tolist() == pytest.approx([0.1, 0.1], rel=1e-5)
    assert flush_error(x, 1.1 * x, 32).tolist() == pytest.approx([0.1, 0.1], rel=1e-5)  # unchanged for ordinary x


def test_a_held_layer_is_said_once_per_flush_however_many_slices() -> None:
    """A prefill past ``SLICE_TOKENS`` is quantized in slices; the first key slice crossing holds the layer. Before,
    each later slice of the same flush added an ``already_held`` event (and log line): 4 events for a 2-slice
    prefill with key and value thresholds, where the same prefill quantized at once says 2. Now 2 either way."""
    from kvbits.cache.store import SLICE_TOKENS

    said = []
    for n in (1024 + 128, 2 * SLICE_TOKENS + 128):
        torch.manual_seed(0)
        cache = QuantizedKVCache(num_layers=1, scheme="kivi-2")
        mon = CacheMonitor(cache, FallbackPolicy(key_error=0.0, value_error=0.0))
        cache.update(torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32), 0)
        said.append([(e["side"], e["action"]) for e in mon.events])
        assert mon.held_layers() == [0]
    assert said[0] == said[1] == [("key", "hold_layer"), ("value", "already_held")]


def _help(text: str, name: str) -> str:
    """The ``# HELP`` text of metric ``name`` in an exposition."""
    (line,) = [x for x in text.splitlines() if x.startswith(f"# HELP {name} ")]
    return line[len(f"# HELP {name} ") :]


def test_a_hybrid_models_state_bytes_are_exported_beside_the_kv_bytes() -> None:
    """A hybrid model's convolution / linear-attention states are outside ``total_bytes`` (``memory_report()``'s
    ``linear_state_bytes``). Before, the metrics and the snapshot had ``kvbits_cache_bytes`` / ``total_bytes`` only:
    a tiny LFM2 (2 conv layers) held 6,144 state bytes that nothing exported. Now ``kvbits_linear_state_bytes``
    (same labels) and the snapshot's ``linear_state_bytes`` say them; a model without state layers has no such
    series (as an uncalibrated cache has no ``kvbits_tokens_beyond_calibration``) and 0 in the snapshot."""
    cfg = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    cache = QuantizedKVCache(config=cfg, scheme="kivi-2")
    mon = CacheMonitor(cache, labels={"request": "r1"})
    run(model, cache, ids_of(2, 40))
    state = cache.memory_report()["linear_state_bytes"]
    assert state > 0
    text = mon.prometheus()
    m = parse(text)
    assert m["kvbits_linear_state_bytes"] == [({"scheme": "kivi-2", "request": "r1"}, state)]
    assert [lab for lab, _ in m["kvbits_cache_bytes"]] == [lab for lab, _ in m["kvbits_linear_state_bytes"]]
    assert "linear_state_bytes" in _help(text, "kvbits_linear_state_bytes")
    assert "# TYPE kvbits_linear_state_bytes gauge" in text
    snap = mon.snapshot()
    assert snap["linear_state_bytes"] == state and snap["total_bytes"] == cache.memory_report()["total_bytes"]
    assert json.loads(strict_json(snap))["linear_state_bytes"] == state

    llama_cache = QuantizedKVCache(config=llama().config, scheme="kivi-2")
    plain = CacheMonitor(llama_cache)
    run(llama(), llama_cache, ids_of(1, 40))
    assert "kvbits_linear_state_bytes" not in plain.prometheus()
    assert plain.snapshot()["linear_state_bytes"] == 0


def test_clipped_values_say_they_count_the_measured_flushes_only() -> None:
    """``kvbits_clipped_values_total`` counts values clipped in the measured flushes: with ``sample_every=2`` the
    flushes skipped are not read (reading them is the host sync sampling saves), so it reads fewer than all the
    cache clipped (12,610 of 16,247 for kvquant-4 calibrated narrow, 160 + 128 tokens). Before, its HELP,
    the CLI's ``--sample-every`` help and the snapshot's ``clipped`` said nothing of it; now each says it."""
    from kvbits.cli import build_parser

    model, art = llama(), narrow_kvquant(llama())
    clipped = []
    for every in (1, 2):
        cache = QuantizedKVCache(config=model.config, scheme="kvquant-4", calibration=art, calibration_warnings=False)
        mon = CacheMonitor(cache, FallbackPolicy(sample_every=every))
        run(model, cache, ids_of(1, 160), decode=16)
        text = mon.prometheus()
        clipped.append(sum(v for _, v in parse(text)["kvbits_clipped_values_total"]))
    assert 0 < clipped[1] < clipped[0]  # the sampled count is not the cache's
    help_text = _help(text, "kvbits_clipped_values_total")
    assert "measured flushes only" in help_text and "sample_every" in help_text
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["monitor"]
    (opt,) = [a for a in sub._actions if "--sample-every" in a.option_strings]
    assert "clipped" in opt.help and "measured" in opt.help
    assert '"clipped" (in the measured' in sub.epilog


def test_an_estimate_of_every_flushs_clipped_values_is_exported_beside_the_sampled_counter() -> None:
    """``kvbits_clipped_values_total`` stays the sampled counter (measured flushes only); a gauge
    ``kvbits_clipped_values_estimated`` (and the snapshot's ``clipped_estimated``) scales it to every flush by the
    values quantized over the values measured. kvquant-4 calibrated narrow, 160 + 16 tokens: 19,817 clipped in all;
    sample_every=2 counts 18,903 and estimates 19,809, where ``clipped * sample_every`` would say 37,806 (the prefill's
    flush, measured first, holds most of the values). Before, nothing estimated the whole: an operator multiplying the
    counter by sample_every doubled it."""
    model, art = llama(), narrow_kvquant(llama())
    out = {}
    for every in (1, 2, 3):
        cache = QuantizedKVCache(config=model.config, scheme="kvquant-4", calibration=art, calibration_warnings=False)
        mon = CacheMonitor(cache, FallbackPolicy(sample_every=every))
        run(model, cache, ids_of(1, 160), decode=16)
        m = parse(mon.prometheus())
        assert "kvbits_clipped_values_estimated gauge" in mon.prometheus()
        counted = {(lab["layer"], lab["side"]): v for lab, v in m["kvbits_clipped_values_total"]}
        estimated = {(lab["layer"], lab["side"]): v for lab, v in m["kvbits_clipped_values_estimated"]}
        assert estimated.keys() == counted.keys()
        snap = {(str(r["layer"]), r["side"]): r["clipped_estimated"] for r in mon.snapshot()["signals"]}
        assert snap == estimated
        out[every] = (sum(counted.values()), sum(estimated.values()))
    truth = out[1][0]
    assert out[1][1] == truth  # every flush measured: the estimate is the count
    for every in (2, 3):
        counted, estimated = out[every]
        assert counted < truth and abs(estimated - truth) < 0.02 * truth
        assert counted * every > 1.5 * truth  # the naive scaling would be far off
    fresh = CacheMonitor(QuantizedKVCache(config=model.config, scheme="kivi-2"), FallbackPolicy(sample_every=2))
    assert all(r["clipped_estimated"] == 0 for r in fresh.snapshot()["signals"])  # nothing flushed: 0, not 0 / 0


def test_numpy_ints_are_taken_as_counts_and_a_non_str_label_name_is_refused_by_name() -> None:
    """``patience`` / ``sample_every`` from numpy (a config read with numpy, an array's element) were refused as "must
    be an int >= 1, got np.int64(2)" while numpy's float thresholds are taken; now they are taken as Python ints (JSON
    numbers in the snapshot). A label name that is no str (``labels={1: "a"}``) raised ``'int' object is not
    iterable`` from inside the name check; now a TypeError that says a str was expected."""
    pol = FallbackPolicy(key_error=0.5, patience=np.int64(2), sample_every=np.int32(3))
    assert (pol.patience, pol.sample_every) == (2, 3)
    assert type(pol.patience) is int and type(pol.sample_every) is int
    assert json.loads(strict_json(pol.to_dict()))["sample_every"] == 3
    for bad in (np.int64(0), np.float64(2.0), np.bool_(True)):
        with pytest.raises(ValueError, match="sample_every must be an int >= 1"):
            FallbackPolicy(sample_every=bad)
    with pytest.raises(TypeError, match="label name must be a str"):
        CacheMonitor(QuantizedKVCache(config=llama().config, scheme="kivi-2"), labels={1: "a"})  # type: ignore[dict-item]


def test_monitor_help_documents_the_scheme_label_and_what_clipped_fraction_reads():
    """``kvbits monitor --help`` named neither the ``scheme`` label every Prometheus series carries nor what
    ``--clipped-fraction`` is measured over (one token's values per check for one-token blocks: 2 of 192 clipped on
    smollm2-135m is 1.04 %, so small thresholds hold at once); both are said now, with a threshold for such blocks."""
    import argparse

    from kvbits.monitor.cli import EPILOG, add_parser
    from kvbits.monitor.export import RESERVED_LABELS

    text = " ".join(EPILOG.split())
    assert 'scheme="NAME"' in text and "every series carries" in text
    assert all(name in text for name in RESERVED_LABELS)  # the names --label refuses
    assert "over the values that flush quantized" in text and "one token's values" in text
    assert "e.g. 0.05" in text
    p = add_parser(argparse.ArgumentParser().add_subparsers())
    (clip,) = [a for a in p._actions if "--clipped-fraction" in a.option_strings]
    assert "one token's values per check" in clip.help


def test_cli_monitor_names_the_files_it_wrote(tmp_path, monkeypatch, capsys) -> None:
    """kvbits monitor wrote --prom and --events without a word (every other command says "wrote ..."); its summary
    now ends naming them."""
    from _wordlevel import save_word_tokenizer, write_word_text

    from kvbits.cli import main

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    save_word_tokenizer(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)  # fmt: skip
    text = write_word_text(tmp_path / "book.txt", 400)
    prom, events = tmp_path / "kvbits.prom", tmp_path / "ev.jsonl"
    argv = ["monitor", "--model", str(folder), "--data", str(text), "--context", "200", "--scheme", "kivi-2",
            "--value-error", "0", "--prom", str(prom), "--events", str(events)]  # fmt: skip
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"wrote {prom} (Prometheus text)" in out and prom.is_file()
    assert f"appended 2 event(s) to {events} (JSON lines)" in out
    assert len(events.read_text().splitlines()) == 2


def test_cli_monitor_beyond_calibration_end_to_end(tmp_path, monkeypatch, capsys, caplog) -> None:
    """``kvbits monitor --beyond-calibration --calibration DIR`` on a tiny model past its 64 calibrated tokens: every
    run ended in "too many values to unpack (expected 3)" (watch() unpacked three of _load_windows' four values); now
    each layer is held at token 65, said once per layer, and the run's summary says the context passed 64."""
    from _wordlevel import save_word_tokenizer, write_word_text

    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model
    from kvbits.cli import main

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    save_word_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    text = write_word_text(tmp_path / "book.txt", 400)
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, 64, 32, generator=g) for _ in range(2)]
    cal = artifact_from_samples("kvquant-4", keys, keys, meta={"model": describe_model(cfg)}).save(tmp_path / "cal")
    argv = ["monitor", "--model", str(folder), "--data", str(text), "--context", "200", "--scheme", "kvquant-4",
            "--beyond-calibration", "--calibration", str(cal)]  # fmt: skip
    with caplog.at_level("WARNING", logger="kvbits"):
        assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "past the 64 the calibration saw" in out and "held layers: [0, 1]" in out
    said = [r.getMessage() for r in caplog.records if "beyond_calibration" in r.getMessage()]
    assert len(said) == 2 and all("threshold 64" in s and "at token 65" in s for s in said), said
