"""Report: a run's numbers as terminal tables, Markdown/HTML pages and figures.

``write_report(out_dir)`` turns an evaluation output folder into ``report.md``, a self-contained
``report.html`` and PNG figures; ``print_summary`` / ``bucket_table`` are what the CLI prints.
matplotlib is needed only for the figures and is imported only when they are drawn.
"""

from typing import TYPE_CHECKING

from kvbits._lazy import lazy_exports

if TYPE_CHECKING:
    from kvbits.report.render import write_report
    from kvbits.report.summary import RunSummary
    from kvbits.report.tables import bucket_table, print_summary
    from kvbits.report.verdict import verdict

# imported on first use: `kvbits --help` imports this package's cli module without torch (kvbits._lazy)
__getattr__ = lazy_exports(
    __name__,
    {
        "write_report": "render",
        "RunSummary": "summary",
        "bucket_table": "tables",
        "print_summary": "tables",
        "verdict": "verdict",
    },
)

__all__ = ["RunSummary", "bucket_table", "print_summary", "verdict", "write_report"]
