"""Per-step cost of a one-token flush (``QuantizedKVCache.update`` of a per-token scheme): the aten ops it runs,
each a kernel launch on a GPU. Pinned as an upper bound on the op count (not a timing), with the stored codes,
scales and returned K/V checked bit for bit against a reference computed once."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbits.cache import QuantizedKVCache
from kvbits.quant import quantize
from kvbits.quant.pack import pack_bits, unpack_bits
from kvbits.schemes import get_scheme

transformers = pytest.importorskip("transformers")


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip


def test_int8_token_one_token_flush_op_count():
    """int8-token, one token per side: ``quantize`` took 53 aten ops and a whole decode ``update`` (both sides'
    flushes, the eager check, the returned K/V) 159 at e45df0d; fewer now (a shared ``s > 0`` mask, one ``aminmax``
    for the range, the zero-point's float32 copy made once)."""
    x = torch.randn(1, 2, 1, 64)
    spec = get_scheme("int8-token").key
    quantize(x, spec, validate=False, sync=False)
    with _OpCount() as c:
        quantize(x, spec, validate=False, sync=False)
    assert c.n <= 50, f"{c.n} aten ops to quantize one int8 token"
    cache = QuantizedKVCache(_config(), "int8-token", checks="eager")
    k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    for _ in range(4):
        cache.update(k, v, 0)
    with _OpCount() as c:
        cache.update(k, v, 0)
    assert c.n <= 153, f"{c.n} aten ops per one-token int8-token update"


@pytest.mark.parametrize("bits", [2, 4])
def test_bytewise_pack_matches_word_layout(bits):
    """``pack_bits`` of 2- and 4-bit codes (uint8 shifts) gives the bytes of the 32-bit word layout: code ``i`` at
    bits ``[b*i, b*(i+1))`` little-endian, the last word zero-padded."""
    torch.manual_seed(0)
    for n in (1, 3, 5, 8, 13, 64):
        codes = torch.randint(0, 1 << bits, (2, 3, n), dtype=torch.int64)
        word = sum(int(c) << (bits * i) for i, c in enumerate(codes[1, 2].tolist()))
        want = [(word >> (8 * j)) & 0xFF for j in range((n * bits + 7) // 8)]
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and packed.is_contiguous()
        assert packed[1, 2].tolist() == want
        assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.uint8))


# sha256 (first 16 hex) of every stored code / scale / zero-point and the returned K/V over a prefill of 200 tokens and
# 40 decode steps (seeded), taken at e45df0d: the op savings must not move a bit (elementwise ops and min / max only,
# exact in IEEE arithmetic whatever the CPU)
DIGESTS = {
    "int8-token": "fc327beb03182e76",
    "int4-token": "ffb7f89e1274fdf2",
    "int2-token": "d47d1b2717bfca00",
    "kivi-2": "33fdadda503a97a3",
    "kivi-4": "57bc22493cbf3931",
}  # no pre-RoPE scheme: its cos/sin tables may differ in the last bit between CPUs' vector math libraries


def _digest(scheme: str) -> str:
    torch.manual_seed(0)
    cache = QuantizedKVCache(_config(), scheme, checks="eager")
    h = hashlib.sha256()
    for t in range(41):
        q = 200 if t == 0 else 1
        # integer draws scaled by a power of two: the same floats on every CPU (randn's vector path may not be)
        k = torch.randint(-3 * 2**12, 3 * 2**12, (2, 2, q, 64)) / 2**12
        v = torch.randint(-(2**12), 2**12, (2, 2, q, 64)) / 2**12
        keys, values = cache.update(k, v, 0)
        h.update(keys.numpy().tobytes())
        h.update(values.numpy().tobytes())
    layer = cache.layers[0]
    for store in (layer._k, layer._v):
        for chunk in store.chunks:
            for t in chunk.stored_tensors():
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("scheme", sorted(DIGESTS))
def test_flush_results_bit_identical(scheme):
    assert _digest(scheme) == DIGESTS[scheme]
