"""Pre-RoPE keys in `StaticQuantizedKVCache`: fixed RoPE tables and positions kept on the device.

``QuantizedKVCache`` un-rotates a pre-RoPE key side (KVQuant §3.2; ``kvbits.cache.store.rope_at``) at positions the
host knows (its sinks, dropped and flushed counts) and computes the cos/sin of each block when it needs them. A
captured decode step cannot read the host, so a static layer keeps what those rotations need on the device:

- ``cos`` / ``sin``: float32 tables ``(P, D)`` (or ``(P, D / 2)`` for rotate-half RoPE, whose halves repeat) covering
  every position the layer's attended slots can hold (``kvbits.cache.fused.RopeTableCache``, shared by the cache's
  layers, ``P = rope_table_positions(first + slots)``, ``slots`` the quantized tokens at ``max_cache_len``: the rows
  ``kvbits.plan(..., fused_decode=True)`` counts), made at the layer's first ``update`` and never regrown: a captured
  step reads them at fixed addresses. A windowed layer's block written ahead of those slots (which nothing attends)
  is un-rotated at positions clamped to the last row;
- ``offset``: ``(B,)`` int64, each sequence's cache index minus its model position (left padding), read from the
  position ids of a request's first ``update`` (``kvbits.cache.layer.position_offset``; none: 0) and written in place;
  read again at later multi-token updates for the rows that held only pads so far (``pad_rows``, a chunked prefill:
  ``kvbits.cache.layer.reread_offset``), up to and including the first single-token update when the host counts it
  (not captured): a row whose first real token comes alone in a last one-token chunk (or right after the prompt)
  reads its offset there, as ``QuantizedKVCache`` does. ``pad_rows`` is dropped as soon as no row is all pads (read
  with the offset's host check), so the decode steps of other batches never read again.

Quantized slot ``t`` of sequence ``b`` holds the key of position ``first + t - offset[b]`` (``first``: the layer's sink
count), negative positions taken as 0 (pad slots, masked), as ``rope_at`` and the decode kernels
take them. Keys are un-rotated there before they are quantized (``unrotate``), and rotated back after they are
dequantized (``rotate``, ``kvbits.kernels.reference.apply_rope_at``) or by the fused kernels (``pos0``). The tables are
the ones the model's rotary module gives (``RotaryTables``, computed on the K/V device), so both rotations are those of
``QuantizedKVCache`` bit for bit.

Refused (``check_rotary``): partial rotary embeddings (the kernels rotate every channel) and rope types whose tables
depend on the sequence length (``dynamic``, ``longrope``): ``QuantizedKVCache`` serves those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbits.kernels.reference import apply_rope_at
from kvbits.quant.rope import invert_rope
from kvbits.quant.tensor import saturate

if TYPE_CHECKING:  # pragma: no cover
    from kvbits.cache.fused import RopeTableCache
    from kvbits.quant.rope import RotaryTables

__all__ = ["StaticRope", "check_rotary"]


def check_rotary(rotary: RotaryTables, where: str) -> None:
    """``ValueError`` for RoPE the static layers cannot hold on the device (see the module docstring)."""
    if 0 < rotary.rot_dim != rotary.head_dim:
        raise ValueError(
            f"{where}: partial rotary embedding ({rotary.rot_dim} of {rotary.head_dim} channels): pre-RoPE keys in "
            "fixed slabs rotate every channel; QuantizedKVCache serves this model"
        )
    if rotary.length_dependent:
        raise ValueError(
            f"{where}: rope_type {rotary.rope_type!r} has tables that depend on the sequence length; pre-RoPE keys "
            "in fixed slabs need fixed tables: QuantizedKVCache serves this model"
        )


class StaticRope:
    """RoPE state of one static layer's pre-RoPE keys (see the module docstring).

    Args:
        rotary: the layer's tables (``RotaryTables.tables_for_layer``), full rotary (``check_rotary``).
        tables: the cache's shared float32 tables.
        first: position of quantized slot 0 at offset 0 (the layer's sinks).
        slots: the layer's quantized slots a step attends (a windowed layer's block written ahead of them excluded:
            its slots are un-rotated at clamped positions, ``unrotate``).
        batch: sequences.
        device: the K/V device.
    """

    def __init__(
        self, rotary: RotaryTables, tables: RopeTableCache, first: int, slots: int, batch: int, device: torch.device
    ) -> None:
        self.first, self.reach = first, first + slots  # positions a sequence with offset 0 reaches
        self.cos, self.sin = tables.get(rotary, self.reach, device)
        self.offset = torch.zeros(batch, dtype=torch.int64, device=device)
        # (B,) bool: rows whose offset a later prefill chunk reads again; transient (dropped at the first decode step,
        # which never reads it): not a slab at a fixed address, not in the layer's state_tensors
        self.pad_rows: torch.Tensor | None = None

    @property
    def positions(self) -> int:
        """Positions the tables cover: ``[0, P)``."""
        return self.cos.shape[0]

    @property
    def table_bytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes

    def start(self, offset: torch.Tensor | None, pad_rows: torch.Tensor | None = None) -> None:
        """A request's first update: ``offset`` ``(B,)`` from its position ids (``None``: none came, cache indices),
        ``pad_rows`` ``(B,)`` bool the rows it showed only pads (``repeated_positions``; ``None``: none).
        One host read: every position a slot can hold must lie in the tables, which are never regrown."""
        if offset is None:
            self.pad_rows = None
            self.offset.zero_()
            return
        self._write(offset, pad_rows)

    def reread(self, offset: torch.Tensor, pad_rows: torch.Tensor | None) -> None:
        """A later update of a request with all-pads rows: ``offset`` ``(B,)`` read again for them
        (``kvbits.cache.layer.reread_offset``), the rows still so (``None``: none). One host read, as ``start``."""
        self._write(offset, pad_rows)

    def _write(self, offset: torch.Tensor, pad_rows: torch.Tensor | None) -> None:
        """``offset`` written in place, after checking the tables cover the positions it gives; ``pad_rows`` kept
        while some row is all pads, else dropped (one host read for both)."""
        if pad_rows is None:
            ahead = max(0, -int(offset.min()))  # position ids that start past the cache indices
        else:
            ahead, pads = torch.stack([(-offset.min()).clamp_min(0), pad_rows.any().long()]).tolist()
            pad_rows = pad_rows if pads else None
        self.pad_rows = pad_rows
        if self.reach + ahead > self.positions:
            raise ValueError(
                f"position ids run {ahead} positions past the cache indices: slots would reach position "
                f"{self.reach + ahead - 1}, beyond the {self.positions} the fixed RoPE tables cover; give position ids "
                "from 0 (or use QuantizedKVCache, whose tables grow)"
            )
        self.offset.copy_(offset)

    def pos0(self) -> torch.Tensor:
        """``(B,)`` int32 position of quantized slot 0 of each sequence (the kernels' ``quant_pos0``)."""
        return (self.first - self.offset).to(torch.int32)

    def unrotate(self, keys: torch.Tensor, slot0: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``keys`` ``(B, H_kv, n, D)`` bound for slots ``slot0 + arange(n)`` (``slot0`` a 0-dim tensor) →
        pre-RoPE keys in their dtype. Device work only."""
        n = keys.shape[2]
        pos = (torch.arange(n, device=keys.device) + (slot0 + self.first))[None] - self.offset[:, None]
        # (B, n): pad slots before position 0, as rope_at and the kernels take them; a windowed layer's block written
        # ahead of its attended slots (nothing attends it) past the tables' last row
        pos = pos.clamp(0, self.positions - 1)
        cos, sin = self.cos[pos], self.sin[pos]  # (B, n, D or D / 2) float32
        if 2 * cos.shape[-1] == keys.shape[-1] and keys.shape[-1] > 1:  # rotate-half tables keep one half
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return invert_rope(keys, cos, sin)

    def rotate(self, keys: torch.Tensor) -> torch.Tensor:
        """Dequantized pre-RoPE ``keys`` ``(B, H_kv, slots, D)`` → post-RoPE, slot ``t`` at its position; float16 /
        bfloat16 keys saturated to the dtype's finite range after the rotation (``rope_at``, ``reference.materialize``:
        a pair within 65504 can rotate to ``sqrt(2)`` times it). Device work only."""
        return saturate(apply_rope_at(keys, self.cos, self.sin, self.pos0()), keys.dtype)
