"""Which backends SDPA may use while a timing runs: torch's choice, or all but cuDNN's.

torch keys its cuDNN attention plans on the exact sizes, the key length included, and builds a plan on the host at
every new length (``aten/src/ATen/native/cudnn/MHA.cpp``; ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``,
pytorch/pytorch#155958, covers only BSHD-contiguous inputs). A decode step attends over one more token than the last,
so where SDPA picks cuDNN (a GPU) every decode step through SDPA pays for a plan, a host cost that kvbits' fused
decode steps (no SDPA) never pay (BENCHMARKS.md §6, session 46). ``kvbits speed --sdpa`` and the GPU benchmark's
baselines use this module; it imports only torch, as the GPU machine requires.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["SDPA_MODES", "check_sdpa_mode", "sdpa_backends"]

SDPA_MODES = ("auto", "no-cudnn")  # the default first


def check_sdpa_mode(mode: object) -> str:
    """``mode`` when it is one of ``SDPA_MODES``; ``ValueError`` otherwise."""
    if mode not in SDPA_MODES:
        raise ValueError(f"sdpa must be one of {SDPA_MODES}, got {mode!r}")
    return str(mode)


@contextlib.contextmanager
def sdpa_backends(mode: str) -> Iterator[None]:
    """SDPA calls in the block as ``mode`` says: ``"auto"`` (torch's choice) or ``"no-cudnn"`` (flash,
    memory-efficient or math; the flags are process-wide while the block runs). ``ValueError`` for another mode."""
    if check_sdpa_mode(mode) == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
