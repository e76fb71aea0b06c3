"""Exact byte accounting for a scheme: the single formula the planner and the tests share.

The cache (``kvbits.cache``) stores real tensors; ``memory_report()`` sums their ``nbytes``. The
planner (``kvbits.plan``) calls the functions here. Tests hold the two equal, so neither can forget
a byte of metadata (scales, zero-points, outliers, sinks, residual window).

Storage conventions (one sequence, one layer, one of K or V, ``H`` KV heads, head dim ``D``):

- integer / NUQ codes: bit-packed along ``D``, ``ceil(D * bits / 8)`` bytes per (token, head) row;
- scales and zero-points: float16, 2 bytes each (zero-point = group minimum, asymmetric only); float32, 4 bytes,
  for dynamic specs with ``scale_dtype="fp32"`` (``TensorSpec.scale_bytes``);
- FP8 codes: 1 byte per element, per-token scales as above, static scales in the layer's fixed bytes;
- dense-and-sparse outliers: ``outlier_count(D, frac)`` per row, each a float16 value and an index
  (uint8 when ``D <= 256``, else int16);
- full-precision tokens (sinks, residual window, not-yet-flushed): the cache's float dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvbits.schemes.spec import KVScheme, TensorSpec

SCALE_BYTES = 2  # float16 static scales, codebooks, channel vectors, outlier values (dynamic: spec.scale_bytes)
PACKED_KINDS = ("int", "nuq", "fp8")  # kinds stored as codes + metadata: the fused decode kernel's layout


@dataclass(frozen=True)
class TokenSplit:
    """How the ``T`` tokens seen so far are held by one layer.

    ``sink`` + ``quantized`` + ``full`` tokens are stored; ``dropped`` tokens left a sliding window.
    ``full`` counts the not-yet-flushed buffer (residual window) only, not the sinks.
    """

    sink: int
    quantized: int
    full: int
    dropped: int = 0

    @property
    def stored(self) -> int:
        return self.sink + self.quantized + self.full


def flushed_tokens(scheme: KVScheme, n_after_sinks: int) -> int:
    """Tokens moved into the quantized store once ``n_after_sinks`` non-sink tokens were seen.

    The buffer is flushed ``block`` tokens at a time whenever it holds ``residual + block`` tokens,
    so the count is ``block * floor((n - residual) / block)`` for ``n >= residual``.
    """
    if scheme.is_identity:
        return 0
    excess = n_after_sinks - scheme.residual
    return 0 if excess <= 0 else scheme.block * (excess // scheme.block)


def sliding_falls_back(scheme: KVScheme, window: int) -> bool:
    """A sliding-window layer keeps full precision when the buffer alone could outgrow the window."""
    return scheme.is_identity or scheme.residual + scheme.block - 1 > window - 1


def token_split(scheme: KVScheme, n_tokens: int, sliding_window: int | None = None) -> TokenSplit:
    """Where each of ``n_tokens`` seen tokens lives in one layer (see ``TokenSplit``).

    Full-attention layers: the first ``sinks`` tokens stay exact, ``flushed_tokens`` are quantized,
    the rest are the full-precision buffer. Sliding-window layers (window ``W``) need only the last
    ``W - 1`` tokens for the next step: sinks are not kept, quantized blocks are dropped once all
    their tokens left the window, and when ``residual + block - 1 > W - 1`` the layer stores its
    window in full precision (``sliding_falls_back``). ``scheme`` is the layer's own (``for_layer``).

    Raises:
        ValueError: ``n_tokens < 0``, ``sliding_window < 1``, or a mixed ``scheme``.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if sliding_window is not None and sliding_window < 1:  # 0 or less held a negative count of tokens (bytes)
        raise ValueError(f"sliding_window must be >= 1 (the cache's rule) or None, got {sliding_window}")
    if scheme.is_mixed:
        raise ValueError(f"token_split is per layer: pass {scheme.name!r}.for_layer(layer_idx), not the mixed scheme")
    if sliding_window is None:
        sink = min(n_tokens, scheme.sinks) if not scheme.is_identity else 0
        q = flushed_tokens(scheme, n_tokens - sink)
        return TokenSplit(sink=sink, quantized=q, full=n_tokens - sink - q)
    keep_from = max(0, n_tokens - sliding_window + 1)  # first token index still needed
    if sliding_falls_back(scheme, sliding_window):
        full = n_tokens - keep_from
        return TokenSplit(sink=0, quantized=0, full=full, dropped=keep_from)
    n_blocks = flushed_tokens(scheme, n_tokens) // scheme.block
    first_kept = min(n_blocks, keep_from // scheme.block)
    q = (n_blocks - first_kept) * scheme.block
    full = n_tokens - n_blocks * scheme.block
    return TokenSplit(sink=0, quantized=q, full=full, dropped=first_kept * scheme.block)


def outlier_count(head_dim: int, frac: float) -> int:
    """Outliers kept per (token, head) row: ``ceil(frac * D)`` (0 when ``frac == 0``), the product rounded to 9
    decimals first: in floats 0.07 * 100 is 7.000000000000001, whose ceiling kept 8 outliers for a 7 % request."""
    return 0 if frac <= 0 else math.ceil(round(frac * head_dim, 9))


def outlier_index_bytes(head_dim: int) -> int:
    return 1 if head_dim <= 256 else 2


def packed_row_bytes(head_dim: int, bits: int) -> int:
    """Bytes of one bit-packed row of ``head_dim`` codes."""
    return math.ceil(head_dim * bits / 8)


def float_bytes(fmt_or_bits: str | int) -> int:
    if isinstance(fmt_or_bits, int):
        return fmt_or_bits // 8
    return {"fp16": 2, "bf16": 2, "fp32": 4}[fmt_or_bits]


def token_groups_fit(spec: TensorSpec, head_dim: int) -> bool:
    """Whether ``spec`` can store rows of ``head_dim`` channels: its per-token groups (if any) divide
    ``D`` (the quantizer refuses a partial group), and a Hadamard rotation has a power-of-two ``D``."""
    g = spec.group_size
    if not rotation_fits(spec, head_dim):
        return False
    return not (spec.is_quantized and spec.granularity == "token" and g is not None and head_dim % g)


def rotation_fits(spec: TensorSpec, head_dim: int) -> bool:
    """Whether ``spec``'s rotation (if any) fits ``head_dim``: Hadamard needs a power of two."""
    return spec.rotate is None or (head_dim >= 2 and not head_dim & (head_dim - 1))


def check_head_dim(spec: TensorSpec, head_dim: int) -> None:
    """``ValueError`` when ``spec`` can not store rows of ``head_dim`` channels (``token_groups_fit``):
    counting a partial group would plan a cache that can not exist."""
    if not token_groups_fit(spec, head_dim):
        if not rotation_fits(spec, head_dim):
            raise ValueError(f"a {spec.rotate} rotation needs a power-of-two head_dim, got {head_dim}")
        raise ValueError(f"per-token groups of {spec.group_size} channels do not divide head_dim {head_dim}")


def check_scheme_head_dim(scheme: KVScheme, head_dim: int) -> None:
    """``check_head_dim`` for both sides of ``scheme`` (every layer's, for a mixed scheme); the
    ``ValueError`` names the scheme and the side."""
    for sub in scheme.layer_schemes() if scheme.is_mixed else [scheme]:
        for side, reason in _side_errors(sub, head_dim):
            raise ValueError(f"scheme {scheme.name!r} can not store head_dim {head_dim}: {side}s: {reason}")


def _side_errors(sub: KVScheme, head_dim: int) -> Iterator[tuple[str, str]]:
    """``(side, reason)`` for each side of the one-layer scheme ``sub`` that can not store rows of ``head_dim``
    channels (``check_head_dim``'s reason); none for an identity (full-precision) scheme."""
    if sub.is_identity:
        return
    for side, spec in (("key", sub.key), ("value", sub.value)):
        try:
            check_head_dim(spec, head_dim)
        except ValueError as exc:
            yield side, str(exc)


def check_scheme_layer_head_dims(
    scheme: KVScheme, head_dims: Mapping[int, int], windows: Mapping[int, int | None] | None = None
) -> None:
    """``check_head_dim`` of the scheme each layer is stored by (``scheme.for_layer(i)``) against that layer's own
    head dim: ``head_dims`` maps each layer with K/V to its ``D`` (Gemma 4's global layers are wider than its
    sliding ones). ``windows``: each layer's sliding window (None: full attention); a sliding layer whose window
    its scheme keeps in full precision (``sliding_falls_back``, the cache's rule) is not checked, as it quantizes
    nothing. The ``ValueError`` names the scheme and the side, and the layers when their head dims differ."""
    windows = windows or {}
    head_dims = {
        i: d for i, d in head_dims.items()
        if (w := windows.get(i)) is None or not sliding_falls_back(scheme.for_layer(i), w)
    }  # fmt: skip
    by_dim: dict[int, list[int]] = {}
    for i, d in head_dims.items():
        by_dim.setdefault(d, []).append(i)
    for d, layers in by_dim.items():
        failed: dict[tuple[str, str], list[int]] = {}  # (side, reason) -> layers
        for i in layers if scheme.is_mixed else layers[:1]:  # a uniform scheme: one check per head dim
            for side, reason in _side_errors(scheme.for_layer(i), d):
                failed.setdefault((side, reason), []).append(i)
        if not failed:
            continue
        (side, reason), bad = next(iter(failed.items()))
        if not scheme.is_mixed:
            bad = layers
        where = ""
        if len(by_dim) > 1 or len(bad) < len(head_dims):
            listed = ", ".join(map(str, bad[:6])) + (", ..." if len(bad) > 6 else "")
            others = ", ".join(str(x) for x in sorted(by_dim) if x != d)
            where = f" of layer{'s' if len(bad) > 1 else ''} {listed}" + (
                f" (other layers: head_dim {others})" if others else ""
            )
        raise ValueError(f"scheme {scheme.name!r} can not store head_dim {d}{where}: {side}s: {reason}")


def quantized_bytes(spec: TensorSpec, n_tokens: int, n_heads: int, head_dim: int) -> int:
    """Bytes for ``n_tokens`` quantized tokens of one sequence (codes + per-block metadata + outliers).

    ``n_tokens`` must be a whole number of flush blocks for per-channel/head/tensor granularity,
    which ``token_split`` guarantees.
    """
    if spec.kind == "float":
        return n_tokens * n_heads * head_dim * float_bytes(spec.fmt)
    check_head_dim(spec, head_dim)
    rows = n_tokens * n_heads
    if spec.kind == "fp8":
        codes = rows * head_dim
        meta = rows * spec.scale_bytes if spec.granularity == "token" else 0
    else:
        codes = rows * packed_row_bytes(head_dim, spec.bits)
        per_scale = spec.scale_bytes * (2 if spec.has_zero_point else 1)
        if spec.static:
            meta = 0
        elif spec.granularity == "token":
            groups = head_dim // (spec.group_size or head_dim)
            meta = rows * groups * per_scale
        elif spec.granularity == "channel":
            if n_tokens % spec.group_size:
                raise ValueError(f"{n_tokens} tokens is not a whole number of {spec.group_size}-token groups")
            meta = (n_tokens // spec.group_size) * n_heads * head_dim * per_scale
        else:  # head / tensor: one scale set per flushed block, counted by the caller via n_blocks
            meta = 0
    k = outlier_count(head_dim, spec.outlier_frac)
    sparse = rows * k * (SCALE_BYTES + outlier_index_bytes(head_dim))
    return codes + meta + sparse


def per_block_meta_bytes(spec: TensorSpec, n_heads: int) -> int:
    """Metadata stored once per flushed block (head / tensor granularity, dynamic scales)."""
    if spec.kind != "int" and spec.kind != "nuq" or spec.static:
        return 0
    per_scale = spec.scale_bytes * (2 if spec.has_zero_point else 1)
    if spec.granularity == "head":
        return n_heads * per_scale
    if spec.granularity == "tensor":
        return per_scale
    return 0


def fixed_layer_bytes(spec: TensorSpec, n_heads: int, head_dim: int) -> int:
    """Per-layer bytes that do not grow with tokens or batch: static scales, NUQ codebooks, the float16
    ``(H_kv, D)`` channel means (``centre``) and smoothing factors (``smooth``).

    Static integer / NUQ scales count as ``kvbits calibrate`` writes them per channel, ``(H_kv, D)``; the granularities it
    does not calibrate (scales installed with ``set_static_qparams``) as ``quantize`` groups them: at ``token`` one
    per KV head and channel group (``D / group_size`` of them, one without ``group_size``), at ``head`` one per KV
    head, at ``tensor`` one. The cache stores the shape it is given, so another one (``(H_kv, 1, D)``) makes
    ``memory_report()`` differ from this."""
    if not spec.is_quantized:
        return 0
    total = 0
    if spec.static:
        per_scale = SCALE_BYTES * (2 if spec.has_zero_point else 1)
        if spec.kind == "fp8":  # float32 scales: one per layer, or one per KV head
            total += 4 * (n_heads if spec.granularity == "head" else 1)
        elif spec.granularity == "channel":
            total += n_heads * head_dim * per_scale
        elif spec.granularity == "token":  # one per (head, channel group), as ``quantize`` groups the channels
            total += n_heads * (head_dim // (spec.group_size or head_dim)) * per_scale
        elif spec.granularity == "head":
            total += n_heads * per_scale
        else:
            total += per_scale
    if spec.kind == "nuq":
        total += (2**spec.bits) * SCALE_BYTES
    total += (int(spec.centre) + int(spec.smooth is not None)) * n_heads * head_dim * SCALE_BYTES
    return total


def layer_bytes(
    scheme: KVScheme,
    n_tokens: int,
    *,
    batch: int,
    n_heads: int,
    head_dim: int,
    full_dtype_bytes: int = 2,
    sliding_window: int | None = None,
) -> dict[str, int]:
    """Bytes one layer holds after ``n_tokens`` tokens, for ``batch`` sequences of equal length.

    Returns ``{"key": ..., "value": ..., "full": ..., "quantized": ..., "fixed": ...}`` where
    ``key``/``value`` are the totals of each side and the other three break the total down.
    ``scheme`` is the layer's own: a mixed scheme's ``for_layer(i)``.
    """
    if scheme.is_mixed:
        raise ValueError(
            f"layer_bytes counts one layer: pass the scheme that layer is stored by, "
            f"{scheme.name!r}.for_layer(layer_idx), not the mixed scheme"
        )
    split = token_split(scheme, n_tokens, sliding_window)
    fallback = sliding_window is not None and sliding_falls_back(scheme, sliding_window)
    if not (scheme.is_identity or fallback):  # this layer will quantize (once enough tokens arrive)
        check_scheme_head_dim(scheme, head_dim)
    out = {"key": 0, "value": 0, "full": 0, "quantized": 0, "fixed": 0}
    n_blocks = split.quantized // scheme.block if split.quantized else 0
    for side, spec in (("key", scheme.key), ("value", scheme.value)):
        if scheme.is_identity:
            # identity schemes (fp16, bf16) store every kept token in their own float format
            full, quant, fixed = batch * split.stored * n_heads * head_dim * float_bytes(spec.fmt), 0, 0
        elif fallback:
            full, quant, fixed = batch * split.stored * n_heads * head_dim * full_dtype_bytes, 0, 0
        else:
            full = batch * (split.sink + split.full) * n_heads * head_dim * full_dtype_bytes
            quant = batch * (
                quantized_bytes(spec, split.quantized, n_heads, head_dim)
                + n_blocks * per_block_meta_bytes(spec, n_heads)
            )
            fixed = fixed_layer_bytes(spec, n_heads, head_dim)
        out[side] = full + quant + fixed
        out["full"] += full
        out["quantized"] += quant
        out["fixed"] += fixed
    return out


ROPE_TABLE_ROWS = 1024  # the fused path's RoPE tables grow in multiples of this many positions
ROPE_TABLE_GROWTH = 1.25  # ... to 1.25x the positions a step needs


def rope_table_positions(n_positions: int) -> int:
    """Rows of the fused decode path's RoPE tables when a step needs ``n_positions`` positions
    (``kvbits.cache.fused.RopeTableCache``): ``1.25 * n`` rounded up to a multiple of 1024, more than ``n``."""
    need = max(n_positions * ROPE_TABLE_GROWTH, n_positions + 1)
    return ROPE_TABLE_ROWS * math.ceil(need / ROPE_TABLE_ROWS)


def rope_table_bytes(n_positions: int, width: int) -> int:
    """float32 cos + sin tables of ``rope_table_positions(n_positions)`` rows by ``width`` columns (``D / 2``
    for rotate-half RoPE, whose tables repeat their halves; ``D`` otherwise). Once per model and device,
    not per sequence: fused decode over pre-RoPE keys keeps them beside the K/V (not in ``layer_bytes``)."""
    return 2 * 4 * rope_table_positions(n_positions) * width


def average_bits(scheme: KVScheme, head_dim: int = 128, n_heads: int = 8, n_layers: int | None = None) -> float:
    """Asymptotic bits per cached element (K and V averaged), metadata included.

    Counts codes, scales, zero-points and outliers of the quantized store, as the context grows
    without bound (sinks, the residual window and per-layer constants vanish in the limit). The
    planner reports the exact figure at a given context instead. A mixed scheme averages its layers'
    figures over ``n_layers`` layers (required for it: the share of each override depends on it).

    Raises:
        ValueError: the scheme can not store rows of ``head_dim`` channels (``check_scheme_head_dim``),
            or a mixed scheme without ``n_layers`` (or with overrides beyond it).
    """
    if scheme.is_mixed:
        if n_layers is None or n_layers < 1:
            raise ValueError(f"mixed scheme {scheme.name!r}: average bits need n_layers (the model's layer count)")
        scheme.check_layer_count(n_layers)
        per = [average_bits(scheme.for_layer(i), head_dim, n_heads) for i in range(n_layers)]
        return sum(per) / n_layers
    check_scheme_head_dim(scheme, head_dim)
    bits = 0.0
    for spec in (scheme.key, scheme.value):
        if not spec.is_quantized:
            bits += float_bytes(spec.fmt) * 8
            continue
        n = scheme.block
        b = quantized_bytes(spec, n, n_heads, head_dim) + per_block_meta_bytes(spec, n_heads)
        bits += 8 * b / (n * n_heads * head_dim)
    return bits / 2
