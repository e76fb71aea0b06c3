"""Reserved quantized storage: ``QuantizedKVCache(max_cache_len=...)``.

Without a reservation the one growing chunk of a per-token or per-channel spec is concatenated at every
flush, a copy of the layer's whole quantized history (every decode step when ``block = 1``). With one, each
full layer allocates its chunk for the tokens ``token_split`` quantizes at ``max_cache_len`` and writes
flushes in place. Checked here on tiny random-weight models: the same tokens, logits and codes as without
it (dequantize path and fused path), the codes never move, the cache holds exactly the reservation (all of
it counted, nothing else), which at ``max_cache_len`` tokens is ``kvbits.plan`` at that context; past it, a
logged release and the unreserved bytes again; beam-style batch maps and sliding layers.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from unittest import mock

import pytest
import torch
from test_cache import storage_bytes, walk_tensors
from test_fused_cache import NEW, PROMPT, SCHEMES, attention, build, install, prompt, spec, use_triton

from kvbits.cache import QuantizedKVCache
from kvbits.cache import fused as fused_mod
from kvbits.cache.compat import cache_kwargs
from kvbits.kernels import dispatch
from kvbits.kernels.reference import decode_attention_reference, pack_store, used_slots, word_rows
from kvbits.plan import plan
from kvbits.quant import quantize
from kvbits.schemes import KVScheme, TensorSpec, token_split

pytestmark = pytest.mark.usefixtures("one_thread")

FULL = PROMPT + NEW - 1  # tokens a generation of NEW tokens leaves in the cache


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNEL", "reference")


@torch.no_grad()
def run(model, scheme, *, fused: bool, new: int = NEW, ids=None, steps: list | None = None, **cache_kw):
    """Greedy generation; returns (sequences, logits (new, B, V), cache). ``steps``: filled with the codes'
    storage address of layer 0's keys after every model call (None before the first flush)."""
    ids = prompt() if ids is None else ids
    cache = QuantizedKVCache(config=model.config, scheme=scheme, fused_decode=fused, **cache_kw)
    install(cache, scheme)
    hook = None
    if steps is not None:

        def record(*_):
            chunks = cache.layers[0]._k.chunks
            steps.append(chunks[0].data.untyped_storage().data_ptr() if chunks else None)

        hook = model.register_forward_hook(record)
    try:
        with attention(model, fused):
            out = model.generate(ids, **cache_kwargs(cache, model), max_new_tokens=new, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)  # fmt: skip
    finally:
        if hook is not None:
            hook.remove()
    return out.sequences, torch.stack(out.logits), cache


RESERVED = ["int8-token", "int4-kivi", "int4-prerope", "kvquant3-block", "fp8-e4m3-token", "int4-hadamard", "vllm-int8"]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scheme", RESERVED)
def test_reservation_changes_no_result_and_holds_what_the_planner_counts(scheme: str, fused: bool):
    model, sch = build("llama"), SCHEMES[scheme]
    seq_ref, logits_ref, ref = run(model, sch, fused=fused)
    addresses: list = []
    seq, logits, cache = run(model, sch, fused=fused, steps=addresses, max_cache_len=FULL)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=0)
    if fused:
        rep = cache.fused_report()
        assert rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0, rep
    for la, lb in zip(ref.layers, cache.layers):  # the same codes and metadata, bit for bit
        for sa, sb in ((la._k, lb._k), (la._v, lb._v)):
            assert len(sa.chunks) == len(sb.chunks) == 1
            for name in ("data", "scale", "zero", "outlier_values", "outlier_index"):
                a, b = getattr(sa.chunks[0], name), getattr(sb.chunks[0], name)
                assert (a is None) == (b is None) and (a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    # flushed in place: the codes never moved after the first flush (without it, every flush moves them)
    flushed = [a for a in addresses if a is not None]
    assert len(flushed) == NEW and len(set(flushed)) == 1, addresses
    # full at max_cache_len: exactly the planned bytes, and the unreserved cache's
    want = plan(model.config, context=FULL, batch=seq.shape[0], scheme=sch, dtype_bytes=4)
    report = cache.memory_report()
    assert report["total_bytes"] == want["total_bytes"] == ref.memory_report()["total_bytes"]
    assert all(r["reserved_tokens"] == token_split(sch, FULL).quantized for r in report["layers"])
    extra = report["position_bytes"] + (cache.fused_report()["rope_table_bytes"] if fused else 0)
    assert storage_bytes(walk_tensors(cache)) == report["total_bytes"] + extra  # no hidden copy


@pytest.mark.parametrize("per_block", ["key", "value"])
def test_one_reserved_side_beside_a_per_block_side_decodes_fused(per_block: str):
    """A scheme whose one side keeps one growing chunk (reserved for ``max_cache_len``) and whose other side is
    stored per block (head granularity: nothing reserved): the fused store hands the kernels the slots in use of
    both, one slot count. Before, the reserved side's every slot beside the other's used ones was refused at the
    first decode step (``key and value codes must be (B, H_kv, T_q, *) ...``: 48 slots against 32)."""
    sides = {"key": spec(4, "token"), "value": spec(4, "token")} | {per_block: spec(4, "head")}
    sch = KVScheme(f"t-mixed-{per_block}", **sides, sinks=2, residual=4, block=8)
    model = build("llama")
    seq_ref, logits_ref, _ = run(model, sch, fused=True)
    seq, logits, cache = run(model, sch, fused=True, max_cache_len=FULL)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=0)
    rep = cache.fused_report()
    assert rep["fused_steps"] == (NEW - 1) * 2 and rep["fallback_steps"] == 0, rep
    reserved = cache.layers[0]._v if per_block == "key" else cache.layers[0]._k
    assert reserved.reserved_slots == token_split(sch, FULL).quantized  # held, written in place throughout


def test_reservation_is_held_from_the_first_flush():
    """Before ``max_cache_len`` the cache holds the whole reservation (what a server sets aside), not less:
    the quantized components are those the planner counts at ``max_cache_len``, from the prefill on."""
    model, sch = build("llama"), SCHEMES["int4-kivi"]
    T = 200
    _, _, cache = run(model, sch, fused=False, new=3, max_cache_len=T)
    quant = ("codes", "scales", "zero_points", "outliers")
    held = sum(cache.memory_report()["components"][c] for c in quant)
    want = plan(model.config, context=T, batch=2, scheme=sch, dtype_bytes=4)["components"]["quantized"]
    assert held == want
    layer = cache.layers[0]
    assert layer._k.n_quantized == token_split(sch, PROMPT + 2).quantized < layer._k.reserved_slots
    # the slots past the chunk are zeros: a store that reads them would see finite values, never garbage
    codes = layer._k._slots["data"]
    assert not codes[:, :, layer._k.n_quantized :].any()


def test_beyond_the_reservation_is_logged_and_grows_as_without(caplog):
    model, sch = build("llama"), SCHEMES["int8-token"]
    seq_ref, logits_ref, ref = run(model, sch, fused=True)
    with caplog.at_level(logging.WARNING, logger="kvbits.cache.store"):
        seq, logits, cache = run(model, sch, fused=True, max_cache_len=PROMPT + 5)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=0)
    told = [r.getMessage() for r in caplog.records if "exceed" in r.getMessage()]
    assert len(told) == 4, told  # once per side and layer
    assert "layer 0 keys: 46 quantized tokens exceed the 45 reserved for max_cache_len" in told[0]
    assert cache.memory_report()["total_bytes"] == ref.memory_report()["total_bytes"]  # released
    assert all(r["reserved_tokens"] == 0 for r in cache.memory_report()["layers"])
    cache.reset()  # the next request reserves again
    assert all(layer._k.reserve_tokens == PROMPT + 5 for layer in cache.layers)


def test_flushes_into_the_same_slots_keep_the_packed_view():
    """The packed view of a reserved store covers every slot, so a per-token scheme's flush at each step (into the
    same slots) keeps it: no rebuild per step. New slots (a batch map releases them, the next flush reserves again)
    give a new view; every view reads what the store holds, and the fused reference step over it equals attention
    over the dequantized history."""
    from kvbits.kernels import reference

    model, sch = build("llama"), SCHEMES["int8-token"]
    cache = QuantizedKVCache(config=model.config, scheme=sch, max_cache_len=64, fused_decode=True)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 16, 32, generator=g), torch.randn(2, 2, 16, 32, generator=g)
    cache.update(k[:, :, :8], v[:, :, :8], 0)
    store = cache.layers[0]._k
    first = store.packed()
    with mock.patch.object(reference, "pack_side", wraps=reference.pack_side) as pack:
        for t in range(8, 12):
            cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
            assert store.packed() is first
        assert pack.call_count == 0 and store.n_quantized == 12
        cache.reorder_cache(torch.tensor([1, 0]))  # new storage: the next flush reserves new slots
        cache.update(k[:, :, 12:13], v[:, :, 12:13], 0)
        again = store.packed()
        assert again is not first and pack.call_count == 1 and again.codes.data_ptr() == store._slots["data"].data_ptr()
    q = torch.randn(2, 4, 1, 32, generator=g)
    keys, values = cache.materialize(0)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1))
    got = decode_attention_reference(q, fused_mod.packed_store(cache.layers[0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_batch_maps_release_and_the_next_flush_reserves_again():
    model, sch = build("llama"), SCHEMES["int8-token"]
    cache = QuantizedKVCache(config=model.config, scheme=sch, max_cache_len=64)
    ref = QuantizedKVCache(config=model.config, scheme=sch)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 12, 32, generator=g), torch.randn(2, 2, 12, 32, generator=g)
    for c in (cache, ref):
        c.update(k[:, :, :10], v[:, :, :10], 0)
        c.reorder_cache(torch.tensor([1, 1]))
    store = cache.layers[0]._k
    assert store.reserved_slots == 0 and store.nbytes() == ref.layers[0]._k.nbytes()
    for c in (cache, ref):
        out = c.update(k[:, :, 10:11], v[:, :, 10:11], 0)
    assert store.reserved_slots == 64 and store.n_quantized == 11
    torch.testing.assert_close(out[0], cache.materialize(0)[0], atol=0, rtol=0)
    for a, b in zip(out, ref.materialize(0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("workspace", [False, True])
def test_holding_a_layer_in_full_precision_gives_the_unused_slots_back(workspace: bool, caplog):
    """The monitor's fallback (``hold_full_precision``) stops a layer's flushes: the slots reserved past what
    it has quantized would never be written, so they are released; the layer then holds the bytes of a cache
    without a reservation, pins no other storage, and decodes the same values."""
    model, sch = build("llama"), SCHEMES["int8-token"]
    cache = QuantizedKVCache(config=model.config, scheme=sch, max_cache_len=64, workspace=workspace)
    ref = QuantizedKVCache(config=model.config, scheme=sch, workspace=workspace)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 16, 32, generator=g), torch.randn(2, 2, 16, 32, generator=g)
    for c in (cache, ref):
        for li in range(len(c.layers)):
            c.update(k[:, :, :10], v[:, :, :10], li)
    held, other = cache.layers[0], cache.layers[1]
    assert held._k.reserved_slots == 64 and held._k.nbytes() > ref.layers[0]._k.nbytes()
    with caplog.at_level(logging.INFO, logger="kvbits.cache.layer"):
        assert held.hold_full_precision() and ref.layers[0].hold_full_precision()
    freed = [r.getMessage() for r in caplog.records if "reserved bytes released" in r.getMessage()]
    assert len(freed) == 1, freed
    for sa, sb in ((ref.layers[0]._k, held._k), (ref.layers[0]._v, held._v)):
        assert sb.reserved_slots == 0 and sb.nbytes() == sa.nbytes()
        assert sb.workspace_bytes() == sa.workspace_bytes()
    assert other._k.reserved_slots == 64  # only the held layer gives its reservation back
    assert held.hold_full_precision()  # holding again: nothing more to release, no second message
    assert sum("released" in r.getMessage() for r in caplog.records) == 1
    report = cache.memory_report()
    assert report["layers"][0]["reserved_tokens"] == 0
    held_bytes = report["total_bytes"] + report["position_bytes"] + report["workspace_bytes"]
    assert storage_bytes(walk_tensors(cache)) == held_bytes
    for i in range(10, 16):  # held: later tokens stay in full precision, the same values as without a reservation
        for c in (cache, ref):
            for li in range(len(c.layers)):
                c.update(k[:, :, i : i + 1], v[:, :, i : i + 1], li)
        for li in range(len(cache.layers)):
            for a, b in zip(cache.materialize(li), ref.materialize(li)):
                assert torch.equal(a, b)
    assert held._k.n_quantized == ref.layers[0]._k.n_quantized and held._k.reserved_slots == 0


def test_sliding_layers_reserve_nothing():
    model = build("gemma3")
    cache = QuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=64)
    assert [layer._k.reserve_tokens for layer in cache.layers] == [0, 64]


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "64"])
def test_bad_max_cache_len_is_refused(bad):
    with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
        QuantizedKVCache(config=build("llama").config, scheme="int8-token", max_cache_len=bad)


def test_fused_store_spans_the_reserved_slots_and_says_which_are_used():
    model, sch = build("llama"), SCHEMES["int4-kivi"]
    with mock.patch.object(dispatch, "decode_attention", wraps=dispatch.decode_attention) as kernel:
        run(model, sch, fused=True, new=4, max_cache_len=128)
    store = kernel.call_args.args[1]
    n = token_split(sch, PROMPT + 2).quantized
    assert store.key.n_slots == store.value.n_slots == token_split(sch, 128).quantized
    assert store.quant_used == n and store.quant_lens.tolist() == [n, n]


# --------------------------------------------------------------------------------------------------
# Kernels: slots past quant_used are never read
# --------------------------------------------------------------------------------------------------


def _store_with_garbage(spec: TensorSpec, used: int, slots: int, B: int = 2, H: int = 2, D: int = 64, half: bool = False):
    """A store of ``slots`` slots whose slots past ``used`` hold NaN scales and random codes, and the same
    store cut to ``used`` slots."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, slots, D, generator=g)
    qt = quantize(x, spec)
    rows = -(-used // (slots // qt.scale.shape[2]))  # scale rows in use
    qt.scale[:, :, rows:] = float("nan")
    qt.data[:, :, used:] = torch.randint(0, 255, qt.data[:, :, used:].shape, generator=g, dtype=torch.uint8)
    tail = torch.randn(B, H, 3, D, generator=g).to(torch.float16 if half else torch.float32)
    full = pack_store([qt], [qt], tail, tail.clone())
    reserved = replace(full, quant_lens=torch.full((B,), used, dtype=torch.int32), quant_used=used)  # fmt: skip
    cut = pack_store([_head(qt, used)], [_head(qt, used)], tail, tail.clone())
    return reserved, cut, torch.randn(B, 4, 1, D, generator=g).to(tail.dtype)


def _head(qt, n):
    from kvbits.cache.store import _slice_chunk

    return _slice_chunk(qt, 0, n)


SPECS = {
    "int4-token": TensorSpec(kind="int", bits=4, fmt=None, granularity="token", group_size=None),
    "int8-token": TensorSpec(kind="int", bits=8, fmt=None, granularity="token", group_size=None),
    "int2-channel": TensorSpec(kind="int", bits=2, fmt=None, granularity="channel", group_size=16),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_reads_only_the_used_slots(name: str):
    reserved, cut, q = _store_with_garbage(SPECS[name], used=33 if name != "int2-channel" else 32, slots=96)
    out = decode_attention_reference(q, reserved)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_attention_reference(q, cut), atol=0, rtol=0)


def test_reference_keeps_the_slot_mask_of_the_used_slots():
    """A reserved store (``quant_used`` below ``T_q``, ``max_cache_len``) of a left-padded batch: ``used_slots`` cuts
    the mask with the codes, so row 1's 20 pad slots stay unattended, the output that of the same store walked
    whole. Dropping the cut mask (mutant ``ref_used_slots_mask``: ``qm = None``) attended the pads: 0.86 off."""
    reserved, _, q = _store_with_garbage(SPECS["int8-token"], used=40, slots=96)
    mask = torch.ones(2, 96, dtype=torch.bool)
    mask[1, :20] = False  # sequence 1 left-padded
    reserved = replace(reserved, quant_mask=word_rows(mask))
    cut = used_slots(reserved)
    assert cut.quant_mask is not None and cut.quant_mask.shape == (2, 40) and not cut.quant_mask[1, :20].any()
    out = decode_attention_reference(q, reserved)
    assert torch.isfinite(out).all()
    whole = replace(reserved, key=cut.key, value=cut.value, quant_mask=word_rows(mask[:, :40]), quant_used=None)
    torch.testing.assert_close(out, decode_attention_reference(q, whole), atol=0, rtol=0)
    unmasked = decode_attention_reference(q, replace(whole, quant_mask=None))
    assert (out - unmasked).abs().max() > 0.1  # the pads matter: a mask dropped would show


def test_quant_used_beyond_the_slots_is_refused():
    reserved, _, _ = _store_with_garbage(SPECS["int8-token"], used=8, slots=16)
    with pytest.raises(ValueError, match=r"quant_used must be in \[0, 16\]"):
        replace(reserved, quant_used=17)


@pytest.mark.parametrize(
    "name,dequant", [("int4-token", "f32"), ("int8-token", "f16"), ("int2-channel", "f32")]
)  # fmt: skip
def test_triton_kernel_reads_only_the_used_slots(monkeypatch, name: str, dequant: str):
    """33 used slots: the int32 word that reads slot 32's per-token scale also brings slot 33's NaN, which
    reached the output (0 * NaN) before ``_token_words`` zeroed the pair's padding half."""
    use_triton(monkeypatch)
    from kvbits.kernels.triton_decode import decode_attention_triton

    half = dequant == "f16"
    used = 33 if name != "int2-channel" else 32
    reserved, cut, q = _store_with_garbage(SPECS[name], used=used, slots=96, half=half)
    out = decode_attention_triton(q, reserved, target_programs=4, dequant=dequant)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_attention_reference(q, cut), atol=2e-3 if half else 2e-6, rtol=0)


# (spec, used slots, half queries, kernel): product kernel (f32 tiles, row gather, int32-word mask and scale reads
# on 32-token tiles over 3 splits, f16 tiles) and the folded kernel (float16 queries only)
MASKED_LAUNCHES = {
    "int8-token-f32": ("int8-token", 40, False, {}),
    "int8-token-gather": ("int8-token", 40, False, {"vectorized": False}),
    "int8-token-words": ("int8-token", 40, False, {"meta32": True, "block_t": 32, "splits": 3}),
    "int4-token-f16": ("int4-token", 40, True, {"dequant": "f16"}),
    "int2-channel-f32": ("int2-channel", 32, False, {}),
    "int4-token-fold": ("int4-token", 40, True, "fold"),
}


@pytest.mark.parametrize("case", list(MASKED_LAUNCHES))
def test_triton_kernels_keep_the_slot_mask_of_the_used_slots(monkeypatch, case: str):
    """The Triton kernels on a reserved store (``quant_used`` below ``T_q``) of a left-padded batch give the
    reference's output (``test_reference_keeps_the_slot_mask_of_the_used_slots``), which the pads change.
    ``test_bounds`` runs such a store only for bounds and finite output; a kernel dropping the mask of a
    reserved store (mutant: ``HAS_QMASK`` false when ``quant_used`` is set) gave the unmasked output, 0.86 off."""
    use_triton(monkeypatch)
    from kvbits.kernels import triton_decode, triton_fold  # after use_triton: interpreted on CPU

    name, used, half, kw = MASKED_LAUNCHES[case]
    reserved, _, q = _store_with_garbage(SPECS[name], used=used, slots=96, half=half)
    mask = torch.ones(2, 96, dtype=torch.bool)
    mask[1, :20] = False  # sequence 1 left-padded
    reserved = replace(reserved, quant_mask=word_rows(mask))
    if kw == "fold":
        assert triton_fold.fold_supported(reserved, q) is None, triton_fold.fold_supported(reserved, q)
        out = triton_fold.decode_attention_fold(q, reserved, splits=2)
    else:
        out = triton_decode.decode_attention_triton(q, reserved, **kw)
    want = decode_attention_reference(q, reserved)
    tol = 2e-3 if half else 2e-6
    torch.testing.assert_close(out, want, atol=tol, rtol=0)
    unmasked = decode_attention_reference(q, replace(reserved, quant_mask=None))
    assert (out.float() - unmasked.float()).abs().max() > 0.1  # the pads matter: a mask dropped would show


@pytest.mark.parametrize("reserve", [None, FULL])
def test_triton_kernel_reads_scales_as_words_at_every_slot_count(monkeypatch, reserve: int | None):
    """One scale per token row (``int8-token``): a growing cache holds an odd number of slots every other step
    and an odd reservation at every step. The kernel still reads the scales as int32 words there
    (``K_W32 == 2``, ``_token_words(ODD=True)``), where it used to fall back to 2-byte loads (synchronous in
    the tile loop on sm_90) on those steps only, so that a growing and a reserved cache launched different
    kernels. The tokens and logits are those of the reference kernel."""
    from _launch import LaunchSpy

    from kvbits.schemes import get_scheme

    use_triton(monkeypatch)
    from kvbits.kernels import triton_decode  # after use_triton: interpreted on CPU

    spy = LaunchSpy(triton_decode._decode_kernel)
    monkeypatch.setattr(triton_decode, "_decode_kernel", spy)
    model, sch = build("qwen2"), get_scheme("int8-token")
    seq, logits, _ = run(model, sch, fused=True, max_cache_len=reserve)
    words = [(m["K_W32"], m["V_W32"]) for m in spy.seen]
    assert len(words) == (NEW - 1) * 2
    odd = {pair for pair in words if pair == (2, 2)}
    assert FULL % 2 == 1 and set(words) <= {(1, 1), (2, 2)} and odd, words
    monkeypatch.setenv("KVBITS_KERNEL", "reference")
    seq_ref, logits_ref, _ = run(model, sch, fused=True, max_cache_len=reserve)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-4, rtol=0)


def _decode_step_peaks(*, claim: bool = False, **cache_kw) -> dict:
    """``LiveBytes`` peak of one int8-token decode step of layer 0 (token 256 of 300 random K/V), growing
    (``None``) and with ``max_cache_len=300``: ``{reserve: (peak, cache, keys the step returned)}``.
    ``claim``: the layer is claimed for fused decode first."""
    from kvbits.evaluate.livebytes import LiveBytes

    model = build("llama")
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(2))
    out = {}
    for reserve in (None, 300):
        cache = QuantizedKVCache(config=model.config, scheme="int8-token", max_cache_len=reserve, **cache_kw)
        cache.update(k[:, :, :256], v[:, :, :256], 0)
        if claim:
            assert fused_mod.claim(cache.layers[0], torch.zeros(1, 4, 1, 32))
        with LiveBytes() as live:
            keys, _ = cache.update(k[:, :, 256:257], v[:, :, 256:257], 0)
        out[reserve] = (live.peak, cache, keys)
    return out


def test_a_fused_decode_step_allocates_no_history_with_a_reservation():
    """Measured with ``LiveBytes`` (meta placeholders count nothing): a claimed layer's decode step stores
    one token; without a reservation it also allocates a new copy of every code and scale (per-token
    flush), with one only the new token's few bytes."""
    runs = _decode_step_peaks(claim=True, fused_decode=True)
    assert all(keys.device.type == "meta" for _, _, keys in runs.values())
    peaks = {reserve: peak for reserve, (peak, _, _) in runs.items()}
    history = runs[300][1].layers[0]._k.nbytes() * 257 // 300 * 2  # both sides' codes and scales for 257 tokens
    assert peaks[None] >= history > 10 * peaks[300], peaks


def test_livebytes_counts_no_meta_tensor():
    from kvbits.evaluate.livebytes import LiveBytes

    with LiveBytes() as live:
        a = torch.empty(1024, 1024, device="meta")
        b = torch.ones(256)
    assert live.peak == b.nbytes and a.device.type == "meta"


def test_the_workspace_is_reserved_too():
    """``workspace=True`` keeps the dequantized history: reserved alike, so it never moves either, and it
    holds the same values as a growing workspace; ``workspace_bytes`` counts the reservation."""
    model, sch = build("llama"), SCHEMES["int8-token"]
    seq_ref, logits_ref, ref = run(model, sch, fused=False, workspace=True)
    seq, logits, cache = run(model, sch, fused=False, workspace=True, max_cache_len=FULL + 10)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=0)
    for la, lb in zip(ref.layers, cache.layers):
        for sa, sb in ((la._k, lb._k), (la._v, lb._v)):
            assert torch.equal(sa.work, sb.work)
            assert sb.work.untyped_storage().data_ptr() == sb._work_slots.untyped_storage().data_ptr()
            assert sb.workspace_bytes() == sa.workspace_bytes() * (FULL + 10) // FULL
    assert cache.memory_report()["workspace_bytes"] > ref.memory_report()["workspace_bytes"]
    # past the reservation: released with the chunk's (logged there), grown as without one
    seq, logits, short = run(model, sch, fused=False, workspace=True, max_cache_len=PROMPT + 5)
    assert torch.equal(seq, seq_ref) and short.layers[0]._k._work_slots is None
    assert short.memory_report()["workspace_bytes"] == ref.memory_report()["workspace_bytes"]


@pytest.mark.parametrize("scheme", ["int8-token", "int4-kivi", "int4-prerope", "kvquant3-block", "fp8-e4m3"])
def test_a_reserved_workspace_is_returned_as_a_view(monkeypatch, scheme: str):
    """With a reserved workspace, ``update`` returns views of it (sinks | dequantized history | buffer, the
    sinks and buffer copied in): the same tokens and logits as the growing workspace, every step after the
    first flush returned without a copy of the history, and the public ``materialize()`` still a new tensor.
    Sinks, a residual window, pre-RoPE keys and one-chunk-per-block FP8 included."""
    from kvbits.cache.store import SideStore

    model, sch = build("llama"), SCHEMES[scheme]
    seq_ref, logits_ref, ref = run(model, sch, fused=False, workspace=True)
    plain, views = SideStore.materialize, []

    def spy(self, dtype, *, view=False):
        out = plain(self, dtype, view=view)
        slots = self._work_slots
        views.append(view and slots is not None and out.untyped_storage().data_ptr() == slots.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(SideStore, "materialize", spy)
    seq, logits, cache = run(model, sch, fused=False, workspace=True, max_cache_len=FULL)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(logits, logits_ref, atol=1e-6, rtol=0)
    assert len(views) == 2 * 2 * NEW and all(views[-4 * (NEW - 1) :]), views  # (layers x sides) per model call
    B, H, D = seq.shape[0], 2, 32
    assert cache.memory_report()["workspace_bytes"] == 2 * 2 * B * H * FULL * D * 4  # every token's slot, float32
    for li in range(2):
        layer = cache.layers[li]
        keys, values = layer.materialize()
        assert keys.untyped_storage().data_ptr() != layer._k._work_slots.untyped_storage().data_ptr()
        for a, b in zip((keys, values), ref.layers[li].materialize()):
            assert torch.equal(a, b)


@torch.no_grad()
def test_beam_search_with_a_reserved_workspace_equals_a_growing_one():
    """Beam search maps the batch at every step (``reorder_cache``): the workspace's reservation is released
    and taken again, in its layout, at the next flush; the beams and scores stay those of a growing workspace."""
    model, sch = build("llama"), SCHEMES["int4-kivi"]
    outs = []
    for reserve in (None, FULL + 8):
        cache = QuantizedKVCache(config=model.config, scheme=sch, workspace=True, max_cache_len=reserve)
        out = model.generate(prompt(), **cache_kwargs(cache, model), max_new_tokens=NEW, num_beams=2, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)  # fmt: skip
        outs.append((out, cache))
    (a, grown), (b, reserved) = outs
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), atol=1e-5, rtol=0)
    # the last step's map released it; KIVI flushes every 16 tokens, so no flush has taken it again since
    assert reserved.layers[0]._k._work_slots is None and reserved.layers[0]._k.reserve_total == FULL + 8
    for la, lb in zip(grown.layers, reserved.layers):
        for x, y in zip(la.materialize(), lb.materialize()):
            assert torch.equal(x, y)


def test_a_dequantize_step_copies_no_history_with_a_reserved_workspace():
    """``LiveBytes``: a decode step of a layer with a growing workspace allocates the history it returns; with
    a reserved one, the new token's few bytes (the returned K/V view the workspace)."""
    runs = _decode_step_peaks(workspace=True)
    assert all(keys.shape == (1, 2, 257, 32) for _, _, keys in runs.values())
    peaks = {reserve: peak for reserve, (peak, _, _) in runs.items()}
    history = 2 * 257 * 2 * 32 * 4  # K and V, float32, what a step returns
    assert peaks[None] >= history > 10 * peaks[300], peaks


def test_append_copy_benchmark_runs_and_shows_the_copy():
    """``benchmarks/append_copy.py`` at a small size: a growing int8-token layer allocates its quantized
    history per step (what the kernel then reads), a reserved one a few bytes; both hold the same."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "append_copy.py"
    spec = importlib.util.spec_from_file_location("append_copy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    grow, res = (mod.measure("int8-token", r, 512, 1, 2, 64, 3) for r in (False, True))
    assert grow["peak_mib"] >= grow["kernel_reads_mib"] > 20 * res["peak_mib"] > 0
    assert grow["held_mib"] == res["held_mib"] and grow["kernel_reads_mib"] == res["kernel_reads_mib"]
