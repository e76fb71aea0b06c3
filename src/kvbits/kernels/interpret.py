"""Run the Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``): tests, ``--smoke``.

Call ``enable_interpreter()`` before a module of ``TRITON_KERNEL_MODULES`` is first imported: Triton decides at
``@triton.jit`` decoration time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations

import os
import sys

__all__ = ["TRITON_KERNEL_MODULES", "enable_interpreter", "interpreting"]

# the modules whose @triton.jit kernels are decorated at import (compiled or interpreted, fixed then)
TRITON_KERNEL_MODULES = ("kvbits.kernels.triton_decode", "kvbits.kernels.triton_fold", "kvbits.kernels.triton_quantize")

_PATCHED = False
# the values of TRITON_INTERPRET that Triton (3.6's getenv_bool, case-insensitive) takes for "on"
_TRUE = ("1", "true", "on", "yes", "y")


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton for its interpreter, as Triton reads it (``1``, ``true``, ``on``,
    ``yes``, ``y``, any case); standard library only. Before, kvbits took only ``1``: under ``TRITON_INTERPRET=true``
    Triton interpreted while ``KVBITS_KERNEL=triton`` refused CPU queries and ``dequant="f16"`` emitted inline PTX,
    which the interpreter cannot run."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def _reinterpret_triton_language() -> None:
    """Turn ``triton.language``'s own ``@jit`` helpers into interpreted functions.

    ``tl.zeros``, ``tl.max``, ``tl.interleave``, ... are ``@triton.jit`` functions of
    ``triton.language.standard``: decorated when Triton was first imported. If that happened before
    ``TRITON_INTERPRET=1`` (transformers imports Triton when it is installed), they are compiled-mode
    ``JITFunction`` objects, which refuse to be called from an interpreted kernel. Rebinding them as
    ``InterpretedFunction`` in every loaded ``triton.language`` module gives what a fresh import with
    the variable set would have given.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    converted: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in converted:
                    converted[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, converted[id(value)])


def enable_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` and make the interpreter usable in this process.

    - If Triton was already imported in compiled mode, its language helpers are rebound as
      interpreted functions (``_reinterpret_triton_language``).
    - The interpreter keeps scalars as 1-element arrays and converts them with ``int(array)``, which
      NumPy 2.4 turned into a ``TypeError``, so every loop with a runtime bound fails
      (triton-lang/triton#9171; fixed upstream with ``.squeeze()``, Triton 3.6 still has it). The shim
      re-defines that one conversion.
    - ``tl.fma`` rounds once, as on the GPU (``_fma_rounded_once``, float16 / float32); the interpreter's own rounds the product too.
    - ``tl.dot`` of bfloat16 operands multiplies their values, not their uint16 bit patterns.
    - float32 → bfloat16 casts (``x.to(tl.bfloat16)``) round to nearest even, as on the GPU and in torch
      (``_f32_to_bf16``); the interpreter's own truncates, which doubled the kernel's error on bfloat16 queries.
      Integer → bfloat16 casts convert the values (through float32, exact to 2^24) where the interpreter's own
      reinterprets them as bit patterns (7 became 6.4e-40).

    Compiled (GPU) kernels are unaffected; call this only where kernels should run on the CPU.
    """
    global _PATCHED
    if not interpreting():
        early = sorted(name for name in sys.modules if name in TRITON_KERNEL_MODULES)
        if early:
            raise RuntimeError(
                f"{', '.join(early)} imported before enable_interpreter(): its kernels were decorated in compiled "
                "mode and cannot run on CPU tensors; call enable_interpreter() before importing them (tests: "
                "import Triton kernel modules inside the test, or after test_kernels' set-up)"
            )
    already_imported = "triton" in sys.modules and not interpreting()
    os.environ["TRITON_INTERPRET"] = "1"
    if _PATCHED:
        return
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if already_imported:
        _reinterpret_triton_language()
    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    original_fma = interp.InterpreterBuilder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype in (np.float16, np.float32):  # bfloat16 is uint16 bits here: the interpreter's own
            return _fma_rounded_once(x, y, z)
        return original_fma(self, x, y, z)

    interp.InterpreterBuilder.create_fma = create_fma
    original_dot = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bfloat16 operands are uint16 bit patterns in the interpreter, and its dot multiplies those
        # integers (its float8 branch converts; bfloat16 has none): widen them to float32 first
        a, b = (_bf16_as_f32(interp, x) for x in (a, b))
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot
    original_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and (src.dtype.scalar == tl.float32 or src.dtype.scalar.is_int()):
            # integers: through their float32 values (the interpreter's own reinterprets them as bit patterns)
            return interp.TensorHandle(_f32_to_bf16(src.data.astype(np.float32)), tl.bfloat16)
        return original_cast(self, src, dst_type)

    interp.InterpreterBuilder.cast_impl = cast_impl  # create_fp_trunc (``.to``'s float downcast) calls it
    _PATCHED = True


def _bf16_as_f32(interp, x):
    """A bfloat16 ``TensorHandle`` (uint16 bit patterns) as float32 values (exact); others unchanged."""
    import numpy as np
    import triton.language as tl

    if x.dtype.scalar != tl.bfloat16:
        return x
    bits = x.data.astype(np.uint32) << 16
    return interp.TensorHandle(bits.view(np.float32), tl.float32)


def _f32_to_bf16(x):
    """float32 values → bfloat16 bit patterns (uint16), rounded to nearest, ties to even (the GPU's
    ``cvt.rn.bf16.f32``, torch's ``.bfloat16()``); NaN stays NaN (quiet), values past bfloat16's range go to inf."""
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x40).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def _fma_rounded_once(x, y, z):
    """``tl.fma`` with one rounding, as the GPU's fused multiply-add (``fma.rn``).

    The interpreter computes ``x * y + z`` in the operands' dtype: in float16 the product is rounded
    first, at the product's magnitude, which can be far larger than the result's (``code * scale`` next
    to ``zero``). Here the product and sum are exact in float64 (float16 / float32 operands) and rounded
    once to the result dtype.
    """
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
    return TensorHandle(exact.astype(z.data.dtype), z.dtype.scalar)
