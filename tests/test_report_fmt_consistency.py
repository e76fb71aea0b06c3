"""The same number reads the same way wherever :mod:`kvbits.report.fmt` prints it: the decimals, the sign of a
figure that rounds to zero and the switch to scientific notation are decided on the printed (rounded) value, and a
huge value prints in scientific notation rather than as a 300-digit string."""

from __future__ import annotations

from kvbits.report.fmt import fmt_budget, fmt_bytes, fmt_ci, fmt_float, fmt_frac, fmt_kl, fmt_pct


def test_fmt_pct_decimals_follow_the_printed_value() -> None:
    """0.99996 printed ``+100.00%`` (two decimals) beside ``+100.0%`` for 1.0; 1e300 printed 303 digits."""
    assert fmt_pct(0.99996) == fmt_pct(1.0) == "+100.0%"
    assert fmt_pct(-0.99996) == fmt_pct(-1.0) == "-100.0%"
    assert fmt_pct(0.0099996) == "+1.00%"
    assert fmt_pct(1e300) == "+1.0e+302%"
    assert fmt_pct(-1e300) == "-1.0e+302%"
    assert len(fmt_pct(1e300)) < 16


def test_fmt_frac_no_minus_zero_and_no_300_digits() -> None:
    """-1e-12 printed ``-0.00%``; 1e300 printed a 300-digit percentage."""
    assert fmt_frac(-1e-12) == fmt_frac(0.0) == "0.00%"
    assert fmt_frac(1e300) == "1.00e+302%"
    assert fmt_frac(0.99997) == "99.99%"  # unchanged: short of 1 never prints as 100 %


def test_fmt_float_no_minus_zero_and_no_300_digits() -> None:
    """-1e-12 printed ``-0.000``; 1e300 printed 301 digits and 3 decimals."""
    assert fmt_float(-1e-12) == fmt_float(-0.0004) == fmt_float(0.0) == "0.000"
    assert fmt_float(-0.0005001) == "-0.001"  # a figure that does not round to zero keeps its sign
    assert fmt_float(1e300) == "1.000e+300"
    assert fmt_float(12345.6789) == "12345.679"


def test_fmt_kl_scientific_switch_decided_on_the_rounded_value() -> None:
    """0.00099999 printed ``1.00e-03`` beside ``0.0010`` for 0.001."""
    assert fmt_kl(0.00099999) == fmt_kl(0.001) == "0.0010"
    assert fmt_kl(-0.00099999, signed=True) == fmt_kl(-0.001, signed=True) == "-0.0010"
    assert fmt_kl(0.00099949) == "9.99e-04"  # still below 1e-3 once rounded
    assert fmt_kl(1e300) == "1.0000e+300"


def test_fmt_budget_negative_sign() -> None:
    """-0.01 printed ``+-1%``."""
    assert fmt_budget(-0.01) == "-1%"
    assert fmt_budget(-0.01, sign=False) == "-1%"
    assert fmt_budget(0.01) == "+1%"
    assert fmt_budget(-1e-12) == "+0%"


def test_fmt_bytes_and_ci_huge() -> None:
    """1e300 bytes printed a 291-digit GiB count; a CI bound of 1e300 a 303-digit one."""
    assert fmt_bytes(1e300) == "9.31e+290 GiB"
    assert fmt_ci((-1e300, 1e300)) == "[-1.00e+302, +1.00e+302]"
    assert fmt_ci((-1e-5, 0.002)) == "[+0.00, +0.20]"


def test_merged_runs_table_shows_date_and_torch_as_text() -> None:
    """The "Runs merged" table of the needle and speed reports wrote the date and torch version raw: a ``|`` in them
    added a column (7 unescaped bars in a 5-bar row) and ``<b>`` was live markup in report.md."""
    import re

    from kvbits.report.fmt import merged_runs_table

    run = {"path": "/r", "date": "2024|<b>x</b>", "commit": {"sha": "abc"}, "versions": {"torch": "2.1|<i>"}}
    lines = merged_runs_table([run], [])
    row = lines[4]
    assert re.sub(r"\\\|", "", row).count("|") == lines[2].count("|")
    assert "<b>" not in row and "<i>" not in row
    assert row == "| `/r` | 2024\\|&lt;b&gt;x&lt;/b&gt; | `abc` | 2.1\\|&lt;i&gt; |"
