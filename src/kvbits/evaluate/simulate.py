"""One-pass simulation of a quantized KV cache: what token-by-token decoding would compute, in one forward.

``simulate(model, scheme)`` is a context manager that switches a stock transformers model to the
attention function ``"kvbits_simulate"`` (registered through transformers' public
``AttentionInterface``, selected with ``model.set_attn_implementation``) and always switches it back.
Inside, one forward over a window of ``T`` tokens gives, for every query position ``t``, the
attention output that a ``QuantizedKVCache`` following ``scheme`` would have produced when token
``t`` was decoded:

- full-attention layers: key/value ``j <= t`` is exact for ``j < S`` (``S = min(T, sinks)``),
  quantized for ``S <= j < S + flushed_tokens(scheme, t + 1 - S)``, exact otherwise (the
  full-precision buffer). Quantized block ``b`` covers tokens ``[S + b*block, S + (b+1)*block)`` and is
  ``fake_quantize`` of that slice alone, exactly as the cache flushes it. With no residual window
  (``int4-token``: residual 0, block 1) token ``t``'s own K/V is already quantized when it attends,
  as in the cache, which flushes before it returns;
- sliding-window layers (window ``W``, keys ``j > t - W``): no sinks, and full precision when
  ``sliding_falls_back(scheme, W)`` (``kvbits.schemes.accounting``);
- identity schemes (``fp16``, ``bf16``): every token cast to the format and back;
- pre-RoPE key specs: keys un-rotated, quantized, rotated back (``kvbits.quant.rope``); static
  scales and NUQ codebooks come from a ``kvbits.calibrate`` artifact (``calibration=``);
- ``semantics="prefill"``: queries ``t < prompt_len`` see everything exact (a full-precision prefill),
  later queries follow the decode rule above.

Memory stays bounded at long context: attention runs in chunks of ``chunk_size`` queries and never
builds a ``T x T`` score matrix. For a chunk ``[a, b)`` the quantized region ``[S, hi(t))`` grows
with ``t``, so keys below ``hi(a)`` are quantized for every query of the chunk and only the band
``[hi(a), b)`` differs per query. One attention call covers ``[exact sinks | quantized keys up to
hi(b-1) | exact keys from hi(a)]``, the band appearing twice, with a boolean mask choosing one copy
per query. The chunk layouts and masks depend only on positions, scheme and window, so they are
built once per forward and shared by every layer of a kind. GQA goes through SDPA's
``enable_gqa``: K/V are never repeated.

Restriction: batch rows must be unpadded (no 2-D ``attention_mask`` with zeros): the mask is built
here from positions, and a padded ``attention_mask`` raises ``ValueError``. Masks the simulator does not build are
refused with ``ValueError`` naming ``mode='stream'``: ALiBi position biases (Falcon) and chunked attention (Llama 4,
where a query sees its own chunk, not a sliding window) over more than one chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvbits._model import (
    attention_modules,
    check_model,
    hybrid_layers,
    shared_attention,
    shared_attention_note,
)
from kvbits.evaluate.entropy import attention_entropy
from kvbits.quant.tensor import FLOAT_DTYPES, quantize, saturate
from kvbits.schemes.accounting import sliding_falls_back
from kvbits.schemes.presets import get_scheme
from kvbits.schemes.spec import KVScheme, TensorSpec

logger = logging.getLogger(__name__)

__all__ = [
    "IMPLEMENTATION",
    "SEMANTICS",
    "Simulation",
    "first_quantizing_context",
    "quantized_bounds",
    "quantized_keys_seen",
    "simulate",
    "simulated_kv",
]

IMPLEMENTATION = "kvbits_simulate"
SEMANTICS = ("decode", "prefill")
DEFAULT_CHUNK = 256

_ACTIVE: contextvars.ContextVar[Simulation | None] = contextvars.ContextVar("kvbits_simulation", default=None)
_SLIDING_TYPES = ("sliding_attention", "chunked_attention")


@dataclass
class Simulation:
    """The per-forward state of one ``simulate`` context (read it after each forward).

    Attributes:
        scheme: the scheme being simulated.
        semantics: ``"decode"`` or ``"prefill"``.
        prompt_len: queries ``t < prompt_len`` see exact K/V (prefill semantics), else 0.
        attn_layers: layers whose attention-output error and attention entropy are recorded.
        chunk_size: queries per attention chunk.
        attn_error: layer -> ``(B, T)`` float32 relative error ``||o_q - o_ref|| / ||o_ref||`` per
            query position of the last forward, ``o_ref`` being the attention output with exact K/V
            for the same queries (norms over all heads and channels).
        attn_entropy: layer -> ``(B, T)`` float32 entropy (nats) of each query's attention
            distribution over the keys it sees in the last forward, mean over query heads
            (:func:`kvbits.evaluate.entropy.attention_entropy`), with the quantized K/V.
        attn_entropy_ref: the same with exact K/V for the same queries (the ``o_ref`` attention).
        calls: attention calls made in this context (one per layer per forward).
        clipped: values saturated against their scales in the last forward, summed over layers:
            ``{"keys", "keys_elements", "values", "values_elements"}`` (calibration mismatch signal).
    """

    scheme: KVScheme
    semantics: str = "decode"
    prompt_len: int = 0
    attn_layers: frozenset[int] = frozenset()
    chunk_size: int = DEFAULT_CHUNK
    attn_error: dict[int, torch.Tensor] = field(default_factory=dict)
    attn_entropy: dict[int, torch.Tensor] = field(default_factory=dict)
    attn_entropy_ref: dict[int, torch.Tensor] = field(default_factory=dict)
    calls: int = 0
    clipped: dict[str, int] = field(default_factory=dict)
    _modules: frozenset[int] = frozenset()
    _rotary_layers: dict[int, Any] = field(default_factory=dict)
    _qkw: dict[tuple[int, str], dict[str, Any]] = field(default_factory=dict)
    _layouts: dict[tuple, tuple] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget what the previous forward recorded."""
        self.attn_error = {}
        self.attn_entropy = {}
        self.attn_entropy_ref = {}
        self.calls = 0
        self.clipped = {}

    def _layout(
        self, T: int, window: int | None, device: torch.device, *, exact: bool = False, scheme: KVScheme | None = None
    ):
        """``(lo, hi per position, chunk plans)`` for ``scheme`` (a layer's; default this scheme), cached per
        (T, window, device, scheme)."""
        scheme = self.scheme if scheme is None else scheme
        key = (T, window, str(device), exact, scheme.sinks, scheme.residual, scheme.block, scheme.is_identity)
        if key not in self._layouts:
            if len(self._layouts) > 8:  # windows of many lengths: keep memory bounded
                self._layouts.clear()
            pos = torch.arange(T, device=device)
            prompt = self.prompt_len if self.semantics == "prefill" else 0
            if prompt >= T:  # every query would sit in the exact prefill: nothing measured, silently
                raise ValueError(
                    f"semantics='prefill' with prompt_len={prompt} and a forward of {T} tokens: no query comes "
                    "after the prompt, so nothing would be quantized; give prompt_len < the sequence length"
                )
            lo, hi = quantized_bounds(scheme, pos, T, sliding_window=window, prompt_len=prompt)
            self._layouts[key] = (lo, hi, _plan(T, self.chunk_size, lo, hi, window, exact=exact))
        return self._layouts[key]


# --------------------------------------------------------------------------------------- bounds


def _flushed(scheme: KVScheme, n: torch.Tensor) -> torch.Tensor:
    """``flushed_tokens`` for a tensor of non-sink token counts."""
    excess = n - scheme.residual
    return torch.where(excess > 0, scheme.block * torch.div(excess, scheme.block, rounding_mode="floor"), 0)


def quantized_bounds(
    scheme: KVScheme,
    positions: torch.Tensor,
    n_tokens: int,
    *,
    sliding_window: int | None = None,
    prompt_len: int = 0,
) -> tuple[int, torch.Tensor]:
    """Which keys query ``t`` sees quantized: ``[lo, hi(t))`` for each ``t`` in ``positions``.

    Every other visible key (``j <= t``, and ``j > t - W`` in a sliding layer) is exact. ``lo`` is
    a constant: the number of sinks ``S = min(n_tokens, sinks)`` in full-attention layers, 0 otherwise.
    For identity schemes "quantized" means cast to the scheme's float format.

    Args:
        scheme: the scheme.
        positions: query positions ``(c,)``, int64.
        n_tokens: window length ``T``.
        sliding_window: ``W`` for a sliding-window layer.
        prompt_len: queries ``t < prompt_len`` see nothing quantized (prefill semantics).
    """
    if scheme.is_identity:
        lo, hi = 0, positions + 1
    elif sliding_window is not None and sliding_falls_back(scheme, sliding_window):
        return 0, torch.zeros_like(positions)
    else:
        lo = 0 if sliding_window is not None else min(n_tokens, scheme.sinks)
        hi = lo + _flushed(scheme, positions + 1 - lo)
    if prompt_len > 0:
        hi = torch.where(positions < prompt_len, lo, hi)
    return lo, hi


def quantized_keys_seen(model: Any, scheme: KVScheme, n_tokens: int) -> int:
    """Keys, summed over ``model``'s attention layers, that the last scored query of a window of ``n_tokens``
    tokens (position ``n_tokens - 2``, which predicts the last token) sees stored quantized (cast, for an
    identity layer) by :func:`quantized_bounds`, the simulator's and the cache's rule, in either semantics.

    0 means the scheme changed nothing that is scored: its sinks and full-precision window hold every token the
    window's predictions attend to (``kivi-2``, 128 exact tokens, at a context of 128), or every layer is a
    sliding one too short for its buffer. A :func:`kvbits._model.shared_attention` block counts once for each
    ``hybrid`` layer of the config (the layers that call it). Once a layer holds a quantized key it keeps one in view for every later
    query, so the last scored query decides. Layers' windows are read from the modules and their config
    (``_layer_window``); a model that passes its window only at call time (Mistral's ``sliding_window`` kwarg,
    no ``layer_types``) may attend either way, and the larger count is taken, so 0 is never said wrongly.
    """
    t = n_tokens - 2
    if t < 0:
        return 0
    pos = torch.tensor([t])
    seen = 0
    calls = [(m, m.layer_idx) for m in attention_modules(model) if m.layer_idx >= 0]
    shared = shared_attention(model)  # Zamba's (no layer_idx: it was 'quantizes nothing at any context') / Zamba2's
    if shared:
        calls += [(shared[0], i) for i in hybrid_layers(model) or [-1]]
    for m, idx in calls:
        layer = scheme.for_layer(idx)
        windows = [_layer_window(m, {})]
        config = getattr(m, "config", None)
        passed = getattr(config, "sliding_window", None)  # what a Mistral-style layer passes at call time
        if windows[0] is None and getattr(config, "layer_types", None) is None and isinstance(passed, int) and passed > 0:
            windows.append(passed)
        counts = []
        for window in windows:
            lo, hi = quantized_bounds(layer, pos, n_tokens, sliding_window=window)
            oldest = 0 if window is None else max(0, t - window + 1)  # keys j > t - W are in the window
            counts.append(max(0, int(hi[0]) - max(lo, oldest)))
        seen += max(counts)
    return seen


def first_quantizing_context(model: Any, scheme: KVScheme, limit: int = 1 << 24) -> int | None:
    """The shortest window (tokens) at which :func:`quantized_keys_seen` is positive, or None up to ``limit``
    (every layer a sliding one too short for the scheme's buffer)."""
    hi = 2
    while quantized_keys_seen(model, scheme, hi) == 0:
        if hi >= limit:
            return None
        hi = min(limit, hi * 2)
    lo = hi // 2  # nothing seen at lo (or lo < 2); seen at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if quantized_keys_seen(model, scheme, mid) else (mid, hi)
    return hi


# ----------------------------------------------------------------------------------- quantizing


def _blocks_fake_quantize(
    x: torch.Tensor, spec: TensorSpec, block: int, *, clipped: dict[str, int] | None = None, side: str = "", **kw: Any
) -> torch.Tensor:
    """Fake-quantize ``x`` ``(B, H, n*block, D)`` block by block, each block on its own.

    Blocks are folded into the batch dimension for one ``fake_quantize`` call: every granularity
    reduces at most over one block of one sequence, so this equals one call per block. ``kw``:
    calibrated ``static_scale`` / ``static_zero`` / ``codebook`` (broadcast over the batch).
    ``clipped``: when given, ``clipped[side]`` counts values saturated against their scales (static
    scales from calibration clip data beyond the calibrated range) and ``clipped[side + "_elements"]``
    the elements quantized.
    """
    B, H, n, D = x.shape
    if n == 0:
        return x
    nb = n // block
    assert nb * block == n, (n, block)
    xb = x.reshape(B, H, nb, block, D).transpose(1, 2).reshape(B * nb, H, block, D)
    # validate=False: K/V come straight from the model (the runner checks the outputs are finite)
    qt = quantize(xb, spec, validate=False, **kw)
    out = qt.dequantize(x.dtype)
    if clipped is not None:
        clipped[side] = clipped.get(side, 0) + qt.clipped
        clipped[side + "_elements"] = clipped.get(side + "_elements", 0) + xb.numel()
    return out.reshape(B, nb, H, block, D).transpose(1, 2).reshape(B, H, n, D)


def simulated_kv(
    scheme: KVScheme,
    key: torch.Tensor,
    value: torch.Tensor,
    lo: int,
    hi: int,
    *,
    rotary: Any = None,
    key_kwargs: dict[str, Any] | None = None,
    value_kwargs: dict[str, Any] | None = None,
    clipped: dict[str, int] | None = None,
    pos_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache stores for tokens ``[lo, hi)`` of ``key``/``value`` ``(B, H_kv, T, D)``, dequantized.

    Returns ``(K~, V~)`` of shape ``(B, H_kv, hi - lo, D)``. Identity schemes cast to their format and
    back; pre-RoPE key specs un-rotate with ``rotary`` (``kvbits.quant.rope.RotaryTables`` of the
    layer, positions as the cache gives them), quantize, and rotate back (float16 / bfloat16 saturated to the dtype's
    finite range after it, as the cache). ``key_kwargs`` /
    ``value_kwargs``: calibrated parameters (``CalibrationArtifact.quantize_kwargs``). ``pos_offset`` ``(B,)``:
    token ``j`` of sequence ``b`` sits at model position ``j - pos_offset[b]`` (clamped at 0), as the cache reads it
    from the model's ``position_ids`` (``kvbits.cache.layer.position_offset``); ``None``: at ``j``.
    """
    if key.dim() != 4 or value.dim() != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"key and value must be (B, H_kv, T, D) with the same B, H_kv and T, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    T = key.shape[2]
    if not 0 <= lo <= hi <= T:
        raise ValueError(f"need 0 <= lo <= hi <= T={T} (tokens [lo, hi) of key/value), got lo={lo}, hi={hi}")
    if not scheme.is_identity and (hi - lo) % scheme.block:
        raise ValueError(
            f"tokens [{lo}, {hi}) are not whole flush blocks of {scheme.block} (scheme {scheme.name!r}): the cache "
            "quantizes whole blocks only"
        )
    if not scheme.is_identity and scheme.key.pre_rope and rotary is None:
        raise ValueError(
            f"scheme {scheme.name!r} quantizes keys before RoPE: pass rotary= (the layer's "
            "kvbits.quant.rope.RotaryTables) to un-rotate them"
        )
    k, v = key[:, :, lo:hi], value[:, :, lo:hi]
    if scheme.is_identity:
        return (
            k.to(FLOAT_DTYPES[scheme.key.fmt]).to(k.dtype),
            v.to(FLOAT_DTYPES[scheme.value.fmt]).to(v.dtype),
        )
    if scheme.key.pre_rope:
        pos = torch.arange(lo, hi, device=k.device)
        if pos_offset is not None:  # the model's positions, as the cache un-rotates at them (store.rope_at)
            pos = (pos[None] - pos_offset.to(k.device)[:, None]).clamp_min(0)
        pre = rotary.unrotate(k, pos)
        kq = rotary.rotate(
            _blocks_fake_quantize(pre, scheme.key, scheme.block, clipped=clipped, side="keys", **(key_kwargs or {})),
            pos,
        )
        kq = saturate(kq, kq.dtype)  # as the cache (store.rope_at): a pair within 65504 rotates to up to sqrt(2) times it
    else:
        kq = _blocks_fake_quantize(k, scheme.key, scheme.block, clipped=clipped, side="keys", **(key_kwargs or {}))
    vq = _blocks_fake_quantize(v, scheme.value, scheme.block, clipped=clipped, side="values", **(value_kwargs or {}))
    return kq, vq


# ------------------------------------------------------------------------------------ attention


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA of ``q`` ``(B, H_q, c, D)`` over ``k``/``v`` ``(B, H_kv, L, D)`` with bool ``mask`` ``(c, L)``.

    ``enable_gqa`` lets SDPA pair each KV head with its ``G`` query heads without copying K/V
    (torch >= 2.5); older torch repeats K/V.
    """
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    except TypeError:  # pragma: no cover - torch < 2.5
        G = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask, scale=scale
        )


def _attend(q, k, v, mask, scale, softcap):
    """Attention of ``q`` ``(B, H_q, c, D)`` over ``k``/``v`` ``(B, H_kv, L, D)`` with bool ``mask`` ``(c, L)``.

    With a logit soft-cap (Gemma 2) scores are computed explicitly, the ``G`` query heads of each KV
    head folded into the query axis (scores ``(B, H_kv, G*c, L)``, bounded by the chunk size), in the
    order and dtypes of transformers' eager attention, which the cache runs through (scores scaled and
    capped in the model's dtype, softmax in float32, cast back): scores cast to float32 before the cap
    put a ``bf16`` scheme on a bfloat16 Gemma 2 9.5e-3 (relative) from the model it leaves unchanged.
    """
    if softcap is None:
        return _sdpa_gqa(q, k, v, mask, scale)
    B, Hq, c, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qf = q.reshape(B, Hkv, G * c, D)
    s = torch.matmul(qf, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask.repeat(G, 1), float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype), v)
    return o.reshape(B, Hq, c, D)


@dataclass
class _ChunkPlan:
    """Where the keys of query chunk ``[a, b)`` come from, and who sees what (shared by all layers
    of one kind: the layout depends on positions, the scheme and the window, not on the layer).

    Keys are ``cat(src[:, :, k0:s1], key[:, :, e0:b])`` where ``src`` holds exact sinks below ``lo``
    and quantized keys above it. ``mask`` ``(b - a, L)`` is stored whole, or as ``pieces``
    ``(col0, col1, submask)``: the columns that are not visible to every query of the chunk.
    """

    a: int
    b: int
    k0: int
    s1: int
    e0: int
    length: int
    mask: torch.Tensor | None
    pieces: list[tuple[int, int, torch.Tensor]]

    def full_mask(self, device: torch.device) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        mask = torch.ones(self.b - self.a, self.length, dtype=torch.bool, device=device)
        for c0, c1, sub in self.pieces:
            mask[:, c0:c1] = sub
        return mask


MASK_CACHE_BYTES = 64 << 20  # keep whole masks up to this size per layer kind, else rebuild per layer


def _chunk_pieces(
    segments: list[tuple[str, int, int]], a: int, b: int, lo: int, hi: torch.Tensor, window: int | None
) -> list[tuple[int, int, torch.Tensor]]:
    """Columns of a chunk's mask whose visibility differs between its queries, with their values.

    ``segments``: ``(kind, p0, p1)`` in key order; ``"quant"`` keys are visible iff
    ``lo <= j < hi(t)``, ``"exact"`` keys iff ``j <= t`` and not in ``[lo, hi(t))``; sliding windows
    add ``j > t - W``. Everything else is visible to every query (the bulk of a long prefix).
    """
    device = hi.device
    t = torch.arange(a, b, device=device)[:, None]
    h = hi[:, None]
    h_a, h_b = int(hi[0]), int(hi[-1])
    w_lo = -(1 << 62) if window is None else b - window  # j >= w_lo is inside every query's window
    pieces, col = [], 0
    for kind, p0, p1 in segments:
        # [u0, u1): positions visible to every query of the chunk
        if kind == "quant":
            u0, u1 = max(p0, w_lo), min(p1, h_a)
        else:
            u0, u1 = max(p0, w_lo, h_b if p0 >= lo else -(1 << 62)), min(p1, a + 1)
        if u1 <= u0:
            u0 = u1 = p1
        for c0, c1 in ((p0, u0), (u1, p1)):
            if c1 <= c0:
                continue
            j = torch.arange(c0, c1, device=device)[None, :]
            if kind == "quant":
                m = (j >= lo) & (j < h)
            else:
                m = (j <= t) & ~((j >= lo) & (j < h))
            if window is not None:
                m &= j > t - window
            pieces.append((col + c0 - p0, col + c1 - p0, m))
        col += p1 - p0
    return pieces


def _plan(
    T: int, chunk: int, lo: int, hi_all: torch.Tensor, window: int | None, *, exact: bool = False
) -> list[_ChunkPlan]:
    """Chunk plans for a forward of ``T`` tokens (``exact``: the unquantized reference attention)."""
    device = hi_all.device
    plans: list[_ChunkPlan] = []
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        k0 = 0 if window is None else max(0, a - window + 1)  # keys older than this are out of every window
        if exact:
            segments = [("exact", k0, b)]
            plans.append(
                _ChunkPlan(
                    a,
                    b,
                    k0,
                    k0,
                    k0,
                    b - k0,
                    None,
                    _chunk_pieces(
                        segments, a, b, 0, torch.zeros(b - a, dtype=torch.long, device=device), window
                    ),
                )
            )
            continue
        hi = hi_all[a:b]
        h_a, h_b = int(hi[0]), int(hi[-1])
        s1 = max(lo, h_b)  # src[k0:s1]: exact sinks [k0, lo), quantized [lo, h_b)
        e0 = max(h_a, k0, lo)
        if h_a >= a:  # the chunk's own keys may all be quantized already (no residual window)
            needed = (hi <= torch.arange(a, b, device=device)).nonzero()
            e0 = b if needed.numel() == 0 else max(e0, a + int(needed[0]))
        segments = []
        if lo > k0:
            segments.append(("exact", k0, lo))
        if s1 > max(lo, k0):
            segments.append(("quant", max(lo, k0), s1))
        if b > e0:
            segments.append(("exact", e0, b))
        k0 = min(k0, s1)
        plans.append(
            _ChunkPlan(
                a,
                b,
                k0,
                max(s1, k0),
                e0,
                sum(p1 - p0 for _, p0, p1 in segments),
                None,
                _chunk_pieces(segments, a, b, lo, hi, window),
            )
        )
    if sum((p.b - p.a) * p.length for p in plans) <= MASK_CACHE_BYTES:
        for p in plans:
            p.mask, p.pieces = p.full_mask(device), []
    return plans


def _layer_window(module: Any, kwargs: dict) -> int | None:
    """Sliding window of the calling layer: the kwarg the model passes, else its config's layer type."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None:
        return int(window)
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is not None and idx is not None and types[idx] in _SLIDING_TYPES:
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        return int(window) if window is not None else None
    return None


def _check_not_chunked(module: Any, T: int, window: int | None) -> None:
    """``ValueError`` for a chunked-attention layer (Llama 4: ``layer_types`` ``chunked_attention``) in a forward
    longer than its chunk: a query there sees the keys of its own chunk of ``attention_chunk_size`` tokens, from the
    chunk's start, where the simulator's masks are sliding windows of that size reaching into the previous chunk
    (within one chunk both are causal). Simulated, an exact float32 'scheme' measured KL 1.44 nats and top-1 0.51
    against the model on a 4-layer Llama 4 (chunks of 16, 80 tokens); the real cache (``mode='stream'``) attends
    through the model's own chunked mask."""
    if window is None or T <= window:
        return
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types is not None and idx is not None and types[idx] == "chunked_attention":
        raise ValueError(
            f"{IMPLEMENTATION}: layer {idx} attends in chunks of {window} tokens (chunked attention, Llama 4), each "
            f"query within its own chunk, which the simulator's sliding-window masks do not reproduce beyond one "
            f"chunk ({T} tokens here): evaluate with mode='stream' (`kvbits eval --mode stream`), which runs the real "
            "cache through the model's own attention, or with a context of at most the chunk size"
        )


def _simulate_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``kvbits_simulate`` attention function (transformers' attention-interface signature).

    ``query`` ``(B, H_q, T, D)``, ``key``/``value`` ``(B, H_kv, T, D)`` post-RoPE; returns
    ``((B, T, H_q, D), None)``.
    """
    sim = _ACTIVE.get()
    if sim is None or id(module) not in sim._modules:
        raise RuntimeError(
            f"attention implementation {IMPLEMENTATION!r} called outside a kvbits.evaluate.simulate() context "
            "for this model; use `with simulate(model, scheme): model(...)`"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{IMPLEMENTATION}: explicit attention masks are not supported (got shape "
            f"{tuple(attention_mask.shape)}); evaluate unpadded windows without an attention_mask"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{IMPLEMENTATION}: learned attention sinks (s_aux) are not supported")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{IMPLEMENTATION} evaluates one whole window per forward (no cache): query has "
            f"{query.shape[2]} positions, key {key.shape[2]}"
        )
    sim.calls += 1
    T, D = query.shape[2], query.shape[3]
    scale = scaling if scaling is not None else D**-0.5
    softcap = kwargs.get("softcap")
    window = _layer_window(module, kwargs)
    _check_not_chunked(module, T, window)
    layer = getattr(module, "layer_idx", None)
    if layer is None and sim.scheme.is_mixed:
        raise ValueError(f"mixed scheme {sim.scheme.name!r}: an attention module without layer_idx can not be matched")
    scheme = sim.scheme.for_layer(layer) if layer is not None else sim.scheme

    lo, hi_all, plans = sim._layout(T, window, query.device, scheme=scheme)
    q_end = int(hi_all[-1]) if T else 0
    src = key
    vsrc = value
    if q_end > lo:
        rotary = sim._rotary_layers.get(layer) if scheme.key.pre_rope else None
        kw = {
            f"{side}_kwargs": {n: t.to(key.device) for n, t in sim._qkw.get((layer, side), {}).items()}
            for side in ("key", "value")
        }
        offset = None
        if rotary is not None:  # position_ids off the token indices (a window at an offset): where the cache un-rotates
            from kvbits.cache.layer import position_offset

            offset = position_offset((), kwargs, 0, key)
        kq, vq = simulated_kv(
            scheme, key, value, lo, q_end, rotary=rotary, clipped=sim.clipped, pos_offset=offset, **kw
        )
        src = torch.cat([key[:, :, :lo], kq], dim=2) if lo else kq
        vsrc = torch.cat([value[:, :, :lo], vq], dim=2) if lo else vq

    record = layer in sim.attn_layers
    ref_plans = sim._layout(T, window, query.device, exact=True, scheme=scheme)[2] if record else None
    outs, errs, ents, ents_ref = [], [], [], []
    for i, p in enumerate(plans):
        if p.b > p.e0 and p.s1 > p.k0:
            kk = torch.cat([src[:, :, p.k0 : p.s1], key[:, :, p.e0 : p.b]], dim=2)
            vv = torch.cat([vsrc[:, :, p.k0 : p.s1], value[:, :, p.e0 : p.b]], dim=2)
        elif p.b > p.e0:
            kk, vv = key[:, :, p.e0 : p.b], value[:, :, p.e0 : p.b]
        else:
            kk, vv = src[:, :, p.k0 : p.s1], vsrc[:, :, p.k0 : p.s1]
        qc = query[:, :, p.a : p.b]
        mask = p.full_mask(query.device)
        o = _attend(qc, kk, vv, mask, scale, softcap)
        outs.append(o)
        if record:
            r = ref_plans[i]
            k_ref, mask_ref = key[:, :, r.k0 : r.b], r.full_mask(query.device)
            o_ref = _attend(qc, k_ref, value[:, :, r.k0 : r.b], mask_ref, scale, softcap).float()
            diff = (o.float() - o_ref).pow(2).sum(dim=(1, 3)).sqrt()
            errs.append(diff / o_ref.pow(2).sum(dim=(1, 3)).sqrt().clamp_min(torch.finfo(torch.float32).tiny))
            # the same queries and keys as the two attention calls: no extra forward
            ents.append(attention_entropy(qc, kk, mask, scale, softcap).float())
            ents_ref.append(attention_entropy(qc, k_ref, mask_ref, scale, softcap).float())
    if record:
        sim.attn_error[layer] = torch.cat(errs, dim=1)
        sim.attn_entropy[layer] = torch.cat(ents, dim=1)
        sim.attn_entropy_ref[layer] = torch.cat(ents_ref, dim=1)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


def _guard_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """Mask builder for ``kvbits_simulate``: no mask object (built from positions), refuse padding."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            f"{IMPLEMENTATION} evaluates unpadded windows only; the attention_mask has padding (zeros)"
        )


def _register() -> None:
    """Add ``kvbits_simulate`` to transformers' attention and mask tables (a new name; nothing replaced)."""
    from transformers import AttentionInterface

    if IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(IMPLEMENTATION, _simulate_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - older transformers: no mask table, the mask is then None
        return
    if IMPLEMENTATION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(IMPLEMENTATION, _guard_mask)


# -------------------------------------------------------------------------------------- context


def _check_no_alibi(model: Any) -> None:
    """``ValueError`` for a model that adds an ALiBi position bias to its attention mask (Falcon with
    ``alibi=True``): the simulator builds its causal masks from positions and would drop the bias
    (transformers 5.25's Falcon then failed inside its forward on the mask the simulator does not build)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "alibi", False) is True:
        raise ValueError(
            f"{type(model).__name__} adds an ALiBi position bias to its attention mask, which the simulator "
            "(it builds causal masks from positions) does not apply: evaluate it with mode='stream' "
            "(`kvbits eval --mode stream`), which runs the real cache through the model's own attention"
        )


def _set_impl(model: Any, impl: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(impl)
    else:  # pragma: no cover - transformers without the public setter
        model.config._attn_implementation = impl


def _impls(model: Any) -> dict[int, str | None]:
    """``_attn_implementation`` of every config reachable from the model (top level and sub-models)."""
    from transformers import PreTrainedModel

    out = {id(model.config): model.config._attn_implementation}
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            out.setdefault(id(m.config), m.config._attn_implementation)
    return out


def _calibration_kwargs(
    model: Any, scheme: KVScheme, calibration: Any
) -> dict[tuple[int, str], dict[str, Any]]:
    """``(layer, side) -> quantize kwargs`` from a calibration artifact; checks it fits scheme and model."""
    needs = scheme.needs_calibration()
    if calibration is None:
        if needs:
            raise ValueError(
                f"scheme {scheme.name!r} needs calibrated parameters for its {' and '.join(needs)} (static scales "
                "or NUQ codebooks): create them with `kvbits calibrate` and pass calibration=<folder>"
            )
        return {}
    from kvbits.calibrate import load_calibration

    if isinstance(calibration, (str, bytes)) or hasattr(calibration, "__fspath__"):
        calibration = load_calibration(calibration, model_config=model.config, scheme=scheme)
    else:
        calibration.check_scheme(scheme)
        calibration.check_model(model.config)
    # only the sides this scheme calibrates, as the caches install them: an artifact may hold parameters for a side
    # the scheme stores otherwise (check_scheme allows it), which quantize refuses rather than ignores
    return {
        (i, side): calibration.quantize_kwargs(i, side) if getattr(scheme.for_layer(i), side).calibratable else {}
        for i in calibration.kv_layers  # a hybrid model's attention layers (check_model matched them)
        for side in ("key", "value")
    }


def _shared_block_tables(model: Any, tables: Any) -> Any:
    """The RoPE tables of a shared attention block's calls (``layer_idx`` -1: Zamba2's, one per ``hybrid`` layer):
    the hybrid layers' tables when they are all alike (one rotary module, one layer type, one head dim), else
    ``ValueError`` (the simulator can not tell which layer calls the block). ``tables.tables_for_layer(-1)`` was
    "layer_idx must be an int in [0, 4), got -1" for every pre-RoPE scheme."""
    layers = hybrid_layers(model)
    per = [tables.tables_for_layer(i) for i in layers]
    alike = {(id(t.rotary), t.layer_type, t.rot_dim, t.head_dim, t.half_tables) for t in per}
    if len(alike) != 1:
        raise ValueError(
            f"{IMPLEMENTATION}: {type(model).__name__}'s attention block is shared by its hybrid layers {layers}, "
            f"whose RoPE tables differ (or none is typed 'hybrid'): the simulator can not tell which layer calls it; "
            "evaluate pre-RoPE schemes with mode='stream' (`kvbits eval --mode stream`)"
        )
    return per[0]


@contextlib.contextmanager
def simulate(
    model: Any,
    scheme: str | dict | KVScheme,
    *,
    semantics: str = "decode",
    prompt_len: int | None = None,
    attn_layers: Sequence[int] = (),
    chunk_size: int = DEFAULT_CHUNK,
    calibration: Any = None,
) -> Iterator[Simulation]:
    """Run ``model`` with simulated KV-cache quantization inside the ``with`` block.

    Args:
        model: a transformers causal LM (or its base model) whose attention modules dispatch through
            ``ALL_ATTENTION_FUNCTIONS`` (every transformers 5 text model).
        scheme: preset name, dict, JSON path or ``KVScheme``.
        semantics: ``"decode"`` (token-by-token from token 0) or ``"prefill"`` (the first
            ``prompt_len`` tokens prefilled in full precision).
        prompt_len: required with ``semantics="prefill"``.
        attn_layers: layers whose attention-output error and attention entropy are recorded in
            ``Simulation.attn_error``, ``attn_entropy`` and ``attn_entropy_ref`` (ints in ``[0, num_layers)``,
            else ``ValueError``).
        chunk_size: queries per attention chunk (memory ``~ chunk_size * T`` mask entries and scores
            per head).
        calibration: a ``kvbits.calibrate`` artifact (or its folder) for schemes with static scales or
            NUQ codebooks (KVQuant presets), as ``QuantizedKVCache(calibration=...)`` takes it.

    Yields:
        The ``Simulation`` state; ``attn_error``, ``attn_entropy(_ref)`` and ``calls`` describe the
        last forward (call ``reset()`` between forwards to be sure nothing stale is read).

    The model's attention implementation is restored on exit, also when the block raises.
    """
    check_model(model, "simulate", attention=True)
    _check_no_alibi(model)
    scheme = get_scheme(scheme)
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    from kvbits.evaluate.inputs import check_layer_indices

    if semantics == "prefill":
        if (
            prompt_len is None
            or isinstance(prompt_len, bool)
            or not isinstance(prompt_len, (int, np.integer))  # NumPy's ints, as evaluate() takes them
            or prompt_len < 1
        ):
            raise ValueError(f"semantics='prefill' needs a positive int prompt_len, got {prompt_len!r}")
    elif prompt_len not in (None, 0):
        raise ValueError(f"prompt_len is only meaningful with semantics='prefill' (got {prompt_len!r})")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    modules = attention_modules(model)
    shared = sorted({type(m).__name__ for m in modules if m.layer_idx < 0})
    if shared and scheme.is_mixed:  # it was 'overrides layers [1], beyond the model's 0 layers' (max layer_idx -1)
        raise ValueError(
            f"{IMPLEMENTATION}: mixed scheme {scheme.name!r} on {type(model).__name__}, whose attention block "
            f"{shared[0]} is shared by several layers (layer_idx -1: Zamba2's hybrid layers): the simulator can not "
            "tell which layer calls it, so it applies one scheme to all of them; evaluate mixed schemes with "
            "mode='stream' (`kvbits eval --mode stream`: the real cache, which the model tells the layer). "
            "kvbits tune probes layers in the simulator and can not tune this model"
        )
    if not modules:  # Zamba's shared block has no layer_idx: it was 'max() arg is an empty sequence'
        raise ValueError(
            f"{IMPLEMENTATION}: {shared_attention_note(model)} (the simulator finds attention modules by their "
            "layer_idx)"
        )
    if attn_layers and shared:  # the shared block's calls carry no layer: 'attn_layers must be in [0, 0)'
        raise ValueError(
            f"{IMPLEMENTATION}: attn_layers={list(attn_layers)}: "
            f"{shared_attention_note(model) or 'the attention block is shared by several layers (layer_idx -1)'}; "
            "leave attn_layers empty"
        )
    qkw = _calibration_kwargs(model, scheme, calibration)
    if shared and any(qkw.values()):  # it looked up layer -1 in an artifact of layers [1, 3]: calibration ignored
        raise ValueError(
            f"{IMPLEMENTATION}: scheme {scheme.name!r} takes calibrated parameters per layer (the artifact holds "
            f"layers {sorted({i for i, _ in qkw})}), but {type(model).__name__}'s attention block {shared[0]} is "
            "shared by several layers (layer_idx -1): the simulator can not tell which layer calls it, so it would "
            "quantize without them; evaluate calibrated schemes with mode='stream' (`kvbits eval --mode stream`)"
        )
    n_layers = max(m.layer_idx for m in modules) + 1
    scheme.check_layer_count(n_layers)
    attn_layers = check_layer_indices("attn_layers", attn_layers)  # int(0.7) recorded layer 0 without a word
    if any(not 0 <= x < n_layers for x in attn_layers):  # a layer the model lacks recorded nothing without a word
        raise ValueError(f"attn_layers must be in [0, {n_layers}), got {attn_layers}")
    rotary_layers: dict[int, Any] = {}
    pre_rope = [m for m in modules if scheme.for_layer(m.layer_idx).key.pre_rope
                and not scheme.for_layer(m.layer_idx).is_identity]  # fmt: skip
    if pre_rope:
        from kvbits.cache.cache import rotary_for
        from kvbits.quant.rope import RotaryTables

        # the cache's own refusals first (HunYuan's key norm after RoPE): the simulator stands for that cache
        tables, _ = rotary_for(scheme, model.config, RotaryTables.from_model(model))
        for m in pre_rope:
            if m.layer_idx < 0:  # Zamba2's shared block: the tables its calling layers share
                rotary_layers[m.layer_idx] = _shared_block_tables(model, tables)
            else:
                rotary_layers[m.layer_idx] = tables.tables_for_layer(m.layer_idx)
    _register()
    sim = Simulation(
        scheme=scheme,
        semantics=semantics,
        prompt_len=int(prompt_len or 0),
        attn_layers=frozenset(attn_layers),
        chunk_size=chunk_size,
        _modules=frozenset(id(m) for m in modules),
        _rotary_layers=rotary_layers,
        _qkw=qkw,
    )
    before = _impls(model)
    original = model.config._attn_implementation
    token = _ACTIVE.set(sim)
    try:
        _set_impl(model, IMPLEMENTATION)
        if model.config._attn_implementation != IMPLEMENTATION:
            raise RuntimeError(
                f"{type(model).__name__} did not accept attn_implementation={IMPLEMENTATION!r} (it does not "
                "dispatch attention through transformers' AttentionInterface): evaluate it with mode='stream' "
                "(`kvbits eval --mode stream`), which runs the real cache through the model's own attention"
            )
        yield sim
    finally:
        _ACTIVE.reset(token)
        try:
            _set_impl(model, original)
        finally:
            after = _impls(model)
            if after != before:  # sub-configs that had their own implementation
                logger.warning("attention implementations after simulate() differ: %s vs %s", after, before)
