"""Electric-fence tensors: a kernel that reads past the end of one faults.

Triton's interpreter runs a kernel's loads on host memory at the addresses the kernel computes, and reads
only the lanes its masks let through. ``fenced(t)`` copies ``t`` to the end of a fresh anonymous mapping whose
next page allows no access (``mprotect(PROT_NONE)``), so a load one word past ``t`` (a tile's words beyond
the last row, say) is a segmentation fault instead of garbage that a mask hides. The copy keeps 4-byte
alignment (the kernels' word reads check it), so at most 3 bytes past ``t`` stay readable.

Run kernels on fenced tensors in a subprocess (a fault kills the process): ``tests/test_bounds.py``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
from typing import Any

import torch

PROT_NONE = 0
_MAPPINGS: list[mmap.mmap] = []  # kept alive: the tensors view them
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def fenced(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (same shape, dtype and strides: a view of padded rows stays one) whose last element
    ends at most 3 bytes before a page no access is allowed to; its first byte is 4-byte aligned."""
    if not t.is_contiguous() and t.dim() and all(s >= 0 for s in t.stride()):
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
        flat = fenced(torch.zeros(extent, dtype=t.dtype))
        out = flat.as_strided(t.shape, t.stride())
        out.copy_(t)
        return out
    n = t.numel() * t.element_size()
    page = mmap.PAGESIZE
    pages = -(-max(n, 1) // page) + 1
    buf = mmap.mmap(-1, pages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if _libc.mprotect(base + (pages - 1) * page, page, PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    offset = ((pages - 1) * page - n) // 4 * 4
    _MAPPINGS.append(buf)
    if n == 0:
        return t.new_empty(t.shape)
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
    out.copy_(t)
    return out


def _fence_fields(obj: Any) -> Any:
    """``obj`` (a dataclass) with every tensor field fenced and every dataclass field fenced in turn."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = fenced(v)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _fence_fields(v)
    return dataclasses.replace(obj, **changes)


def fence_store(store: Any) -> Any:
    """A ``PackedStore`` whose every tensor (codes, scales, zero-points, codebooks, outliers, tails, lengths,
    masks, RoPE tables) is ``fenced``."""
    return _fence_fields(store)
