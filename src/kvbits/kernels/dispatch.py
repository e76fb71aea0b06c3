"""Pick the decode-attention implementation: the fused Triton kernel on CUDA, the torch reference elsewhere.

``KVBITS_KERNEL=reference|triton`` overrides the automatic choice (``auto``, the default). Triton is
imported lazily, on the first call that wants it, never at ``import kvbits``. ``KVBITS_DEQUANT=f16`` makes
the Triton kernel dequantize plain integer codes in float16 for float16 queries (``decode_attention_triton``'s
``dequant``; opt-in until a GPU run has checked and timed it, BENCHMARKS.md §6); ``KVBITS_DEQUANT=fold`` takes the
folded-scale kernel (``kvbits.kernels.triton_fold``) for the integer stores it reads (``fold_supported``), also
opt-in until a GPU run; ``f32`` is the default. ``KVBITS_AUTOTUNE=on`` times a few launches of the Triton kernel on
the first decode step of each shape and takes the fastest one that matches the default launch's output
(``kvbits.kernels.autotune``); an explicit ``KVBITS_DEQUANT`` then limits the candidates to that dequantization.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from kvbits.kernels import autotune
from kvbits.kernels.reference import PackedStore, decode_attention_reference

logger = logging.getLogger(__name__)

__all__ = [
    "DEQUANT_ENV",
    "KERNEL_ENV",
    "check_triton_device",
    "decode_attention",
    "dequant_mode",
    "kernel_calls",
    "kernel_mode",
    "kernel_settings",
    "require_triton",
    "resolve_kernel",
    "triton_available",
]

KERNEL_ENV = "KVBITS_KERNEL"
DEQUANT_ENV = "KVBITS_DEQUANT"
DEQUANT_MODES = ("f32", "f16", "fold")  # decode_attention_triton's ``dequant`` (triton_decode imports these); default first
MODES = ("auto", "reference", "triton")  # KVBITS_KERNEL; the default first
INSTALL_HINT = "install Triton (pip install 'kvbits[triton]'; Linux + CUDA, or TRITON_INTERPRET=1 on CPU)"


@functools.cache
def triton_available() -> bool:
    """Whether ``kvbits.kernels.triton_decode`` (hence Triton) imports."""
    try:
        import kvbits.kernels.triton_decode  # noqa: F401
    except ImportError as exc:
        logger.debug("Triton unavailable: %s", exc)
        return False
    return True


def kernel_mode() -> str:
    """``KVBITS_KERNEL`` (``auto``, ``reference`` or ``triton``); ``ValueError`` for anything else."""
    mode = os.environ.get(KERNEL_ENV, "").strip().lower() or MODES[0]
    if mode not in MODES:
        raise ValueError(f"{KERNEL_ENV} must be one of {MODES}, got {mode!r}")
    return mode


def dequant_mode() -> str:
    """``KVBITS_DEQUANT`` (``f32``, the default, ``f16`` or ``fold``); ``ValueError`` for anything else."""
    mode = os.environ.get(DEQUANT_ENV, "").strip().lower() or DEQUANT_MODES[0]
    if mode not in DEQUANT_MODES:
        raise ValueError(f"{DEQUANT_ENV} must be one of {DEQUANT_MODES}, got {mode!r}")
    return mode


def kernel_settings() -> dict[str, str]:
    """The decode-kernel settings in force, as a timing or an evaluation should record them:
    ``{"kernel": KVBITS_KERNEL, "dequant": KVBITS_DEQUANT, "autotune": KVBITS_AUTOTUNE}`` (their defaults when
    unset: ``auto``, ``f32``, ``off``). ``ValueError`` for a value those variables do not take."""
    return {"kernel": kernel_mode(), "dequant": dequant_mode(), "autotune": autotune.autotune_mode()}


# kernel_settings() with nothing set: each parser's first mode
DEFAULT_SETTINGS = {"kernel": MODES[0], "dequant": DEQUANT_MODES[0], "autotune": autotune.MODES[0]}


def check_triton_device(x: torch.Tensor, what: str) -> None:
    """``KVBITS_KERNEL=triton``: ``ValueError`` unless ``x`` is on CUDA or Triton runs interpreted.

    Triton launches CPU tensors only through its interpreter (``TRITON_INTERPRET=1``, as
    ``kvbits.kernels.interpret.enable_interpreter`` sets it), or compiles them for another GPU inside
    ``kvbits.kernels.aot.compile_only``; otherwise Triton itself fails with an opaque "0 active drivers"
    error at the launch.
    """
    from kvbits.kernels import aot, interpret  # standard library only: no Triton import

    if not x.is_cuda and not interpret.interpreting() and not aot.compiling():
        raise ValueError(
            f"{KERNEL_ENV}=triton runs the Triton kernels on CUDA tensors, or on CPU tensors through Triton's "
            f"interpreter (TRITON_INTERPRET=1, kvbits.kernels.interpret.enable_interpreter()); got {what} on "
            f"{x.device} without it: set {KERNEL_ENV}=reference (or auto) for the torch reference"
        )


def require_triton(q: torch.Tensor) -> None:
    """``KVBITS_KERNEL=triton``: ``ImportError`` unless Triton imports, ``ValueError`` unless it can launch on
    ``q``'s device (``check_triton_device``)."""
    if not triton_available():
        raise ImportError(f"{KERNEL_ENV}=triton but Triton is not importable; {INSTALL_HINT}")
    check_triton_device(q, "the query")


def resolve_kernel(q: torch.Tensor, store: PackedStore) -> str:
    """``"triton"`` or ``"reference"``: what ``decode_attention`` runs for these inputs."""
    mode = kernel_mode()
    if mode == "reference":
        return "reference"
    if mode == "triton":
        require_triton(q)
        from kvbits.kernels.triton_decode import supported

        reason = supported(store, q)
        if reason:
            raise NotImplementedError(f"{KERNEL_ENV}=triton: {reason}")
        return "triton"
    if not q.is_cuda or not triton_available():
        return "reference"
    from kvbits.kernels.triton_decode import supported

    reason = supported(store, q)
    if reason:
        log_fallback_once(logger, "decode attention", reason, "; kernel_calls() counts the calls served by it")
        return "reference"
    return "triton"


# the fallbacks to the torch reference logged so far in this process, as (what, reason): each once, the first
# LOGGED_FALLBACKS_MAX
_LOGGED_FALLBACKS: set[tuple[str, str]] = set()
LOGGED_FALLBACKS_MAX = 32  # a reason naming a per-step shape (a view's strides) would otherwise grow the set unbounded


def log_fallback_once(log: logging.Logger, what: str, reason: str, note: str = "") -> None:
    """Log on ``log`` that ``what`` (``"decode attention"``, ``"quantize-and-pack"``) falls back to the torch
    reference for ``reason``: once per distinct ``(what, reason)`` (info), not at every decode step or block flush
    of every layer; past ``LOGGED_FALLBACKS_MAX`` distinct pairs, further ones at debug level. ``note`` is appended
    to the message."""
    key = (what, reason)
    if key in _LOGGED_FALLBACKS:
        return
    if len(_LOGGED_FALLBACKS) >= LOGGED_FALLBACKS_MAX:
        log.debug("%s falls back to the torch reference: %s", what, reason)
        return
    _LOGGED_FALLBACKS.add(key)
    log.info("%s falls back to the torch reference: %s (logged once per reason%s)", what, reason, note)


_CALLS: dict[str, int] = {"triton": 0, "reference": 0}  # decode_attention's calls by what served them


def kernel_calls() -> dict[str, int]:
    """``{"triton": n, "reference": m}``: ``decode_attention`` calls so far in this process by the implementation
    that served them (calls traced by ``torch.compile`` or replayed from a CUDA graph run no Python: not counted).
    A timing reads it before and after, so that a run of the torch reference is not reported as the kernel's."""
    return dict(_CALLS)


def decode_attention(q: torch.Tensor, store: PackedStore, scale: float | None = None) -> torch.Tensor:
    """Decode attention ``q (B, H_q, 1, D)`` over a packed store → ``(B, H_q, 1, D)`` in ``q.dtype``.

    Fused Triton kernel on CUDA when Triton imports and supports the store, else the float32 torch
    reference (``decode_attention_reference``); ``KVBITS_KERNEL`` forces either; ``KVBITS_AUTOTUNE=on`` picks the
    Triton kernel's launch by timing (``kvbits.kernels.autotune``). Both attend rotated sides
    (``PackedTensor.rotate``) in the codes' basis (``reference.code_basis``). ``TypeError`` for a query that is not
    floating point; a sequence whose every slot is masked attends to nothing and gets zeros (as torch's SDPA).
    """
    if not q.is_floating_point():  # before the kernel choice: Triton's refusal would send it to the reference
        raise TypeError(f"q must be a floating-point tensor (float16, bfloat16, float32), got {q.dtype}")
    kernel = resolve_kernel(q, store)
    if not torch.compiler.is_compiling():
        _CALLS[kernel] += 1
    if kernel == "triton":
        from kvbits.kernels.triton_decode import decode_attention_triton

        if autotune.autotune_mode() == "on":
            return autotune.attend(q, store, scale)
        return decode_attention_triton(q, store, scale, dequant=dequant_mode())
    return decode_attention_reference(q, store, scale)
