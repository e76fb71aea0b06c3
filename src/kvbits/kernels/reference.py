"""The packed decode-attention layout, and its pure-torch reference.

Layout (one layer, a batch of ``B`` sequences; what the Triton kernels in ``triton_decode`` read)
-----------------------------------------------------------------------------------------------
Notation: ``(B, H_kv, T, D)`` for keys/values, ``H_q`` query heads, ``G = H_q / H_kv`` query heads
per KV head (GQA; ``G = 1`` is MHA). Every tensor is contiguous (the Triton kernels refuse views with other
strides, ``triton_decode.layout_reason``; the torch reference reads any).

Quantized store, one ``PackedTensor`` per side (K and V), ``T_q`` token slots:

- ``codes``: ``(B, H_kv, T_q, ceil(D * bits / 8))`` uint8, the codes of each (token, head) row
  bit-packed along ``D`` exactly as ``kvbits.quant.pack``: code ``i`` of each 8-code word sits at bits
  ``[bits*i, bits*(i+1))`` of the word, little-endian, so for 2/4/8 bits channel ``d`` is in byte
  ``d // (8 / bits)`` at shift ``(d % (8 / bits)) * bits``; 3-bit codes may straddle two bytes.
- ``scale`` (and ``zero`` when asymmetric): float16 (float32 for ``scale_dtype="fp32"`` specs) ``(B, H_kv, T_q / tps, D / cps)``, where one scale
  covers ``tps`` consecutive tokens ("tokens per scale") and ``cps`` consecutive channels ("channels
  per scale"). The element at (token ``t``, channel ``d``) uses ``scale[..., t // tps, d // cps]``:

  ================================  =======  =======  ==========================
  granularity (``TensorSpec``)       tps      cps      scale shape
  ================================  =======  =======  ==========================
  per-token (values; KIVI values)    1        g or D   ``(B, H_kv, T_q, D/g)``
  per-channel over G tokens (keys)   G        1        ``(B, H_kv, T_q/G, D)``
  per-head / per-tensor, per block   block    D        ``(B, H_kv, T_q/block, 1)``
  static per-channel (calibrated)    2**30    1        ``(B, H_kv, 1, D)``
  ================================  =======  =======  ==========================

  Decoding by ``kind``: ``"int"`` (``kvbits.quant.affine``): asymmetric ``x = code * scale + zero``,
  symmetric ``x = (code - (2**(bits-1) - 1)) * scale``; ``"nuq"`` (``kvbits.quant.nuq``, KVQuant §3.3):
  ``u = codebook[code]`` (a float16 ``(2**bits,)`` per-layer codebook), asymmetric
  ``x = zero + (u + 1) * scale / 2``, symmetric ``x = u * scale``; ``"fp8"`` (``fmt`` e4m3 / e5m2):
  ``codes`` ``(B, H_kv, T_q, D)`` hold the float8 bytes, ``x = float(code) * scale`` with one scale per
  token row (``tps = 1, cps = D``) or one static float32 scale (``tps = STATIC_TPS``).
- dense-and-sparse outliers (KVQuant §3.5), optional: ``outlier_values`` float16 and ``outlier_index``
  (uint8, int16 when ``D > 256``) ``(B, H_kv, T_q, k)``: channel ``outlier_index[..., j]`` of each row is
  ``outlier_values[..., j]`` exactly, whatever its code decodes to.
- ``pre_rope`` keys (KVQuant §3.2): the codes hold keys *before* RoPE; attention rotates each
  dequantized key back with rotate-half RoPE (``x * cos[p] + rotate_half(x) * sin[p]``, transformers'
  ``apply_rotary_pos_emb``), ``p = quant_pos0[b] + t``, tables ``rope_cos`` / ``rope_sin`` ``(T_pos, D)``
  (or their repeated first half, ``(T_pos, D / 2)``).
- rotated sides (``PackedTensor.rotate``, from a ``TensorSpec.rotate`` spec; QuaRot, Ashkboos et al.
  2024): the codes hold ``x @ R``, ``R = rotation_matrix(D)`` orthogonal (``kvbits.quant.rotate``), and
  everything above (scales, outliers) lives in that basis. ``dequantize_packed`` rotates back (``@ R^T``);
  the decode entry points (``decode_attention_reference``, ``decode_attention_triton``) move the step into
  the codes' basis instead (``code_basis``): ``q @ R_K``, the tail ``@ R_K`` / ``@ R_V``, and the output
  ``@ R_V^T``, so the kernels read rotated codes as they read any others. Pre-RoPE keys may not be rotated
  (RoPE acts on pairs of the model's channels; refused).

Full-precision tail (sinks, residual window, not-yet-flushed buffer): ``key_full`` / ``value_full``
``(B, H_kv, T_f, D)`` in a float dtype, keys already rotated (post-RoPE), never Hadamard-rotated: the
model's own K/V.

Ragged batches: sequence ``b`` owns quantized slots ``[0, quant_lens[b])`` and tail slots
``[0, full_lens[b])`` (``(B,)`` int32 each); the slots after them are padding, never read. Masks,
optional: ``quant_mask`` ``(B, T_q)`` and ``full_mask`` ``(B, T_f)`` bool, ``False`` for slots the
sequence must not attend to although they are within its length (left padding of a batch, whose pad
tokens the cache stores like any other; ``quant_mask`` is held as the view of rows padded to whole int32 words,
``word_rows``, which the kernels read as words). Softmax
attention does not depend on the order of the tokens, so the kernels visit quantized tokens then tail
tokens, although in the cache the sinks come first; only RoPE needs true positions (``quant_pos0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvbits.quant.fp8 import fp8_dtype
from kvbits.quant.pack import packed_size, unpack_bits
from kvbits.quant.rotate import check_rotatable, rotate, unrotate
from kvbits.quant.tensor import QuantizedTensor, from_channel_basis, saturate, to_channel_basis
from kvbits.schemes.accounting import PACKED_KINDS

STATIC_TPS = 2**30  # "tokens per scale" of a scale row that covers every slot

__all__ = [
    "PackedStore",
    "PackedTensor",
    "code_basis",
    "decode_attention_reference",
    "dequantize_packed",
    "pack_side",
    "pack_store",
]


@dataclass
class PackedTensor:
    """One side (K or V) of the quantized store; see the module docstring for the layout.

    Attributes:
        codes: ``(B, H_kv, T_q, ceil(D * bits / 8))`` uint8 (fp8: the ``(B, H_kv, T_q, D)`` float8 bytes).
        scale: ``(B, H_kv, T_q // tps, D // cps)`` float16 (a static fp8 scale and ``scale_dtype="fp32"``: float32).
        zero: same shape as ``scale`` (asymmetric) or ``None`` (symmetric).
        bits: 2, 3, 4 or 8.
        tps: tokens per scale; cps: channels per scale.
        head_dim: ``D``.
        kind: ``"int"``, ``"nuq"`` or ``"fp8"``.
        fmt: fp8 format, ``"e4m3"`` or ``"e5m2"`` (``kind="fp8"`` only).
        codebook: ``kind="nuq"``: float16 ``(2**bits,)``.
        outlier_values, outlier_index: ``(B, H_kv, T_q, k)`` float16 / uint8|int16, or ``None``.
        rotate: ``None``, or the rotation the codes were stored under (``"hadamard"``: they decode to
            ``x @ R``, ``kvbits.quant.rotate``); ``dequantize_packed`` rotates back, the decode entry points
            rotate the query, tail and output instead (``code_basis``).
        channel_mean, channel_factor: a ``centre`` / ``smooth`` spec's float16 ``(H_kv, D)`` vectors (the
            layer's, not counted in ``nbytes``): the codes decode to ``(x - mean) / factor`` (before any
            ``rotate``); ``dequantize_packed`` undoes it, the decode entry points move the query and the key
            tail into that basis instead (``code_basis``; keys only).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    tps: int
    cps: int
    head_dim: int
    kind: str = "int"
    fmt: str | None = None
    codebook: torch.Tensor | None = None
    outlier_values: torch.Tensor | None = None
    outlier_index: torch.Tensor | None = None
    rotate: str | None = None
    channel_mean: torch.Tensor | None = None
    channel_factor: torch.Tensor | None = None

    @property
    def has_channel_transform(self) -> bool:
        return self.channel_mean is not None or self.channel_factor is not None

    def __post_init__(self) -> None:
        """Shape-level consistency (no device reads): what the kernels would otherwise read as garbage."""
        if self.kind not in PACKED_KINDS:
            raise ValueError(f"PackedTensor.kind must be one of {PACKED_KINDS}, got {self.kind!r}")
        if self.rotate is not None:
            check_rotatable(self.head_dim, self.rotate)
        if self.kind == "nuq" and (self.codebook is None or tuple(self.codebook.shape) != (2**self.bits,)):
            got = None if self.codebook is None else tuple(self.codebook.shape)
            raise ValueError(
                f"a {self.bits}-bit NUQ PackedTensor needs a ({2**self.bits},) codebook, got {got}"
            )
        if self.kind == "fp8" and (
            self.bits != 8 or self.fmt not in ("e4m3", "e5m2") or self.zero is not None
        ):
            raise ValueError(
                f"an fp8 PackedTensor needs bits=8, fmt e4m3|e5m2 and no zero-point, got bits={self.bits}, "
                f"fmt={self.fmt!r}, zero={'set' if self.zero is not None else None}"
            )
        if (self.outlier_values is None) != (self.outlier_index is None):
            raise ValueError("outlier_values and outlier_index must both be given or both be None")
        if self.outlier_values is not None:
            want = (*self.codes.shape[:3], self.outlier_values.shape[-1])
            if tuple(self.outlier_values.shape) != want or tuple(self.outlier_index.shape) != want:
                raise ValueError(
                    f"outliers must be (B, H_kv, T_q, k) = {want}, got {tuple(self.outlier_values.shape)} and "
                    f"{tuple(self.outlier_index.shape)}"
                )
        self._check_layout()

    def _check_layout(self) -> None:
        """The codes and metadata as the module docstring lays them out: ``codes`` uint8 ``(B, H_kv, T_q, row)`` with
        ``row = ceil(D * bits / 8)`` (fp8: ``D``), ``scale`` (and ``zero``, the same shape) ``(B, H_kv, rows, D / cps)``
        with at least ``T_q // tps`` rows (one for a static ``tps``). The Triton kernels address rows by these
        sizes: codes of another width, dtype (int8 codes sign-extended) or bit count, or scales of another shape,
        were misread without a word (outputs 2.3-2.8 off, or reads past the scales' end) where the reference failed
        inside ``unpack_bits`` or an index. Shapes only."""
        codes, D = self.codes, self.head_dim
        row = packed_size(D, self.bits)  # fp8 (bits 8, checked above): D
        if codes.dtype != torch.uint8 or codes.dim() != 4 or codes.shape[3] != row:
            raise ValueError(
                f"{self.kind} {self.bits}-bit codes of head dim {D} must be uint8 (B, H_kv, T_q, {row}), got "
                f"{codes.dtype} {tuple(codes.shape)}"
            )
        if self.tps < 1 or self.cps < 1 or D % self.cps:
            raise ValueError(f"tps and cps must be positive and cps divide head dim {D}, got tps={self.tps}, cps={self.cps}")
        rows = 1 if self.tps == STATIC_TPS else codes.shape[2] // self.tps
        for name, m in (("scale", self.scale), ("zero", self.zero)):
            if m is not None and (m.dim() != 4 or m.shape[:2] != codes.shape[:2] or m.shape[3] != D // self.cps
                                  or m.shape[2] < rows):  # fmt: skip
                raise ValueError(
                    f"{name} must be (B, H_kv, >= {rows}, {D // self.cps}) = (B, H_kv, T_q // tps, D / cps) for codes "
                    f"{tuple(codes.shape)}, tps={self.tps}, cps={self.cps}; got {tuple(m.shape)}"
                )

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def n_slots(self) -> int:
        return self.codes.shape[2]

    @property
    def n_outliers(self) -> int:
        """Sparse outliers per (token, head) row (0: none)."""
        return 0 if self.outlier_values is None else self.outlier_values.shape[-1]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the kernel reads for this side."""
        ts = (self.codes, self.scale, self.zero, self.codebook, self.outlier_values, self.outlier_index)
        return [t for t in ts if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for all slots: codes + scales (+ zero-points, codebook, outliers)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


INDEX_DTYPES = (torch.int32, torch.int64)  # PackedStore's lengths and positions
BOOL, FLOAT32 = (torch.bool,), (torch.float32,)  # its slot masks; its RoPE tables


@dataclass
class PackedStore:
    """A layer's K/V in the kernel layout (see the module docstring).

    Attributes:
        key, value: quantized stores, both ``None`` or both set (``T_q`` slots each).
        key_full, value_full: ``(B, H_kv, T_f, D)`` float tail (post-RoPE keys), both ``None`` or both set.
        quant_lens, full_lens: ``(B,)`` int32 (or int64) valid slots per sequence.
        rope_cos, rope_sin: ``(T_pos, D)`` float32 tables when the quantized keys are pre-RoPE, else ``None``;
            or ``(T_pos, D / 2)``, the first half of rotate-half tables whose halves repeat. At least one row;
            positions past the last (not checked: device values) read it, on every path.
        quant_pos0: ``(B,)`` int32 position of quantized slot 0 (pre-RoPE keys only), e.g. the sink count;
            negative for a left-padded row (its pad slots, masked, sit before position 0).
        quant_mask, full_mask: ``(B, T_q)`` / ``(B, T_f)`` bool, ``False`` for slots a sequence must not
            attend to (left padding), or ``None`` (every slot within the lengths). ``quant_mask``'s rows may be
            padded to whole words (``word_rows``: a view with a row stride that is a multiple of 4).
        quant_used: ``max(quant_lens)`` when the host knows it and it is below ``T_q`` (a cache's reserved
            slots: ``QuantizedKVCache(max_cache_len=...)``), else ``None``. The kernels split only those
            slots and the reference reads only those; the lengths still decide what each sequence attends.
        uniform_lens: every sequence's lengths are the host's integers, ``quant_used`` (else ``T_q``) quantized
            slots and ``T_f`` tail slots, as ``quant_lens`` / ``full_lens`` hold them. The Triton kernels then
            take the integers instead of loading the tensors, which spares each split a memory round trip before
            its first tile (its loop bounds would wait for the load). Set by the producers that build the lengths
            from those integers (``kvbits.cache.fused.packed_store``; ``pack_store`` without lengths). Like
            ``quant_used``, a fact the host declares: checking it against the tensors would cost a device sync per
            decode step, which the cache's step never makes (``tests/test_cache.py``'s sync checks).
    """

    key: PackedTensor | None
    value: PackedTensor | None
    key_full: torch.Tensor | None
    value_full: torch.Tensor | None
    quant_lens: torch.Tensor
    full_lens: torch.Tensor
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None
    quant_pos0: torch.Tensor | None = None
    quant_mask: torch.Tensor | None = None
    full_mask: torch.Tensor | None = None
    quant_used: int | None = None
    uniform_lens: bool = False
    _layout: tuple[str | None] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Shape- and dtype-level consistency (no device reads): the Triton kernels would otherwise read another side's
        slots or past a tensor's end, or a slot mask that is not bool as bytes, without a word, and the reference fail
        deep inside. Built at every fused decode step
        of every layer, so the passing path reads shapes only."""
        key, value, kf, vf = self.key, self.value, self.key_full, self.value_full
        if (key is None) != (value is None) or (kf is None) != (vf is None):
            raise ValueError(
                "a PackedStore needs both quantized sides or neither, and both tails or neither; got key "
                f"{_given(key)}, value {_given(value)}, key_full {_given(kf)}, value_full {_given(vf)}"
            )
        if key is None and kf is None:
            raise ValueError("an empty PackedStore: give quantized sides, a full-precision tail, or both")
        lens = self.quant_lens.shape
        if len(lens) != 1:
            raise ValueError(f"quant_lens must be (B,), got {tuple(lens)}")
        B, T_q, T_f = lens[0], 0, 0
        if key is not None:
            k, v = key.codes.shape, value.codes.shape
            H, D, T_q = k[1], key.head_dim, k[2]
            if k[:3] != v[:3] or k[0] != B or value.head_dim != D:
                raise ValueError(
                    f"key and value codes must be (B, H_kv, T_q, *) with one head dim, B={B} as quant_lens, got "
                    f"{tuple(k)} (head dim {D}) and {tuple(v)} (head dim {value.head_dim})"
                )
        else:
            H, D = kf.shape[1], kf.shape[-1]
        if kf is not None:
            f = kf.shape
            if f != vf.shape or len(f) != 4 or f[0] != B or f[1] != H or f[3] != D:
                raise ValueError(
                    f"the tails must be (B={B} as quant_lens, H_kv={H}, T_f, D={D}) for keys and values, got "
                    f"{tuple(f)} and {tuple(vf.shape)}"
                )
            T_f = f[2]
        for name, t, want in (("full_lens", self.full_lens, (B,)), ("quant_pos0", self.quant_pos0, (B,)),
                              ("quant_mask", self.quant_mask, (B, T_q)), ("full_mask", self.full_mask, (B, T_f))):
            if t is not None and t.shape != want:
                raise ValueError(f"{name} must be {want} for this store (quant_lens: B={B}), got {tuple(t.shape)}")
        if self.quant_used is not None and not 0 <= self.quant_used <= T_q:
            raise ValueError(f"quant_used must be in [0, {T_q}] (the quantized slots), got {self.quant_used}")
        cos, sin = self.rope_cos, self.rope_sin
        if (cos is None) != (sin is None) or (cos is not None and (
            key is None or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] not in (D, D // 2)
        )):  # fmt: skip
            raise ValueError(
                f"rope_cos and rope_sin must both be None or both (T_pos, D={D}) or half-width (T_pos, {D // 2}) "
                f"tables for quantized pre-RoPE keys; got {_shape(cos)} and {_shape(sin)}, quantized keys {_given(key)}"
            )
        # the Triton kernels read masks as bytes and tables as float32: another dtype is misread (an int32 slot mask:
        # four bytes per slot, outputs 1.3 off) or fails deep inside a launch
        for name, t, want in (("quant_lens", self.quant_lens, INDEX_DTYPES), ("full_lens", self.full_lens, INDEX_DTYPES),
                              ("quant_pos0", self.quant_pos0, INDEX_DTYPES), ("quant_mask", self.quant_mask, BOOL),
                              ("full_mask", self.full_mask, BOOL), ("rope_cos", cos, FLOAT32),
                              ("rope_sin", sin, FLOAT32)):  # fmt: skip
            if t is not None and t.dtype not in want:
                raise TypeError(f"{name} must be {' or '.join(map(str, want))}, got {t.dtype}")
        if cos is not None:
            _check_rope_tables(cos.shape[0], self.quant_pos0)
        self._layout = None  # triton_decode.layout_reason's answer, once asked

    @property
    def quant_slots_used(self) -> int:
        """The quantized slots the kernels walk: ``quant_used``, else all ``T_q``."""
        if self.quant_used is not None:
            return self.quant_used
        return 0 if self.key is None else self.key.n_slots

    @property
    def batch(self) -> int:
        return self.quant_lens.shape[0]

    @property
    def n_kv_heads(self) -> int:
        t = self.key.codes if self.key is not None else self.key_full
        return t.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key.head_dim if self.key is not None else self.key_full.shape[-1]

    @property
    def pre_rope(self) -> bool:
        return self.rope_cos is not None

    @property
    def rotated(self) -> bool:
        """Whether a quantized side holds rotated codes (``PackedTensor.rotate``; see ``code_basis``)."""
        return any(p is not None and p.rotate is not None for p in (self.key, self.value))

    @property
    def device(self) -> torch.device:
        return self.quant_lens.device

    @property
    def nbytes(self) -> int:
        """Bytes of every slot of the store (codes, metadata, tail), padding included."""
        total = sum(p.nbytes for p in (self.key, self.value) if p is not None)
        total += sum(t.numel() * t.element_size() for t in (self.key_full, self.value_full) if t is not None)
        return total


def _check_rope_tables(T_pos: int, pos0: torch.Tensor | None) -> None:
    """``ValueError`` for RoPE tables the decode paths cannot read: without ``quant_pos0`` (the Triton kernel loaded
    each sequence's first position from a one-byte placeholder, the reference failed inside ``apply_rope_at``) or
    without rows (the kernel read before them). Shapes only: whether the tables cover every position
    ``quant_pos0[b] + t`` (``t < quant_lens[b]``) is in device values, which a decode step never reads back (its
    ``PackedStore`` is made at every step); positions past the tables are clamped to their last row on both paths
    (``apply_rope_at``, the kernel's ``T_pos``), as ``kvbits.cache`` never makes them (it sizes its tables)."""
    if pos0 is None:
        raise ValueError("RoPE tables need quant_pos0 (B,), the position of each sequence's first quantized slot")
    if T_pos < 1:
        raise ValueError("the RoPE tables have no rows (T_pos = 0): give (T_pos >= 1, D or D / 2) tables")


def _given(x: object) -> str:
    return "None" if x is None else "set"


def _shape(x: torch.Tensor | None) -> str:
    return "None" if x is None else str(tuple(x.shape))


# --------------------------------------------------------------------------------------------------
# Building the layout from QuantizedTensor blocks
# --------------------------------------------------------------------------------------------------


def _cat_tokens(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the tokens (dim 2); a single contiguous part is returned as is (no copy)."""
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=2).contiguous()


def pack_side(blocks: list[QuantizedTensor], what: str = "key") -> PackedTensor:
    """Concatenate ``QuantizedTensor`` blocks of one side along the tokens into a ``PackedTensor``.

    Blocks ``(B, H_kv, n_i, D)`` in token order, all of one spec (kinds int, nuq, fp8; dense-and-sparse
    outliers allowed). A single block whose tensors are already contiguous is not copied: the
    ``PackedTensor`` then shares their storage (``kvbits.cache`` relies on this to hand its packed blocks
    to the kernel without a copy). Raises ``NotImplementedError`` for float blocks (nothing to unpack:
    attend over them directly). Blocks of a rotated spec keep their rotation (``PackedTensor.rotate``).
    """
    spec = blocks[0].spec
    B, H, _, D = blocks[0].shape
    if spec.kind not in PACKED_KINDS:
        raise NotImplementedError(
            f"{what}: the packed decode layout holds {PACKED_KINDS} codes; kind={spec.kind!r} is not "
            "supported (attend over QuantizedTensor.dequantize() instead)"
        )
    codes, scales, zeros, o_vals, o_idx = [], [], [], [], []
    tps = cps = None
    for i, qt in enumerate(blocks):
        if qt.spec != spec or qt.shape[:2] != (B, H) or qt.shape[3] != D:
            raise ValueError(
                f"{what} block {i}: spec/shape {qt.spec}, {qt.shape} differs from block 0 "
                f"({spec}, {blocks[0].shape})"
            )
        n = qt.n_tokens
        # `expand_to`: the keepdim scale shape on quantize's grouped view; static scales are stored
        # once per layer and broadcast, so they are materialised per group here.
        if spec.kind == "fp8" and qt.static:  # one float32 scale for the layer (static / tensor)
            b_tps, b_cps, shape, expand_to = 0, D, (B, H, 1, 1), (B, H, 1, 1)
        elif spec.kind == "fp8":  # one scale per (token, head) row
            b_tps, b_cps, shape, expand_to = 1, D, (B, H, n, 1), (B, H, n, 1)
        elif spec.granularity == "token":
            g = spec.group_size or D
            b_tps, b_cps, shape, expand_to = 1, g, (B, H, n, D // g), (B, H, n, D // g, 1)
        elif spec.granularity == "channel" and spec.group_size is None:
            # static per-channel (KVQuant keys): one calibrated (H, D) scale for every token; one
            # scale row covers all slots (tps = STATIC_TPS, a constant so kernels do not recompile)
            b_tps, b_cps, shape, expand_to = 0, 1, (B, H, 1, D), (B, H, 1, D)
        elif spec.granularity == "channel":
            G = spec.group_size
            b_tps, b_cps, shape, expand_to = G, 1, (B, H, n // G, D), (B, H, n // G, 1, D)
        else:  # head: (B, H, 1, 1); tensor: (B, 1, 1, 1), repeated per head
            b_tps, b_cps, shape, expand_to = n, D, (B, H, 1, 1), (B, H, 1, 1)
        if tps is None:
            tps, cps = b_tps, b_cps
        elif (tps, cps) != (b_tps, b_cps):
            raise ValueError(
                f"{what} block {i}: {n} tokens; head/tensor blocks must all have the same length"
            )
        codes.append(qt.data.view(torch.uint8) if spec.kind == "fp8" else qt.data)
        scales.append(qt.scale.expand(expand_to).reshape(shape))
        if qt.zero is not None:
            zeros.append(qt.zero.expand(expand_to).reshape(shape))
        if qt.outlier_values is not None:
            o_vals.append(qt.outlier_values)
            o_idx.append(qt.outlier_index)
    codes_t = _cat_tokens(codes)
    if tps == 0:
        for i in range(1, len(blocks)):
            same = torch.equal(scales[i], scales[0]) and (not zeros or torch.equal(zeros[i], zeros[0]))
            if not same:
                raise ValueError(f"{what} block {i}: static scales differ from block 0's")
        scales, zeros, tps = scales[:1], zeros[:1], STATIC_TPS
    for name in ("channel_mean", "channel_factor"):
        first = getattr(blocks[0], name)
        if any(getattr(b, name) is not first and not torch.equal(getattr(b, name), first) for b in blocks[1:]):
            raise ValueError(f"{what}: the blocks of one layer must share its {name}")
    codebook = None
    if spec.kind == "nuq":
        codebook = blocks[0].codebook
        if codebook is None or codebook.shape != (2**spec.bits,):
            raise ValueError(
                f"{what}: NUQ blocks need their layer's ({2**spec.bits},) codebook, got {codebook}"
            )
        if any(b.codebook is not codebook and not torch.equal(b.codebook, codebook) for b in blocks[1:]):
            raise ValueError(f"{what}: NUQ blocks of one layer must share its codebook")
        # on the codes' device: quantize reads a codebook from any device (it moves it), and a block built that way
        # keeps the caller's tensor, which the kernel could not read (found on the H200: a CPU codebook beside CUDA codes)
        codebook = codebook.to(device=codes_t.device, dtype=torch.float16).contiguous()
    # fp8's static scale stays float32 (quantize keeps it so), as do scale_dtype="fp32" scales and zero-points;
    # every other scale is float16 already
    wide = spec.kind == "fp8" and tps == STATIC_TPS or spec.scale_dtype == "fp32"
    meta_dtype = torch.float32 if wide else torch.float16
    return PackedTensor(
        codes=codes_t,
        scale=_cat_tokens(scales).to(meta_dtype).contiguous(),
        zero=_cat_tokens(zeros).to(meta_dtype).contiguous() if zeros else None,
        bits=spec.bits,
        tps=tps,
        cps=cps,
        head_dim=D,
        kind=spec.kind,
        fmt=spec.fmt if spec.kind == "fp8" else None,
        codebook=codebook,
        outlier_values=_cat_tokens(o_vals) if o_vals else None,
        outlier_index=_cat_tokens(o_idx) if o_idx else None,
        rotate=spec.rotate,
        # the layer's vectors, shared by every block (quantize keeps the caller's tensors)
        channel_mean=blocks[0].channel_mean,
        channel_factor=blocks[0].channel_factor,
    )


def _lens(
    lens: torch.Tensor | list[int] | None, default: int, B: int, device: torch.device, what: str
) -> torch.Tensor:
    if lens is None:
        return torch.full((B,), default, dtype=torch.int32, device=device)
    out = torch.as_tensor(lens, dtype=torch.int32, device=device).reshape(-1)
    if out.shape[0] != B:
        raise ValueError(f"{what} must have one entry per sequence ({B}), got {out.shape[0]}")
    if bool((out < 0).any()) or bool((out > default).any()):
        raise ValueError(f"{what} must be in [0, {default}], got {out.tolist()}")
    return out


def pack_store(
    key_blocks: list[QuantizedTensor],
    value_blocks: list[QuantizedTensor],
    key_full: torch.Tensor | None = None,
    value_full: torch.Tensor | None = None,
    *,
    quant_lens: torch.Tensor | list[int] | None = None,
    full_lens: torch.Tensor | list[int] | None = None,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    quant_pos0: torch.Tensor | list[int] | None = None,
    quant_mask: torch.Tensor | None = None,
    full_mask: torch.Tensor | None = None,
) -> PackedStore:
    """Concatenate a layer's quantized blocks (and its full-precision tail) into the kernel layout.

    Args:
        key_blocks, value_blocks: ``QuantizedTensor`` blocks ``(B, H_kv, n_i, D)`` in token order, as
            ``kvbits.quant.quantize`` produces them (int kinds, no outliers); may be empty.
        key_full, value_full: ``(B, H_kv, T_f, D)`` float tail (post-RoPE keys) or ``None``.
        quant_lens, full_lens: ``(B,)`` valid slots per sequence (default: all ``T_q`` / ``T_f``, and the store's
            ``uniform_lens``).
        rope_cos, rope_sin: ``(T_pos, D)`` (or half-width ``(T_pos, D / 2)``) tables when the quantized
            keys are pre-RoPE.
        quant_pos0: ``(B,)`` position of the first quantized slot (default 0), pre-RoPE keys only.
        quant_mask, full_mask: ``(B, T_q)`` / ``(B, T_f)`` bool, ``False`` for slots not to attend to.
    """
    if len(key_blocks) != len(value_blocks):
        raise ValueError(
            f"need as many key blocks as value blocks, got {len(key_blocks)} and {len(value_blocks)}"
        )
    if (key_full is None) != (value_full is None):
        raise ValueError("key_full and value_full must both be given or both be None")
    if not key_blocks and key_full is None:
        raise ValueError("an empty store: give quantized blocks, a full-precision tail, or both")
    key = pack_side(key_blocks, "key") if key_blocks else None
    value = pack_side(value_blocks, "value") if value_blocks else None
    ref = key.codes if key is not None else key_full
    B, H, device = ref.shape[0], ref.shape[1], ref.device
    D = key.head_dim if key is not None else key_full.shape[-1]
    if key is not None and (value.codes.shape[:3] != key.codes.shape[:3] or value.head_dim != D):
        raise ValueError(
            f"key and value stores differ: {tuple(key.codes.shape)} vs {tuple(value.codes.shape)}"
        )
    if key_full is not None:
        if (
            key_full.shape != value_full.shape
            or key_full.dim() != 4
            or key_full.shape[:2] != (B, H)
            or key_full.shape[3] != D
        ):
            raise ValueError(
                f"full-precision tail must be (B={B}, H_kv={H}, T_f, D={D}) for keys and values, got "
                f"{tuple(key_full.shape)} and {tuple(value_full.shape)}"
            )
        key_full, value_full = key_full.contiguous(), value_full.contiguous()
    T_q = key.n_slots if key is not None else 0
    T_f = key_full.shape[2] if key_full is not None else 0
    ql = _lens(quant_lens, T_q, B, device, "quant_lens")
    fl = _lens(full_lens, T_f, B, device, "full_lens")
    if bool(((ql + fl) < 1).any()):
        raise ValueError(
            f"every sequence needs at least one token; quant_lens={ql.tolist()}, full_lens={fl.tolist()}"
        )
    pos0 = None
    if (rope_cos is None) != (rope_sin is None):
        raise ValueError("rope_cos and rope_sin must both be given or both be None")
    if rope_cos is not None:
        if key is None:
            raise ValueError("RoPE tables apply to pre-RoPE quantized keys, but the store has none")
        if rope_cos.shape != rope_sin.shape or rope_cos.dim() != 2 or rope_cos.shape[1] not in (D, D // 2):
            raise ValueError(
                f"rope tables must be (T_pos, D={D}) or half-width (T_pos, {D // 2}), got "
                f"{tuple(rope_cos.shape)}, {tuple(rope_sin.shape)}"
            )
        pos0 = quant_pos0 if quant_pos0 is not None else [0] * B
        pos0 = torch.as_tensor(pos0, dtype=torch.int32, device=device).reshape(-1)
        if pos0.shape[0] != B:
            raise ValueError(f"quant_pos0 must have one entry per sequence ({B}), got {pos0.shape[0]}")
        if int((pos0 + ql).max()) > rope_cos.shape[0]:
            raise ValueError(
                f"rope tables cover {rope_cos.shape[0]} positions, keys reach {int((pos0 + ql).max())}"
            )
        rope_cos, rope_sin = rope_cos.float().contiguous(), rope_sin.float().contiguous()
    elif quant_pos0 is not None:
        raise ValueError("quant_pos0 is only meaningful with rope tables (pre-RoPE keys)")
    qm = _mask(quant_mask, (B, T_q), device, "quant_mask")
    qm = word_rows(qm) if qm is not None else None
    fm = _mask(full_mask, (B, T_f), device, "full_mask")
    fm = fm.contiguous() if fm is not None else None
    return PackedStore(key, value, key_full, value_full, ql, fl, rope_cos, rope_sin, pos0, qm, fm,
                       uniform_lens=quant_lens is None and full_lens is None)  # fmt: skip


def _mask(
    mask: torch.Tensor | None, shape: tuple[int, int], device: torch.device, what: str
) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{what} must be a bool tensor of shape {shape}, got {got}")
    return mask.to(device)


def word_rows(mask: torch.Tensor, slots: int | None = None) -> torch.Tensor:
    """A ``(B, T)`` bool slot mask as the ``(B, slots)`` view (default ``slots = T``; slots past ``T`` are
    ``False``) of a buffer whose rows are whole int32 words (``round_up(slots, 4)`` bytes, the rest ``False``),
    so the decode kernels read it as words (``triton_decode._mask_words``) whatever the slot count; a mask
    of contiguous ``(B, T)`` rows is read a byte at a time unless ``T`` is a multiple of 4."""
    B, T = mask.shape
    slots = T if slots is None else slots
    buf = torch.zeros(B, -(-slots // 4) * 4, dtype=torch.bool, device=mask.device)
    buf[:, :T] = mask
    return buf[:, :slots]


# --------------------------------------------------------------------------------------------------
# Reference dequantization and attention
# --------------------------------------------------------------------------------------------------


def dequantize_packed(p: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All slots of a ``PackedTensor`` back to floats ``(B, H_kv, T_q, D)``.

    Computed in float32 (float64 when ``dtype`` is float64) with the formulas of
    ``kvbits.quant.affine.dequantize_affine`` / ``kvbits.quant.nuq.dequantize_nuq`` / ``dequantize_fp8``,
    so float32 results equal ``QuantizedTensor.dequantize``; outliers are written back last, then a
    rotated side (``p.rotate``) is rotated back (``@ R^T``) and a centred / smoothed one multiplied by its
    factor and shifted by its mean, as ``QuantizedTensor.dequantize`` does.
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    T, D = p.n_slots, p.head_dim
    tps = max(T, 1) if p.tps == STATIC_TPS else p.tps
    grouped = T % tps == 0 and D % p.cps == 0 and p.scale.shape[2] >= T // tps
    if grouped:  # each scale broadcast over its (tps, cps) block: no (B, H, T, D) copy of the scales
        B, H = p.codes.shape[:2]
        blocks = (B, H, T // tps, tps, D // p.cps, p.cps)

        def expand(m: torch.Tensor) -> torch.Tensor:
            return m[:, :, : T // tps].to(work)[:, :, :, None, :, None]
    else:
        rows = torch.arange(T, device=p.codes.device) // p.tps  # slot t -> scale row t // tps
        cols = torch.arange(D, device=p.codes.device) // p.cps  # channel d -> scale column d // cps

        def expand(m: torch.Tensor) -> torch.Tensor:
            return m.to(work)[:, :, rows][:, :, :, cols]

    def view(x: torch.Tensor) -> torch.Tensor:  # codes (B, H, T, D) in the layout ``expand`` broadcasts against
        return x.reshape(blocks) if grouped else x

    # in place on the one float copy of the codes (the same operations and roundings; a + b == b + a exactly)
    if p.kind == "fp8":
        out = view(p.codes.view(fp8_dtype(p.fmt)).to(work)).mul_(expand(p.scale))
    else:
        codes = view(unpack_bits(p.codes, p.bits, p.head_dim))
        if p.kind == "nuq":
            out = p.codebook.to(codes.device, work)[codes.long()]
            if p.zero is None:
                out.mul_(expand(p.scale))
            else:
                out.add_(1.0).mul_(expand(p.scale) / 2).add_(expand(p.zero))
        elif p.zero is None:
            out = codes.to(work).sub_(2 ** (p.bits - 1) - 1).mul_(expand(p.scale))
        else:
            out = codes.to(work).mul_(expand(p.scale)).add_(expand(p.zero))
    if grouped:
        out = out.reshape(p.codes.shape[:3] + (D,))
    if p.outlier_values is not None:
        out = out.scatter(-1, p.outlier_index.long(), p.outlier_values.to(work))
    if p.rotate is not None:
        out = unrotate(out, p.rotate, work)
    if p.has_channel_transform:  # saturated to a float16 / bfloat16 dtype's range, as QuantizedTensor.dequantize
        out = saturate(from_channel_basis(out, p.channel_mean, p.channel_factor), dtype)
    return out.to(dtype)


def _head_slots(p: PackedTensor, n: int) -> PackedTensor:
    """The first ``n`` slots of a side (views): codes and outliers by slot, scales by their rows."""
    rows = -(-n // p.tps)  # static scales (tps = STATIC_TPS): their one row

    def first(t: torch.Tensor | None, k: int) -> torch.Tensor | None:
        return None if t is None else t[:, :, :k]

    return replace(
        p, codes=first(p.codes, n), scale=first(p.scale, rows), zero=first(p.zero, rows),
        outlier_values=first(p.outlier_values, n), outlier_index=first(p.outlier_index, n),
    )  # fmt: skip


def used_slots(store: PackedStore) -> PackedStore:
    """``store`` cut to the quantized slots in use (``quant_used``, views; the store itself when ``None``)."""
    u = store.quant_used
    if u is None or store.key is None or u == store.key.n_slots:
        return store
    qm = None if store.quant_mask is None else store.quant_mask[:, :u]
    return replace(
        store, key=_head_slots(store.key, u), value=_head_slots(store.value, u), quant_mask=qm, quant_used=None
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the halves of the last dim (transformers' ``rotate_half``)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope_at(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos0: torch.Tensor) -> torch.Tensor:
    """Rotate keys ``(B, H_kv, T, D)``: slot ``t`` of sequence ``b`` sits at position ``pos0[b] + t``.

    Tables ``(T_pos, D)``, or ``(T_pos, D / 2)`` for rotate-half tables whose halves repeat; positions
    past the table end or before 0 are clamped (padding slots).
    """
    if cos.shape[-1] * 2 == k.shape[-1]:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    T = k.shape[2]
    pos = (pos0.long()[:, None] + torch.arange(T, device=k.device)[None, :]).clamp(
        0, cos.shape[0] - 1
    )  # (B, T); clamped slots are padding
    c = cos.to(k.dtype)[pos][:, None]  # (B, 1, T, D)
    s = sin.to(k.dtype)[pos][:, None]
    return k * c + rotate_half(k) * s


def _rope_keys(store: PackedStore, dtype: torch.dtype) -> torch.Tensor:
    """A pre-RoPE store's quantized keys ``(B, H_kv, T_q, D)`` in ``dtype``, decoded then rotated to their positions.

    For float16 / bfloat16 the decode (float32) is saturated to ``dtype``'s range, rounded to it, rotated in it (the
    arithmetic of transformers' ``apply_rotary_pos_emb``) and saturated again: a pair past the range after RoPE
    becomes ``+-max``, not inf. Values that stay within the range are bit for bit what they were without it.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    k = saturate(dequantize_packed(store.key, torch.float32), dtype).to(dtype) if half else dequantize_packed(store.key, dtype)
    k = apply_rope_at(k, store.rope_cos, store.rope_sin, store.quant_pos0)
    return saturate(k, dtype)


def materialize(
    store: PackedStore, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense keys, values ``(B, H_kv, T_q + T_f, D)`` in ``dtype`` and the validity mask ``(B, T_q + T_f)``.

    Quantized slots come first, then tail slots; rotated sides are rotated back (``dequantize_packed``) and
    pre-RoPE keys then rotated to their positions (in ``dtype``): the model's K/V. A float16 / bfloat16 ``dtype``
    saturates pre-RoPE keys to its finite range before RoPE and after it (``saturate``): RoPE mixes channels ``d``
    and ``d + D/2``, so a pair of decoded keys within 65504 can rotate to up to ``sqrt(2) * 65504``, inf in float16
    (NaN in attention; ``(-65504, -65504)`` at 45 degrees), where the Triton kernel saturates too (``K_SAT``).
    """
    ks, vs, masks = [], [], []
    store = used_slots(store)
    if store.key is not None:
        if store.pre_rope:
            k = _rope_keys(store, dtype)
        else:
            k = dequantize_packed(store.key, dtype)
        ks.append(k)
        vs.append(dequantize_packed(store.value, dtype))
        T = store.key.n_slots
        m = torch.arange(T, device=store.device)[None, :] < store.quant_lens[:, None].long()
        masks.append(m if store.quant_mask is None else m & store.quant_mask)
    if store.key_full is not None:
        ks.append(store.key_full.to(dtype))
        vs.append(store.value_full.to(dtype))
        T = store.key_full.shape[2]
        m = torch.arange(T, device=store.device)[None, :] < store.full_lens[:, None].long()
        masks.append(m if store.full_mask is None else m & store.full_mask)
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2), torch.cat(masks, dim=1)


def code_basis(
    q: torch.Tensor, store: PackedStore, dtype: torch.dtype | None = None, *, query_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, PackedStore, str | None]:
    """The decode step ``(q, store)`` in the basis its codes are stored in: ``(q', store', out_rotate)``.

    A rotated side holds the codes of ``x @ R`` (``PackedTensor.rotate``), which the kernels decode as
    stored. ``R`` is orthogonal, so ``q . k = (q R_K) . (k R_K)`` for every token and
    ``sum_j p_j v_j = (sum_j p_j v_j R_V) R_V^T``: rotated keys take ``q' = q @ R_K`` and the key tail
    ``key_full @ R_K``; rotated values take the value tail ``value_full @ R_V``, and the caller rotates the
    output back, ``unrotate(out, out_rotate)`` (``out_rotate``: the values' rotation, or ``None``). In
    ``store'`` the sides share the codes and metadata (no copy) and say ``rotate=None``: in that basis they
    decode to exactly the vectors attention needs. A store with no rotated side comes back as is.

    Centred / smoothed keys (``PackedTensor.channel_mean`` / ``channel_factor``) decode to ``(k - m) / f``:
    ``q . k = (q * f) . ((k - m) / f) + q . m``, and ``q . m`` is the same for every key of a query, which
    softmax ignores. So ``q' = q * f`` (each KV head's ``f`` for its ``G`` query heads) and the key tail
    ``(key_full - m) / f``, before a rotation of the keys if there is one (the codes are of
    ``((k - m) / f) @ R``); the output needs nothing.

    Pre-RoPE centred / smoothed keys: RoPE mixes channels ``d`` and ``d + D/2`` at a position-dependent angle,
    so ``q . m`` is not the same for every key and stays with the codes. A factor equal over each such pair
    (``rope_pairs_tied``; what ``kvbits calibrate`` fits) commutes with RoPE: ``q' = q * f``, the (post-RoPE)
    tail ``key_full / f``, and the keys decode to ``code + m / f`` (``channel_mean`` becomes ``m / f`` in
    float32, ``channel_factor`` ``None``). Any other factor stays too. What stays is decoded before RoPE, by
    ``materialize`` (``dequantize_packed``) and by the Triton kernel (``K_MEAN`` / ``K_FACTOR``). In float16 both
    saturate the keys they hold to +-65504 before and after RoPE: with a folded factor that is ``k / f`` (what the
    float16 dot takes), so the keys saturate at ``+-65504 f``, not at the unfolded path's +-65504. Keys the cache
    accepts never reach it (its bound ``65504 / sqrt(2) min(f) - max |m|``, ``cache.fixed.channel_bound``, keeps
    ``|k / f|`` under 65504 before and after RoPE), so the fold stays for float16 queries where ``min(f) < 1``
    (every calibrated factor: normalised to mean 1), where refusing it would cost the unfolded kernel's registers.

    Cost per step: two ``(D, D)`` products over the query heads and the tail (sinks, residual window,
    unflushed buffer), never over the quantized history.

    Args:
        q: ``(B, H_q, 1, D)`` queries (post-RoPE).
        store: the layer's ``PackedStore``, tail in the model's basis.
        dtype: dtype of ``q'`` and the rotated tail; default ``q``'s for ``q'`` and, for the tail, the wider
            of its own and ``q``'s (a rotated tail is new values: kept at the query's precision when that is
            finer, as for float32 queries over a float16 tail). The products run in float32, float64 when
            ``dtype`` or the input is float64.
        query_dtype: dtype of ``q'`` alone, over ``dtype`` (the folded kernel keeps ``q'`` float32 and splits it
            into two float16 halves, where one float16 rounding of ``q @ R`` cost more than its own arithmetic).

    Raises:
        NotImplementedError: pre-RoPE keys stored rotated (the kernels apply RoPE to the dequantized codes,
            which are in the rotated basis); centred / smoothed values.
    """
    key, value = store.key, store.value
    k_rot = None if key is None else key.rotate
    v_rot = None if value is None else value.rotate
    k_chan = key is not None and key.has_channel_transform and not store.pre_rope
    # pre-RoPE centred / smoothed keys: a factor equal over each RoPE pair commutes with RoPE and moves into the
    # query (the rest, code + m / f, is decoded before RoPE); any other factor stays with the codes
    k_fold = (
        key is not None and store.pre_rope and key.channel_factor is not None and rope_pairs_tied(key.channel_factor)
    )
    if value is not None and value.has_channel_transform:
        raise NotImplementedError(
            "values stored centred / smoothed: the decode entry points move only the keys' query and tail "
            "into the codes' basis (attend over materialize()'s K/V instead)"
        )
    if k_rot is None and v_rot is None and not k_chan and not k_fold:
        return q, store, None
    if k_rot is not None and store.pre_rope:
        raise NotImplementedError(
            f"pre-RoPE keys stored with a {k_rot!r} rotation: the decode kernels apply RoPE to the "
            "dequantized codes, which are in the rotated basis (attend over materialize()'s K/V instead)"
        )
    wide = dtype == torch.float64
    q_dtype = query_dtype or dtype or q.dtype

    def rot(x: torch.Tensor | None, kind: str, out: torch.dtype) -> torch.Tensor | None:
        return None if x is None else rotate(x.double() if wide else x, kind).to(out)

    key_full, value_full = store.key_full, store.value_full
    tail_dtype = dtype
    if tail_dtype is None and key_full is not None:
        tail_dtype = torch.promote_types(key_full.dtype, q.dtype)
    if k_chan or k_fold:
        # post-RoPE: q . k = (q * f) . ((k - m) / f) + q . m, and softmax ignores q . m, the same for every key;
        # pre-RoPE with f tied over RoPE pairs: q . RoPE(f * c + m) = (q * f) . RoPE(c + m / f)
        work = torch.float64 if wide else torch.float32
        H_q, H_kv, D = q.shape[1], key.codes.shape[1], key.head_dim
        if key.channel_factor is not None:
            f = key.channel_factor.reshape(H_kv, D).to(q.device, work).repeat_interleave(H_q // H_kv, 0)
            q = q.to(work) * f[None, :, None, :]
        if k_rot is None:  # else the rotation below casts
            q = q.to(q_dtype)
        tail_mean = None if k_fold else key.channel_mean  # pre-RoPE: the tail is the model's keys, divided by f
        if key_full is not None:
            key_full = to_channel_basis(key_full.double() if wide else key_full, tail_mean,
                                        key.channel_factor).to(tail_dtype)  # fmt: skip
        mean = None
        if k_fold and key.channel_mean is not None:
            mean = key.channel_mean.to(work) / key.channel_factor.to(work)
        key = replace(key, channel_mean=mean, channel_factor=None)
    if k_rot is not None:
        q = rot(q, k_rot, q_dtype)
        key = replace(key, rotate=None)
        key_full = rot(key_full, k_rot, tail_dtype)
    if v_rot is not None:
        value = replace(value, rotate=None)
        value_full = rot(value_full, v_rot, tail_dtype)
    return q, replace(store, key=key, value=value, key_full=key_full, value_full=value_full), v_rot


_TIED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # factor tensor -> (its version, tied over RoPE pairs)


def rope_pairs_tied(factor: torch.Tensor) -> bool:
    """Whether ``factor`` ``(H_kv, D)`` is equal at channels ``d`` and ``d + D/2`` (rotate-half RoPE pairs),
    so that it commutes with RoPE (``kvbits calibrate`` fits pre-RoPE factors so: ``tie_rope_pairs``).

    Memoised per tensor and in-place version: decode steps pass the layer's installed vector, so the host sync
    of the comparison happens once per layer, not at every step.
    """
    hit = _TIED.get(factor)
    if hit is not None and hit[0] == factor._version:
        return hit[1]
    D = factor.shape[-1]
    f = factor.reshape(-1, D)
    tied = D % 2 == 0 and torch.equal(f[:, : D // 2], f[:, D // 2 :])
    _TIED[factor] = (factor._version, tied)
    return tied


def decode_attention_reference(
    q: torch.Tensor, store: PackedStore, scale: float | None = None, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One decode step of softmax attention over a packed store (dequantize, then plain attention).

    Rotated sides (``PackedTensor.rotate``) are attended in the codes' basis (``code_basis``), as the
    Triton kernel attends them: the query and tail are rotated, the output rotated back.

    Args:
        q: ``(B, H_q, 1, D)`` queries of the new token (post-RoPE), ``H_q = G * H_kv``.
        store: the layer's ``PackedStore``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        dtype: compute dtype: float32 (the reference), float64 (ground truth in tests), or float16
            ("plain torch at the kernel's precision", the yardstick of the flash-attention tests).

    Returns:
        ``(B, H_q, 1, D)`` in ``q.dtype``. Query head ``j`` attends KV head ``j // G`` (transformers'
        ``repeat_kv``). A sequence whose every slot is masked gets zeros, as torch's SDPA gives (not NaN).
    """
    if not q.is_floating_point():  # the output would be cast back to it: integer attention outputs
        raise TypeError(f"q must be a floating-point tensor (float16, bfloat16, float32, float64), got {q.dtype}")
    H_kv = store.n_kv_heads
    B, H_q, one, D = q.shape if q.dim() == 4 else (-1, -1, -1, -1)  # any other rank: the message below
    if one != 1 or D != store.head_dim or B != store.batch or H_q % H_kv:
        raise ValueError(
            f"q must be (B={store.batch}, H_q (a multiple of H_kv={H_kv}), 1, D={store.head_dim}), "
            f"got {tuple(q.shape)}"
        )
    G = H_q // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q_dtype = q.dtype
    q, store, out_rotate = code_basis(q, store, dtype)
    k, v, mask = materialize(store, dtype)
    qg = q.reshape(B, H_kv, G, D).to(dtype)
    s = torch.einsum("bhgd,bhtd->bhgt", qg, k) * scale  # (B, H_kv, G, T)
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgt,bhtd->bhgd", p, v)
    # no slot to attend to: zeros, as SDPA (and the kernel's merge) give, rather than softmax's 0 / 0 (no host sync)
    out = out.masked_fill(~mask.any(dim=1)[:, None, None, None], 0.0).reshape(B, H_q, 1, D)
    if out_rotate is not None:  # the output is in the values' basis: rotate it back
        return unrotate(out, out_rotate, q_dtype)
    return out.to(q_dtype)
