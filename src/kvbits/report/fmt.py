"""Numbers as the report prints them, and the conventions of ``summary.json``.

``summary.json`` (written by :mod:`kvbits.evaluate.runner`): ``delta_rel`` and its CI are
*fractions* (``0.01`` = +1 % perplexity), ``top1`` is the fraction of positions whose argmax matches
the reference, ``kl`` is the mean KL(reference ‖ quantized) in nats per token. Missing numbers
(absent keys, ``null``, NaN) become NaN in the records and print as ``n/a``; an infinite ΔPPL prints as
``+inf%``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbits.report.inline import code

__all__ = [
    "DEFAULT_THRESHOLD",
    "NA",
    "bos_phrase",
    "bucket_label",
    "fmt_bytes",
    "fmt_ci",
    "fmt_ci_bound",
    "fmt_end",
    "fmt_float",
    "fmt_float_sig",
    "fmt_frac",
    "fmt_judged",
    "fmt_kl",
    "fmt_pct",
    "fmt_pos",
    "merged_runs_table",
]

DEFAULT_THRESHOLD = 0.01  # "hurts" = perplexity more than 1 % above the unquantized reference
NA = "n/a"


def _num(x: Any) -> float:
    """A float, or NaN for None / non-numbers."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _ok(x: float) -> bool:
    return not math.isnan(x) and not math.isinf(x)


_BIG = 1e9  # a figure this large (as printed: percent, GiB, ...) prints in scientific notation


def _fixed(x: float, spec: str) -> str:
    """``x`` formatted with the fixed-point ``spec`` (``"+.2f"``, ``".3f"``), the one rule every number here follows:
    a figure that rounds to zero prints as ``0.00`` / ``+0.00``, never ``-0.00``, and one of at least ``_BIG`` (1e9)
    in absolute value prints with as many decimals in scientific notation (``1e300 -> '1.000e+300'``), not as a
    300-digit string."""
    text = format(x, spec)
    if float(text) == 0:
        return format(0.0, spec)
    if abs(float(text)) >= _BIG:
        return format(x, spec[:-1] + "e")
    return text


def bos_phrase(summary: Mapping[str, Any], *, markdown: bool = True) -> str | None:
    """``"the BOS token `<s>` (id 1)"`` for a record whose ``"bos"`` is ``"always"`` (the token and id where it
    records them: ``"the BOS token"`` alone otherwise), None for one without a BOS (``"never"`` or no field).

    ``markdown=False``: the token plain, ``"the BOS token <s> (id 1)"``, for the console summaries (as eval's
    header prints it; a code span's backticks are noise on a terminal)."""
    if summary.get("bos") != "always":
        return None
    token, tid = summary.get("bos_token"), summary.get("bos_token_id")
    if not isinstance(token, str):
        return "the BOS token"
    return f"the BOS token {code(token) if markdown else token}" + (f" (id {tid})" if type(tid) is int else "")


def fmt_pos(n: int) -> str:
    """A token position as in the bucket names: multiples of 1024 as ``4K``, others verbatim."""
    if n and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def fmt_end(hi: int) -> str:
    """The exclusive end of a bucket. A window of ``T`` tokens has ``T - 1`` predicting positions, so
    its last bucket ends at ``T - 1``: an end one short of a multiple of 1024 prints as that multiple
    (``[4096, 8191)`` is ``4K–8K``, the rest of an 8K window)."""
    return fmt_pos(hi + 1) if hi > 0 and (hi + 1) % 1024 == 0 else fmt_pos(hi)


def bucket_label(lo: int, hi: int) -> str:
    """``0–1K``, ``4K–8K``, ``1000–1K`` (prefill), ``0–999`` (a 1000-token window)."""
    return f"{fmt_pos(lo)}–{fmt_end(hi)}"


def fmt_pct(frac: float, digits: int = 2) -> str:
    """A relative change (fraction) as a signed percentage: ``0.0042 -> '+0.42%'``; ``inf -> '+inf%'``
    (a perplexity that overflowed: shown, not hidden as ``n/a``)."""
    if math.isinf(frac):
        return "+inf%" if frac > 0 else "-inf%"
    if not _ok(frac):
        return NA
    pct = frac * 100
    # one decimal from 100 % up, decided on the printed value: 99.996 % prints as +100.0%, as 100 % does
    d = 1 if abs(float(f"{pct:.{digits}f}")) >= 100 else digits
    return _fixed(pct, f"+.{d}f") + "%"


def fmt_judged(frac: float, threshold: float) -> str:
    """``fmt_pct(frac)`` for a ΔPPL judged against the budget ``threshold``, with as many more decimals (up to 6) as
    it takes not to print as the budget itself: at a 1 % budget ``0.01004 -> '+1.004%'`` (it fails), ``0.0099996 ->
    '+0.99996%'`` (it passes), where two decimals printed both as ``+1.00%``."""
    digits = 2
    if _ok(frac) and _ok(threshold) and frac != threshold:
        pct, budget = frac * 100, threshold * 100
        while digits < 6 and abs(pct) < 100 and round(pct, digits) == round(budget, digits):
            digits += 1
    return fmt_pct(frac, digits)


def fmt_budget(threshold: float, sign: bool = True) -> str:
    """A ΔPPL budget (fraction) as the percentage it is, no digit rounded away: ``0.005 -> '+0.5%'``,
    ``0.01 -> '+1%'``, ``0.025 -> '+2.5%'`` (``sign=False``: ``'0.5%'``). ``fmt_pct(t, 0)`` printed a 0.5 %
    budget as ``+0%`` and 2.5 % as ``+2%``, naming a budget the verdict did not apply."""
    pct = round(threshold * 100, 6) + 0.0  # + 0.0: -0.0 prints as 0
    return f"{pct:+g}%" if sign else f"{pct:g}%"


def _signed(x: float, digits: int) -> str:
    """``x`` with its sign and ``digits`` decimals; one that rounds to zero prints as ``+0.00``, not ``-0.00``."""
    return _fixed(x, f"+.{digits}f")


def fmt_ci_bound(frac: float) -> str:
    """One bound of a 95 % CI of a relative change (fraction) as percent without the ``%`` sign, always two decimals
    (also past 100 %, where :func:`fmt_pct` drops to one): ``1.12345 -> '+112.35'``. The delta table's ``[lo, hi]``
    and the verdict's "95% CI lo% to hi%" both print their bounds with it, so they never disagree."""
    return _signed(frac * 100, 2)


def fmt_ci(ci: tuple[float, float]) -> str:
    """A 95 % CI of a relative change: ``[+0.10, +0.80]`` (percent, :func:`fmt_ci_bound`), or '' when unknown. A
    bound that rounds to zero prints as ``+0.00`` (a bound of -0.001 % printed as ``-0.00``)."""
    lo, hi = ci
    if not (_ok(lo) and _ok(hi)):
        return ""
    return f"[{fmt_ci_bound(lo)}, {fmt_ci_bound(hi)}]"


def fmt_kl(x: float, *, signed: bool = False) -> str:
    """KL in nats (or another small quantity): 4 decimals, or scientific below 1e-3 (0 prints as ``0``);
    ``signed``: with its sign (``+0.0312``, a difference). The switch is decided on the printed value:
    0.00099999 rounds to ``1.00e-03``, which is 1e-3, so it prints as ``0.0010`` as 0.001 does."""
    if not _ok(x):
        return NA
    if x == 0:
        return "0"
    sign = "+" if signed else ""
    sci = f"{x:{sign}.2e}"
    return sci if abs(float(sci)) < 1e-3 else _fixed(x, f"{sign}.4f")


def fmt_frac(x: float, digits: int = 2) -> str:
    """A fraction as a percentage with ``digits`` decimals (top-1 agreement): ``0.98765 -> '98.77%'``. A fraction
    short of 1 never prints as 100 %, nor one above 0 as 0 %: they stop one last digit short, ``0.99997 -> '99.99%'``,
    ``0.00003 -> '0.01%'`` (one token in 32K that differs is not all of them)."""
    if not _ok(x):
        return NA
    text = _fixed(x * 100, f".{digits}f")
    step = 10.0**-digits
    if x < 1 and float(text) >= 100:
        text = f"{100 - step:.{digits}f}"
    elif x > 0 and float(text) <= 0:
        text = f"{step:.{digits}f}"
    return f"{text}%"


def fmt_bytes(n: float) -> str:
    """A byte count in binary units: ``1288490188.8 -> '1.20 GiB'``, ``5242880 -> '5.00 MiB'``."""
    if not _ok(n):
        return NA
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return _fixed(n / size, ".2f") + f" {unit}"
    return f"{int(n)} B"


def fmt_float(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals; ``n/a`` for NaN, ``inf`` for an overflowed value (a perplexity)."""
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return NA if not _ok(x) else _fixed(x, f".{digits}f")


def fmt_float_sig(x: float, digits: int, sig: int = 3) -> str:
    """``fmt_float(x, digits)``, or ``sig`` significant digits for a nonzero ``x`` that ``digits`` decimals would
    show with fewer than two (below ``10 ** (1 - digits)``): with one decimal 12.34 tokens/s prints as ``12.3``,
    but 0.0331 as ``0.0331`` rather than ``0.0``; with two a speed-up of 1.482 prints as ``1.48``, 0.0329 as
    ``0.0329`` rather than ``0.03``."""
    if _ok(x) and x != 0 and abs(x) < 10.0 ** (1 - digits):
        return f"{x:#.{sig}g}"
    return fmt_float(x, digits)


def merged_runs_table(
    merged: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str, Callable[[Mapping[str, Any]], str]]],
    note: str | None = None,
) -> list[str]:
    """Markdown lines of a merged report's "Runs merged" section: one row per run (``merged_from``), its folder,
    then ``columns`` (``(header, alignment, cell)``: what that run measured), date, commit and torch version. The
    date and torch version are shown as text (:func:`~.markdown.md_cell`: a ``|`` in them adds no column, ``<b>`` is
    no markup), as the eval report's table shows them."""
    from kvbits.report.markdown import (
        md_cell,  # here, not at the top: markdown imports document, which imports fmt
    )

    lines = ["## Runs merged", ""] + ([note, ""] if note else [])
    lines += [
        "| run | " + "".join(f"{h} | " for h, _, _ in columns) + "date | commit | torch |",
        "|:---|" + "".join(f"{a}|" for _, a, _ in columns) + ":---|:---|:---|",
    ]
    for m in merged:
        commit = m.get("commit") or {}
        sha = str(commit.get("sha") or NA)[:10] + (" (dirty)" if commit.get("dirty") else "")
        cells = "".join(f"{cell(m)} | " for _, _, cell in columns)
        path = code(str(m.get("path"))).replace("|", "\\|")  # a "|" ends a table cell even in a code span
        lines.append(f"| {path} | {cells}{md_cell(str(m.get('date') or NA))} | {code(sha)} | "
                     f"{md_cell(str((m.get('versions') or {}).get('torch', NA)))} |")  # fmt: skip
    return lines + [""]
