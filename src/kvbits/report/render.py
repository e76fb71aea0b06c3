"""Turn an evaluation output folder into ``report.md``, ``report.html`` and PNG figures.

The report is built once as a short list of blocks (heading, paragraph, table, figure, code) and
then written twice, as Markdown and as one self-contained HTML page (inline CSS, figures as base64
PNG), so the two always say the same thing.

Input (written by :mod:`kvbits.evaluate.runner`)::

    DIR/summary.json                   required: the numbers
    DIR/config.json                    optional: run arguments, versions, commit, date
    DIR/tokens/<scheme>.safetensors    optional: per-token nll, nll_ref, kl, top1, shape (W, T-1)
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbits.report.calibration import (
    CALIBRATION_NOTE,
    calibration_rows,
    calibration_table,
    calibration_warnings,
)
from kvbits.report.fmt import DEFAULT_THRESHOLD, fmt_pos
from kvbits.report.plots import PLOT_FILES
from kvbits.report.summary import RunSummary
from kvbits.report.tables import TableData, attn_table, delta_table, metric_table, overall_table
from kvbits.report.verdict import verdict

logger = logging.getLogger(__name__)

__all__ = ["load_config", "load_token_arrays", "reproduce_command", "write_report"]


# ------------------------------------------------------------------------------------ inputs


def load_config(out_dir: str | Path) -> dict[str, Any]:
    """``DIR/config.json`` as a dict, or ``{}`` when it is missing or unreadable (logged)."""
    p = Path(out_dir) / "config.json"
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", p, exc)
        return {}
    return data if isinstance(data, dict) else {}


def load_token_arrays(out_dir: str | Path, schemes: list[str]) -> dict[str, dict[str, Any]]:
    """Per-token arrays of each scheme from ``DIR/tokens/<scheme>.safetensors`` (numpy, no torch).

    Schemes without a file, and unreadable files (logged), are simply absent from the result.
    """
    tok_dir = Path(out_dir) / "tokens"
    if not tok_dir.is_dir():
        return {}
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    out: dict[str, dict[str, Any]] = {}
    for name in schemes:
        p = tok_dir / f"{name}.safetensors"
        if not p.is_file():
            continue
        try:
            out[name] = dict(load_file(str(p)))
        except (OSError, SafetensorError) as exc:  # an optional file: skip it, keep the report
            logger.warning("ignoring unreadable per-token file %s: %s", p, exc)
    return out


def _args(config: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("args", "arguments", "run", "params"):
        if isinstance(config.get(key), Mapping):
            return config[key]
    return {}


def _commit(config: Mapping[str, Any]) -> str:
    c = config.get("commit") or config.get("git_commit") or ""
    if isinstance(c, Mapping):
        sha = str(c.get("sha") or c.get("hash") or c.get("commit") or "")
        return sha + (" (dirty tree)" if c.get("dirty") else "")
    return str(c)


_REPEATED_FLAGS = {"schemes": "--scheme", "scheme": "--scheme"}  # `kvbits eval --scheme A --scheme B`


def reproduce_command(config: Mapping[str, Any], run: RunSummary, out_dir: str | Path | None = None) -> str:
    """The command line that re-runs this evaluation, from ``config.json``.

    Uses the recorded command line (``argv``, or ``command``) when there is one; otherwise (a run
    started from Python) rebuilds ``kvbits eval --flag value ...`` from the recorded arguments, or
    from the summary itself when ``config.json`` is missing. ``--out`` is the report's folder.
    """
    cmd = config.get("command")
    if isinstance(cmd, str) and cmd.strip():
        return cmd.strip()
    argv = config.get("argv") if isinstance(config.get("argv"), list) else cmd if isinstance(cmd, list) else None
    if argv:
        argv = [str(a) for a in argv]
        if Path(argv[0]).name in ("kvbits", "__main__.py", "cli.py", "python", "python3"):
            argv = argv[1:]
        return shlex.join(["kvbits", *argv])
    args = dict(_args(config))
    if not args:
        args = {
            "model": run.model, "data": run.data, "context": run.context, "windows": run.windows,
            "schemes": [r.name for r in run.results], "mode": run.mode, "semantics": run.semantics,
        }
    if out_dir is not None and "out" not in args and "out_dir" not in args:
        args["out"] = str(out_dir)
    parts = ["kvbits", "eval"]
    for key, value in args.items():
        if key in _REPEATED_FLAGS and isinstance(value, (list, tuple)):
            for v in value:
                parts += [_REPEATED_FLAGS[key], str(v)]
            continue
        flag = "--" + ("out" if key == "out_dir" else str(key)).replace("_", "-")
        if value is None or value is False or isinstance(value, Mapping):
            continue  # unset, off, or nested settings without a flag form
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple)):
            parts += [flag, *(str(v) for v in value)]  # an empty list is the bare flag ("none")
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


# ------------------------------------------------------------------------------------ document


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str  # inline **bold** and `code` allowed


@dataclass(frozen=True)
class Meta:
    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Table:
    data: TableData


@dataclass(frozen=True)
class Figure:
    path: Path
    alt: str
    caption: str


@dataclass(frozen=True)
class Code:
    text: str


Block = Heading | Para | Meta | Table | Figure | Code

_FIGURE_TEXT = {
    "ppl_vs_position": "Perplexity (top) and ΔPPL against the unquantized reference (bottom) along the "
    "context; the dotted red line is the 1% budget.",
    "delta_heatmap": "ΔPPL % per scheme and position bucket, with 95% confidence intervals.",
    "kl_by_bucket": "KL divergence from the reference per position bucket (log scale; zeros are not drawn).",
    "bits_vs_delta": "Memory against quality: average bits per cached element vs ΔPPL, overall (filled) "
    "and in the worst bucket (hollow).",
    "attn_error": "Relative error of the attention output per sampled layer and position bucket.",
}


def _build(
    run: RunSummary, config: Mapping[str, Any], figures: Mapping[str, Path], failed: Mapping[str, str],
    plot_note: str, threshold: float, out_dir: Path, has_tokens: bool,
) -> list[Block]:
    ctx = fmt_pos(run.context)
    ctx = "unknown context" if not run.context else f"{ctx} context" if "K" in ctx else f"{ctx}-token context"
    blocks: list[Block] = [Heading(1, f"KV-cache quantization report: {run.model} on {run.data}, {ctx}")]
    fp = run.fingerprint or {}
    versions = config.get("versions")
    meta = [
        ("Model", f"`{run.model}`" + (f" (fingerprint `{fp['model']}`)" if fp.get("model") else "")),
        ("Data", f"`{run.data}`" + (f" (tokens fingerprint `{fp['tokens']}`)" if fp.get("tokens") else "")),
        ("Context", f"{run.context} tokens per window, {run.windows} window(s)"),
        ("Semantics", f"`{run.semantics}`, `{run.mode}` mode"),
    ]
    if run.peak_memory:
        meta.append(("Peak memory", run.peak_memory))
    meta += [
        ("Date", str(config.get("date") or config.get("timestamp") or "n/a")),
        ("Commit", f"`{_commit(config)}`" if _commit(config) else "n/a"),
    ]
    if isinstance(versions, Mapping) and versions:
        meta.append(("Versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    blocks += [Meta(tuple(meta)), Heading(2, "Verdict"), Para(verdict(run, threshold))]
    if plot_note:
        blocks.append(Para(plot_note))

    def fig(key: str) -> None:
        if key in figures:
            blocks.append(Figure(figures[key], PLOT_FILES[key], _FIGURE_TEXT[key]))
        elif key in failed:
            blocks.append(Para(f"*The figure `{key}.png` could not be drawn: {failed[key]}.*"))

    blocks.append(Heading(2, "Where along the context it hurts"))
    if run.bucket_spans:
        fig("ppl_vs_position")
        if "ppl_vs_position" in figures and not has_tokens:
            blocks.append(Para("*No per-token arrays in `tokens/`: the curves are bucket means.*"))
        blocks += [Table(delta_table(run, threshold)), Table(metric_table(run, "ppl"))]
        fig("delta_heatmap")
        blocks += [
            Heading(2, "KL divergence and top-1 agreement"),
            Table(metric_table(run, "kl")),
        ]
        fig("kl_by_bucket")
        blocks.append(Table(metric_table(run, "top1")))
    else:
        blocks.append(Para("The run recorded no position buckets."))
    blocks += [Heading(2, "Overall"), Table(overall_table(run, threshold))]
    fig("bits_vs_delta")
    blocks.append(Heading(2, "Attention-output error"))
    at = attn_table(run)
    if at is None:
        blocks.append(Para("Not measured in this run."))
    else:
        blocks.append(Table(at))
        fig("attn_error")
    cal = calibration_rows(run, config)
    if cal:
        blocks += [Heading(2, "Calibration"), Para(CALIBRATION_NOTE), Table(calibration_table(cal))]
        blocks += [Para(w) for w in calibration_warnings(cal)]
    blocks += [
        Heading(2, "How to reproduce"),
        Code(reproduce_command(config, run, out_dir)),
    ]
    commit = _commit(config)
    if commit:
        blocks.append(Para(f"at commit `{commit.split()[0]}` of kvbits."))
    return blocks


# ------------------------------------------------------------------------------------ Markdown


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(t: TableData) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in t.headers) + " |"]
    lines.append("|" + "|".join("---:" if i in t.right else ":---" for i in range(len(t.headers))) + "|")
    for row in t.rows:
        cells = [f"**{_md_cell(c.text)}**" if c.tone == "bad" and c.text else _md_cell(c.text) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    return (f"*{t.caption}*\n\n" + out) if t.caption else out


def to_markdown(blocks: list[Block], out_dir: Path) -> str:
    parts = []
    for b in blocks:
        if isinstance(b, Heading):
            parts.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            parts.append(b.text)
        elif isinstance(b, Meta):
            parts.append("\n".join(f"- **{k}:** {v}" for k, v in b.items))
        elif isinstance(b, Table):
            parts.append(_md_table(b.data))
        elif isinstance(b, Figure):
            rel = os.path.relpath(b.path, out_dir)
            parts.append(f"![{b.alt}]({rel})\n\n*{b.caption}*")
        elif isinstance(b, Code):
            parts.append(f"```bash\n{b.text}\n```")
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------ HTML

_CSS = """
body{font:15px/1.5 -apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;color:#1f2328;
 max-width:1100px;margin:2em auto;padding:0 1.2em}
h1{font-size:1.6em;border-bottom:1px solid #d0d7de;padding-bottom:.3em}
h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #eaeef2;padding-bottom:.2em}
ul.meta{list-style:none;padding:0;color:#444}ul.meta li{margin:.1em 0}
p.verdict{background:#f6f8fa;border-left:4px solid #0969da;padding:.8em 1em}
p.warning{background:#fff8c5;border-left:4px solid #bf8700;padding:.5em 1em}
table{border-collapse:collapse;margin:.4em 0 1.2em;font-variant-numeric:tabular-nums;font-size:14px}
th,td{border:1px solid #d0d7de;padding:.3em .6em}th{background:#f6f8fa}
td.r,th.r{text-align:right}td.bad{background:#ffebe9;color:#a40e26;font-weight:600}
td.good{color:#1a7f37}td.muted{color:#8c959f}
.caption{color:#57606a;font-size:13px;margin:.2em 0}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eaeef2}
figcaption{color:#57606a;font-size:13px}
code{background:#f6f8fa;padding:.1em .3em;border-radius:4px;font-size:90%}
pre{background:#f6f8fa;padding:.8em 1em;overflow-x:auto;border-radius:6px}
"""


def _inline(text: str) -> str:
    """Escape, then render ``**bold**``, ``*italic*`` and ```code``` spans."""
    s = html.escape(text, quote=False)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    s = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", s)
    return re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"<em>\1</em>", s)


def _cls(*names: str) -> str:
    joined = " ".join(n for n in names if n)
    return f' class="{joined}"' if joined else ""


def _html_table(t: TableData) -> str:
    head = "".join(f"<th{_cls('r' if i in t.right else '')}>{html.escape(h)}</th>" for i, h in enumerate(t.headers))
    rows = [f"<tr>{head}</tr>"]
    for row in t.rows:
        tds = "".join(
            f"<td{_cls('r' if i in t.right else '', c.tone)}>{html.escape(c.text)}</td>" for i, c in enumerate(row)
        )
        rows.append(f"<tr>{tds}</tr>")
    cap = f'<p class="caption">{_inline(t.caption)}</p>' if t.caption else ""
    return cap + "<table>" + "".join(rows) + "</table>"


def to_html(blocks: list[Block], title: str) -> str:
    body = []
    after_verdict = False
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{html.escape(b.text)}</h{b.level}>")
            after_verdict = b.text == "Verdict"
        elif isinstance(b, Para):
            cls = ' class="verdict"' if after_verdict else ' class="warning"' if b.text.startswith("Warning:") else ""
            body.append(f"<p{cls}>{_inline(b.text)}</p>")
            after_verdict = False
        elif isinstance(b, Meta):
            items = "".join(f"<li><strong>{html.escape(k)}:</strong> {_inline(v)}</li>" for k, v in b.items)
            body.append(f'<ul class="meta">{items}</ul>')
        elif isinstance(b, Table):
            body.append(_html_table(b.data))
        elif isinstance(b, Figure):
            data = base64.b64encode(Path(b.path).read_bytes()).decode("ascii")
            alt = html.escape(b.alt, quote=True)
            body.append(
                f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(b.caption)}</figcaption></figure>"
            )
        elif isinstance(b, Code):
            body.append(f"<pre><code>{html.escape(b.text)}</code></pre>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


# ------------------------------------------------------------------------------------ entry point


def _write_text(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def write_report(
    out_dir: str | Path,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    plots: bool | None = None,
    smooth: int = 256,
    strict: bool = False,
) -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and the figures (PNG) of an evaluation folder.

    Args:
        out_dir: the evaluator's output folder; it must hold ``summary.json``. ``config.json`` and
            ``tokens/*.safetensors`` are used when present.
        threshold: the ΔPPL budget (fraction) the verdict and the tables judge against.
        plots: True: draw figures (ImportError with an install hint without matplotlib);
            False: none; None: draw them when matplotlib is installed, else say so in the report.
        smooth: tokens in the running mean of the per-token curves.
        strict: raise when a figure fails instead of noting it in the report.

    Returns:
        ``{"markdown": ..., "html": ..., <figure key>: ...}`` with each file's path; figure keys
        are the PNG stems (``ppl_vs_position``, ``delta_heatmap``, ``kl_by_bucket``,
        ``bits_vs_delta``, ``attn_error``), present only when drawn.

    Raises:
        FileNotFoundError: ``out_dir`` has no ``summary.json``.
        ValueError: ``threshold`` is not a positive number.
    """
    if not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold must be a positive fraction (0.01 = 1%), got {threshold!r}")
    if plots not in (True, False, None):
        raise TypeError(f"plots must be True, False or None, got {plots!r}")
    out = Path(out_dir)
    run = RunSummary.load(out)
    config = load_config(out)
    tokens = load_token_arrays(out, [r.name for r in run.results])

    figures: dict[str, Path] = {}
    failed: dict[str, str] = {}
    note = ""
    if plots is not False:
        from kvbits.report import plots as plots_mod

        try:
            plots_mod.require_matplotlib()
        except ImportError:
            if plots:
                raise
            note = f"*Figures skipped: {plots_mod.INSTALL_HINT}.*"
            logger.warning(plots_mod.INSTALL_HINT)
        else:
            figures, failed = plots_mod.make_plots(
                run, out, tokens, threshold=threshold, smooth=smooth, strict=strict
            )

    blocks = _build(run, config, figures, failed, note, threshold, out, bool(tokens))
    title = blocks[0].text if isinstance(blocks[0], Heading) else "kvbits report"
    paths: dict[str, Path] = {
        "markdown": _write_text(out / "report.md", to_markdown(blocks, out)),
        "html": _write_text(out / "report.html", to_html(blocks, title)),
    }
    paths.update(figures)
    logger.info("report written to %s", paths["markdown"])
    return paths
