"""What the README and the package docstrings say about the code, held to the code: the schemes table's storage and
average bits, the stages it names, and the ``bits_at_context`` example it gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvbits
from kvbits.schemes import average_bits, list_schemes

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGE = ROOT / "src" / "kvbits"

# SmolLM2-135M's published config (what the planner reads: 30 layers x 3 KV heads x 64 channels).
SMOLLM2 = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
}  # fmt: skip


def schemes_table() -> dict[str, tuple[str, ...]]:
    """The README's ``## Schemes`` table: name -> (sinks, residual, block, bits at D=128, bits at D=64)."""
    section = README.read_text().split("## Schemes", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \|.*?\| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \(([\d.]+)\) \|", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_the_schemes_table_lists_every_preset_with_its_windows_and_average_bits() -> None:
    """README: "avg bits D=128 (D=64)": at head dim 128 / 8 KV heads and 64 / 2 heads, as ``kvbits schemes`` counts."""
    table = schemes_table()
    presets = {s.name: s for s in list_schemes()}
    assert sorted(table) == sorted(presets), "the README's schemes table and the registered presets differ"
    for name, row in table.items():
        s = presets[name]
        want = (
            str(s.sinks), str(s.residual), str(s.block),
            f"{average_bits(s, head_dim=128, n_heads=8):.2f}", f"{average_bits(s, head_dim=64, n_heads=2):.2f}",
        )  # fmt: skip
        assert row == want, f"README's row for {name}: {row}, the library: {want}"


def stage_folders() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("stage", stage_folders())
def test_every_stage_folder_is_named_in_the_package_docstring_and_the_readme(stage: str) -> None:
    """``help(kvbits)`` and the README's stages table ("one folder each under src/kvbits/") name every subpackage:
    the package docstring had left out ``tune`` and ``export``."""
    assert f"``{stage}``" in (kvbits.__doc__ or ""), f"kvbits' docstring does not name the {stage} stage"
    assert f"| `{stage}/` |" in README.read_text(), f"the README's stages table has no row for {stage}/"


def test_the_bits_at_context_example_names_the_dtype_it_holds_in() -> None:
    """README's ``evaluate/`` row: kivi-2's ``bits_at_context`` at 128 tokens depends on the dtype the model runs in
    (full-precision tokens are counted in it): 16 in bfloat16, 32 in float32, ``kvbits eval``'s default. The README
    said "16 at 128 tokens" alone, which a default run does not report."""
    m = re.search(
        r"kivi-2 is ([\d.]+) bits in the long run, (\d+) at (\d+) tokens in bfloat16 and (\d+) in float32",
        " ".join(README.read_text().split()),
    )
    assert m, "the README's bits_at_context example for kivi-2 names no dtype"
    long_run, bf16, tokens, fp32 = float(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
    for dtype_bytes, stated in ((2, bf16), (4, fp32)):
        (p,) = kvbits.plan(SMOLLM2, context=tokens, batch=1, scheme=["kivi-2"], dtype_bytes=dtype_bytes)
        assert p["avg_bits"] == pytest.approx(stated), (dtype_bytes, p["avg_bits"], stated)
    assert average_bits(kvbits.get_scheme("kivi-2"), head_dim=64, n_heads=3) == pytest.approx(long_run)
