"""Aten ops and host reads of one one-token ``QuantizedKVCache.update`` per scheme (CPU, eager checks).

    PYTHONPATH=src python benchmarks/update_ops.py [--steps 128] [--schemes int8-token int4-token kivi-2 kvquant-4]

One layer of a tiny Llama config (2 KV heads, head dim 64) takes a 200-token prefill, 8 untimed one-token updates,
then ``--steps`` one-token updates, each under a ``TorchDispatchMode`` that counts the aten ops dispatched (each a
kernel launch on a GPU) and the host reads of a tensor's value (``aten::_local_scalar_dense``: a host-device sync on
a GPU). Printed: the means per update (a windowed scheme such as kivi-2 flushes once per block, hence the mean over
many steps). ``kvquant-4`` is calibrated on random K/V (``artifact_from_samples``). Counts, not times: they do not
depend on the machine's load. BENCHMARKS.md §6 "Session 62" records them before and after the flush's op savings.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from kvbits.cache import QuantizedKVCache
from kvbits.schemes import get_scheme


class Counter(TorchDispatchMode):
    """Aten ops and ``_local_scalar_dense`` host reads dispatched inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip


def make_cache(scheme: str) -> QuantizedKVCache:
    """An eager cache of ``scheme``; a calibrated scheme gets an artifact fitted on random K/V (300 tokens, 2 samples)."""
    cfg = config()
    if not get_scheme(scheme).calibratable():
        return QuantizedKVCache(cfg, scheme, checks="eager")
    from kvbits.calibrate import artifact_from_samples
    from kvbits.calibrate.artifact import describe_model

    keys = [torch.randn(1, 2, 300, 64) for _ in range(2)]
    values = [torch.randn(1, 2, 300, 64) for _ in range(2)]
    art = artifact_from_samples(get_scheme(scheme), keys, values, meta={"model": describe_model(cfg)})
    return QuantizedKVCache(cfg, scheme, calibration=art, checks="eager")


@torch.no_grad()
def count(scheme: str, steps: int) -> tuple[float, float]:
    """Mean aten ops and host reads per one-token update of layer 0."""
    torch.manual_seed(0)
    cache = make_cache(scheme)
    cache.update(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64), 0)
    k, v = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    for _ in range(8):
        cache.update(k, v, 0)
    ops = syncs = 0
    for _ in range(steps):
        with Counter() as c:
            cache.update(k, v, 0)
        ops += c.ops
        syncs += c.syncs
    return ops / steps, syncs / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--schemes", nargs="+", default=["int8-token", "int4-token", "kivi-2", "kvquant-4"])
    args = p.parse_args()
    torch.set_num_threads(1)
    for scheme in args.schemes:
        ops, syncs = count(scheme, args.steps)
        print(f"{scheme}: {ops:.1f} aten ops, {syncs:.2f} host reads per one-token update")


if __name__ == "__main__":
    main()
