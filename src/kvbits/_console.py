"""The console the CLIs print their tables to (:func:`stdout_console`): no figure is ever cut to ``…``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

# stdout that is not a terminal (a pipe, a log file, CI) has no width to fit: rich's 80-column default cut table
# cells to "+262…" / "kvqua…". Lines there are as long as their content (a table is as wide as its cells).
UNBOUNDED_WIDTH = 100_000
# ... except prose: a pipe's free-text column (`kvbits schemes`' descriptions, one of 669 characters) wraps at this
# width, else every row of its table (borders, title centred over it) is as long as the longest sentence.
PIPE_PROSE_WIDTH = 100


def fold_columns(table: Any) -> Any:
    """``table`` (a ``rich.table.Table``) with every column that would cut a too-long cell to ``…`` folding it
    onto the next line instead (a number split over two lines is still read; a cut one is lost). Returns it."""
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"
    return table


def prose_width(console: Console) -> int | None:
    """The ``max_width`` for a free-text (prose) column on ``console``: ``None`` on a terminal (its width already
    wraps it; terminal output is left as it was), :data:`PIPE_PROSE_WIDTH` on a pipe or a file, whose unbounded
    width would otherwise stretch the column, and its whole table, to the longest sentence on one line."""
    return None if console.is_terminal else PIPE_PROSE_WIDTH


def stdout_console() -> Console:
    """A rich console on stdout: a terminal's tables fit its width, folding (never cutting) a cell that does not
    fit; a pipe's or a file's lines are as long as their content (tables are never squeezed). A closed stdout
    raises ``BrokenPipeError`` (rich would exit 1 silently) for :func:`kvbits.cli.main` to end quietly."""
    from rich.console import Console, RenderHook
    from rich.table import Table

    class _FoldTables(RenderHook):
        def process_renderables(self, renderables: list[Any]) -> list[Any]:
            for r in renderables:
                if isinstance(r, Table):
                    fold_columns(r)
            return renderables

    class _PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            # rich's own answer to a closed stdout (`kvbits plan | head -1`) is a silent `SystemExit(1)`, which
            # reads as a failure; the command line's main() answers every closed stdout (rich's or print's) alike.
            raise BrokenPipeError(32, "Broken pipe")

    console = _PipeConsole()
    if not console.is_terminal:
        console = _PipeConsole(width=UNBOUNDED_WIDTH)
    console.push_render_hook(_FoldTables())
    return console
