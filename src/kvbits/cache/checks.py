"""Checks of the K/V a `QuantizedKVLayer` receives, eager or lazy (no host-device sync per step).

The rule: K/V that cannot be stored faithfully (NaN, inf, ``|x|`` beyond the float16 range of scales
and zero-points) get a clear ``ValueError`` naming the layer, never silent corruption. The float16 bound
applies only to sides that hold something in float16 (``range_bounds``): int / NUQ / FP8 codes (float16
scales, zero-points, outliers) and float16 storage; bf16 / fp32 storage and sliding-window layers that keep
their window in the K/V dtype only need finite values. Two ways:

- **eager** (``checks="eager"``; ``"auto"`` on CPU, where a sync costs nothing): every ``update`` checks
  its K/V before storing them (``check_now``: one sync per layer per step) and bad
  K/V are refused; clipped counts are host ints.
- **lazy** (``checks="lazy"``; ``"auto"`` on CUDA and other accelerators): ``update`` only writes
  ``max |K|`` and ``max |V|`` of its new tokens into its row of a small float32 table on the device (two
  kernels, nothing else: the table's maximum is taken when the check reads it, and NaN propagates through both
  reductions; inf, and ``|x| > 65504`` where bounded, fail) and clipped counts
  stay 0-dim int64 device tensors: the per-step path never waits for the device. The pending maxima are
  read (one sync per device, for all layers of a cache together, ``run_checks``) every ``check_every``
  update steps of a layer (default 64) and whenever the cache is read: ``memory_report()``,
  ``calibration_report()``, ``fused_report()``, ``materialize()``, ``check_inputs()``. Bad K/V found
  there raise ``ValueError`` naming the layer(s), the side, the update steps and token positions of the
  window they arrived in; they were stored and attended over meanwhile, so the layer stays failed (every
  later ``update`` or read raises the same error) until ``reset()``. Counts read from the device are exact.
  K/V arriving after the last check of a generation are only covered by the next read or
  ``check_inputs()``: call one after generating (reports do).

Some specs store more than ``|x|`` in float16, so their bound is lower (``input_bound``): asymmetric NUQ
stores the group range ``max - min`` (``|x| <= 65504 / 2``), and pre-RoPE keys are un-rotated before
quantization, which mixes the two channels of a rotation pair (``|x| <= 65504 / sqrt(2)``, both at once
for KVQuant's NUQ keys); Hadamard-rotated sides code ``x @ R``, which can gather a row's norm in one
channel (``|x| <= 65504 / sqrt(D)``, once ``D`` is known: from the config, else the first K/V). Beyond them
a scale or zero-point would be inf and the stored rows decode to NaN. Centred / smoothed sides code
``(x - mean) / factor``: installing their vectors lowers the bound to ``bound * min(factor) - max |mean|``
(``QuantizedKVLayer.set_static_qparams``). Integer zero-points (``TensorSpec.integer_zero``) anchor the grid at
0, so a level the data reaches can lie half a step past the range (``|x| <= 65504 / (1 + (1 + 2**-10) / (2**bits
- 1))``, 61406 at 4 bits: ``kvbits.quant.affine.integer_zero_bound``).

Structural checks (types, ``(B, H_kv, T, D)`` shapes, dtype/device changes, calibration) never need the
device and stay eager in both modes (``validate``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbits.quant.affine import integer_zero_bound
from kvbits.quant.checks import FP16_MAX, KV_DTYPES, check_kv
from kvbits.report.calibration import CLIP_WARN_FRAC  # one warning level for the cache, report and evaluate
from kvbits.schemes.accounting import rotation_fits, token_groups_fit

if TYPE_CHECKING:  # pragma: no cover
    from kvbits.cache.layer import QuantizedKVLayer
    from kvbits.schemes.spec import KVScheme, TensorSpec

__all__ = [
    "CHECK_MODES",
    "CLIP_WARN_FRAC",
    "DEFAULT_CHECK_EVERY",
    "InputChecks",
    "check_channel_groups",
    "check_config_shape",
    "check_every_arg",
    "check_incoming",
    "check_mode",
    "check_now",
    "fmt_x",
    "input_bound",
    "run_checks",
    "validate",
    "write_maxima",
]

CHECK_MODES = ("auto", "eager", "lazy")
DEFAULT_CHECK_EVERY = 64
# rows of a lazy layer's maxima table; a longer window folds its rows into the first (two kernels). 64 rows of
# (max |K|, max |V|) in float32 are 512 bytes: the CUDA caching allocator's smallest block, which the (2,) running
# maximum this table replaced took as well
MAX_ROWS = 64
# QuantizedKVCache logs (once) a layer clipping more than CLIP_WARN_FRAC of its quantized keys or values against
# static scales (imported above from kvbits.report.calibration, the calibration report's level)
SIDES = ("key_states", "value_states")


def fmt_x(x: float) -> str:
    """A magnitude or bound in the K/V checks' messages (eager, lazy, both caches): 6 significant digits, so that
    65505 past the float16 bound 65504 reads as past it (``.4g`` wrote both as ``6.55e+04``)."""
    return f"{x:.6g}"


def check_mode(mode: object) -> str:
    """``"auto"``, ``"eager"`` or ``"lazy"``; ``ValueError`` for anything else."""
    if mode not in CHECK_MODES:
        raise ValueError(f"checks must be one of {CHECK_MODES}, got {mode!r}")
    return str(mode)


def check_every_arg(n: object) -> int:
    """A positive int (update steps between lazy checks); ``ValueError`` for anything else."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"check_every must be a positive int, got {n!r}")
    return n


def input_bound(
    spec: TensorSpec | None, layer_mode: str = "quantized", head_dim: int | None = None
) -> tuple[float, str]:
    """``(bound, why)``: the largest ``|x|`` a side of a layer in ``layer_mode`` stores faithfully, and the
    reason in words (``inf``: finiteness only).

    float16 holds the values or their metadata for int / NUQ / FP8 codes (float16 scales, zero-points and
    outliers) and for float16 storage (``None``: that plain case): 65504, less where a spec stores more than
    ``|x|`` (asymmetric NUQ stores the range ``max - min``; pre-RoPE keys are un-rotated before quantizing,
    which mixes the channels of a rotation pair; integer zero-points reach a level up to half a step past the
    range; a rotated spec codes ``x @ R``, up to ``sqrt(D) max |x|``
    in one channel, so its bound needs ``head_dim``: without it, none is set for the rotation yet). bf16 /
    fp32 storage and ``"fallback"`` sliding layers (their window kept in the K/V dtype) hold any finite value.
    """
    if layer_mode == "fallback":
        return math.inf, "the window is kept in the K/V dtype"
    if spec is not None and spec.kind == "float":
        if spec.fmt != "fp16":
            return math.inf, f"stored as {spec.fmt}"
        return FP16_MAX, "stored as float16"
    bound, why = FP16_MAX, ["the float16 range of scales"]
    if spec is None:
        return bound, why[0]
    if spec.kind == "nuq" and not spec.symmetric:
        bound /= 2  # the stored scale is the whole range max - min, up to 2 max |x|
        why.append("asymmetric NUQ stores the range max - min, so half of it")
    if spec.integer_zero:
        bound = integer_zero_bound(spec.bits)  # a reached level lies up to half a step past the range
        why.append(f"integer zero-points put a level up to half a step past the range ({bound / FP16_MAX:.4f} of it)")
    if spec.pre_rope:
        bound /= math.sqrt(2)  # un-rotating a pair (a, b) gives up to |(a, b)| = sqrt(2) max(|a|, |b|)
        why.append("pre-RoPE keys are un-rotated first, which mixes channel pairs (1/sqrt(2) of it)")
    if spec.rotate is not None and head_dim is not None:
        bound /= math.sqrt(head_dim)  # |x @ R| <= ||x||_2 <= sqrt(D) max |x| (R orthonormal)
        why.append(f"a {spec.rotate} rotation can gather a row's norm in one channel (1/sqrt({head_dim}) of it)")
    return bound, "; ".join(why)


@dataclass
class InputChecks:
    """Per-layer check state.

    Attributes:
        mode: ``"auto"`` / ``"eager"`` / ``"lazy"`` as asked; ``lazy`` is what it resolved to on the K/V
            device (``resolve``).
        every: update steps between lazy checks of this layer.
        steps: update steps seen (0-based index of the next one).
        checked_steps, checked_tokens: steps ``[0, checked_steps)`` / positions ``[0, checked_tokens)``
            are known good.
        maxima: lazy: ``(rows, 2)`` float32 ``max |K|``, ``max |V|`` of the unchecked steps, one row per step
            (``rows = min(every, MAX_ROWS)``), on the device; the first ``filled`` rows hold them.
        filled: lazy: rows of ``maxima`` written since the last check.
        pending: lazy: K/V arrived since the last check (``amax()`` has something to read).
        error: the message of a failed lazy check (sticky until ``reset``).
        clipped: lazy, for a layer whose clipping the cache watches (``QuantizedKVLayer.clip_watch``): its
            ``(keys, values)`` clipped counts as read back with the last check (same transfer), else ``None``.
        bounds: largest ``|K|`` and ``|V|`` accepted, with the reasons (``input_bound`` of the layer's
            specs; ``inf``: finiteness only); non-finite values always fail.
    """

    mode: str = "auto"
    every: int = DEFAULT_CHECK_EVERY
    lazy: bool = False
    steps: int = 0
    checked_steps: int = 0
    checked_tokens: int = 0
    maxima: torch.Tensor | None = None
    filled: int = 0
    pending: bool = False
    error: str | None = None
    clipped: tuple[int, int] | None = None
    bounds: tuple[tuple[float, str], tuple[float, str]] = (input_bound(None), input_bound(None))

    def resolve(self, device: torch.device) -> None:
        """Pick eager or lazy for K/V on ``device`` (``"auto"``: eager on CPU only)."""
        self.lazy = self.mode == "lazy" or (self.mode == "auto" and device.type != "cpu")

    def reset(self) -> None:
        self.lazy = False
        self.steps = self.checked_steps = self.checked_tokens = self.filled = 0
        self.maxima = self.error = self.clipped = None
        self.pending = False

    @property
    def due(self) -> bool:
        """A lazy check is due: ``every`` update steps since the last one."""
        return self.lazy and self.steps - self.checked_steps >= self.every

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise ValueError(self.error)

    def observe(self, name: str, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check (eager) or record (lazy) K/V ``(B, H_kv, q, D)`` of one update step of ``name`` ("layer 3")."""
        self.raise_if_failed()
        if key_states.numel() and value_states.numel():
            (self._record if self.lazy else self._check_now)(name, key_states, value_states)
        self.steps += 1

    def _record(self, name: str, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Lazy: write ``max |K|``, ``max |V|`` into the next row of ``maxima`` on the device (one kernel per side,
        no sync; a full table first folds into its first row)."""
        if self.maxima is None:
            rows = min(self.every, MAX_ROWS)
            self.maxima = torch.zeros(rows, 2, dtype=torch.float32, device=key_states.device)
        if self.filled == self.maxima.shape[0]:  # a window longer than the table: keep its maximum in row 0
            self.maxima[0] = self.maxima.amax(0)
            self.filled = 1
        write_maxima(self.maxima[self.filled], key_states, value_states)
        self.filled += 1
        self.pending = True

    def amax(self) -> torch.Tensor:
        """Lazy: ``(2,)`` float32 ``max |K|``, ``max |V|`` since the last check, on the device (NaN propagates;
        zeros when nothing arrived)."""
        if self.maxima is None:
            raise RuntimeError("no lazy maxima: the layer's checks are eager or nothing was stored yet")
        return self.maxima[: self.filled].amax(0) if self.filled else self.maxima.new_zeros(2)

    def _check_now(self, name: str, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Eager: one device sync for both sides (NaN propagates through the maxima)."""
        check_now((f"{name} {SIDES[0]}", f"{name} {SIDES[1]}"), key_states, value_states, self.bounds)

    def verdict(self, amax: list[float], name: str, tokens_seen: int) -> str | None:
        """Close the pending window with its host maxima ``[max |K|, max |V|]``: ``None``, or the error
        (kept in ``error``)."""
        bad = [
            (side, a, b) for side, a, b in zip(SIDES, amax, self.bounds)
            if not (math.isfinite(a) and a <= b[0])
        ]  # fmt: skip
        first, last, p0 = self.checked_steps, self.steps - 1, self.checked_tokens
        self.checked_steps, self.checked_tokens, self.pending = self.steps, tokens_seen, False
        self.filled = 0
        if not bad:
            return None
        what = " and ".join(f"{side} {_what(a)}" for side, a, _ in bad)
        rules = {
            "finite" + ("" if math.isinf(bound) else f" with |x| <= {fmt_x(bound)}, {why}") for _, _, (bound, why) in bad
        }  # fmt: skip
        self.error = (
            f"{name} {what} (K/V must be {'; '.join(sorted(rules))}): they "
            f"arrived in update steps {first}..{last} (token positions {p0}..{tokens_seen - 1}), found by the "
            f"lazy check (checks='lazy', check_every={self.every}), and were stored and attended over, so outputs "
            f"since step {first} are invalid; reset() the cache (checks='eager' refuses such K/V before storing them)"
        )
        return self.error


def check_now(
    names: tuple[str, str],
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    bounds: tuple[tuple[float, str], tuple[float, str]],
) -> None:
    """Eager check of K/V ``(B, H_kv, q, D)`` against ``bounds`` (``(bound, why)`` per side, ``input_bound``): one
    device sync for both sides (``write_maxima``), more only to word an error. ``ValueError`` naming ``names[i]`` for
    NaN / inf, ``|x|`` past its bound, or float64 values past the float32 range (which the maxima, and a bf16 / fp32
    store, turn into inf). ``QuantizedKVLayer`` and ``StaticQuantizedLayer`` check alike with it."""
    amax = write_maxima(torch.empty(2, dtype=torch.float32, device=key_states.device), key_states, value_states)
    for x, name, a, (bound, why) in zip((key_states, value_states), names, amax.tolist(), bounds):
        if not math.isfinite(a):
            if not bool(torch.isfinite(x).all()):
                n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
                raise ValueError(f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf); refusing to store it")
            a = float(x.detach().abs().max())  # float64 past the float32 range: finite, but not as stored
            raise ValueError(f"{name} has |x| up to {fmt_x(a)}, beyond the float32 range; refusing to store it")
        if a > bound:
            raise ValueError(f"{name} has |x| up to {fmt_x(a)}, beyond {fmt_x(bound)} ({why}); refusing to store it")


def write_maxima(row: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
    """Write ``max |K|``, ``max |V|`` (float32, NaN kept) into ``row`` ``(2,)``, one kernel per side; returns ``row``."""
    for i, x in enumerate((key_states, value_states)):
        x = x.detach() if x.requires_grad else x  # out= takes no tensor that records gradients
        if x.dtype == torch.float64:  # vector_norm does not narrow its input: float64, then the copy narrows
            row[i].copy_(torch.linalg.vector_norm(x, math.inf))
        else:
            torch.linalg.vector_norm(x, math.inf, dtype=torch.float32, out=row[i])
    return row


def _what(amax: float) -> str:
    if math.isnan(amax):
        return "contain NaN"
    return "contain inf" if math.isinf(amax) else f"reach |x| = {fmt_x(amax)}"  # fmt_x: as the bound


def _host_maxima(pending: list[torch.Tensor]) -> list[list[float]]:
    """The pending ``(2,)`` maxima on the host: one transfer (one sync) per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(pending):
        by_device.setdefault(t.device, []).append(i)
    out: list[list[float]] = [[] for _ in pending]
    for idx in by_device.values():
        host = torch.stack([pending[i] for i in idx]).cpu().tolist()
        for i, row in zip(idx, host):
            out[i] = row
    return out


def _pending_rows(pending: list[QuantizedKVLayer]) -> list[torch.Tensor]:
    """What a lazy check reads back per pending layer: ``amax`` ``(2,)``, followed, when the cache watches some
    layer's clipping (``clip_watch``), by the clipped counts of keys and values (float32; 0 for unwatched
    layers), so that they come back in the same transfer as the maxima (no sync of their own)."""
    if all(layer.clip_watch is None for layer in pending):
        return [layer.checks.amax() for layer in pending]
    rows = []
    for layer in pending:
        amax = layer.checks.amax()
        counts = layer.clipped_counts() if layer.clip_watch is not None else (0, 0)
        tail = [c.reshape(1).float() if isinstance(c, torch.Tensor) else amax.new_full((1,), float(c)) for c in counts]
        rows.append(torch.cat([amax, *tail]))
    return rows


def run_checks(layers: Iterable[QuantizedKVLayer]) -> None:
    """Run the pending lazy checks of ``layers`` together; ``ValueError`` naming every failed layer.

    A no-op (no sync) when nothing is pending: eager layers, or no update since the last check.
    """
    layers = list(layers)
    pending = [layer for layer in layers if layer.checks.pending]
    if pending:
        maxima = _host_maxima(_pending_rows(pending))
        for layer, row in zip(pending, maxima):
            if layer.clip_watch is not None:
                layer.checks.clipped = (int(row[2]), int(row[3]))
            layer.checks.verdict(row[:2], f"layer {layer.layer_idx}", layer.tokens_seen)
    failed = []
    for layer in layers:
        checks = layer.checks
        if checks.error is not None:
            failed.append(layer)
        elif checks.lazy:  # nothing pending (or all good): known good up to here
            checks.checked_steps, checks.checked_tokens = checks.steps, layer.tokens_seen
    if failed:
        more = ", ".join(str(layer.layer_idx) for layer in failed[1:])
        raise ValueError(failed[0].checks.error + (f" [also failed: layers {more}]" if more else ""))


def check_channel_groups(scheme: KVScheme, key_dim: int, value_dim: int, where: str) -> None:
    """``ValueError`` unless every per-token channel group of ``scheme`` divides its side's head dim ``D``
    (``kvbits.schemes.accounting.token_groups_fit``, the rule the planner applies too).

    Checked before anything is stored (at construction when the config gives ``D``, else at the first
    update): otherwise the first flush, possibly mid-generation, is where ``quantize`` finds out.
    """
    for side, spec, D in (("keys", scheme.key, key_dim), ("values", scheme.value, value_dim)):
        if not rotation_fits(spec, D):
            raise ValueError(
                f"{where}: scheme {scheme.name!r} rotates {side} with a {spec.rotate} matrix, which needs a "
                f"power-of-two head_dim (64, 128, 256), got {D}; use a scheme without rotate for this model"
            )
        if not token_groups_fit(spec, D):
            g = spec.group_size
            allowed = [d for d in range(2, D + 1) if D % d == 0]  # 1 is refused by TensorSpec (lossless)
            raise ValueError(
                f"{where}: scheme {scheme.name!r} quantizes {side} per token in groups of group_size channels, "
                f"which must divide head_dim {D}: group_size must be one of {allowed} (or None: all {D} "
                f"channels), got {g}"
            )


def check_config_shape(
    where: str,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    kv_heads: int | None,
    head_repeat: int,
    head_dim: int | None,
) -> None:
    """``ValueError`` for K/V ``(B, H, q, D)`` without the config's ``kv_heads`` heads (or ``kv_heads * head_repeat``:
    each repeated by the model, Falcon's new architecture) or ``head_dim`` channels (``None``: not known, not checked):
    a cache holding them would hold other bytes than ``kvbits plan`` counts. The one check and message of
    ``QuantizedKVLayer`` (every update) and ``StaticQuantizedKVCache``'s layers (the first). Host metadata only."""
    heads_ok = kv_heads is None or key_states.shape[1] in (kv_heads, kv_heads * head_repeat)
    dims_ok = head_dim is None or key_states.shape[3] == value_states.shape[3] == head_dim
    if heads_ok and dims_ok:
        return
    parts = []
    if kv_heads is not None:
        repeated = f", or each repeated {head_repeat} times: {kv_heads * head_repeat}," if head_repeat > 1 else ""
        parts.append(f"num_key_value_heads={kv_heads}{repeated}")
    if head_dim is not None:
        parts.append(f"head_dim={head_dim} channels")
    raise ValueError(
        f"{where}: key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} (expected "
        f"(B, H_kv, T, D)) do not have the config's {' and '.join(parts)}: the cache would hold other bytes than "
        "kvbits plan counts for this model (a config of another model?)"
    )


def check_incoming(layer: QuantizedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Host-only checks of K/V ``(B, H_kv, q, D)`` for ``layer``, whatever it holds: floating tensors of 4 dims,
    K and V agreeing on ``(B, H_kv, q)``, dtype and device, ``D >= 1``, the config's heads and head dim. ``update`` (``validate``) and
    ``lazy_initialization`` (which transformers' ``early_initialization`` calls directly) both run them, as
    ``StaticQuantizedLayer.lazy_initialization`` does (``layer``: anything with ``layer_idx``,
    ``num_key_value_heads``, ``head_repeat`` and ``head_dim``)."""
    names = (f"layer {layer.layer_idx} key_states", f"layer {layer.layer_idx} value_states")
    for x, what in zip((key_states, value_states), names):
        if not isinstance(x, torch.Tensor) or x.dtype not in KV_DTYPES or x.dim() != 4:
            check_kv(x, what)  # raises the precise TypeError / ValueError before looking at values
    kB, kH, kT, kD = key_states.shape
    vB, vH, vT, vD = value_states.shape
    if (kB, kH, kT) != (vB, vH, vT) or not (kD and vD):  # D = 0: a side without channels, never checked or stored
        raise ValueError(
            f"layer {layer.layer_idx}: key_states {tuple(key_states.shape)} and value_states "
            f"{tuple(value_states.shape)} must agree on (B, H_kv, T) and have D >= 1 channels"
        )
    if key_states.dtype != value_states.dtype:
        raise TypeError(
            f"layer {layer.layer_idx}: key dtype {key_states.dtype} != value dtype {value_states.dtype}"
        )
    if key_states.device != value_states.device:
        raise ValueError(
            f"layer {layer.layer_idx}: key_states on {key_states.device} but value_states on {value_states.device}; "
            "K and V must be on one device"
        )
    check_config_shape(f"layer {layer.layer_idx}", key_states, value_states, layer.num_key_value_heads,
                       layer.head_repeat, layer.head_dim)  # fmt: skip


def validate(layer: QuantizedKVLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Host-only checks of ``update``'s K/V ``(B, H_kv, q, D)`` against ``layer`` (no device sync):
    types, shapes (``check_incoming``), channel groups dividing ``D`` (first update), agreement with the cached
    ``(B, H_kv, *, D)``, dtype/device, calibration."""
    check_incoming(layer, key_states, value_states)
    if not layer.is_initialized and layer.mode == "quantized":  # before the first update stores anything
        check_channel_groups(layer.scheme, key_states.shape[3], value_states.shape[3], f"layer {layer.layer_idx}")
    if layer.is_initialized:
        for what, x, store in (
            ("key_states", key_states, layer._k),
            ("value_states", value_states, layer._v),
        ):
            ref = store.buffer
            heads = ref.shape[1] * layer.repeat  # the stored heads, as the model hands them over
            if x.shape[0] != ref.shape[0] or x.shape[1] != heads or x.shape[3] != ref.shape[3]:
                repeated = f" ({ref.shape[1]} stored heads, each repeated {layer.repeat} times)" if layer.repeat > 1 else ""
                raise ValueError(
                    f"layer {layer.layer_idx}: {what} {tuple(x.shape)} does not match the cached "
                    f"(B, H_kv, *, D) = {(ref.shape[0], heads, '*', ref.shape[3])}{repeated}"
                )
        if key_states.dtype != layer.dtype or key_states.device != layer.device:
            raise TypeError(
                f"layer {layer.layer_idx}: K/V changed from {layer.dtype} on {layer.device} to "
                f"{key_states.dtype} on {key_states.device}; reset() the cache first"
            )
    missing = layer.needs_calibration()
    if missing:
        raise ValueError(
            f"layer {layer.layer_idx}: scheme {layer.scheme.name!r} needs calibrated parameters ({', '.join(missing)}); "
            "run `kvbits calibrate` and install them with set_static_qparams() before use"
        )
