"""Run the Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``): tests, ``--smoke``.

Call ``enable_interpreter()`` before ``kvbits.kernels.triton_decode`` is first imported: Triton decides
at ``@triton.jit`` decoration time whether a kernel is compiled or interpreted.
"""

from __future__ import annotations

import os
import sys

__all__ = ["enable_interpreter"]

_PATCHED = False


def enable_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` and make the interpreter work with NumPy >= 2.4.

    The interpreter keeps scalars as 1-element arrays and converts them with ``int(array)``, which
    NumPy 2.4 turned into a ``TypeError``, so every loop with a runtime bound fails
    (triton-lang/triton#9171; fixed upstream with ``.squeeze()``, Triton 3.6 still has it). The shim
    re-defines that one conversion; compiled (GPU) kernels are unaffected.
    """
    global _PATCHED
    if "kvbits.kernels.triton_decode" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("kvbits.kernels.triton_decode was imported before enable_interpreter(); its kernels are compiled")
    os.environ["TRITON_INTERPRET"] = "1"
    if _PATCHED:
        return
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    _PATCHED = True
