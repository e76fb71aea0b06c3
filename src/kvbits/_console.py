"""The console the CLIs print their tables to (:func:`stdout_console`): no figure is ever cut to ``…``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# stdout that is not a terminal (a pipe, a log file, CI) has no width to fit: rich's 80-column default cut table
# cells to "+262…" / "kvqua…". Lines there are as long as their content (a table is as wide as its cells).
UNBOUNDED_WIDTH = 100_000


def fold_columns(table: Any) -> Any:
    """``table`` (a ``rich.table.Table``) with every column that would cut a too-long cell to ``…`` folding it
    onto the next line instead (a number split over two lines is still read; a cut one is lost). Returns it."""
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"
    return table


def stdout_console() -> Console:
    """A rich console on stdout: a terminal's tables fit its width, folding (never cutting) a cell that does not
    fit; a pipe's or a file's lines are as long as their content (tables are never squeezed)."""
    from rich.console import Console, RenderHook
    from rich.table import Table

    class _FoldTables(RenderHook):
        def process_renderables(self, renderables: list[Any]) -> list[Any]:
            for r in renderables:
                if isinstance(r, Table):
                    fold_columns(r)
            return renderables

    console = Console()
    if not console.is_terminal:
        console = Console(width=UNBOUNDED_WIDTH)
    console.push_render_hook(_FoldTables())
    return console
