"""``LiveBytes``: the peak of the bytes held by tensors created inside a block (CPU or any device).

A ``TorchDispatchMode`` sees the output of every aten op run inside it; each new storage (the output of
an op that is neither a view nor in-place) is counted when it first appears and uncounted when it is freed (a finalizer on the storage), so ``peak`` is the
most those storages held at once. Tensors created before the block (the model, a cache's earlier
contents) are not counted; buffers an op allocates and frees inside its own kernel are not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...``, then ``m.peak`` (bytes) and ``m.current`` (still held at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":  # shape only, no memory (the fused path's placeholder K/V)
            return
        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.live:
            return
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        n = self.live.pop(key, None)
        if n is not None:
            self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:  # a view or an in-place op: no new storage
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
