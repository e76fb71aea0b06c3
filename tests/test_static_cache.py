"""``StaticQuantizedKVCache`` (``kvbits.cache.static``): fixed slabs a CUDA graph can replay.

Checked on tiny random-weight models: it stores what ``QuantizedKVCache`` stores for the same scheme, per-token and
windowed (KIVI-style) alike (the same greedy tokens and logits, through SDPA over dequantized slabs and through the
fused path, a left-padded batch included, flushes during the decode), its error is the scheme's (visible against an
unquantized cache), its bytes are ``kvbits.plan``'s at ``max_cache_len`` (plus, windowed, one block ahead and a full
window), its slabs keep their addresses across steps and ``reset()``, and bad input is refused with a clear error.
That one recorded step replays correctly is ``tests/test_aot.py``'s replay test.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import replace

import pytest
import torch
from test_fused_cache import PROMPT, VOCAB, attention, build, install, prompt, use_triton
from transformers import DynamicCache

from kvbits.cache import QuantizedKVCache, StaticQuantizedKVCache, static_reason, track_positions
from kvbits.cache.compat import cache_kwargs
from kvbits.kernels.reference import STATIC_TPS
from kvbits.plan import plan
from kvbits.schemes import KVScheme, TensorSpec, get_scheme

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 12
MAX_LEN = PROMPT + NEW + 4  # a few slots never written
# KIVI's recipe at this model's size: keys per channel over groups of 4 tokens, values per token in groups of 16
# channels, 8 recent tokens in full precision, blocks of 4: the prompt flushes 8 blocks, the decode 3 more
KIVI_SMALL = KVScheme(
    "kivi-small", key=TensorSpec(kind="int", bits=4, fmt=None, granularity="channel", group_size=4),
    value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=16), residual=8, block=4,
)  # fmt: skip
# no window, blocks of 8 (int4-channel's shape): the flushed block holds the token that fills it
CHANNEL_SMALL = KVScheme(
    "channel-small", key=TensorSpec(kind="int", bits=2, fmt=None, granularity="channel", group_size=8),
    value=TensorSpec(kind="int", bits=2, fmt=None, granularity="token"), block=8,
)  # fmt: skip
# per-token INT4 with the first 4 tokens kept in full precision (attention sinks)
SINKS4 = KVScheme("int4-sinks", key=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"),
                  value=TensorSpec(kind="int", bits=4, fmt=None, granularity="token"), sinks=4)  # fmt: skip
# the same three with keys quantized before RoPE (KVQuant; int4-channel-prerope's shape is CHANNEL_SMALL's)
KIVI_PREROPE = replace(KIVI_SMALL, name="kivi-prerope", key=replace(KIVI_SMALL.key, pre_rope=True))
CHANNEL_PREROPE = replace(CHANNEL_SMALL, name="channel-prerope", key=replace(CHANNEL_SMALL.key, pre_rope=True))
SINKS4_PREROPE = replace(SINKS4, name="int4-sinks-prerope", key=replace(SINKS4.key, pre_rope=True))
# sinks beside a flush window: KIVI's with 3 sinks, and KVQuant's block recipe at this size (kvquant-4-block: pre-RoPE NUQ
# keys per channel over blocks, NUQ values per token, 1 % outliers), blocks of 4 and 3 sinks
KIVI_SINKS = replace(KIVI_SMALL, name="kivi-sinks", sinks=3)
_KVQ_BLOCK = get_scheme("kvquant-4-block")
KVQUANT_BLOCK = replace(_KVQ_BLOCK, name="kvquant-block-small", key=replace(_KVQ_BLOCK.key, group_size=4), block=4,
                        sinks=3)  # fmt: skip
NAMED = {s.name: s for s in (KIVI_SMALL, CHANNEL_SMALL, SINKS4, KIVI_PREROPE, CHANNEL_PREROPE, SINKS4_PREROPE,
                             KIVI_SINKS, KVQUANT_BLOCK)}  # fmt: skip


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "reference")


@torch.no_grad()
def generate(model, cache, *, fused: bool, ids=None, attention_mask=None):
    """Greedy generation of ``NEW`` tokens; ``(sequences, logits (NEW, B, V))``."""
    ids = prompt() if ids is None else ids
    extra = {} if attention_mask is None else {"attention_mask": attention_mask}
    with attention(model, fused):
        out = model.generate(ids, **cache_kwargs(cache, model), **extra, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@torch.no_grad()
def decode_steps(model, cache, ids, steps: int, *, fused: bool, monkeypatch=None, attention_mask=None,
                 graphed: list | None = None) -> torch.Tensor:
    """A prefill of ``ids``, then ``steps`` greedy decode steps: logits ``(steps, B, V)``. With ``monkeypatch``, the
    steps after the first are replayed from the second, recorded by ``benchmarks/graph_replay.py``'s emulation of a
    CUDA graph (``GraphedDecode``; the cache's checks must be lazy). ``attention_mask`` ``(B, T)``: a left-padded
    batch; every step then passes the grown mask and each row's ``position_ids``, as ``generate`` does. ``graphed``: a
    list that receives the ``GraphedDecode``."""
    step = None
    if monkeypatch is not None:
        from pathlib import Path

        from kvbits.evaluate.graphs import GraphedDecode

        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from graph_replay import tape_capture

        step = GraphedDecode(model, eager=1, capture=tape_capture)
        if graphed is not None:
            graphed.append(step)
    kw, out, extra = cache_kwargs(cache, model), [], {}
    mask, pos = attention_mask, None
    if mask is not None:
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        extra = {"attention_mask": mask, "position_ids": pos}
    with attention(model, fused):
        nxt = model(ids, **kw, **extra, use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(steps):
            cpos = torch.tensor([ids.shape[1] + i])
            if mask is None:
                extra = {"position_ids": cpos[None]} if step is None else {}
            else:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                extra = {"attention_mask": mask, "position_ids": pos[:, -1:] + 1 + i}
            lg = (model if step is None else step)(nxt, **kw, use_cache=True, cache_position=cpos, **extra).logits
            out.append(lg[:, -1].clone())
            nxt = lg[:, -1:].argmax(-1)
    if step is not None:
        assert step.captured and step.calls == steps
    return torch.stack(out)


@pytest.mark.parametrize("fused", [False, True], ids=["sdpa", "fused"])
@pytest.mark.parametrize(
    "scheme", ["int8-token", "int2-token", "int4-token-hadamard", "vllm-fp8-token", "int4-g16", "vllm-int4",
               "int4-token,0=fp16", "kivi-small", "channel-small", "fp8-e4m3", "fp8-e4m3-head", "fp8-e4m3-hadamard",
               "int4-sinks", "kivi-prerope", "channel-prerope", "int4-sinks-prerope", "kvquant-4", "kvquant-2",
               "int4-token-smooth-prerope", "kivi-sinks", "kvquant-block-small"],
)  # fmt: skip
def test_static_cache_stores_what_the_quantized_cache_stores(scheme, fused):
    """The same scheme through both caches: the same greedy tokens and logits, every decode step of every layer
    through the fused path when asked (mixed schemes: the float layer too, as a tail-only store). Static FP8 scales:
    vLLM's 1.0, and per-head scales installed in both (``set_static_qparams``, a different one per head and layer);
    KVQuant's calibrated parameters (static pre-RoPE key ranges, NUQ codebooks, 1 % outliers, a sink) and centred /
    smoothed pre-RoPE keys, installed alike; sinks beside a flush window (KIVI's, and KVQuant's block recipe)."""
    model = build("llama")
    if scheme == "int4-g16":  # groups of 16 channels per token (int4-g64's groups do not divide this model's D = 32)
        spec = TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=16)
        scheme = KVScheme("int4-g16", key=spec, value=spec)
    scheme = NAMED.get(scheme, scheme)
    reference = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=fused)
    for c in (reference, cache):
        install(c, get_scheme(scheme))  # per-head FP8 scales; nothing for the other schemes
    want_seq, want = generate(model, reference, fused=fused)
    seq, got = generate(model, cache, fused=fused)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert [layer.fused.steps for layer in cache.layers] == [NEW - 1 if fused else 0] * 2
    assert int(cache.get_seq_length()) == PROMPT + NEW - 1 and cache.get_mask_sizes(1, 0) == (MAX_LEN, 0)
    if isinstance(scheme, KVScheme) and scheme.block > 1:  # windowed: flushed during the decode, as QuantizedKVCache
        R, blk = scheme.residual + scheme.sinks, scheme.block
        assert int(cache.layers[0].qlen) == (PROMPT + NEW - 1 - R) // blk * blk > (PROMPT - R) // blk * blk


@pytest.mark.parametrize("scheme", ["int4-token", "kivi-small", "int4-sinks", "kivi-prerope", "channel-prerope",
                                    "int4-sinks-prerope", "kvquant-4", "kvquant-block-small"])  # fmt: skip
@pytest.mark.parametrize("fused", [False, True], ids=["sdpa", "fused"])
def test_static_cache_left_padded_batch(fused, scheme):
    """Left padding: the pads take slots like any token; the mask transformers builds hides them (SDPA), and on
    fused steps it becomes the slabs' slot mask (and the window's). Same tokens and logits as ``QuantizedKVCache``.
    Pre-RoPE keys are un-rotated at the model's positions: each row's pad count is read from the position ids of the
    prefill (``track_positions`` hands them over where transformers passes none, 5.17), for every layer."""
    model = build("qwen2")
    scheme = NAMED.get(scheme, scheme)
    ids = prompt(batch=3, seed=4)
    ids[0, :7] = 0
    ids[2, :3] = 0
    mask = (ids != 0).long()
    reference = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused)
    # the static slabs keep scheme.sinks slots (a padded row's hold pads, warned about); QuantizedKVCache widens a
    # left-padded request's sinks: the reference here keeps them as the slabs do
    reference._padded_sink_slots = lambda *args, **kwargs: 0
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=fused)
    for c in (reference, cache):
        install(c, get_scheme(scheme))  # calibrated schemes: their parameters; nothing for the others
    tracking = track_positions(model)
    try:
        want_seq, want = generate(model, reference, fused=fused, ids=ids, attention_mask=mask)
        seq, got = generate(model, cache, fused=fused, ids=ids, attention_mask=mask)
    finally:
        tracking.remove()
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert all(layer.fused.fallbacks == 0 for layer in cache.layers)
    if get_scheme(scheme).key.pre_rope:
        assert all(layer.rope.offset.tolist() == [7, 0, 3] for layer in cache.layers)
        assert cache.position_ids_hint is None  # forgotten after each call


@torch.no_grad()
def test_static_cache_says_once_when_no_position_ids_reach_its_pre_rope_keys(monkeypatch, caplog):
    """Where transformers passes no position ids to ``Cache.update`` (5.17; Falcon, GPT-NeoX on 5.25: simulated here)
    and ``track_positions`` is not on, a left-padded batch's pre-RoPE keys are un-rotated at cache indices (offsets 0).
    ``QuantizedKVCache`` says so (INFO, once per cache); before, ``StaticQuantizedKVCache`` said nothing (a batch with
    pads 0/3/7: offsets ``[0, 0, 0]``, no record). Now it says it once, and nothing once ``track_positions`` hands the
    positions over (offsets ``[0, 3, 7]``)."""
    original = StaticQuantizedKVCache.update

    def update(self, k, v, layer_idx, *args, **kwargs):
        kwargs.pop("position_ids", None)
        if isinstance(kwargs.get("kwargs"), dict):
            kwargs["kwargs"] = {n: x for n, x in kwargs["kwargs"].items() if n != "position_ids"}
        return original(self, k, v, layer_idx, *args, **kwargs)

    monkeypatch.setattr(StaticQuantizedKVCache, "update", update)
    model = build.__wrapped__("llama")  # a model of its own: no tracking left by other tests
    ids = prompt(batch=3, seed=4)
    ids[1, :3] = 0
    ids[2, :7] = 0
    for tracked, want in ((False, [0, 0, 0]), (True, [0, 3, 7])):
        tracking = track_positions(model) if tracked else None
        cache = StaticQuantizedKVCache(config=model.config, scheme=CHANNEL_PREROPE, max_cache_len=MAX_LEN)
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="kvbits.cache.static"):
                for _ in range(2):  # a second request on the same cache: not said again
                    cache.reset()
                    model.generate(ids, attention_mask=(ids != 0).long(), **cache_kwargs(cache, model),
                                   max_new_tokens=2, do_sample=False, pad_token_id=0)  # fmt: skip
        finally:
            if tracking is not None:
                tracking.remove()
        told = [r for r in caplog.records if "no position_ids reached the cache" in r.getMessage()]
        assert all(layer.rope.offset.tolist() == want for layer in cache.layers)
        assert len(told) == (0 if tracked else 1), [r.getMessage() for r in told]
        if told:
            assert "StaticQuantizedKVCache" in told[0].getMessage() and "track_positions" in told[0].getMessage()


@pytest.mark.parametrize("scheme", ["int4-token", "kivi-small", "int4-sinks", "kivi-prerope", "kvquant-4",
                                    "kvquant-block-small"])  # fmt: skip
def test_static_cache_fused_steps_through_the_triton_kernel(monkeypatch, scheme):
    """The fused steps through the Triton kernels (interpreted on a CPU), launched for all reserved slots with each
    sequence's length read from the device (and a windowed scheme's window as the masked tail): the logits of the
    torch reference over the same slabs."""
    model = build("llama")
    scheme = NAMED.get(scheme, scheme)
    reference = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=True)
    install(reference, get_scheme(scheme))
    want_seq, want = generate(model, reference, fused=True)
    use_triton(monkeypatch)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=True)
    install(cache, get_scheme(scheme))
    seq, got = generate(model, cache, fused=True)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert [layer.fused.steps for layer in cache.layers] == [NEW - 1] * 2


@pytest.mark.parametrize("scheme", ["fp16", "int4-token,0=fp16", "int4-token"])
def test_static_cache_left_padded_batch_through_the_triton_kernel(monkeypatch, scheme):
    """A left-padded batch through the Triton kernels with ``max_cache_len`` not a multiple of 4: a float layer's
    tail mask was a view of 4-byte-padded rows (``word_rows``) that the kernels read in rows of ``max_cache_len``
    bytes, so rows after the first were masked at the wrong slots (float32 logits 0.11 away from the reference's,
    NaN where a row's every slot read masked). The logits of the torch reference over the same slabs."""
    model = build("qwen2")
    ids = prompt(batch=2, seed=4)
    ids[1, :5] = 0
    mask = (ids != 0).long()
    odd = MAX_LEN + 1 if MAX_LEN % 4 == 0 else MAX_LEN
    assert odd % 4
    reference = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=odd, fused_decode=True)
    want_seq, want = generate(model, reference, fused=True, ids=ids, attention_mask=mask)
    use_triton(monkeypatch)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=odd, fused_decode=True)
    seq, got = generate(model, cache, fused=True, ids=ids, attention_mask=mask)
    assert torch.equal(seq, want_seq) and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert all(layer.fused.steps == NEW - 1 and layer.fused.fallbacks == 0 for layer in cache.layers)


def test_static_cache_error_is_the_schemes():
    """Quantizing shows: INT2 per token moves the logits far more than INT8 from an unquantized cache, and the
    slabs hold packed codes (uint8, ``D * bits / 8`` bytes per row) with a scale and zero-point per token."""
    model = build("llama")
    _, exact = generate(model, DynamicCache(config=model.config), fused=False)
    err = {}
    for scheme in ("int8-token", "int2-token"):
        cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
        _, got = generate(model, cache, fused=False)
        err[scheme] = float((got - exact).abs().max())
        layer = cache.layers[0]
        bits = get_scheme(scheme).key.bits
        assert layer.key.codes.dtype == torch.uint8 and layer.key.codes.shape == (2, 2, MAX_LEN, 32 * bits // 8)
        assert layer.key.scale.shape == (2, 2, MAX_LEN, 1) and layer.key.zero is not None
    assert 0 < err["int8-token"] < 0.05 < err["int2-token"], err


@pytest.mark.parametrize("scheme", ["int4-token", "vllm-int8", "int8-token,1=fp16", "kivi-small", "int4-sinks",
                                    "channel-prerope", "int4-sinks-prerope", "kivi-sinks"])  # fmt: skip
def test_static_cache_bytes_are_the_plan_at_max_cache_len(scheme):
    """Every byte of the slabs (codes, scales, zero-points, float layers, windows) is counted, and the total is what
    ``kvbits.plan`` says ``max_cache_len`` tokens take, from the first token on (the slabs are reserved); a windowed
    scheme also holds one quantized block ahead and a whole window (and its sinks), where the plan counts the tokens
    left in it.
    Pre-RoPE keys add, apart, their RoPE tables (the bytes ``plan(..., fused_decode=True)`` adds for them: rows for the
    attended slots, a windowed scheme's block ahead not counted, ``test_windowed_pre_rope_tables_are_the_plans_rows``)
    and a position offset per sequence and layer."""
    model = build("llama")
    scheme = NAMED.get(scheme, scheme)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    generate(model, cache, fused=False)
    held = sum(t.nbytes for layer in cache.layers for p in (layer.key, layer.value) if p is not None for t in p.tensors())
    held += sum(t.nbytes for layer in cache.layers for t in (layer.key_full, layer.value_full) if t is not None)
    report = cache.memory_report()
    at = plan(model.config, context=MAX_LEN, batch=2, scheme=scheme, dtype_bytes=4)
    want = at["total_bytes"]
    if isinstance(scheme, KVScheme) and scheme.block > 1:
        n_q = (MAX_LEN - scheme.sinks - scheme.residual) // scheme.block * scheme.block  # quantized at max_cache_len
        window = scheme.sinks + scheme.residual + scheme.block
        layer = cache.layers[0]
        full_token = 2 * len(cache.layers) * layer.key_full[:, :, 0].nelement() * 4  # K and V of one token, float32
        assert at["components"]["full"] == (MAX_LEN - n_q) * full_token
        want = at["components"]["quantized"] * (n_q + scheme.block) // n_q + window * full_token
        assert want > at["total_bytes"]
    assert report["total_bytes"] == held == want
    # apart: per layer the two counts (int64), the lengths of both sides (int32 per sequence), the check maxima
    # (float32, two pairs), the clip counts (int64 per side) and a windowed layer's window positions (int64 each)
    window = scheme.sinks + scheme.residual + scheme.block if isinstance(scheme, KVScheme) and scheme.block > 1 else 0
    pre_rope = get_scheme(scheme).key.pre_rope
    assert report["state_bytes"] == 2 * (2 * 8 + 2 * 4 * 2 + 2 * 4 * 2 + 2 * 8 + 8 * window + 8 * 2 * pre_rope)
    tables = plan(model.config, context=MAX_LEN, batch=2, scheme=scheme, dtype_bytes=4, fused_decode=True)
    assert report["rope_table_bytes"] == cache.fused_report()["rope_table_bytes"]
    assert report["rope_table_bytes"] == (tables["total_bytes"] - at["total_bytes"] if pre_rope else 0)
    assert (report["rope_table_bytes"] > 0) == pre_rope


def _held_storages(obj, seen: dict[int, int], depth: int = 0) -> None:
    """Every tensor storage reachable from ``obj`` (kvbits objects, dataclasses, lists, dicts): ``seen`` maps each
    storage's address to its bytes, so a tensor shared by several holders counts once."""
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif depth < 6 and isinstance(obj, (list, tuple)):
        for x in obj:
            _held_storages(x, seen, depth + 1)
    elif depth < 6 and isinstance(obj, dict):
        for x in obj.values():
            _held_storages(x, seen, depth + 1)
    elif depth < 6 and type(obj).__module__.startswith("kvbits") and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            _held_storages(x, seen, depth + 1)


@pytest.mark.parametrize("name", ["kvquant-4", "int4-token-smooth", "int4-token-smooth-prerope", "kvquant-4-block"])
def test_static_cache_calibrated_bytes_are_every_storage_once(name):
    """Calibrated schemes (a synthetic ``artifact_from_samples`` KVQuant artifact; channel means and factors installed
    by hand): after a prefill and decode steps, ``memory_report()``'s total, state and RoPE tables are the bytes of
    every storage the cache holds, each once, and its ``fixed`` is the plan's. The slabs' codebooks and channel vectors
    are the installed tensors themselves (not copies: the plan counts them once); a slab that does keep a copy (as
    ``pack_side`` makes of a codebook on another device or dtype) has it counted in ``fixed``."""
    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    model, scheme = build("llama"), get_scheme(name)
    if scheme.key.kind == "nuq":
        g = torch.Generator().manual_seed(0)
        samples = [torch.randn(1, 2, 128, 32, generator=g) for _ in range(2)]
        art = artifact_from_samples(name, samples, samples, meta={"model": describe_model(model.config)})
        cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, calibration=art)
    else:
        cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
        install(cache, scheme)
    generate(model, cache, fused=False)
    report = cache.memory_report()
    seen: dict[int, int] = {}
    for layer in cache.layers:
        _held_storages(layer, seen)
    assert report["total_bytes"] + report["state_bytes"] + report["rope_table_bytes"] == sum(seen.values())
    at = plan(model.config, context=MAX_LEN, batch=2, scheme=scheme, dtype_bytes=4)
    assert report["fixed_bytes"] == at["components"]["fixed"] > 0
    names = {"codebook": "codebook", "channel_mean": "channel_mean", "channel_factor": "channel_factor"}
    for layer in cache.layers:
        for side, slab in (("key", layer.key), ("value", layer.value)):
            for field, key in names.items():
                if getattr(slab, field) is not None:
                    assert getattr(slab, field) is layer._fixed[side][key], (layer.layer_idx, side, field)
    layer = cache.layers[0]
    field = "codebook" if layer.key.codebook is not None else "channel_mean"
    copy = getattr(layer.key, field).clone()
    before = layer.nbytes()
    layer.key = replace(layer.key, **{field: copy})
    after = layer.nbytes()
    assert after["fixed"] == before["fixed"] + copy.nbytes and after["quantized"] == before["quantized"]


@pytest.mark.parametrize("fused", [False, True], ids=["sdpa", "fused"])
@pytest.mark.parametrize("scheme", ["kivi-4", "int4-channel", "kivi-sinks"])
def test_a_window_longer_than_max_cache_len_holds_only_its_positions(scheme, fused):
    """A windowed scheme whose window (``sinks + residual + block``: KIVI-4's 160, int4-channel's 128) is longer
    than ``max_cache_len`` never flushes: its float slabs hold ``max_cache_len`` positions (they held the whole window,
    160 slots for 51 here: 3.1x the plan's float bytes), and one quantized block ahead, as at any length. It serves
    what ``QuantizedKVCache`` serves (nothing quantized), also once the host's counts are off (a replayed step quantizes
    the window's oldest block at every step, into slots nothing attends)."""
    model = build("llama")
    scheme = NAMED.get(scheme, scheme)
    s, T = get_scheme(scheme), PROMPT + NEW - 1
    if s.name == "kivi-sinks":  # a window of 3 sinks, then T + 4 tokens
        scheme = s = replace(s, residual=T)
    assert s.sinks + s.residual + s.block > T
    reference = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=T, fused_decode=fused)
    want_seq, want = generate(model, reference, fused=fused)
    for host_counts in (True, False):
        cache.reset()
        for layer in cache.layers:
            layer.host_counts = host_counts
        seq, got = generate(model, cache, fused=fused)
        assert torch.equal(seq, want_seq)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert int(cache.layers[0].qlen) == 0
    layer = cache.layers[0]
    assert layer.key_full.shape[2] == layer.window_pos.shape[0] == T and layer.key.n_slots == s.block
    at = plan(model.config, context=T, batch=2, scheme=scheme, dtype_bytes=4)
    report = cache.memory_report()
    assert report["full_bytes"] == at["components"]["full"] and at["components"]["quantized"] == 0
    assert report["quantized_bytes"] == sum(t.nbytes for la in cache.layers for p in (la.key, la.value)
                                            for t in p.tensors())  # fmt: skip


def test_static_cache_slabs_keep_their_addresses_and_reset_in_place():
    """The slabs are allocated once: every step writes into them (what a captured graph needs), ``reset()`` empties
    them in place, and a second generation after it gives the first one's tokens and logits."""
    model = build("qwen2")
    cache = StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=MAX_LEN, fused_decode=True)
    seen = []
    hook = model.register_forward_hook(lambda *_: seen.append((cache.layers[1].key.codes.data_ptr(),
                                                                cache.layers[1].length.data_ptr())))  # fmt: skip
    try:
        seq1, logits1 = generate(model, cache, fused=True)
        cache.reset()
        assert int(cache.layers[0].length) == 0 and cache.layers[0].tokens_written == 0
        assert not cache.layers[0].key.codes.any()
        seq2, logits2 = generate(model, cache, fused=True)
    finally:
        hook.remove()
    assert len(set(seen)) == 1 and len(seen) == 2 * NEW
    assert torch.equal(seq1, seq2) and torch.equal(logits1, logits2)


@pytest.mark.parametrize("name", ["kvquant-4", "fp8-e4m3", "fp8-e4m3-head"])
def test_reset_keeps_the_static_scale_rows(name: str):
    """A side with static scales keeps one calibrated row (FP8: the default 1.0 or its install), not slot data:
    ``reset()`` zeroed it with the slots, so every generation after a reset decoded its keys with scale 0
    (kvquant-4: logits 0.48 away, other tokens; fp8-e4m3: 0.80). The second generation is now the first's."""
    model = build("llama")
    scheme = get_scheme(name)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=False)
    install(cache, scheme)
    seq1, logits1 = generate(model, cache, fused=False)
    static = [p for p in (cache.layers[0].key, cache.layers[0].value) if p.tps == STATIC_TPS]
    assert len(static) == (1 if name == "kvquant-4" else 2)  # kvquant-4's values: dynamic per-token scales
    rows = [(p.scale.clone(), None if p.zero is None else p.zero.clone()) for p in static]
    assert all(bool(scale.any()) for scale, _ in rows)
    cache.reset()
    for (scale, zero), p in zip(rows, static):
        assert torch.equal(p.scale, scale) and (zero is None or torch.equal(p.zero, zero))
    seq2, logits2 = generate(model, cache, fused=False)
    assert torch.equal(seq1, seq2) and torch.equal(logits1, logits2)


def test_static_cache_refuses_what_it_cannot_hold():
    """Schemes that need the host's flush bookkeeping or calibration are named with the reason; so are sliding
    layers, a missing ``max_cache_len`` and more tokens than it."""
    rotated = replace(SINKS4_PREROPE, name="rotated-prerope", key=replace(SINKS4_PREROPE.key, rotate="hadamard"))
    smooth = get_scheme("int4-token-smooth")
    centred_values = replace(smooth, name="centred-values", value=smooth.key)
    for scheme, words in ((centred_values, "values: centred / smoothed values"),
                          (rotated, "pre-RoPE keys with a hadamard rotation")):  # fmt: skip
        why = static_reason(get_scheme(scheme))
        assert why is not None and words in why, (scheme, why)
        with pytest.raises(ValueError, match="fixed slabs"):
            StaticQuantizedKVCache(num_layers=2, scheme=scheme, max_cache_len=8)
    with pytest.raises(ValueError, match="max_cache_len=4 leaves no slot past the 4 sinks"):
        StaticQuantizedKVCache(num_layers=2, scheme=SINKS4, max_cache_len=4)
    for scheme in ("int8-token", "int4-token-hadamard", "vllm-fp8-token", "fp16", "int4-token,0=fp16", "kivi-4",
                   "kivi-2", "int4-channel", "int2-channel", "fp8-e4m3", "fp8-e4m3-head", SINKS4,
                   "int4-channel-prerope", "int3-channel-prerope", SINKS4_PREROPE, "kvquant-4", "kvquant-2",
                   "int4-token-smooth", "int2-token-smooth-prerope", "kvquant-4-block", "kvquant-2-block",
                   KIVI_SINKS):  # fmt: skip
        assert static_reason(get_scheme(scheme).for_layer(0)) is None
    with pytest.raises(ValueError, match="max_cache_len is required"):
        StaticQuantizedKVCache(num_layers=2, max_cache_len=None)
    with pytest.raises(NotImplementedError, match="full-attention layers only"):
        StaticQuantizedKVCache(config=build("gemma3").config, max_cache_len=8)
    model = build("llama")
    cache = StaticQuantizedKVCache(config=model.config, max_cache_len=PROMPT + 3)
    with pytest.raises(ValueError, match="> max_cache_len"):
        generate(model, cache, fused=False)


@torch.no_grad()
def test_static_cache_is_not_croppable_and_says_what_is():
    """Assisted decoding asks for a croppable cache: transformers refuses it after the prefill. ``crop()`` itself
    said 'QuantizedKVCache can', which crops only the tokens it still holds in full precision (assisted decoding
    refuses it too unless the scheme is fp16 / bf16); it now says so."""
    model = build("llama")
    cache = StaticQuantizedKVCache(config=model.config, scheme="int4-token", max_cache_len=PROMPT + 8)
    assert not cache.is_croppable
    # transformers >= 5.2x refuses a cache that is not croppable; 5.17 does not ask and crops: our refusal, by name
    with pytest.raises((ValueError, NotImplementedError), match="can be cropped|StaticQuantizedKVCache cannot be cropped"):
        model.generate(prompt(batch=1), **cache_kwargs(cache, model), assistant_model=model, max_new_tokens=4,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    with pytest.raises(NotImplementedError, match="cannot be cropped.*full precision.*fp16 / bf16"):
        cache.crop(-1)


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["int8-token", "kivi-small", "int4-sinks-prerope", "fp8-e4m3"])
def test_a_failed_first_request_leaves_the_cache_as_before(scheme):
    """A request's first update that failed (a prompt past ``max_cache_len``, a NaN key in layer 1) left the slabs
    allocated for its batch (and layer 0 holding the prompt): a retry at batch 1 was refused ('key_states must be (B=2,
    ...)') until a new cache was made, ``reset()`` included. Now the layers the request allocated are released and the
    others reset, and the retry generates what a new cache does."""
    model = build("llama")
    scheme = NAMED.get(scheme, scheme)
    fresh = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    want = generate(model, fresh, fused=False, ids=prompt(batch=1))
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="> max_cache_len"):
        generate(model, cache, fused=False, ids=torch.cat([prompt(), prompt()], dim=1))
    assert cache.batch_size == -1 and not any(layer.is_initialized for layer in cache.layers)
    nan = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, out: out * float("nan"))
    try:
        with pytest.raises(ValueError, match="layer 1 keys contains non-finite"):
            generate(model, cache, fused=False)
    finally:
        nan.remove()
    assert cache.batch_size == -1 and cache.layers[0].tokens_written == 0
    got = generate(model, cache, fused=False, ids=prompt(batch=1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    codes = cache.layers[0].key.codes.data_ptr()  # allocated before the request: reset in place, not released
    cache.reset()
    nan = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, out: out * float("nan"))
    try:
        with pytest.raises(ValueError, match="layer 1 keys contains non-finite"):
            generate(model, cache, fused=False, ids=prompt(batch=1))
    finally:
        nan.remove()
    assert cache.layers[0].tokens_written == 0 and int(cache.layers[0].length) == 0
    assert cache.layers[0].key.codes.data_ptr() == codes
    got = generate(model, cache, fused=False, ids=prompt(batch=1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_static_cache_refuses_batch_ops_by_name():
    """``batch_repeat_interleave`` / ``batch_select_indices`` (``Cache``'s, which QuantizedKVCache serves) raised
    AttributeError ('StaticQuantizedLayer' object has no attribute ...). Now a no-op on an empty cache, as
    ``DynamicLayer``'s, and NotImplementedError naming the fixed batch and what serves them once the slabs exist."""
    cache = StaticQuantizedKVCache(num_layers=2, max_cache_len=8)
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([0]))
    k = torch.randn(2, 2, 3, 32)
    for i in range(2):
        cache.update(k, k, i)
    cache.batch_repeat_interleave(1)
    with pytest.raises(NotImplementedError, match=r"cannot batch_repeat_interleave\(3\).*batch of 2.*QuantizedKVCache"):
        cache.batch_repeat_interleave(3)
    with pytest.raises(NotImplementedError, match="cannot batch_select_indices .*batch of 2.*QuantizedKVCache"):
        cache.batch_select_indices(torch.tensor([1]))
    assert cache.batch_size == 2 and cache.layers[0].tokens_written == 3


def test_static_cache_checks_bad_kv_eagerly_or_lazily():
    """NaN / inf / wrong shapes or dtypes: eager checks refuse them before anything is stored; lazy ones (no host
    read in a step) are read by ``check_inputs()`` and ``memory_report()``, naming the layer."""
    k = torch.randn(1, 2, 3, 32)
    eager = StaticQuantizedKVCache(num_layers=1, max_cache_len=8, checks="eager")
    bad = k.clone()
    bad[0, 1, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        eager.update(bad, k, 0)
    assert int(eager.layers[0].length) == 0 and eager.layers[0].tokens_written == 0
    lazy = StaticQuantizedKVCache(num_layers=1, max_cache_len=8, checks="lazy")
    lazy.update(k, k, 0)
    lazy.check_inputs()
    lazy.update(k[:, :, :1], bad[:, :, 2:], 0)
    with pytest.raises(ValueError, match="layer 0: values .*NaN or inf"):
        lazy.memory_report()
    with pytest.raises(ValueError, match=r"must be \(B=1, H_kv=2, q, D=32\)"):
        lazy.update(torch.randn(1, 3, 1, 32), k[:, :, :1], 0)
    with pytest.raises(ValueError, match="torch.float16"):
        lazy.update(k[:, :, :1].half(), k[:, :, :1].half(), 0)
    big = StaticQuantizedKVCache(num_layers=1, max_cache_len=8, checks="lazy")
    big.update(k * 1e5, k, 0)
    with pytest.raises(ValueError, match=r"layer 0: keys .*\|x\| up to"):
        big.check_inputs()


@pytest.mark.parametrize("checks", ["auto", "eager"])
def test_traced_steps_checks_are_read_by_an_eager_cache(checks: str):
    """A traced step (``torch.compile``) checks its K/V lazily whatever the mode; an eager cache (``"auto"`` on the
    CPU) kept their running maximum but never read it: a NaN key written by a compiled step passed ``check_inputs()``
    and ``memory_report()`` in silence. Now they read it."""
    k = torch.randn(1, 2, 3, 32)
    cache = StaticQuantizedKVCache(num_layers=1, max_cache_len=8, checks=checks)
    cache.update(k, k, 0)  # the prefill, eager
    step = torch.compile(lambda key, value: cache.update(key, value, 0)[0], backend="eager", fullgraph=True)
    bad = k[:, :, :1].clone()
    bad[0, 1, 0, 4] = float("nan")
    step(bad, k[:, :, :1])
    assert int(cache.layers[0].length) == 4
    with pytest.raises(ValueError, match="layer 0: keys written to the cache held NaN or inf"):
        cache.check_inputs()
    with pytest.raises(ValueError, match="layer 0: keys .*NaN or inf"):
        cache.memory_report()
    cache.reset()  # a new request: the maximum restarts
    cache.update(k, k, 0)
    cache.check_inputs()


def test_static_cache_refuses_a_layer_it_does_not_have_and_kv_that_are_not_4d_tensors():
    """A cache made for fewer layers than the model raised transformers' IndexError ('list index out of range')
    mid-forward, and layer_idx=-1 stored the K/V in the last layer without a word; a first update of 3-D K/V raised
    'not enough values to unpack', of a numpy array an AttributeError. Now ValueError / TypeError naming them, as
    QuantizedKVCache's."""
    model = build("llama")  # 2 layers
    cache = StaticQuantizedKVCache(num_layers=1, max_cache_len=PROMPT + 4)
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 1\): this cache has 1 layers.*got 1"):
        model(prompt(batch=1), **cache_kwargs(cache, model), use_cache=True)
    k = torch.randn(1, 2, 3, 32)
    cache = StaticQuantizedKVCache(num_layers=2, max_cache_len=8)
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\).*got -1"):
        cache.update(k, k, -1)
    assert not cache.layers[1].is_initialized and cache.layers[1].tokens_written == 0
    with pytest.raises(ValueError, match=r"layer 0 key_states must have 4 dims .*got shape \(2, 3, 32\)"):
        cache.update(k[0], k[0], 0)
    with pytest.raises(TypeError, match="layer 0 value_states must be a torch.Tensor, got ndarray"):
        cache.update(k, k.numpy(), 0)
    assert not cache.layers[0].is_initialized
    cache.update(k, k, 0)  # still usable
    assert cache.layers[0].tokens_written == 3


def test_static_fp8_scales_installed_counted_and_clipping_seen():
    """Static FP8 (vLLM's ``fp8`` KV cache): scales installed by hand or from a calibration artifact, checked (finite,
    ``> 0``, one per head), refused once tokens are stored; values beyond a scale's range saturate and are counted on
    the device, as ``QuantizedKVCache`` counts them; the bytes are the plan's plus the scale in the kernels' layout
    (float32 per sequence and head, each side and layer)."""
    from kvbits.calibrate import CalibrationArtifact

    model = build("llama")
    scheme = get_scheme("fp8-e4m3-head")
    tiny = torch.tensor([1e-4, 2e-4])  # far below these K/V: most values saturate
    counts = {}
    for name in ("quantized", "static"):
        cache = (QuantizedKVCache(config=model.config, scheme=scheme) if name == "quantized" else
                 StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN))  # fmt: skip
        for i in range(2):
            for side in ("key", "value"):
                cache.set_static_qparams(i, side, tiny)
        generate(model, cache, fused=False)
        if name == "quantized":
            counts[name] = [(r["clipped_keys"], r["clipped_values"]) for r in cache.calibration_report()["layers"]]
        else:
            counts[name] = [(r["clipped_keys"], r["clipped_values"]) for r in cache.clipped()]
            report = cache.memory_report()
            at = plan(model.config, context=MAX_LEN, batch=2, scheme=scheme, dtype_bytes=4)["total_bytes"]
            assert report["total_bytes"] == at + 2 * 2 * (2 * 2 * 4) and report["fixed_bytes"] == 2 * 2 * 2 * 4
            with pytest.raises(ValueError, match="before the first token"):
                cache.set_static_qparams(0, "key", tiny)
    assert counts["static"] == counts["quantized"] and all(k > 0 and v > 0 for k, v in counts["static"]), counts
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="per-head FP8 scale must be"):
        cache.set_static_qparams(0, "key", torch.ones(3))
    with pytest.raises(ValueError, match="> 0|positive|finite"):
        cache.set_static_qparams(0, "key", torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="spec is not static; static scales would be ignored"):
        StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=8).set_static_qparams(0, "key", tiny)
    with pytest.raises(TypeError, match="CalibrationArtifact"):
        StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=8, calibration=42)
    assert CalibrationArtifact is not None


@pytest.mark.parametrize("cls", [StaticQuantizedKVCache, QuantizedKVCache])
def test_a_per_head_fp8_scale_of_another_head_count_is_refused_by_layer_and_side(cls):
    """A cache without a config cannot check a per-head FP8 scale's head count when it is installed; the first K/V
    then refuse it, naming the layer and side (the static cache leaves itself as before the request). The static cache said only
    "static FP8 scale: a per-head FP8 scale must be (2,), ... got shape (1, 3, 1, 1)" from inside its slab template
    (``QuantizedKVCache`` named them)."""
    kw = {"max_cache_len": 16} if cls is StaticQuantizedKVCache else {}
    cache = cls(scheme="fp8-e4m3-head", num_layers=2, **kw)
    cache.set_static_qparams(1, "value", torch.ones(3))
    kv = torch.randn(2, 2, 4, 32)
    cache.update(kv, kv, 0)
    with pytest.raises(ValueError, match=r"^layer 1 value static FP8 scale: a per-head FP8 scale must be \(2,\)"):
        cache.update(kv, kv, 1)
    if cls is StaticQuantizedKVCache:  # a failed first request is undone (_undo_request)
        assert int(cache.get_seq_length()) == 0


@pytest.mark.parametrize("scheme", ["int8-token", "kivi-small"])
def test_static_cache_prefill_attends_over_the_written_positions_only(scheme):
    """A prefill (an eager update of several tokens) is announced to transformers' mask code as the positions written
    so far plus its own (``get_mask_sizes``), and ``update`` returns those: a prompt on an empty cache then needs no
    mask (causal SDPA), and a second chunk a mask over its past and itself, not over all ``max_cache_len`` slots. A
    decode step keeps the whole slab, the same size at every step. The prompt's logits are ``DynamicCache``'s up to
    the quantization, and a prefill in two chunks gives ``QuantizedKVCache``'s in the same chunks (a windowed scheme
    flushes what each chunk completes, so chunks change what the prompt's early positions attend to)."""
    model = build("llama")
    ids = prompt()
    scheme = NAMED.get(scheme, scheme)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    assert cache.get_mask_sizes(PROMPT, 0) == (PROMPT, 0) and cache.get_mask_sizes(1, 0) == (MAX_LEN, 0)
    with torch.no_grad():
        whole = model(ids, **cache_kwargs(cache, model), use_cache=True).logits
        assert cache.get_mask_sizes(5, 0) == (PROMPT + 5, 0) and cache.get_mask_sizes(1, 0) == (MAX_LEN, 0)
        chunks = {}
        for name in ("static", "quantized"):
            c = (StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN) if name == "static"
                 else QuantizedKVCache(config=model.config, scheme=scheme))  # fmt: skip
            chunks[name] = torch.cat([model(part, **cache_kwargs(c, model), use_cache=True).logits
                                      for part in (ids[:, :24], ids[:, 24:])], dim=1)  # fmt: skip
        one = model(ids, **cache_kwargs(QuantizedKVCache(config=model.config, scheme=scheme), model), use_cache=True)
        exact = model(ids, **cache_kwargs(DynamicCache(config=model.config), model), use_cache=True).logits
    torch.testing.assert_close(whole, one.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunks["static"], chunks["quantized"], atol=1e-5, rtol=0)
    assert 0 < float((whole - exact).abs().max()) < 0.05


@pytest.mark.parametrize("scheme", ["int4-sinks", "kivi-sinks", "kvquant-block-small"])
@pytest.mark.parametrize("fused", [False, True], ids=["sdpa", "fused"])
def test_static_cache_sinks_filled_by_decode_steps_and_replayed(fused, scheme, monkeypatch):
    """A 2-token prompt under 4 (per-token) or 3 (windowed) sinks: decode steps fill the last sinks on the device (no
    host read), then quantize (per token), or go through the window and flush (windowed). The same tokens and logits
    as ``QuantizedKVCache``, eagerly; and steps recorded while the sinks still fill and after, replayed across the
    boundary and the flushes (``benchmarks/graph_replay.py``'s emulation of a CUDA graph), give the eager steps' logits
    bit for bit."""
    model, scheme = build("llama"), NAMED[scheme]
    ids, S = prompt()[:, :2], scheme.sinks
    reference = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=fused)
    for c in (reference, cache):
        install(c, scheme)
    want_seq, want = generate(model, reference, fused=fused, ids=ids)
    seq, got = generate(model, cache, fused=fused, ids=ids)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    tokens, R, blk = 2 + NEW - 1, scheme.residual, scheme.block
    quantized = tokens - S if blk == 1 else (tokens - S - R) // blk * blk
    assert int(cache.layers[0]._other_lens[0]) == S + (R + blk if blk > 1 else 0)
    assert int(cache.layers[0].lens[0]) == quantized

    logits, graphed = {}, []
    for mode in ("eager", "replayed"):  # positions 2 .. S - 1 (sinks; the second step recorded), then quantized
        c = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=fused,
                                   checks="lazy")  # fmt: skip
        install(c, scheme)
        logits[mode] = decode_steps(model, c, ids, 16, fused=fused, graphed=graphed,
                                    monkeypatch=monkeypatch if mode == "replayed" else None)  # fmt: skip
        tokens = 2 + 16
        assert int(c.layers[0].lens[0]) == (tokens - S if blk == 1 else (tokens - S - R) // blk * blk) > 0  # replayed too
    assert torch.equal(logits["replayed"], logits["eager"])
    if blk == 1:  # per token: a sink step is a variant of its own (the host's counts say which), as a flush is
        assert graphed[0].captured_at == {(0, 1): 2, (): 4}, graphed[0].captured_at


def test_windowed_pre_rope_tables_are_the_plans_rows():
    """A windowed pre-RoPE layer's RoPE tables cover the positions its attended slots hold (the quantized tokens at
    ``max_cache_len``), the rows ``plan(..., fused_decode=True)`` counts: they covered its block written ahead too,
    which at 820 tokens of blocks of 8 (816 quantized) doubled them, 2048 rows for the plan's 1024. That block, which
    nothing attends, is un-rotated at positions clamped to the last row, also with position ids ahead of the cache
    indices by as much as the tables allow."""
    from transformers import LlamaConfig

    from kvbits.schemes.accounting import rope_table_positions

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
    M, Q = 820, 816
    cache = StaticQuantizedKVCache(config=config, scheme=CHANNEL_PREROPE, max_cache_len=M)
    k = torch.randn(1, 2, 3, 32)
    for i in range(2):
        cache.update(k, k, i)
    planned = plan(config, context=M, scheme=CHANNEL_PREROPE, dtype_bytes=4, fused_decode=True)["rope_table_bytes"]
    rope = cache.layers[0].rope
    assert rope.positions == rope_table_positions(Q) == 1024 and cache.layers[0].key.codes.shape[2] == Q + 8
    assert cache.memory_report()["rope_table_bytes"] == rope.table_bytes == planned
    rope.start(torch.tensor([-(1024 - Q)]))  # position ids ahead by what the tables allow: slot Q - 1 at row 1023
    keys = torch.randn(1, 2, 8, 32)
    ahead = rope.unrotate(keys, torch.tensor(Q))  # rows 1024..1031 clamped to 1023, no IndexError
    assert ahead.shape == keys.shape and torch.isfinite(ahead).all()
    torch.testing.assert_close(rope.unrotate(keys[:, :, :1], torch.tensor(Q - 1)), ahead[:, :, :1])


@pytest.mark.parametrize("scheme", ["kivi-prerope", "kvquant-block-small"])
def test_windowed_pre_rope_cache_that_never_flushes_holds_no_tables(scheme, monkeypatch):
    """A windowed pre-RoPE cache whose ``max_cache_len`` never fills the window quantizes no key, and
    ``plan(fused_decode=True)`` counts no RoPE table for it: it held 1024-row tables all the same (131,072 bytes
    for kivi-prerope at ``max_cache_len`` 10 here), bytes the plan did not report. Now it builds none (its block written ahead, never attended, is quantized as it comes); its logits are still
    ``QuantizedKVCache``'s, eager and fused, and a replayed fused step (every step then quantizes the block ahead)
    gives the eager steps' bit for bit."""
    model, scheme = build("llama"), NAMED[scheme]
    M = scheme.sinks + scheme.residual + scheme.block - 2  # the window never fills: nothing flushes
    ids, steps = prompt()[:, :2], M - 2
    logits = {}
    for mode in ("quantized", "eager", "replayed", "sdpa"):
        c = (QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=True) if mode == "quantized" else
             StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=M, fused_decode=mode != "sdpa",
                                    checks="lazy"))  # fmt: skip
        install(c, scheme)
        logits[mode] = decode_steps(model, c, ids, steps, fused=mode != "sdpa",
                                    monkeypatch=monkeypatch if mode == "replayed" else None)  # fmt: skip
        if mode == "quantized":
            continue
        assert all(layer.rope is None for layer in c.layers) and int(c.layers[0].lens[0]) == 0
        planned = plan(model.config, context=M, batch=2, scheme=scheme, dtype_bytes=4, fused_decode=True)
        held = c.memory_report()
        assert held["rope_table_bytes"] == planned["rope_table_bytes"] == 0, held
        if mode == "eager":
            assert c.fused_report()["rope_table_bytes"] == 0
    torch.testing.assert_close(logits["eager"], logits["quantized"], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits["sdpa"], logits["quantized"], atol=1e-4, rtol=0)
    assert torch.equal(logits["replayed"], logits["eager"])


def test_static_cache_pre_rope_refusals():
    """Pre-RoPE keys need the model's RoPE as fixed tables on the device: no config, a partial rotary embedding, rope
    types whose tables depend on the sequence length, tables of another head dim and position ids that run past the
    tables are refused, each saying what was expected."""
    from transformers import LlamaConfig, StableLmConfig

    from kvbits.quant.rope import RotaryTables

    small = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    with pytest.raises(ValueError, match="pass config= \\(or rotary=\\)"):
        StaticQuantizedKVCache(num_layers=2, scheme=SINKS4_PREROPE, max_cache_len=16)
    with pytest.raises(ValueError, match="partial rotary embedding \\(4 of 16 channels\\)"):
        StaticQuantizedKVCache(config=StableLmConfig(**small, partial_rotary_factor=0.25), scheme=SINKS4_PREROPE,
                               max_cache_len=16)  # fmt: skip
    dynamic = LlamaConfig(**small, head_dim=32, rope_parameters={"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic' has tables that depend on the sequence length"):
        StaticQuantizedKVCache(config=dynamic, scheme=CHANNEL_PREROPE, max_cache_len=16)
    # a scheme without pre-RoPE keys asks for no tables
    assert StaticQuantizedKVCache(config=dynamic, scheme="int4-token", max_cache_len=16).layers[0].rotary is None

    wide = RotaryTables.from_config(LlamaConfig(**small, head_dim=64))
    cache = StaticQuantizedKVCache(num_layers=1, scheme=SINKS4_PREROPE, max_cache_len=16, rotary=wide)
    k = torch.randn(1, 2, 5, 32)
    with pytest.raises(ValueError, match="keys have head dim 32, the RoPE tables 64"):
        cache.update(k, k, 0)

    model = build("llama")
    cache = StaticQuantizedKVCache(config=model.config, scheme=SINKS4_PREROPE, max_cache_len=MAX_LEN)
    ids = prompt()[:, :4]
    P = 1024  # the tables' rows (kvbits.schemes.accounting.rope_table_positions(MAX_LEN))
    with torch.no_grad(), pytest.raises(ValueError, match=f"run {P} positions past the cache indices"):
        model(ids, **cache_kwargs(cache, model), position_ids=torch.arange(4)[None].expand(2, -1) + P, use_cache=True)
    cache.reset()
    with torch.no_grad():  # ahead by less than the tables' spare rows: taken, the offsets negative
        model(ids, **cache_kwargs(cache, model), position_ids=torch.arange(4)[None].expand(2, -1) + 100, use_cache=True)
    assert cache.layers[0].rope.offset.tolist() == [-100, -100] and cache.layers[0].rope.positions == P


@pytest.mark.parametrize("scheme", ["channel-prerope", "kivi-prerope", "kvquant-4", "kvquant-block-small"])
def test_static_cache_pre_rope_step_replayed_across_flushes(scheme, monkeypatch):
    """One fused decode step of pre-RoPE keys recorded (``benchmarks/graph_replay.py``'s emulation of a CUDA graph)
    and replayed across flushes of the window (the un-rotation at the flushed block's positions included), and
    KVQuant's calibrated per-token step (static ranges, codebooks, outliers): every replayed step's logits equal the
    eager steps' bit for bit, and the eager steps are ``QuantizedKVCache``'s."""
    model, scheme = build("qwen2"), get_scheme(NAMED.get(scheme, scheme))
    logits = {}
    for mode in ("quantized", "eager", "replayed"):  # flushes at the 8-token (channel) or 4-token (kivi) boundaries
        c = (QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=True) if mode == "quantized" else
             StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=True,
                                    checks="lazy"))  # fmt: skip
        install(c, scheme)
        logits[mode] = decode_steps(model, c, prompt(), NEW, fused=True,
                                    monkeypatch=monkeypatch if mode == "replayed" else None)  # fmt: skip
    torch.testing.assert_close(logits["eager"], logits["quantized"], atol=1e-4, rtol=0)
    assert torch.equal(logits["replayed"], logits["eager"])


def test_static_cache_calibrated_parameters(caplog):
    """KVQuant's recipe from a real ``kvbits calibrate`` artifact (``calibration=``): the tokens, logits and clip counts
    of ``QuantizedKVCache`` with the same artifact; the bytes are the plan's, its ``fixed`` the installed parameters,
    plus a static key range's row per sequence in the kernels' layout. Ranges narrowed by hand clip, counted alike on
    both caches, once per token (not for the sinks decode steps fill). Parameters installed after ``reset()`` are
    written in place (the addresses a captured step reads stay) and give what a fresh cache with them gives. A cache
    without its parameters says what is missing; one reserving positions past the calibrated context says so, once
    per artifact."""
    from kvbits.calibrate import calibrate

    model, scheme = build("llama"), get_scheme("kvquant-4")
    ids = torch.randint(1, VOCAB, (1, 200), generator=torch.Generator().manual_seed(7))
    art = calibrate(model, ids, "kvquant-4", context=64, windows=2, fisher=False)
    reference = QuantizedKVCache(config=model.config, scheme=scheme, calibration=art)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, calibration=art)
    want_seq, want = generate(model, reference, fused=False)
    seq, got = generate(model, cache, fused=False)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    report = cache.memory_report()
    at = plan(model.config, context=MAX_LEN, batch=2, scheme=scheme, dtype_bytes=4)
    rows = 2 * 2 * (2 * 2 * 32 * 2)  # layers x (scale, zero) x (B, H_kv, D) float16: the key range per sequence
    assert report["fixed_bytes"] == at["components"]["fixed"] > 0
    assert report["total_bytes"] == at["total_bytes"] + rows

    def counts(c):
        if isinstance(c, QuantizedKVCache):
            return [(r["clipped_keys"], r["clipped_values"]) for r in c.calibration_report()["layers"]]
        return [(r["clipped_keys"], r["clipped_values"]) for r in c.clipped()]

    # the same parameters with 4 sinks, key ranges halved: a 2-token prompt, whose last sinks decode steps fill
    sinks4 = replace(scheme, name="kvquant-4-sinks4", sinks=4)
    narrow, caches = {}, {}
    for name in ("quantized", "static", "fresh"):
        c = (QuantizedKVCache(config=model.config, scheme=sinks4) if name == "quantized" else
             StaticQuantizedKVCache(config=model.config, scheme=sinks4, max_cache_len=MAX_LEN))  # fmt: skip
        for i in range(2):
            qp = art.static_qparams(i, "key")
            args = (qp[0], qp[1]) if name == "static" else (qp[0] * 0.5, qp[1] * 0.5)  # static: halved after a reset
            c.set_static_qparams(i, "key", *args, codebook=art.codebook(i, "key"))
            c.set_static_qparams(i, "value", codebook=art.codebook(i, "value"))
        if name == "static":
            generate(model, c, fused=False)
            c.reset()
            slab, fixed = c.layers[0].key, c.layers[0]._fixed["key"]
            before = (slab.scale.data_ptr(), slab.codebook.data_ptr(), fixed["static_scale"].data_ptr())
            for i in range(2):
                qp = art.static_qparams(i, "key")
                c.set_static_qparams(i, "key", qp[0] * 0.5, qp[1] * 0.5)
            assert (slab.scale.data_ptr(), slab.codebook.data_ptr(), fixed["static_scale"].data_ptr()) == before
        narrow[name], caches[name] = generate(model, c, fused=False, ids=prompt()[:, :2]), c
    for name in ("static", "fresh"):
        assert torch.equal(narrow[name][0], narrow["quantized"][0])
        torch.testing.assert_close(narrow[name][1], narrow["quantized"][1], atol=1e-4, rtol=0)
        assert counts(caches[name]) == counts(caches["quantized"]), (name, counts(caches[name]))
    assert all(k > 0 for k, _ in counts(caches["static"])), counts(caches["static"])

    bare = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    with pytest.raises(ValueError, match="needs calibrated parameters \\(key static scales, key static zero-points, key "
                                         "NUQ codebook, value NUQ codebook\\)"):  # fmt: skip
        generate(model, bare, fused=False)
    with pytest.raises(ValueError, match="a codebook needs kind='nuq'"):
        StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=8).set_static_qparams(
            0, "key", codebook=art.codebook(0, "key"))  # fmt: skip
    longest = int(art.max_calibrated_length)
    assert MAX_LEN < longest < 100  # the caches above reserve no position past it: nothing said
    assert not [r for r in caplog.records if "max_calibrated_length" in r.getMessage()]
    with caplog.at_level("WARNING", logger="kvbits.cache.static"):
        for _ in range(2):
            StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=100, calibration=art)
    said = [r.getMessage() for r in caplog.records if "max_calibrated_length" in r.getMessage()]
    assert len(said) == 1 and f"max_cache_len=100 reserves positions past the {longest}-token context" in said[0]
    assert said[0].endswith("Calibrate with --context 100 to cover every position.")  # the report's advice


@pytest.mark.parametrize(
    ("scheme", "fused"),
    [(s, f) for s in ("int4-token", "kivi-prerope", "kvquant-4") for f in (False, True)]
    + [("kvquant-block-small", True), ("StaticCache", False)],
)  # StaticCache holds no packed slots: its steps attend through SDPA
def test_left_padded_batch_replayed_from_one_captured_step(scheme, fused, monkeypatch):
    """``GraphedDecode`` with a left-padded batch: each call passes the grown padding mask and each row's position ids;
    the captured step reads them from its own tensors (the mask one of ``max_cache_len`` columns), and transformers
    builds the 4D mask without a host read, as under a CUDA capture. Every replayed step's logits equal the eager steps'
    bit for bit (kvbits' caches, KIVI's flushes, KVQuant's pre-RoPE offsets and its block recipe's sinks beside the
    window included, and transformers' ``StaticCache``), and the eager steps are ``QuantizedKVCache``'s."""
    from transformers import StaticCache

    model = build("qwen2")
    ids = prompt(batch=3, seed=4)
    ids[0, :7] = 0
    ids[2, :3] = 0
    mask = (ids != 0).long()
    scheme = NAMED.get(scheme, scheme)

    def make(mode):
        if scheme == "StaticCache":
            return (DynamicCache(config=model.config) if mode == "quantized" else
                    StaticCache(config=model.config, max_cache_len=MAX_LEN))  # fmt: skip
        c = (QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused) if mode == "quantized" else
             StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN, fused_decode=fused,
                                    checks="lazy"))  # fmt: skip
        if mode == "quantized":  # sinks as the slabs keep them: not widened for the padded rows
            c._padded_sink_slots = lambda *args, **kwargs: 0
        install(c, get_scheme(scheme))
        return c

    logits = {mode: decode_steps(model, make(mode), ids, NEW, fused=fused, attention_mask=mask,
                                 monkeypatch=monkeypatch if mode == "replayed" else None)
              for mode in ("quantized", "eager", "replayed")}  # fmt: skip
    torch.testing.assert_close(logits["eager"], logits["quantized"], atol=1e-4, rtol=0)
    assert torch.equal(logits["replayed"], logits["eager"])


def test_graphed_decode_refuses_inputs_it_cannot_replay(monkeypatch):
    """``GraphedDecode``'s inputs: ``position_ids`` of another shape than ``(B, 1)``, a mask that is not ``(B, L)``, a
    mask beside a cache without a fixed length, a mask longer than the cache, and a replayed call that drops the mask
    or position ids the step was captured with are refused with what was expected, and not counted."""
    from pathlib import Path

    from kvbits.evaluate.graphs import GraphedDecode

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    model = build("llama")
    tok, cpos = torch.ones(2, 1, dtype=torch.long), torch.tensor([4])
    step = GraphedDecode(model, eager=1, capture=tape_capture)
    with pytest.raises(ValueError, match="position_ids must be \\(B, 1\\) = \\(2, 1\\), got \\(2, 2\\)"):
        step(tok, cache_position=cpos, position_ids=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be \\(B, L\\) with B = 2"):
        step(tok, cache_position=cpos, attention_mask=torch.ones(3, 5, dtype=torch.long))
    ids, mask = prompt()[:, :4], torch.ones(2, 5, dtype=torch.long)
    cache = QuantizedKVCache(config=model.config, scheme="int4-token")
    with torch.no_grad():
        model(ids, **cache_kwargs(cache, model), use_cache=True)
        step = GraphedDecode(model, eager=1, capture=tape_capture)
        step(tok, cache_position=cpos, **cache_kwargs(cache, model), attention_mask=mask)  # eager: any cache
        with pytest.raises(ValueError, match="needs a cache of fixed length .* got QuantizedKVCache"):
            step(tok, cache_position=cpos + 1, **cache_kwargs(cache, model), attention_mask=torch.ones(2, 6, dtype=torch.long))
    cache = StaticQuantizedKVCache(config=model.config, scheme="int4-token", max_cache_len=8, checks="lazy")
    with torch.no_grad():
        model(ids, **cache_kwargs(cache, model), use_cache=True)
        step = GraphedDecode(model, eager=1, capture=tape_capture)
        for i in range(2):  # the first eagerly, the second captured
            step(tok, cache_position=cpos + i, **cache_kwargs(cache, model), attention_mask=torch.ones(2, 5 + i, dtype=torch.long))
        assert step.captured and step.mask.shape == (2, 8)
        with pytest.raises(ValueError, match="captured step decodes tokens \\(2, 1\\), with an attention mask"):
            step(tok, cache_position=cpos + 2, **cache_kwargs(cache, model))
        with pytest.raises(ValueError, match="attention_mask covers 9 positions, past the cache's 8 slots"):
            step(tok, cache_position=cpos + 2, **cache_kwargs(cache, model), attention_mask=torch.ones(2, 9, dtype=torch.long))
        # refused calls are not counted, here or on the cache's host
        assert step.calls == 2 and step.replays == 0 and cache.layers[0].tokens_written == 6


def test_graphed_decode_refuses_another_cache_after_its_capture(monkeypatch):
    """A captured step writes the slabs it was captured on: a call passing another cache replayed it into the first
    cache (its length 6 -> 7) and counted the step on the other (tokens_written 5, length 4), logits 0.52 away from
    an eager step on that cache. Now refused, nothing counted or replayed."""
    from pathlib import Path

    from kvbits.evaluate.graphs import GraphedDecode

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    model = build("llama")
    tok = torch.ones(2, 1, dtype=torch.long)
    caches = [StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=16, checks="lazy")
              for _ in range(2)]  # fmt: skip
    with torch.no_grad():
        for seed, cache in enumerate(caches):
            model(prompt(seed=seed + 1)[:, :4], **cache_kwargs(cache, model), use_cache=True)
        step = GraphedDecode(model, eager=1, capture=tape_capture)
        for i in range(2):  # the first eagerly, the second captured
            step(tok, cache_position=torch.tensor([4 + i]), **cache_kwargs(caches[0], model))
        with pytest.raises(ValueError, match="writes the cache it was captured with .* got another"):
            step(tok, cache_position=torch.tensor([4]), **cache_kwargs(caches[1], model))
        assert step.calls == 2 and step.replays == 0
        assert [(c.layers[0].tokens_written, int(c.layers[0].length)) for c in caches] == [(6, 6), (4, 4)]
        step(tok, cache_position=torch.tensor([6]), **cache_kwargs(caches[0], model))  # its own cache: replayed
        assert step.replays == 1 and int(caches[0].layers[0].length) == 7


def test_graphed_decode_forgets_a_failed_captures_mask(monkeypatch):
    """A first capture with a padding mask that failed left its mask tensor behind; the capture retried without a mask
    then refused the next unmasked call ("captured ... with an attention mask") and accepted a call with a padding
    mask, copying it into a tensor the captured step never reads (the padding ignored). Now the retried capture holds
    no mask: unmasked calls replay, a masked one is refused before anything is counted."""
    from pathlib import Path

    from kvbits.evaluate.graphs import GraphedDecode

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    failures = [RuntimeError("capture failed")]

    def flaky(step, device):
        if failures:
            raise failures.pop()
        return tape_capture(step, device)

    model = build("llama")
    tok = torch.ones(2, 1, dtype=torch.long)
    cache = StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=16, checks="lazy")
    kw = cache_kwargs(cache, model)
    with torch.no_grad():
        model(prompt()[:, :4], **kw, use_cache=True)
        step = GraphedDecode(model, eager=1, capture=flaky)
        step(tok, cache_position=torch.tensor([4]), **kw)
        with pytest.raises(RuntimeError, match="capture failed"):
            step(tok, cache_position=torch.tensor([5]), attention_mask=torch.ones(2, 6, dtype=torch.long), **kw)
        step(tok, cache_position=torch.tensor([5]), **kw)  # captured, without a mask
        assert step.captured and step.mask is None
        step(tok, cache_position=torch.tensor([6]), **kw)
        assert step.replays == 1
        padded = torch.ones(2, 8, dtype=torch.long)
        padded[0, :3] = 0
        with pytest.raises(ValueError, match="captured step decodes tokens \\(2, 1\\), without an attention mask"):
            step(tok, cache_position=torch.tensor([7]), attention_mask=padded, **kw)
        assert step.calls == 3 and step.replays == 1 and cache.layers[0].tokens_written == 7


def test_a_cuda_capture_and_its_replays_run_on_the_steps_device_not_the_current_one(monkeypatch):
    """``kvbits speed --device cuda:1 --static --graphs`` while ``cuda:0`` is current: ``capture_cuda_graph`` synced,
    captured (on ``torch.cuda.graph``'s default stream) and replayed on the current device, so the step's kernels on
    ``cuda:1`` ran outside the capture. ``GraphedDecode`` now passes its tokens' device, and the capture, its stream
    and every replay run under ``torch.cuda.device`` of it. CUDA is emulated by recorders (no GPU here)."""
    import contextlib

    from kvbits.evaluate import graphs

    current, log = [0], []

    class device:  # torch.cuda.device: the device current inside
        def __init__(self, d):
            self.index = torch.device(d).index

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    class CUDAGraph:
        def replay(self):
            log.append(("replay", current[0]))

    @contextlib.contextmanager
    def graph(g, stream=None, **kwargs):
        log.append(("capture", current[0], stream))
        yield

    def synchronize(d=None):
        log.append(("synchronize", current[0] if d is None else torch.device(d).index))

    for name, fake in (("device", device), ("CUDAGraph", CUDAGraph), ("graph", graph), ("synchronize", synchronize),
                       ("Stream", lambda d=None: ("stream", current[0] if d is None else torch.device(d).index))):
        monkeypatch.setattr(torch.cuda, name, fake)

    def step():
        log.append(("step", current[0]))
        return torch.zeros(1)

    logits, replay = graphs.capture_cuda_graph(step, torch.device("cuda", 1))
    assert torch.equal(logits, torch.zeros(1))
    assert current == [0]  # restored
    replay()
    assert current == [0] and log == [("synchronize", 1), ("capture", 1, ("stream", 1)), ("step", 1), ("replay", 1),
                                      ("replay", 1)], log  # fmt: skip
    seen = []  # GraphedDecode gives the registered capture its tokens' device
    monkeypatch.setitem(graphs.CAPTURES, "cpu", lambda step, dev: (seen.append(dev), (step(), lambda: None))[1])
    model = build("llama")
    cache = StaticQuantizedKVCache(config=model.config, scheme="int4-token", max_cache_len=8, checks="lazy")
    kw, tok = cache_kwargs(cache, model), torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        model(prompt()[:, :4], **kw, use_cache=True)
        step = graphs.GraphedDecode(model, eager=1)
        for i in range(2):
            step(tok, cache_position=torch.tensor([4 + i]), **kw)
    assert step.captured and seen == [torch.device("cpu")]


def test_windowed_steps_quantize_only_when_they_flush(monkeypatch):
    """While the host's counts are the device's, a windowed decode step quantizes its block only when it flushes
    (decided on the host, no device read), and ``GraphedDecode`` captures the plain step and the flushing one apart
    (each after one eager run), replays the one the counts call for, and counts the replays, so the counts stay the
    device's. A step captured without that bookkeeping (a plain capture) quantizes the block at every step instead, so
    its replays are right across flushes, and so are the eager steps after them. All of these give the logits of
    ``QuantizedKVCache``; a replay past ``max_cache_len`` is refused before anything runs."""
    from pathlib import Path

    from kvbits.cache import static as static_module

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    model, ids = build("qwen2"), prompt()
    quantized = []  # one entry per quantize_pack call (a side of a layer)
    real = static_module.quantize_pack
    monkeypatch.setattr(static_module, "quantize_pack", lambda *a, **k: (quantized.append(1), real(*a, **k))[1])

    def static(max_cache_len: int = MAX_LEN) -> StaticQuantizedKVCache:
        return StaticQuantizedKVCache(config=model.config, scheme=KIVI_SMALL, max_cache_len=max_cache_len,
                                      fused_decode=True, checks="lazy")  # fmt: skip

    want = decode_steps(model, QuantizedKVCache(config=model.config, scheme=KIVI_SMALL, fused_decode=True), ids, NEW,
                        fused=True)  # fmt: skip
    # KIVI_SMALL: 8 recent tokens and blocks of 4; the 40-token prompt flushes 32, the decode flushes at 44, 48, 52
    quantized.clear()
    eager = static()
    got = decode_steps(model, eager, ids, NEW, fused=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert len(quantized) == 2 * 2 * (1 + 3)  # layers x sides x (the prompt's blocks, then each flush)
    assert all(layer.host_counts and layer._host_qlen == int(layer.qlen) == 44 for layer in eager.layers)

    steps: list = []
    cache = static()
    replayed = decode_steps(model, cache, ids, NEW, fused=True, monkeypatch=monkeypatch, graphed=steps)
    assert torch.equal(replayed, got)
    (step,) = steps
    # call 1 eager, 2 captured (plain), 4 the first flush (eager), 8 the second (captured), the others replayed
    assert step.captured_at == {(): 2, (0, 1): 8} and step.replays == NEW - 4
    assert all(layer.tokens_written == PROMPT + NEW and layer.host_counts for layer in cache.layers)
    assert all(layer._host_qlen == int(layer.qlen) == 44 for layer in cache.layers)

    # a plain capture (no bookkeeping) at step 1, replayed over steps 2 .. NEW - 2 (flushes at 3 and 7), the last
    # step eager again (a flush); then, after reset(), a second request replays the same graph
    raw = static()
    kw = cache_kwargs(raw, model)
    token, position = torch.zeros((2, 1), dtype=torch.long), torch.zeros(1, dtype=torch.long)

    def run() -> torch.Tensor:
        return model(token, **kw, use_cache=True, cache_position=position, position_ids=position[None]).logits

    replay = None
    for request in range(2):
        out = []
        with torch.no_grad(), attention(model, True):
            nxt = model(ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
            for i in range(NEW):
                token.copy_(nxt)
                position.fill_(PROMPT + i)
                if i == 1 and replay is None:
                    logits = captured = (recorded := tape_capture(run))[0]
                    replay = recorded[1]
                elif 1 <= i < NEW - 1:
                    replay()
                    logits = captured
                else:
                    logits = run()
                out.append(logits[:, -1].clone())
                nxt = logits[:, -1:].argmax(-1)
        assert torch.equal(torch.stack(out), got), request
        assert not any(layer.host_counts for layer in raw.layers)  # the replays are not counted, after reset() too
        raw.reset()

    short = static(PROMPT + 4)
    steps.clear()
    with pytest.raises(ValueError, match="44 tokens cached \\+ 1 new > max_cache_len=44"):  # the 5th step's replay
        decode_steps(model, short, ids, 5, fused=True, monkeypatch=monkeypatch, graphed=steps)
    assert steps[0].calls == 4 and all(layer.tokens_written == PROMPT + 4 for layer in short.layers)


def test_static_cache_host_counts_across_requests_and_unseen_replays(monkeypatch):
    """The host's counts where they can go wrong: after ``reset()`` a 1-token prompt's sink step starts from no sinks
    (the sink count is reset with the slabs); after a plain capture's replays, which the host does not count, an
    update of several tokens reads the length first (its mask and K/V cover every position written); and a
    ``GraphedDecode`` whose variants were told apart by host counts that are since off refuses to replay. Each gives
    ``QuantizedKVCache``'s logits or a clear error."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    # a second request of one token after reset(): the sink step, then the sinks filled by decode steps
    model, one = build("llama"), prompt()[:, :1]
    cache = StaticQuantizedKVCache(config=model.config, scheme=SINKS4, max_cache_len=MAX_LEN, fused_decode=True)
    generate(model, cache, fused=True)
    cache.reset()
    seq, got = generate(model, cache, fused=True, ids=one)
    fresh = StaticQuantizedKVCache(config=model.config, scheme=SINKS4, max_cache_len=MAX_LEN, fused_decode=True)
    want_seq, want = generate(model, fresh, fused=True, ids=one)
    assert torch.equal(seq, want_seq) and torch.equal(got, want)
    # the tails' lengths too (the torch reference reads a sink slab no further than it holds; Triton's kernel would)
    assert all(torch.equal(a._other_lens, b._other_lens) and torch.equal(a.lens, b.lens)
               for a, b in zip(cache.layers, fresh.layers))  # fmt: skip

    # replays the host does not see, then a 3-token chunk and single steps, eagerly (KIVI_SMALL: flushes among them)
    model, ids = build("qwen2"), prompt()
    tokens = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    plan_ = [1, 1, 1, 1, 1, 3, 1, 1, 1]  # tokens per call; calls 1-4 after the capture at call 1 are replayed
    logits = {}
    for name in ("quantized", "static"):
        c = (QuantizedKVCache(config=model.config, scheme=KIVI_SMALL) if name == "quantized" else
             StaticQuantizedKVCache(config=model.config, scheme=KIVI_SMALL, max_cache_len=MAX_LEN, checks="lazy"))  # fmt: skip
        kw, out, at = cache_kwargs(c, model), [], 0
        token, position = torch.zeros((2, 1), dtype=torch.long), torch.zeros(1, dtype=torch.long)

        def run(token=token, kw=kw, position=position) -> torch.Tensor:  # this cache's captured inputs
            return model(token, **kw, use_cache=True, cache_position=position, position_ids=position[None]).logits

        with torch.no_grad():
            model(ids, **kw, use_cache=True)
            for call, n in enumerate(plan_):
                chunk, pos0 = tokens[:, at : at + n], PROMPT + at
                if n == 1:
                    token.copy_(chunk)
                    position.fill_(pos0)
                    if name == "static" and call == 1:
                        captured, replay = tape_capture(run)
                        lg = captured
                    elif name == "static" and 1 < call < 5:
                        replay()
                        lg = captured
                    else:
                        lg = run()
                else:
                    cpos = torch.arange(pos0, pos0 + n)
                    lg = model(chunk, **kw, use_cache=True, cache_position=cpos, position_ids=cpos[None]).logits
                out.append(lg[:, -1].clone())
                at += n
        logits[name] = torch.stack(out)
        if name == "static":
            assert not any(layer.host_counts for layer in c.layers) and c.layers[0].tokens_written == PROMPT + at
    torch.testing.assert_close(logits["static"], logits["quantized"], atol=1e-4, rtol=0)

    # GraphedDecode's variants, then a plain capture of the same cache: refused, not replayed wrong
    steps: list = []
    cache = StaticQuantizedKVCache(config=model.config, scheme=KIVI_SMALL, max_cache_len=MAX_LEN, fused_decode=True,
                                   checks="lazy")  # fmt: skip
    decode_steps(model, cache, ids, 3, fused=True, monkeypatch=monkeypatch, graphed=steps)
    kw, tok, cpos = cache_kwargs(cache, model), torch.ones((2, 1), dtype=torch.long), torch.tensor([PROMPT + 3])
    with torch.no_grad(), attention(model, True):
        tape_capture(lambda: model(tok, **kw, use_cache=True, cache_position=cpos, position_ids=cpos[None]).logits)
        assert not any(layer.host_counts for layer in cache.layers)
        with pytest.raises(RuntimeError, match="host counts are off since this step was captured"):
            steps[0](tok, cache_position=cpos + 1, **kw)


def test_step_variant_from_the_first_update_on():
    """``step_variant()`` says which layers' next decode step is not their plain one, from the host's counts, before any
    update too: a per-token layer with ``sinks`` writes its first ``sinks`` tokens as sinks (a 1-token prompt's step
    included), a windowed layer's step differs only when it flushes, and a scheme without either never differs."""
    model = build("llama")
    layers = tuple(range(model.config.num_hidden_layers))
    k = torch.randn(1, model.config.num_key_value_heads, 1, model.config.head_dim)
    sinks = StaticQuantizedKVCache(config=model.config, scheme=SINKS4, max_cache_len=MAX_LEN)
    seen = []
    for _ in range(SINKS4.sinks + 2):
        seen.append(sinks.step_variant())
        for i in layers:
            sinks.update(k, k, i)
    assert seen == [layers] * SINKS4.sinks + [(), ()]

    kivi = StaticQuantizedKVCache(config=model.config, scheme=KIVI_SMALL, max_cache_len=MAX_LEN)
    window, flushes = KIVI_SMALL.residual + KIVI_SMALL.block, []
    for t in range(window + 2 * KIVI_SMALL.block):
        if kivi.step_variant():
            assert kivi.step_variant() == layers
            flushes.append(t)
        for i in layers:
            kivi.update(k, k, i)
    assert flushes == [window - 1, window - 1 + KIVI_SMALL.block, window - 1 + 2 * KIVI_SMALL.block]
    assert int(kivi.layers[0].qlen) == 3 * KIVI_SMALL.block

    plain = StaticQuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=MAX_LEN)
    assert plain.step_variant() == ()


def test_a_failed_capture_leaves_the_host_counts_the_devices(monkeypatch):
    """A CUDA capture records kernels without running them: one that fails part-way (here at layer 1's update, with
    every device tensor as before, as after a refused capture) must leave the host's counts where the device's are.
    They were one step ahead on the layers it had passed (layer 0: 42 tokens counted, 41 written), so KIVI's flush came
    a token early on that layer and the later logits were another cache's (28 % of them off, by up to 2.4e-3)."""
    from pathlib import Path

    from kvbits.evaluate.graphs import GraphedDecode

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from graph_replay import tape_capture

    model, ids = build("qwen2"), prompt()
    want = decode_steps(model, QuantizedKVCache(config=model.config, scheme=KIVI_SMALL, fused_decode=True), ids, NEW,
                        fused=True)  # fmt: skip
    cache = StaticQuantizedKVCache(config=model.config, scheme=KIVI_SMALL, max_cache_len=MAX_LEN, fused_decode=True,
                                   checks="lazy")  # fmt: skip
    failed: list[int] = []

    def capture(step, device):
        if failed:
            return tape_capture(step, device)
        failed.append(1)
        held = [(t, t.clone()) for layer in cache.layers for t in layer.tensors()]

        def refused(*args, **kwargs):
            raise RuntimeError("operation not permitted when stream is capturing")

        cache.layers[1].update = refused
        try:
            step()
        finally:
            del cache.layers[1].update
            for t, before in held:  # nothing ran on the device
                t.copy_(before)
        raise AssertionError("unreachable")

    step, kw, got = GraphedDecode(model, eager=1, capture=capture), cache_kwargs(cache, model), []
    with torch.no_grad(), attention(model, True):
        nxt = model(ids, **kw, use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(NEW):
            cpos = torch.tensor([ids.shape[1] + i])
            if i == 1:
                with pytest.raises(RuntimeError, match="stream is capturing"):
                    step(nxt, cache_position=cpos, **kw)
                assert [layer.tokens_written for layer in cache.layers] == [int(cache.layers[0].length)] * 2 == [41] * 2
            lg = step(nxt, cache_position=cpos, **kw).logits
            got.append(lg[:, -1].clone())
            nxt = lg[:, -1:].argmax(-1)
    assert step.captured and step.calls == NEW
    torch.testing.assert_close(torch.stack(got), want, atol=1e-4, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize(("scheme", "fused"), [("int8-token", False), ("kivi-small", False),
                                               ("int4-sinks-prerope", False), ("kivi-small", True)])  # fmt: skip
def test_beam_search_reorders_the_slabs_in_place(scheme, fused):
    """``generate(num_beams=3)`` on a left-padded batch: the same sequences and scores as ``QuantizedKVCache`` (a
    windowed scheme flushing during the decode, pre-RoPE keys with sinks). ``reorder_cache`` raised
    ``NotImplementedError`` after the beams' prefill (the cache then held the 6 beam rows, and a plain retry on it was
    refused for its batch); it now gathers every sequence's rows in place: the slabs keep their addresses. A no-op
    reorder gives other sequences (checked when this was written), so the beams do move."""
    model = build("llama")
    scheme = NAMED.get(scheme, scheme)
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    static = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=32)
    addresses, reorder = [], static.reorder_cache

    def reorder_seen(beam_idx):
        addresses.append([t.data_ptr() for layer in static.layers for t in layer.tensors()])
        reorder(beam_idx)

    static.reorder_cache = reorder_seen
    outs, dynamic = [], QuantizedKVCache(config=model.config, scheme=scheme)
    dynamic._padded_sink_slots = lambda *args, **kwargs: 0  # sinks as the slabs keep them: not widened for row 0's pads
    for cache in (static, dynamic):
        with attention(model, fused):
            outs.append(model.generate(ids, attention_mask=mask, **cache_kwargs(cache, model), max_new_tokens=12,
                                       num_beams=3, do_sample=False, pad_token_id=0, output_scores=True,
                                       return_dict_in_generate=True))  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(outs[0].sequences_scores, outs[1].sequences_scores, rtol=0, atol=1e-5)
    assert static.batch_size == 6 and len(addresses) >= 10
    assert all(a == addresses[0] for a in addresses)
    assert addresses[0] == [t.data_ptr() for layer in static.layers for t in layer.tensors()]
    with pytest.raises(ValueError, match=r"layer 0: beam_idx must be \(6,\), one index per cached sequence, got \(2,\)"):
        static.reorder_cache(torch.tensor([0, 1]))


def test_reorder_cache_refuses_non_integer_beam_idx():
    """``reorder_cache`` checked only ``beam_idx``'s shape: a float, bool or uint8 index reached ``index_select``, which
    said only "index_select(): Expected dtype int32 or int64 for index" (a ``RuntimeError`` naming neither the cache
    nor the layer). It is a ``TypeError`` naming the layer now, before anything is gathered; int32 and an index on
    another device are taken (copied to the slabs' device)."""
    cache = StaticQuantizedKVCache(num_layers=2, scheme="int4-token", max_cache_len=16)
    k = torch.randn(2, 2, 3, 32)
    for i in range(2):
        cache.update(k + i, k, i)
    before = [t.clone() for layer in cache.layers for t in layer.materialize()]
    for bad in (torch.tensor([1.0, 0.0]), torch.tensor([True, False]), torch.tensor([1, 0], dtype=torch.uint8)):
        with pytest.raises(TypeError, match=f"layer 0: beam_idx must hold integer batch indices.*got dtype {bad.dtype}"):
            cache.reorder_cache(bad)
    assert all(torch.equal(a, b) for a, b in zip((t for layer in cache.layers for t in layer.materialize()), before))
    cache.reorder_cache(torch.tensor([1, 0], dtype=torch.int32))
    assert torch.equal(cache.layers[0].materialize()[0][0], before[0][1])


def test_reorder_cache_refuses_out_of_range_beam_idx_on_the_host():
    """An index outside the cached batch (negative, or past it) reached ``index_select``, which said only "index out
    of range in self" (an ``IndexError`` naming neither the cache, the layer nor the batch). A CPU index is
    range-checked first now (it is on the host: no device sync): a ``ValueError`` naming the layer and the range,
    before anything is gathered."""
    cache = StaticQuantizedKVCache(num_layers=2, scheme="int4-token", max_cache_len=16)
    k = torch.randn(2, 2, 3, 32)
    for i in range(2):
        cache.update(k + i, k, i)
    before = [t.clone() for layer in cache.layers for t in layer.materialize()]
    for bad, lo, hi in (([1, -1], -1, 1), ([0, 2], 0, 2), ([-2, 0], -2, 0)):
        with pytest.raises(ValueError, match=rf"layer 0 reorder_cache: beam_idx must index the cached batch of 2 "
                                             rf"sequences \(0\.\.1\), got indices from {lo} to {hi}"):  # fmt: skip
            cache.reorder_cache(torch.tensor(bad))
    assert all(torch.equal(a, b) for a, b in zip((t for layer in cache.layers for t in layer.materialize()), before))
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache.layers[0].materialize()[0][0], before[0][1])


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["int8-token", "kivi-small"])
def test_reset_then_a_request_of_another_length_or_batch(scheme):
    """After ``reset()`` a request of another prompt length decodes as on a fresh cache; one of another batch is
    refused by name (the slabs hold the first request's batch, at addresses a captured step reads), where the
    message was the bare "key_states must be (B=2, H_kv=2, q, D=32), got (3, 2, 5, 32)", and the cache goes on serving
    its batch."""
    model = build("llama")
    scheme = NAMED.get(scheme, scheme)
    cache = StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN)
    generate(model, cache, fused=False)
    cache.reset()
    short = prompt()[:, : PROMPT // 2]
    want = generate(model, StaticQuantizedKVCache(config=model.config, scheme=scheme, max_cache_len=MAX_LEN),
                    fused=False, ids=short)  # fmt: skip
    got = generate(model, cache, fused=False, ids=short)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cache.reset()
    with pytest.raises(ValueError, match=r"layer 0: key_states \(3, 2, 5, 32\): StaticQuantizedKVCache cannot take 3 "
                                         r"sequences \(change its batch\): its slabs hold the batch of 2 of their first "
                                         r"update.*new cache"):  # fmt: skip
        generate(model, cache, fused=False, ids=torch.randint(1, VOCAB, (3, 5)))
    assert cache.get_seq_length() == 0 and cache.batch_size == 2
    got = generate(model, cache, fused=False, ids=short)
    assert torch.equal(got[0], want[0])


def test_integer_zero_point_clips_are_counted_as_the_quantized_cache_counts_them():
    """vLLM's integer zero-points (dynamic scales) clip a token whose range excludes 0: the zero-point clamps to code 0
    and the top of the range is lost (keys in [5, 6] decode to at most 1). ``QuantizedKVCache.calibration_report()``
    counted all 160 such keys; ``StaticQuantizedKVCache.clipped()`` said 0 for the same codes (it counted static
    scales' clips only). Per-token and windowed, prefill and decode steps alike."""
    spec = TensorSpec(kind="int", bits=8, fmt=None, granularity="token", integer_zero=True)
    g = torch.Generator().manual_seed(0)
    for scheme in (KVScheme("vz", key=spec, value=spec), KVScheme("vz-window", key=spec, value=spec, residual=2, block=2)):
        dyn = QuantizedKVCache(num_layers=1, scheme=scheme)
        cache = StaticQuantizedKVCache(num_layers=1, scheme=scheme, max_cache_len=12)
        for q in (5, 1, 1, 1, 3):
            k, v = torch.rand(1, 2, q, 16, generator=g) + 5.0, torch.randn(1, 2, q, 16, generator=g)
            want, _ = dyn.update(k, v, 0)
            got, _ = cache.update(k, v, 0)
            torch.testing.assert_close(got[:, :, : want.shape[2]], want, atol=0, rtol=0)
        report = dyn.calibration_report()["layers"][0]
        assert report["clipped_keys"] > 0 and report["clipped_values"] == 0
        assert cache.clipped() == [{"layer": 0, "clipped_keys": report["clipped_keys"], "clipped_values": 0}]


@pytest.mark.parametrize("window", [False, True])
def test_static_cache_calibration_report_is_the_quantized_caches(window: bool):
    """``StaticQuantizedKVCache`` had ``clipped()`` and no ``calibration_report()``: ``add_clipping`` (kvbits eval's
    and needle's clipped fractions) added nothing for it, silently, and neither the elements quantized nor the
    positions past the calibrated context were reported. Now its report has ``QuantizedKVCache``'s fields and, for the
    same K/V and artifact, its values (static FP8 scales and 2 sinks; KVQuant's block recipe: NUQ codebooks, a flush
    window of 4-token blocks, 3 sinks): here 24 positions against a 16-token calibration, K/V far beyond the FP8
    scales (they clip)."""
    from kvbits.calibrate import calibrate
    from kvbits.evaluate.measures import add_clipping

    model = build("llama")
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    scheme = KVQUANT_BLOCK if window else replace(get_scheme("fp8-e4m3"), name="fp8-sinks2", sinks=2)
    ids = torch.randint(1, VOCAB, (1, 64), generator=torch.Generator().manual_seed(3))
    art = calibrate(model, ids, scheme, context=16, windows=2, fisher=False)
    dyn = QuantizedKVCache(config=cfg, scheme=scheme, calibration=art)
    cache = StaticQuantizedKVCache(config=cfg, scheme=scheme, max_cache_len=32, calibration=art)
    assert cache.calibration_report()["layers"][0] == {
        "layer": 0, "clipped_keys": 0, "clipped_values": 0, "quantized_keys": 0, "quantized_values": 0,
        "max_position": -1, "positions_beyond_calibrated": 0,
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for q in (10, 1, 1, 11, 1):
        for i in range(cfg.num_hidden_layers):
            k, v = torch.randn(2, H, q, D, generator=g) * 50, torch.randn(2, H, q, D, generator=g) * 50
            dyn.update(k, v, i)
            cache.update(k, v, i)
    want, got = dyn.calibration_report(), cache.calibration_report()
    assert got == want, (got, want)
    assert got["max_calibrated_length"] == 16
    row = got["layers"][0]
    assert row["max_position"] == 23 and row["positions_beyond_calibrated"] == 8
    assert window or (row["clipped_keys"] > 0 and row["clipped_values"] > 0)  # NUQ ranges per block/token: none
    assert row["quantized_keys"] == (20 if window else 22) * 2 * H * D
    totals: dict[str, int] = {}
    add_clipping(totals, cache)
    assert totals["keys"] == sum(r["clipped_keys"] for r in want["layers"])
    assert totals["keys_elements"] == sum(r["quantized_keys"] for r in want["layers"]) > 0


def test_static_cache_calibration_report_reads_each_layer_back_once_per_counter(monkeypatch):
    """``calibration_report`` read each layer's ``length`` twice (its own ``int(layer.length)`` and again in
    ``quantized_tokens``) and its ``clipped`` pair element by element: 4 ``int(tensor)`` host reads per layer. Now
    the length once (handed to ``quantized_tokens``) and the clipped pair in one ``tolist``: 1 per layer, same rows."""
    cfg = build("llama").config
    H, D = cfg.num_key_value_heads, cfg.head_dim
    cache = StaticQuantizedKVCache(config=cfg, scheme="int8-token", max_cache_len=32)
    g = torch.Generator().manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        cache.update(torch.randn(1, H, 5, D, generator=g), torch.randn(1, H, 5, D, generator=g), i)
    cache.check_inputs()
    reads = []
    real_int = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: reads.append(t.shape) or real_int(t))
    report = cache.calibration_report()
    assert len(reads) == cfg.num_hidden_layers, reads
    assert report["layers"][0] == {"layer": 0, "clipped_keys": 0, "clipped_values": 0, "quantized_keys": 5 * H * D,
                                   "quantized_values": 5 * H * D, "max_position": 4}  # fmt: skip


@pytest.mark.parametrize("bad", [float("nan"), 1e5])
def test_reset_logs_the_unread_lazy_checks_of_the_request_it_ends(caplog, bad: float):
    """``reset()`` zeroed the lazy checks' maxima unread: a NaN or ``|x|`` past the float16 bound written by a
    request's last (decode) step was never reported by anything. Now ``reset()`` reads them first (one host sync) and
    logs a WARNING naming the layer, as ``QuantizedKVCache.reset()`` does; a failure ``check_inputs()`` already raised
    is not logged again, and the next request starts clean."""
    model = build("llama")
    cache = StaticQuantizedKVCache(config=model.config, scheme="int4-token", max_cache_len=PROMPT + 4, checks="lazy")
    ids, kw = prompt(1), cache_kwargs(cache, model)

    def poison(module, args, out):  # the decode step's keys (every channel: RoPE keeps some |x| >= 1e5)
        return torch.full_like(out, bad)

    with torch.no_grad():
        model(ids, **kw, use_cache=True)
        hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(poison)
        try:
            model(ids[:, :1], **kw, use_cache=True)
        finally:
            hook.remove()
        held = "NaN or inf" if math.isnan(bad) else r"\|x\| up to 1\d{5}(\.\d+)? \(bound 65504\)"
        with caplog.at_level(logging.WARNING, logger="kvbits.cache.static"):
            cache.reset()
        failed = [r.getMessage() for r in caplog.records if "pending lazy K/V check failed" in r.getMessage()]
        assert len(failed) == 1 and re.search(f"layer 1: keys written to the cache held {held}", failed[0]), failed
        assert "layer 0" not in failed[0]
        cache.check_inputs()  # the maxima were zeroed in place after the read
        model(ids, **kw, use_cache=True)
        cache.check_inputs()
        hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(poison)
        try:
            model(ids[:, :1], **kw, use_cache=True)
        finally:
            hook.remove()
        with pytest.raises(ValueError, match="layer 1: keys written"):
            cache.check_inputs()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbits.cache.static"):
            cache.reset()  # already raised: not said twice
        assert not [r for r in caplog.records if "pending lazy K/V check failed" in r.getMessage()]


def test_a_layer_reset_logs_its_unread_lazy_checks_and_the_cache_reset_reads_them_once(caplog):
    """``StaticQuantizedLayer.reset()`` called on its own zeroed a NaN its lazy checks held, unread and unlogged (the
    cache-level reset logged it); now it reads and logs it (one sync), and the cache's reset, which read every layer
    together, is neither read again per layer nor logged twice."""
    model = build("llama")
    ids = prompt(1)

    def poison(module, args, out):
        return torch.full_like(out, float("nan"))

    def run_poisoned(cache):
        with torch.no_grad():
            kw = cache_kwargs(cache, model)
            model(ids, **kw, use_cache=True)
            hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(poison)
            try:
                model(ids[:, :1], **kw, use_cache=True)
            finally:
                hook.remove()

    def failed():
        return [r.getMessage() for r in caplog.records if "pending lazy K/V check failed" in r.getMessage()]

    cache = StaticQuantizedKVCache(config=model.config, scheme="int4-token", max_cache_len=PROMPT + 4, checks="lazy")
    run_poisoned(cache)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache.static"):
        cache.kv_layers[0].reset()
        assert failed() == []
        cache.kv_layers[1].reset()
    assert len(failed()) == 1 and failed()[0].startswith("StaticQuantizedLayer.reset(): "), failed()
    assert "layer 1: keys written to the cache held NaN or inf" in failed()[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbits.cache.static"):
        cache.kv_layers[1].reset()  # zeroed: nothing left to say
    assert failed() == []

    cache = StaticQuantizedKVCache(config=model.config, scheme="int4-token", max_cache_len=PROMPT + 4, checks="lazy")
    run_poisoned(cache)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache.static"):
        cache.reset()
    assert len(failed()) == 1 and failed()[0].startswith("StaticQuantizedKVCache.reset(): "), failed()


def test_static_lazy_check_message_tells_a_value_just_past_the_bound_from_it():
    """The static cache's lazy check wrote magnitudes with 4 digits: 65505 against the float16 bound 65504 read
    "|x| up to 6.55e+04 (bound 6.55e+04)", which reads as within it; the dynamic cache and the eager checks write 6
    (``kvbits.cache.checks.fmt_x``, now shared)."""
    k = torch.randn(1, 2, 3, 32)
    big = k.clone()
    big[0, 0, 0, 0] = 65505.0
    cache = StaticQuantizedKVCache(num_layers=2, max_cache_len=8, checks="lazy")
    cache.update(big, k, 0)
    cache.update(k, big * 2, 1)
    with pytest.raises(ValueError, match=r"layer 0: keys .*\|x\| up to 65505 \(bound 65504\).*\[also failed: layers 1\]"):
        cache.check_inputs()
