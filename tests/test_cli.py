"""The command line: subcommand registry, `schemes`, `plan`, JSON for scripts, tables for people."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvbits import cli
from kvbits.cli import main
from kvbits.plan import DEFAULT_SCHEMES
from kvbits.schemes import average_bits, list_schemes

WORKED = ["--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--context", "32768", "--batch", "8"]
WORKED_BYTES = 137_438_953_472


def run_json(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_schemes_json_lists_every_preset(capsys):
    rows = run_json(capsys, ["schemes", "--json", "--head-dim", "64"])
    assert [r["name"] for r in rows] == [s.name for s in list_schemes()]
    by_name = {s.name: s for s in list_schemes()}
    for r in rows:
        assert r["average_bits"] == pytest.approx(average_bits(by_name[r["name"]], head_dim=64))
        assert {"key", "value", "sinks", "residual", "block", "description", "reference"} <= set(r)
    kivi = next(r for r in rows if r["name"] == "kivi-2")
    assert kivi["key_summary"] == "int2 asym per-channel g32" and kivi["residual"] == 128


def test_schemes_marks_schemes_that_can_not_store_the_head_dim(capsys):
    """At head dim 80, groups of 32/64 channels do not fit, nor does a Hadamard rotation (a power of two):
    listed as n/a with the reason, not priced."""
    rows = run_json(capsys, ["schemes", "--json", "--head-dim", "80"])
    na = {r["name"]: r["unsupported"] for r in rows if r["average_bits"] is None}
    hadamard = {"fp8-e4m3-hadamard", *(f"int{b}-token-hadamard" for b in (8, 4, 3, 2)), "vllm-int4"}
    assert set(na) == {"int4-g64", "kivi-4", "kivi-2"} | hadamard
    assert "per-token groups of 32 channels do not divide head_dim 80" in na["kivi-2"]
    assert "hadamard rotation needs a power-of-two head_dim, got 80" in na["int4-token-hadamard"]
    assert main(["schemes", "--head-dim", "80"]) == 0
    assert "n/a: fp8-e4m3-hadamard, int8-token-hadamard, int4-token-hadamard, int3-token-hadamard, int2-token-hadamard, vllm-int4, int4-g64, kivi-4, kivi-2 can not" in (
        capsys.readouterr().out.replace("\n", " ")
    )


def test_plan_skips_default_schemes_that_can_not_store_the_head_dim(capsys):
    argv = ["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "80", "--context", "100"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["scheme"] for r in json.loads(captured.out)] == [
        s for s in DEFAULT_SCHEMES if s not in ("kivi-4", "kivi-2")
    ]
    assert "note: skipping kivi-2: scheme 'kivi-2' can not store head_dim 80" in captured.err
    assert main([*argv, "--scheme", "kivi-2"]) == 2  # named explicitly: refused with the reason
    captured = capsys.readouterr()
    assert captured.out == "" and "kvbits plan: error: scheme 'kivi-2' can not store head_dim 80" in captured.err


def test_schemes_table_renders(capsys):
    assert main(["schemes"]) == 0
    out = capsys.readouterr().out
    for s in list_schemes():
        assert s.name in out
    assert "arXiv:2402.02750" in out  # KIVI's paper, shortened


def test_schemes_piped_wraps_descriptions_and_centres_the_title_over_the_table(capsys, monkeypatch):
    """Piped (`kvbits schemes > f.txt`), the unbounded console laid vllm-int4's 669-character description on one
    line: every row, border and the padded title were 859 characters, the title centred near column 400. The
    description column now wraps at ``kvbits._console.PIPE_PROSE_WIDTH`` in a pipe (not on a terminal); no word is
    cut."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    assert main(["schemes"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    title, rows = lines[0], [ln for ln in lines if ln[:1] in "┏┃┡│└"]
    widest = max(len(r) for r in rows)
    assert all(len(ln) <= widest for ln in lines) and widest < 400
    left = len(title) - len(title.lstrip())
    assert abs(left - (widest - len(title.strip())) / 2) <= 1  # centred over the table
    text = " ".join(ln.split("│")[8].strip() for ln in rows if ln.startswith("│"))
    for s in list_schemes():
        assert " ".join(s.description.split()) in " ".join(text.split())


def test_prose_width_leaves_a_terminal_alone():
    from rich.console import Console

    from kvbits._console import PIPE_PROSE_WIDTH, prose_width

    assert prose_width(Console(force_terminal=True, width=300)) is None
    assert prose_width(Console(file=io.StringIO())) == PIPE_PROSE_WIDTH


def test_speed_table_piped_is_not_cut(capsys, monkeypatch):
    """``kvbits speed`` (like ``needle`` and ``tune``) printed its table on a plain ``Console()``: piped or in CI it
    was fitted to 80 columns and a cell like "1234.5 (1.02x), 1.50 GiB + linear states 24.00 MiB" was cut to "…".
    Every CLI now prints on ``kvbits._console.stdout_console``: a pipe's table is as wide as its cells."""
    from kvbits.evaluate import speed_cli

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    contexts = [4096, 16384, 65536]
    runs = [
        {"context": c, "cache": name, "batch": 1, "path": "fused decode", "tokens_per_s": 1234.5, "speedup": 1.02,
         "cache_bytes": 3 * 2**29, "linear_state_bytes": 24 * 2**20}
        for c in contexts for name in ("DynamicCache", "kvquant-int2-long-name-g32")
    ]  # fmt: skip
    summary = {"batches": [1], "model": "m", "device": {"name": "cpu"}, "contexts": contexts, "runs": runs,
               "schemes": [{"scheme": "kvquant-int2-long-name-g32"}], "tokens": 8, "wall_seconds": 3.0}  # fmt: skip
    speed_cli._print(summary, None)
    out = capsys.readouterr().out
    assert "…" not in out and out.count("1234.5 (1.02x), 1.50 GiB + linear states 24.00 MiB") == 6


def test_plan_json_worked_example(capsys):
    rows = run_json(capsys, ["plan", *WORKED, "--scheme", "fp16", "--json"])
    assert len(rows) == 1
    r = rows[0]
    assert r["total_bytes"] == WORKED_BYTES and r["bytes_per_token"] == 524288
    assert r["avg_bits"] == 16 and r["compression"] == 1
    assert "per_layer" not in r and "max_concurrency" not in r
    assert r["step_bytes"] == 4 * 2**30  # one of 32 layers of K/V in fp16: 128 GiB / 32


def test_plan_fused_decode_adds_rope_tables(capsys):
    """``--fused-decode``: pre-RoPE schemes count the kernel's RoPE tables; others are unchanged."""
    argv = ["plan", *WORKED, "--scheme", "kvquant-4-block", "--scheme", "kivi-4", "--json"]
    plain, fused = run_json(capsys, argv), run_json(capsys, [*argv, "--fused-decode"])
    assert fused[0]["rope_table_bytes"] == 2 * 4 * 40960 * 64 and plain[0]["rope_table_bytes"] == 0
    assert fused[0]["total_bytes"] == plain[0]["total_bytes"] + fused[0]["rope_table_bytes"]
    assert fused[1]["total_bytes"] == plain[1]["total_bytes"] and fused[1]["components"]["rope_tables"] == 0
    assert main(argv[:-1] + ["--fused-decode"]) == 0  # the table says what it added
    out = capsys.readouterr().out
    assert "RoPE tables of fused pre-RoPE decode (kvquant-4-block 20.00 MiB)" in out


def test_plan_fused_decode_reads_the_config_s_rope(capsys, tmp_path):
    """``--config ... --fused-decode`` counts the tables the fused cache keeps for this model's RoPE: none for
    Phi's partial rotary embedding, which the fused path declines (before: 131,072 bytes counted, the cache 0)."""
    base = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 128, "max_position_embeddings": 4096}  # fmt: skip
    got = {}
    for name, cfg in (("llama", base), ("phi", {**base, "model_type": "phi", "partial_rotary_factor": 0.5})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        argv = ["plan", "--config", str(path), "--context", "300", "--scheme", "kvquant-4-block", "--fused-decode"]
        got[name] = run_json(capsys, [*argv, "--json"])[0]["rope_table_bytes"]
    assert got == {"llama": 131_072, "phi": 0}


def test_plan_overridden_config_without_weights_says_why(capsys, tmp_path):
    """``--config X --kv-heads 4 --gpu-mem 80`` drops the config's parameter estimate (it no longer describes the
    model); the refusal told the user, who had planned from a full config, to "plan from a full config"."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
                                "hidden_size": 512, "vocab_size": 1000, "intermediate_size": 1024}))  # fmt: skip
    argv = ["plan", "--config", str(path), "--context", "1k", "--scheme", "fp16", "--gpu-mem", "80"]
    assert run_json(capsys, [*argv, "--json"])[0]["weights_source"] == "estimated"
    assert main([*argv, "--kv-heads", "4"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "a config whose layers, KV heads or head dim were overridden" in err and "--weights-gib" in err
    assert "plan from a full config" not in err


def test_plan_table_worked_example(capsys):
    assert main(["plan", *WORKED, "--scheme", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "137,438,953,472" in out and "128.00 GiB" in out and "512.00 KiB" in out
    assert "a step also allocates at least 4.00 GiB at 32,768 tokens" in out


def test_plan_default_schemes_gpu_and_per_layer(capsys):
    argv = [
        "plan",
        "--layers",
        "4",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--context",
        "32k",
        "--context",
        "1024",
    ]
    rows = run_json(
        capsys,
        [*argv, "--gpu-mem", "80", "--weights-gib", "14", "--reserve-gib", "2", "--per-layer", "--json"],
    )
    assert [(r["context"], r["scheme"]) for r in rows] == [
        (c, s) for c in (32768, 1024) for s in DEFAULT_SCHEMES
    ]
    for r in rows:
        assert r["max_concurrency"] == (64 * 2**30 - r["components"]["fixed"]) // r["kv_bytes_per_request"]
        assert len(r["per_layer"]) == 4
    assert main([*argv, "--gpu-mem", "80", "--weights-gib", "14", "--per-layer"]) == 0
    out = capsys.readouterr().out
    assert "max concurrency" in out and "per layer" in out and "kivi-2" in out
    assert "at least 128.00 MiB at 32,768 tokens" in out and "the reserve is below it" in out
    assert "pass --reserve-gib 0.125 or more" in " ".join(out.split())  # the caption may wrap
    assert main([*argv, "--gpu-mem", "80", "--weights-gib", "14", "--reserve-gib", "1"]) == 0
    assert "the reserve is below it" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--weights-gib", "1"], "--weights-gib applies"),
        (["--reserve-gib", "2"], "--reserve-gib applies"),
        (["--weights-gib", "1", "--reserve-gib", "0"], "--weights-gib and --reserve-gib apply"),
    ],
)
def test_plan_budget_flags_without_gpu_mem_are_usage_errors(capsys, extra, named):
    """``--weights-gib`` and ``--reserve-gib`` enter only the GPU budget: without ``--gpu-mem`` the plan ignored them
    (exit 0, the same table as without them; --weights-gib only at -v, as an INFO line)."""
    assert main(["plan", *WORKED, "--scheme", "fp16", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbits plan: error: ") and f"{named} to the GPU budget alone: add --gpu-mem GIB" in err, err
    budget = ["--gpu-mem", "200", "--weights-gib", "1", "--reserve-gib", "2", "--json"]
    rows = run_json(capsys, ["plan", *WORKED, "--scheme", "fp16", *budget])
    assert (rows[0]["weights_bytes"], rows[0]["reserve_bytes"]) == (2**30, 2 * 2**30)


def test_plan_refuses_an_unknown_scheme_before_reading_the_config(capsys, monkeypatch):
    """An unknown ``--scheme`` name was refused only after the config was read (about 10 s for smollm2-135m's GGUF):
    each name is now checked first, so the config loader is never reached."""
    import kvbits.plan

    def must_not_load(*args, **kwargs):
        raise AssertionError("the config was read before the scheme names were checked")

    monkeypatch.setattr(kvbits.plan, "load_shape", must_not_load)
    argv = ["plan", "--config", "smollm2-135m", "--context", "1k", "--scheme", "fp16", "--scheme", "int5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbits plan: error: unknown scheme 'int5'"), err


def test_plan_from_config_file_with_override(tmp_path, capsys):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    base = run_json(capsys, ["plan", "--config", str(path), "--context", "100", "--scheme", "fp16", "--json"])
    gqa = run_json(
        capsys,
        ["plan", "--config", str(path), "--kv-heads", "2", "--context", "100", "--scheme", "fp16", "--json"],
    )
    assert base[0]["total_bytes"] == 2 * 2 * 2 * 8 * 64 * 100 == 4 * gqa[0]["total_bytes"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--layers", "2", "--context", "10"], "missing --kv-heads, --head-dim"),
        (["plan", *WORKED, "--scheme", "int5"], "unknown scheme 'int5'"),
        (["plan", *WORKED, "--gpu-mem", "80"], "weights-gib"),
        # planned from dimensions, no config: the error named "the config has no max_position_embeddings"
        (["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"],
         "--context is required when planning from dimensions"),
    ],
)
def test_plan_errors_go_to_stderr(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and captured.err.startswith("kvbits plan: error:")


def test_bad_context_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--context", "lots"])
    assert e.value.code == 2 and "32k" in capsys.readouterr().err


def _needs(command: str, tmp_path: Path) -> list[str]:
    """The arguments ``command`` requires besides ``--model``."""
    return {
        "eval": ["--data", "d.txt", "--scheme", "int4-token"],
        "analyze": [],
        "calibrate": ["--data", "d.txt", "--scheme", "kvquant-4", "--out", str(tmp_path / "cal")],
    }[command]


@pytest.mark.parametrize("command", ["eval", "analyze", "calibrate"])
def test_cuda_without_cuda_is_a_usage_error_before_loading(capsys, monkeypatch, tmp_path, command):
    """torch without CUDA fails with an AssertionError deep inside .to("cuda"); refuse first, clearly."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = main([command, "--model", str(tmp_path / "no-such-model"), *_needs(command, tmp_path), "--device", "cuda"])
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits {command}: error: device 'cuda'" in err and "CUDA" in err, err
    assert "Traceback" not in err and "no-such-model" not in err  # refused before the model was looked at


@pytest.mark.parametrize("command", ["eval", "analyze", "calibrate"])
def test_model_commands_take_the_same_dtypes_and_a_cuda_index(command, tmp_path):
    """analyze took float16 and cuda:N, eval only float32/bfloat16 and cpu/cuda, calibrate neither flag."""
    from kvbits._argtypes import MODEL_DTYPES

    parser = cli.build_parser(only=command)
    base = [command, "--model", "m", *_needs(command, tmp_path)]
    args = parser.parse_args(base)
    assert (args.dtype, args.device) == ("float32", "cpu")
    assert MODEL_DTYPES == ("float32", "bfloat16", "float16")
    for dtype in MODEL_DTYPES:
        assert parser.parse_args([*base, "--dtype", dtype, "--device", "cuda:1"]).dtype == dtype
    assert parser.parse_args([*base, "--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.parametrize(("command", "device"), [("eval", "mps"), ("analyze", "tpu"), ("calibrate", "gpu")])
def test_unknown_device_says_what_was_expected(capsys, tmp_path, command, device):
    status = main([command, "--model", str(tmp_path / "no-such-model"), *_needs(command, tmp_path), "--device", device])
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits {command}: error: device must be 'cpu' or 'cuda'" in err, err
    assert "no-such-model" not in err


def test_context_beyond_max_position_embeddings_is_warned_once_by_one_helper(caplog):
    from types import SimpleNamespace

    from kvbits.evaluate.models import warn_beyond_max_positions

    with caplog.at_level("WARNING", logger="kvbits"):
        assert warn_beyond_max_positions(SimpleNamespace(max_position_embeddings=512), 1024) is True
        assert not warn_beyond_max_positions(SimpleNamespace(max_position_embeddings=512), 512)
        assert not warn_beyond_max_positions(SimpleNamespace(), 1 << 20)  # the config records no limit
        multimodal = SimpleNamespace(get_text_config=lambda: SimpleNamespace(max_position_embeddings=256))
        assert warn_beyond_max_positions(multimodal, 300) is True
    assert [r.getMessage() for r in caplog.records] == [
        "context 1024 exceeds the model's max_position_embeddings 512: positions beyond it are extrapolation",
        "context 300 exceeds the model's max_position_embeddings 256: positions beyond it are extrapolation",
    ]


def test_context_warning_reads_the_decoder_of_a_composite_config(caplog):
    """A config holding a text encoder and a decoder (MusicGen): ``get_text_config()`` without
    ``decoder=True`` raises transformers' 'Multiple valid text configs' ValueError, which analyze,
    calibrate and eval hit after the model had loaded. The decoder's limit is the one that applies."""
    import transformers

    from kvbits.evaluate.models import warn_beyond_max_positions

    decoder = transformers.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=300,
    )  # fmt: skip
    cfg = transformers.MusicgenConfig(
        text_encoder=transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16).to_dict(),
        audio_encoder=transformers.EncodecConfig().to_dict(),
        decoder=decoder.to_dict(),
    )
    with caplog.at_level("WARNING", logger="kvbits"):
        assert warn_beyond_max_positions(cfg, 400) is True
        assert warn_beyond_max_positions(cfg, 300) is False
    assert "max_position_embeddings 300" in caplog.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fused-decode", "on"], "--fused-decode on needs --mode stream"),
        (["--fused-decode", "off"], "--fused-decode off needs --mode stream"),
        (["--data-path", "{tmp}/no-such-folder"], "is not a folder"),
    ],
)
def test_eval_settings_that_would_be_ignored_are_usage_errors_before_loading(capsys, tmp_path, extra, message):
    """``--fused-decode on`` in simulate mode and a ``--data-path`` that does not exist were silently ignored
    (the run went ahead with other settings than the ones asked for)."""
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    argv = ["eval", "--model", str(tmp_path / "no-such-model"), "--data", "x.txt", "--scheme", "int4-token"]
    status = main(argv + extra)
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("kvbits eval: error:") and message in err, err
    assert "Traceback" not in err and "no-such-model" not in err  # refused before the model was looked at


@pytest.mark.parametrize("command", ["eval", "analyze", "calibrate"])
def test_missing_text_is_reported_before_the_model_loads(capsys, tmp_path, command):
    """A typo in --data was found only after the weights had loaded (seconds to minutes); the model named
    here does not exist, so reaching the loading would report it instead."""
    extra = {"eval": ["--scheme", "int4-token"], "analyze": [], "calibrate": ["--scheme", "kvquant-4",
             "--out", str(tmp_path / "cal")]}[command]  # fmt: skip
    argv = [command, "--model", str(tmp_path / "no-such-model"), "--data", str(tmp_path / "typo.txt"), *extra]
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits {command}: error: text file" in err and "does not exist" in err, err
    assert "no-such-model" not in err


def test_analyze_out_that_is_a_file_is_a_usage_error_before_loading(capsys, tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    status = main(["analyze", "--model", str(tmp_path / "no-such-model"), "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and "is not a folder" in err and "no-such-model" not in err, err
    assert out.read_text() == "mine\n"


@pytest.mark.parametrize("extra", [["--plot-layer", "0"], ["--plot-head", "1"]])
def test_analyze_plot_flags_without_out_are_usage_errors_before_loading(capsys, tmp_path, extra):
    """``--plot-layer`` / ``--plot-head`` pick the heatmap kvbits analyze writes to ``--out``; without --out the
    model loaded, the analysis ran and the flags were ignored (exit 0, no plot anywhere)."""
    status = main(["analyze", "--model", str(tmp_path / "no-such-model"), *extra])
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits analyze: error: {extra[0]} choose the heatmap written to --out" in err, err
    assert "no-such-model" not in err


@pytest.mark.parametrize(
    ("scheme", "option", "said"),
    [
        ("fp8-e4m3", ["--percentile", "99"], "--percentile sets static int/NUQ ranges"),
        ("kvquant-4", ["--fp8-scale", "amax"], "--fp8-scale chooses static FP8 scales"),
    ],
)
def test_calibrate_options_the_scheme_would_not_use_are_usage_errors(capsys, tmp_path, scheme, option, said):
    """``--percentile`` on an FP8 scheme and ``--fp8-scale`` on an integer one were accepted and ignored: the
    calibration ran (minutes on a real model) as if they had not been given. Refused before the model loads."""
    argv = ["calibrate", "--model", str(tmp_path / "no-such-model"), "--data", "x.txt", "--scheme", scheme,
            "--out", str(tmp_path / "cal"), *option]  # fmt: skip
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2 and said in err and "no-such-model" not in err, err


def test_calibrate_out_that_is_a_file_is_a_usage_error_before_loading(capsys, tmp_path):
    """``--out FILE`` ran the whole calibration, then failed with ``[Errno 17] File exists``."""
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    argv = ["calibrate", "--model", str(tmp_path / "no-such-model"), "--data", "x.txt"]
    status = main([*argv, "--scheme", "kvquant-4", "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits calibrate: error: --out {out}: exists and is not a folder" in err, err
    assert "no-such-model" not in err and "Errno" not in err
    assert out.read_text() == "mine\n"


# the commands that take --out, each with the arguments it needs besides --model / --data
OUT_COMMANDS = [
    ("eval", ["--scheme", "int4-token"]),
    ("analyze", []),
    ("calibrate", ["--scheme", "kvquant-4"]),
    ("needle", ["--scheme", "int4-token", "--context", "1k"]),
    ("speed", ["--scheme", "int4-token", "--context", "1k"]),
    ("tune", ["--candidates", "int8-token", "--candidates", "int4-token", "--budget-bits", "6"]),
    ("export", ["--calibration", "cal"]),
]


@pytest.mark.parametrize(("command", "args"), OUT_COMMANDS)
def test_an_out_that_can_not_be_written_is_refused_before_the_run(capsys, tmp_path, command, args):
    """``--out`` below a file ran the whole command (a needle sweep, a calibration), then failed with
    ``[Errno 20] Not a directory``; kvbits.cli now checks every --out first (tune's as a file)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("mine\n")
    model = [] if command == "export" else ["--model", str(tmp_path / "no-such-model"), "--data", "x.txt"]
    out = blocker / ("mix.json" if command == "tune" else "run")
    status = main([command, *model, *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and f"--out {out}: can not write there ({blocker} is a file, not a folder)" in err, err
    assert "no-such-model" not in err and "Errno" not in err and blocker.read_text() == "mine\n"


@pytest.mark.parametrize(("command", "args"), OUT_COMMANDS)
def test_an_empty_out_is_refused_before_the_run(capsys, tmp_path, command, args):
    """``--out ""`` (``--out "$DIR"`` with DIR unset) passed the checks: ``kvbits eval`` wrote its whole run into the
    working folder and printed ``wrote /summary.json, report.md, report.html``; ``speed``, ``needle`` and
    ``analyze`` ran to the end, wrote nothing and exited 0."""
    model = [] if command == "export" else ["--model", str(tmp_path / "no-such-model"), "--data", "x.txt"]
    status = main([command, *model, *args, "--out", ""])
    err = capsys.readouterr().err
    assert status == 2 and f"kvbits {command}: error: --out is empty; expected a" in err, err
    assert "no-such-model" not in err


def test_an_empty_monitor_output_file_is_refused(capsys, tmp_path):
    argv = ["monitor", "--model", str(tmp_path / "no-such-model"), "--data", "x.txt", "--scheme", "kivi-2"]
    assert main([*argv, "--events", " "]) == 2
    assert "kvbits monitor: error: --events is empty; expected a file path" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("[1, 2]", "must be a JSON object"),
        ('{"name": "x", "key": 4}', "must be a JSON object, got 4"),
    ],
)
def test_plan_scheme_json_errors_say_what_was_expected(capsys, tmp_path, content, message):
    path = tmp_path / "mine.json"
    if content is not None:
        path.write_text(content)
    assert main(["plan", *WORKED, "--scheme", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbits plan: error:") and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["eval", "analyze", "calibrate"])
def test_context_takes_2k_in_every_command(command):
    extra = {
        "eval": ["--scheme", "x", "--data", "d"],
        "analyze": [],
        "calibrate": ["--scheme", "x", "--data", "d", "--out", "o"],
    }
    args = cli.build_parser(only=command).parse_args(
        [command, "--model", "m", "--context", "2k", *extra[command]]
    )
    assert args.context == 2048


def test_every_context_flag_says_it_takes_2k():
    """Every --context parses 2k (parse_tokens); monitor's help alone did not say so ("tokens decoded (default 2048)")."""
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if "--context" in action.option_strings:
                assert action.type is cli.parse_tokens, name
                assert "e.g." in action.help and "k" in action.help.split("e.g.", 1)[1], (name, action.help)


def test_parse_tokens():
    assert [cli.parse_tokens(s) for s in ("32768", "32k", "32K", "1m", "32_768", "4,096")] == [
        32768, 32768, 32768, 1 << 20, 32768, 4096,
    ]  # fmt: skip
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_tokens("0")


def test_bounded_validators():
    from kvbits._argtypes import bounded

    positive, frac = bounded(int, 1), bounded(float, 0, 1, hi_open=True, what="a layer fraction")
    assert positive("3") == 3 and frac("0") == 0.0 and frac("0.5") == 0.5
    assert bounded(float, 1, lo_open=True)("1.5") == 1.5 and bounded(float, 50, 100)("100") == 100.0
    for parse, text, message in [
        (positive, "0", "expected an integer >= 1, got '0'"),
        (positive, "2.5", "expected an integer >= 1, got '2.5'"),
        (frac, "1", "expected a layer fraction in [0, 1), got '1'"),
        (frac, "-0.1", "expected a layer fraction in [0, 1), got '-0.1'"),
        (frac, "nan", "expected a layer fraction in [0, 1) (a finite number), got 'nan'"),
        (bounded(float, 1, lo_open=True), "1", "expected a number > 1, got '1'"),
        (bounded(float, 0, what="a number of GiB"), "inf", "(a finite number), got 'inf'"),
        (bounded(float, hi=100, hi_open=True), "x", "expected a number < 100, got 'x'"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as e:
            parse(text)
        assert message in str(e.value), (text, str(e.value))
    with pytest.raises(TypeError, match="int or float"):
        bounded(str)


def test_model_data_and_window_helpers():
    from kvbits._argtypes import add_model_data_args, add_window_args

    p = argparse.ArgumentParser()
    add_model_data_args(p, model_help="m", data_help="d", data_default="wikitext2")
    add_window_args(p, context=8192, windows=2, windows_help="windows of --context tokens")
    args = p.parse_args(["--model", "x"])
    assert (args.model, args.data, args.context, args.windows) == ("x", "wikitext2", 8192, 2)
    assert not hasattr(args, "data_path") and p.parse_args(["--model", "x", "--context", "2k"]).context == 2048
    helps = {a.dest: a.help for a in p._actions}
    assert helps["context"] == "tokens per window, e.g. 8192 or 8k (default 8192)"
    assert helps["windows"] == "windows of --context tokens (default 2)"

    q = argparse.ArgumentParser()
    add_model_data_args(q, model_help="m", data_help="d", data_path_help="p")
    assert q.parse_args(["--model", "x", "--data", "y", "--data-path", "z"]).data_path == "z"
    with pytest.raises(SystemExit):
        q.parse_args(["--model", "x"])  # --data required without a default
    with pytest.raises(ValueError, match="multiple of 1024"):
        add_window_args(argparse.ArgumentParser(), context=1000, windows=1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", *WORKED, "--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
        (["plan", *WORKED, "--gpu-mem", "-1"], "argument --gpu-mem: expected a number of GiB >= 0, got '-1'"),
        (["analyze", "--model", "m", "--threshold", "1"], "argument --threshold: expected an outlier threshold > 1"),
        (["analyze", "--model", "m", "--layer-fraction", "1"], "expected a layer fraction in [0, 1), got '1'"),
        (["calibrate", "--model", "m", "--data", "d", "--scheme", "kvquant-4", "--out", "o", "--percentile", "40"],
         "argument --percentile: expected a percentile in [50, 100], got '40'"),
        (["eval", "--model", "m", "--data", "d", "--scheme", "fp16", "--windows", "0"],
         "argument --windows: expected an integer >= 1, got '0'"),
    ],
)
def test_bounded_arguments_are_usage_errors(capsys, argv, message):
    if argv[0] not in _subcommands():
        pytest.skip(f"no {argv[0]} subcommand")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_negative_eval_seed_is_refused_before_the_run(capsys, tmp_path):
    """``kvbits eval --seed -1`` loaded the model, ran the reference and every scheme over every window, then failed
    in numpy's bootstrap with ``expected non-negative integer`` (16 s on a 2-layer test model; an 8K run takes
    minutes), leaving a folder with config.json alone; ``evaluate(seed=-1)`` alike."""
    from kvbits.evaluate.runner import evaluate

    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", str(tmp_path / "no-such-model"), "--data", "x.txt", "--scheme", "fp16", "--seed", "-1"])
    assert e.value.code == 2 and "argument --seed: expected an integer in [0, 4294967295], got '-1'" in (
        capsys.readouterr().err
    )
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"):
        evaluate(str(tmp_path / "no-such-model"), str(tmp_path / "x.txt"), 64, ["int4-token"], seed=-1)


@pytest.mark.parametrize("command", ["eval", "needle", "calibrate", "analyze"])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_every_seeded_command_bounds_its_seed_alike(command, seed, capsys, tmp_path):
    """``--seed`` was bounded (>= 0) in eval only, a plain int elsewhere: calibrate seeded torch with ``-1`` (its
    ``2**64 - 1``), analyze ``random.Random(-1)`` (the same as 1), the needle masked it to 32 bits (``-1`` gave the
    trials of ``2**32 - 1``, ``2**32`` those of 0). Now every command refuses a seed outside [0, 2**32 - 1] alike,
    before the model loads."""
    required = {
        "eval": ["--data", "x.txt", "--scheme", "fp16"],
        "needle": ["--context", "300", "--scheme", "int4-token"],
        "calibrate": ["--data", "x.txt", "--scheme", "kvquant-4", "--out", str(tmp_path / "c")],
        "analyze": ["--data", "x.txt"],
    }[command]
    with pytest.raises(SystemExit) as e:
        main([command, "--model", str(tmp_path / "no-such-model"), *required, "--seed", seed])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --seed: expected an integer in [0, 4294967295], got '{seed}'" in err


def _subcommands() -> list[str]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


@pytest.mark.parametrize("argv", [["--help"], *[[name, "--help"] for name in ("schemes", "plan")]])
def test_help_exits_zero(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: kvbits" in capsys.readouterr().out


def test_every_registered_subcommand_has_help(capsys):
    names = _subcommands()
    assert names[:2] == ["schemes", "plan"]
    for name in names:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
    capsys.readouterr()


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "schemes" in capsys.readouterr().err


def test_ctrl_c_exits_130_with_one_line_and_no_traceback(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "schemes": cli.Command(cli._schemes_add_parser, interrupted)})
    assert main(["schemes"]) == 130  # main raised KeyboardInterrupt: a traceback on stderr
    err = capsys.readouterr().err
    assert err == "kvbits schemes: interrupted\n"


# ------------------------------------------------------------------------------ the registry


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_registry_skips_missing_modules_and_runs_plugins(plugin_dir, monkeypatch, capsys):
    (plugin_dir / "kvb_hello_cli.py").write_text(
        textwrap.dedent(
            """
            def add_parser(subparsers):
                p = subparsers.add_parser("hello", help="say hello")
                p.add_argument("--name", default="world")
                return p

            def run(args):
                print(f"hello {args.name}")
                return 3
            """
        )
    )
    commands = {**cli.COMMANDS, "ghost": "kvbits_no_such_package.cli", "hello": "kvb_hello_cli"}
    monkeypatch.setattr(cli, "COMMANDS", commands)
    assert "ghost" not in _subcommands()
    assert main(["hello", "--name", "kv"]) == 3
    assert capsys.readouterr().out == "hello kv\n"


def test_registry_does_not_hide_import_errors_inside_a_module(plugin_dir, monkeypatch):
    (plugin_dir / "kvb_broken_cli.py").write_text("import kvbits_missing_dependency\n")
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "broken": "kvb_broken_cli"})
    with pytest.raises(ModuleNotFoundError, match="kvbits_missing_dependency"):
        cli.build_parser()


def test_registry_rejects_modules_without_the_protocol(plugin_dir, monkeypatch):
    (plugin_dir / "kvb_empty_cli.py").write_text("x = 1\n")
    monkeypatch.setattr(cli, "COMMANDS", {**cli.COMMANDS, "empty": "kvb_empty_cli"})
    with pytest.raises(TypeError, match="add_parser"):
        cli.build_parser()


# ------------------------------------------------------------------------------ end to end


def test_python_m_kvbits_plan_json_is_clean():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbits",
            "-v",
            "plan",
            *WORKED,
            "--scheme",
            "fp16",
            "--scheme",
            "kivi-2",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)  # stdout holds JSON only, whatever is logged
    assert rows[0]["total_bytes"] == WORKED_BYTES and rows[1]["scheme"] == "kivi-2"


def test_plan_imports_only_its_own_command():
    code = (
        "import sys\n"
        "from kvbits.cli import main\n"
        f"assert main(['plan', *{WORKED!r}, '--scheme', 'fp16', '--json']) == 0\n"
        "heavy = ('torch', 'transformers', 'kvbits.calibrate', 'kvbits.evaluate')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)[0]["total_bytes"] == WORKED_BYTES
    assert out.stderr.strip() == "[]"


def test_console_script_entry_point():
    script = Path(sys.executable).parent / ("kvbits.exe" if os.name == "nt" else "kvbits")
    if not script.exists():
        pytest.skip("kvbits is not installed as a console script in this environment")
    out = subprocess.run(
        [str(script), "plan", *WORKED, "--scheme", "fp16"], capture_output=True, text=True, check=True
    )
    assert "137,438,953,472" in out.stdout


def test_library_log_records_are_not_printed_again_as_kvbits_lines():
    """``logging.basicConfig`` put a handler on the root logger: every huggingface_hub retry of a mistyped model
    name printed twice (the hub's own line, then 'kvbits: WARNING: ...'). Only kvbits' records get kvbits' line."""
    code = textwrap.dedent(
        """
        import logging, sys
        from kvbits.cli import main
        main(["schemes", "--json"])
        logging.getLogger("huggingface_hub.utils._http").warning("retrying in 1s")
        logging.getLogger("kvbits.evaluate").warning("a kvbits warning")
        logging.getLogger("kvbits.evaluate").info("not at -v 0")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "kvbits: WARNING: a kvbits warning" in out.stderr
    assert "retrying" not in out.stderr.replace("retrying in 1s\n", "", 1)  # at most the library's own line
    assert "kvbits: WARNING: retrying" not in out.stderr and "not at -v 0" not in out.stderr


def test_no_progress_json_or_a_pipe_turn_library_progress_bars_off():
    """transformers' 'Loading weights' bar printed under --no-progress and --json (and into log files)."""
    code = textwrap.dedent(
        """
        import os, sys
        from kvbits.cli import main
        main(sys.argv[1:])
        from transformers.utils import logging as hf_logging
        print(os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"), hf_logging.is_progress_bar_enabled())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run(  # stderr is a pipe here, not a terminal
        [sys.executable, "-c", code, "schemes"], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "1 False"


def test_a_missing_input_folder_is_a_usage_error(tmp_path, capsys):
    """`kvbits report NONEXISTENT` exited 1 (a failure) where every other bad input exits 2."""
    assert main(["report", str(tmp_path / "nonexistent")]) == 2
    assert capsys.readouterr().err.startswith("kvbits report: error: no summary.json in ")


def test_eval_says_where_it_wrote(tmp_path, capsys, monkeypatch):
    """`kvbits eval --out` printed its tables and not where the report went (needle and speed say it)."""
    from _wordlevel import save_word_tokenizer, write_word_text
    from test_distributed import _model

    folder, text = tmp_path / "model", write_word_text(tmp_path / "book.txt", 200)
    save_word_tokenizer(folder)
    _model().save_pretrained(folder)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["eval", "--model", str(folder), "--data", str(text), "--context", "64", "--scheme", "int4-token",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}/summary.json, report.md, report.html")


def test_speed_without_matplotlib_says_so_and_leaves_no_older_figure(tmp_path, capsys, monkeypatch):
    """Without matplotlib, `kvbits speed --out` (and `needle`) drew nothing without a word, printed `wrote ...,
    report.md and speed.png`, and a speed.png an earlier run had left in the folder stayed beside the new speed.json
    (another scheme and context), listed by `kvbits report` as the run's figure."""
    from _wordlevel import save_word_tokenizer, write_word_text
    from test_distributed import _model

    from kvbits.report import speed as report_speed
    from kvbits.report.plots.figure import INSTALL_HINT

    folder, text = tmp_path / "model", write_word_text(tmp_path / "book.txt", 200)
    save_word_tokenizer(folder)
    _model().save_pretrained(folder)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["speed", "--model", str(folder), "--data", str(text), "--context", "32", "--tokens", "1", "--warmup", "0",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--scheme", "int4-token"]) == 0
    (out / "speed.png").write_bytes(b"the int4-token run's figure")  # as drawn where matplotlib is installed
    capsys.readouterr()

    def no_matplotlib(*args, **kwargs):
        raise ImportError(INSTALL_HINT)

    monkeypatch.setattr(report_speed, "plot_speed", no_matplotlib)
    assert main([*argv, "--scheme", "int8-token"]) == 0
    captured = capsys.readouterr()
    said = "".join(captured.out.split())  # rich folds long lines
    assert said.endswith(f"wrote{out}/speed.json,report.md(nofigure)") and "speed.png" not in said, captured.out
    assert f"no speed.png: {INSTALL_HINT}" in captured.err, captured.err
    assert not (out / "speed.png").exists() and "speed.png" not in (out / "report.md").read_text()
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out}/report.md"


@pytest.mark.parametrize("scheme", ["vllm-int4,30=fp16", "fp8-e4m3,24-25=bf16", "fp16,30=vllm-int8"])
def test_export_scheme_refuses_layers_past_the_given_count(capsys, scheme):
    """``kvbits export --scheme "vllm-int4,30=fp16" --layers 24`` printed ``--kv-cache-dtype-skip-layers 30`` (exit 0):
    ``--layers`` was checked only for an unquantized base, so a layer past the model (a typo for 3 or 20) went to
    vLLM, and the layer meant to stay unquantized was quantized."""
    assert main(["export", "--scheme", scheme, "--layers", "24"]) == 2
    err = capsys.readouterr().err
    assert "kvbits export: error: mixed scheme" in err and "beyond the given 24 layers" in err, err
    assert main(["export", "--scheme", "vllm-int4,23=fp16", "--layers", "24", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skip_layers"] == [23]


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--model", "m", "--data", "d", "--scheme", "int4-token", "--overwrite"],
        ["needle", "--model", "m", "--context", "1k", "--scheme", "int4-token", "--overwrite"],
        ["speed", "--model", "m", "--context", "1k", "--scheme", "int4-token", "--overwrite"],
        ["tune", "--model", "m", "--data", "d", "--candidates", "int8-token", "--candidates", "int4-token"]
        + ["--budget-bits", "6", "--overwrite"],
    ],
    ids=lambda argv: argv[0],
)
def test_overwrite_without_out_is_refused(capsys, argv):
    """`--overwrite` without `--out` was accepted and ignored (eval, needle, speed and tune ran to the end, wrote
    nothing, exit 0): now a usage error before the model loads (the model "m" here does not exist)."""
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"kvbits {argv[0]}: error: --overwrite replaces what --out holds")


def test_eval_prefill_without_prompt_len_names_the_flags(capsys):
    """`kvbits eval --semantics prefill` without --prompt-len said "semantics='prefill' needs prompt_len with ...",
    the Python argument names, after the text was read; now the flags, before anything loads."""
    assert main(["eval", "--model", "m", "--data", "d", "--context", "64", "--scheme", "int4-token",
                 "--semantics", "prefill"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("kvbits eval: error: --semantics prefill needs --prompt-len N") and "- 1 = 63)" in err


def test_speed_graphs_off_cuda_is_refused_before_the_model_loads(capsys):
    """`kvbits speed --static --graphs` on the CPU loaded the model and then said "graphs=True: CUDA graphs need a
    CUDA device"; now refused first, naming the flags (the model "m" does not exist, so nothing loaded)."""
    assert main(["speed", "--model", "m", "--context", "1k", "--scheme", "int4-token", "--static", "--graphs"]) == 2
    assert capsys.readouterr().err.startswith("kvbits speed: error: --graphs replays decode steps from captured CUDA "
                                              "graphs: it needs --device cuda, got --device cpu")  # fmt: skip


@pytest.mark.parametrize("flags", [["--scope", "request"], ["--patience", "3"]])
def test_monitor_action_flags_without_a_threshold_are_refused(capsys, flags):
    """`kvbits monitor --scope request` (or `--patience 3`) without any threshold ran and held nothing, the flag
    ignored: now a usage error before the model loads."""
    assert main(["monitor", "--model", "m", "--data", "d", "--scheme", "int4-token", *flags]) == 2
    assert "and no threshold was given: add --key-error" in capsys.readouterr().err


def test_eval_attn_layers_out_of_range_names_the_flag(tmp_path, capsys, monkeypatch):
    """An `--attn-layers` index past the model's layers said "attn_layers must be in [0, 2)": now the flag too."""
    from _wordlevel import save_word_tokenizer, write_word_text
    from test_distributed import _model

    folder, text = tmp_path / "model", write_word_text(tmp_path / "book.txt", 200)
    save_word_tokenizer(folder)
    _model().save_pretrained(folder)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    argv = ["eval", "--model", str(folder), "--data", str(text), "--context", "64", "--scheme", "int4-token",
            "--no-progress", "--attn-layers", "7"]  # fmt: skip
    assert main(argv) == 2
    assert "--attn-layers must be in [0, 2), got [7]" in capsys.readouterr().err


def test_plan_caption_names_each_scheme_beyond_max_position_once(capsys, tmp_path):
    """Two ``--context`` values made the caption list every scheme twice ("for fp16, kivi-2, fp16, kivi-2"):
    a scheme's max context does not depend on the context planned."""
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "max_position_embeddings": 4096}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ["plan", "--config", str(path), "--context", "1k", "--context", "4k", "--scheme", "fp16",
            "--scheme", "kivi-2", "--gpu-mem", "80", "--weights-gib", "1"]  # fmt: skip
    assert main(argv) == 0
    caption = " ".join(capsys.readouterr().out.split())
    assert "max_position_embeddings (4,096) for fp16, kivi-2 " in caption, caption
    assert caption.count("kivi-2,") == 0 and "fp16, kivi-2, fp16" not in caption


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["table", "json"])
def test_a_closed_stdout_ends_quietly_with_141(extra):
    """`kvbits plan ... | head -1`: rich's broken-pipe handling exited 1 silently (a failure, for nothing), and
    --json printed 'kvbits plan: error: [Errno 32] Broken pipe' and exited 1. Now: nothing on stderr, 141
    (128 + SIGPIPE, what a shell reports for `cat` or `git log` cut short by `head`)."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write to stdout fails with EPIPE
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        out = subprocess.run([sys.executable, "-m", "kvbits", "plan", *WORKED, "--scheme", "fp16", *extra],
                             stdout=write, stderr=subprocess.PIPE, text=True, env=env, check=False)  # fmt: skip
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")  # cli.EXIT_BROKEN_PIPE


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--contxt", "512"],  # required options missing too: argparse named those, not the typo
        ["-v", "plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--context", "64", "--contxt", "9"],
    ],
)
def test_a_mistyped_flag_is_named_by_its_command_with_the_near_one(capsys, argv):
    """``kvbits eval --contxt 512`` answered "the following arguments are required: --model, --data, --scheme"
    (the typo not named), and with the required options given, ``kvbits: error: unrecognized arguments: --contxt
    512`` under ``kvbits``' usage rather than the command's; now the command names the flag and the near one."""
    command = next(t for t in argv if not t.startswith("-"))
    if command not in _subcommands():
        pytest.skip(f"no {command} subcommand")
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"kvbits {command}: error: unrecognized argument --contxt (did you mean --context?)" in err, err


def test_a_mistyped_command_is_answered_with_the_near_one(capsys):
    """``kvbits evall`` listed the valid commands but suggested none; now it names the near one, as a mistyped
    flag does, and still lists them."""
    if "eval" not in _subcommands():
        pytest.skip("no eval subcommand")
    with pytest.raises(SystemExit) as e:
        main(["evall"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "invalid choice: 'evall'" in err and "'eval'" in err, err
    assert "(did you mean eval?)" in err, err


def test_an_abbreviated_flag_still_parses():
    """The check for unknown flags accepts what argparse accepts: a unique prefix (``--kv-head``), ``--x=v``."""
    assert main(["plan", "--layers=2", "--kv-head", "1", "--head-dim", "64", "--context", "64", "--json"]) == 0
