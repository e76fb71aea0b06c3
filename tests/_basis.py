"""A stand-in for ``kvbits.kernels.reference.code_basis`` that leaves out one part of the basis change
(shared by the kernel and fused-cache tests: they must fail when the query, tail or output is not rotated)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import replace
from unittest import mock

from kvbits.kernels import reference

PARTS = ("query", "tail", "output", "channels")


@contextlib.contextmanager
def skipping(part: str) -> Iterator[None]:
    """Inside, the decode entry points (reference and, when imported, Triton) rotate everything but ``part``:
    ``"query"`` (``q`` stays in the model's basis), ``"tail"`` (the full-precision tail does) or ``"output"``
    (the output is not rotated back) or ``"channels"`` (pre-RoPE centred / smoothed keys lose their mean and
    factor: the codes are read as the keys)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    real = reference.code_basis

    def partial(q, store, dtype=None, *, query_dtype=None):
        q2, store2, out_rotate = real(q, store, dtype, query_dtype=query_dtype)
        if part == "query":
            q2 = q.to(q2.dtype)
        elif part == "tail":
            store2 = replace(store2, key_full=store.key_full, value_full=store.value_full)
        elif part == "output":
            out_rotate = None
        elif store2.key is not None:
            store2 = replace(store2, key=replace(store2.key, channel_mean=None, channel_factor=None))
        return q2, store2, out_rotate

    with contextlib.ExitStack() as stack:
        for name in ("kvbits.kernels.reference", "kvbits.kernels.triton_decode"):
            if name in sys.modules:
                stack.enter_context(mock.patch.object(sys.modules[name], "code_basis", partial))
        yield


def parts_that_matter(
    key_rotated: bool, value_rotated: bool, has_tail: bool, key_channels: bool = False
) -> list[str]:
    """The parts of the basis change a store with these rotations needs (``key_channels``: pre-RoPE centred /
    smoothed keys, decoded with their vectors in place; the query and tail stay in the model's basis)."""
    needs = (("query", key_rotated), ("tail", has_tail), ("output", value_rotated), ("channels", key_channels))
    return [p for p, needed in needs if needed]
