"""Messages the Python API and the CLI share name the setting as the caller spelled it (``kvbits._spelling``):
``overwrite=True`` / ``weights_gib=...`` from Python, ``--overwrite`` / ``--weights-gib`` from ``kvbits``."""

from __future__ import annotations

import pytest
from test_plan import write_tiny_gguf

from kvbits._spelling import cli_spelling, spell
from kvbits.calibrate.artifact import META_FILE
from kvbits.calibrate.calibrate import check_calibration_out
from kvbits.cli import main
from kvbits.plan import plan


def test_spell_names_the_flag_only_inside_the_cli():
    assert spell("overwrite=True", "--overwrite") == "overwrite=True"
    with cli_spelling():
        assert spell("overwrite=True", "--overwrite") == "--overwrite"
    assert spell("overwrite=True", "--overwrite") == "overwrite=True"


def test_calibrate_into_a_held_folder_names_the_callers_spelling(tmp_path, capsys):
    """`kvbits calibrate` into a folder holding a calibration said "or overwrite=True (--overwrite)"."""
    out = tmp_path / "cal"
    out.mkdir()
    (out / META_FILE).write_text('{"scheme": {"name": "kvquant-4"}}', encoding="utf-8")
    with pytest.raises(ValueError, match="already holds a calibration") as err:
        check_calibration_out(out)
    assert "overwrite=True" in str(err.value) and "--overwrite" not in str(err.value)
    argv = ["calibrate", "--model", str(tmp_path / "no-such-model"), "--data", "d.txt", "--scheme", "fp8-e4m3",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    cli = capsys.readouterr().err
    assert "already holds a calibration" in cli and "or --overwrite to replace" in cli, cli
    assert "overwrite=True" not in cli, cli


def test_plan_gpu_mem_on_a_quantized_gguf_names_the_callers_spelling(tmp_path, capsys):
    """`kvbits plan --gpu-mem` on a quantized GGUF said "gpu_mem_gib needs ... pass weights_gib=... (CLI
    --weights-gib)", the Python names first, though the user typed --gpu-mem."""
    path = write_tiny_gguf(tmp_path / "q8.gguf", "Q8_0")
    with pytest.raises(ValueError, match=r"^gpu_mem_gib needs .*pass weights_gib=\.\.\.: kept") as err:
        plan(path, context=10, gpu_mem_gib=1)
    assert "--" not in str(err.value)
    assert main(["plan", "--config", str(path), "--context", "10", "--gpu-mem", "1"]) == 2
    cli = capsys.readouterr().err
    assert "kvbits plan: error: --gpu-mem needs the weights' size" in cli and "pass --weights-gib:" in cli
    assert "gpu_mem_gib" not in cli and "weights_gib" not in cli, cli


def test_plan_reserve_over_gpu_mem_names_the_flags(capsys):
    """`kvbits plan --reserve-gib 100 --gpu-mem 80` said "reserve_gib (100 GiB, CLI --reserve-gib) ..."."""
    assert main(["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "10",
                 "--gpu-mem", "80", "--reserve-gib", "100", "--weights-gib", "1"]) == 2  # fmt: skip
    cli = capsys.readouterr().err
    assert "--reserve-gib (100 GiB) is memory kept free" in cli and "at most --gpu-mem (80 GiB)" in cli, cli
    assert "reserve_gib" not in cli, cli
