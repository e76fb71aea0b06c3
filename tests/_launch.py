"""A stand-in for a Triton kernel object that records each launch's constexprs (shared by the kernel tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LaunchSpy:
    """Wraps a ``@triton.jit`` kernel: ``spy[grid](*args, **meta)`` appends ``meta`` to ``seen``, raises
    ``RuntimeError`` when ``fail(meta)`` says so (a stand-in compile failure), else launches the kernel."""

    def __init__(self, kernel: Any, fail: Callable[[dict], bool] | None = None) -> None:
        self.kernel, self.fail, self.seen = kernel, fail, []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **meta: Any) -> Any:
            self.seen.append(meta)
            if self.fail is not None and self.fail(meta):
                raise RuntimeError("PTX assembly failed (stand-in)")
            return self.kernel[grid](*args, **meta)

        return launch
