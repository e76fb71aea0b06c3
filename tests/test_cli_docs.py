"""The command lines the README and the ``--help`` texts show are real: every ``kvbits ...`` line of the README's
bash blocks and of each subcommand's examples parses with the real parser, and every default an option's help
states is the default argparse applies."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from kvbits.cli import COMMANDS, build_parser, requested_command

README = Path(__file__).resolve().parents[1] / "README.md"


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def kvbits_argv(line: str) -> list[str] | None:
    """The arguments after ``kvbits`` of a shell line (``torchrun ... -m kvbits ...`` too), its trailing ``# comment``
    dropped; None for a line that does not run kvbits."""
    line = re.split(r"\s+#\s", line.strip())[0]
    if not re.match(rf"(kvbits ({'|'.join(COMMANDS)})|torchrun) ", line):  # prose such as "kvbits plan's avg_bits"
        return None
    tokens = shlex.split(line)
    if not tokens or tokens[0] not in ("kvbits", "torchrun") or "kvbits" not in tokens:
        return None
    return tokens[tokens.index("kvbits") + 1 :]


def readme_command_lines() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [ln for b in blocks for ln in b.splitlines() if kvbits_argv(ln) is not None]


def epilog_command_lines() -> list[tuple[str, str]]:
    out = []
    for name, p in subparsers().items():
        for ln in (p.epilog or "").replace("\\\n", " ").splitlines():
            if kvbits_argv(ln) is not None:
                out.append((name, ln.strip()))
    return out


def test_kvbits_argv() -> None:
    assert kvbits_argv("kvbits plan --context 8k   # a comment") == ["plan", "--context", "8k"]
    assert kvbits_argv("torchrun --nproc-per-node 2 -m kvbits eval --windows 4") == ["eval", "--windows", "4"]
    assert kvbits_argv("make demo   # kvbits demo") is None
    assert kvbits_argv('kvbits export --scheme "vllm-int4,0=fp16"') == ["export", "--scheme", "vllm-int4,0=fp16"]


def test_the_readme_shows_its_two_setup_commands_and_the_cli() -> None:
    text = README.read_text()
    first = re.search(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert first is not None
    assert [ln.split("#")[0].strip() for ln in first.group(1).splitlines()] == ["make demo", "make test"]
    assert len(readme_command_lines()) >= 20  # the CLI block: a lost block would pass the test below vacuously


@pytest.mark.parametrize("line", readme_command_lines())
def test_readme_command_lines_parse(line: str) -> None:
    argv = kvbits_argv(line)
    assert argv is not None
    try:
        build_parser(only=requested_command(argv)).parse_args(argv)
    except SystemExit as exc:  # argparse's usage error: a flag renamed, dropped or given a bad value
        pytest.fail(f"the README's command line does not parse (exit {exc.code}): {line}")


@pytest.mark.parametrize(("command", "line"), epilog_command_lines())
def test_help_example_lines_parse(command: str, line: str) -> None:
    argv = kvbits_argv(line)
    assert argv is not None
    try:
        build_parser(only=requested_command(argv)).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"kvbits {command} --help shows a command line that does not parse (exit {exc.code}): {line}")


def inline_help_commands() -> list[tuple[str, str]]:
    """``(where, snippet)`` of every backticked `` `kvbits CMD ...` `` inside a ``--help`` text (a description, an
    epilog or an option's help): shorthand, often without the required options, so not parsed whole."""
    out = []
    pattern = rf"`(kvbits (?:{'|'.join(COMMANDS)})\b[^`]*)`"
    for name, p in subparsers().items():
        texts = [p.description or "", p.epilog or "", *(a.help or "" for a in p._actions)]
        out += [(name, m) for t in texts for m in re.findall(pattern, t.replace("\\\n", " "))]
    return out


def test_inline_help_commands_name_real_options_and_no_stray_positionals() -> None:
    """eval's epilog said `kvbits plan MODEL --context N`; kvbits plan takes no positional (`--model MODEL`), so the
    line did not parse. Every backticked command in a help text: its options are the command's, and each bare word
    is an option's value, unless the command takes positionals (kvbits report RUN)."""
    commands = subparsers()
    snippets = inline_help_commands()
    assert len(snippets) >= 2  # eval's and tune's
    for where, snippet in snippets:
        command, *rest = shlex.split(snippet)[1:]
        parser = commands[command]
        options = {o: a for a in parser._actions for o in a.option_strings}
        positionals = any(not a.option_strings for a in parser._actions)
        takes_value = False
        for token in rest:
            if token.startswith("--"):
                assert token in options, f"kvbits {where} --help: {snippet!r}: kvbits {command} has no {token}"
                takes_value = options[token].nargs != 0
            else:
                assert takes_value or positionals, (
                    f"kvbits {where} --help: {snippet!r}: {token!r} is no option's value and kvbits {command} takes "
                    "no positional argument"
                )
                takes_value = False


def shown(default: object) -> str:
    """A default as the help writes it: ``4.0`` -> ``4``, ``[0.0, 0.25]`` -> ``0,0.25``."""
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, (list, tuple)):
        return ",".join(shown(x) for x in default)
    return str(default)


def stated_defaults() -> list[tuple[str, str, object, str]]:
    """``(command, option, default, help)`` of every option whose parsed default is a value (not None, False or an
    empty list: a flag or an option that is simply absent)."""
    rows = []
    for name, p in subparsers().items():
        for a in p._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction) or a.default in (None, False, []):
                continue
            rows.append((name, a.option_strings[-1], a.default, a.help or ""))
    return rows


def test_stated_defaults_cover_the_options_that_have_one() -> None:
    options = {(c, o) for c, o, _, _ in stated_defaults()}
    assert {("eval", "--context"), ("eval", "--mode"), ("needle", "--depths"), ("monitor", "--scope")} <= options


@pytest.mark.parametrize(
    ("command", "option", "default", "text"), stated_defaults(), ids=[f"{c} {o}" for c, o, _, _ in stated_defaults()]
)
def test_help_states_the_default_argparse_applies(command: str, option: str, default: object, text: str) -> None:
    """Each option with a default says it in its help (``(default 8192)``, ``simulate: ... (the default)``), and a
    number the help calls the default is argparse's (a changed default with a stale help fails here)."""
    where = f"kvbits {command} {option}"
    assert "default" in text, f"{where}: the help does not state the default {shown(default)!r}: {text!r}"
    assert shown(default) in text, f"{where}: the help does not show the default {shown(default)!r}: {text!r}"
    for number in re.findall(r"default:? (-?\d[\d.,]*\d|-?\d)", text):
        assert number == shown(default), f"{where}: the help says default {number}, argparse applies {default!r}"


def test_defaults_the_library_applies_are_those_the_help_states() -> None:
    """Options parsed as None whose default the library applies: the help's figure is the library's."""
    import inspect

    from kvbits.calibrate.calibrate import calibrate
    from kvbits.report.fmt import DEFAULT_THRESHOLD

    helps = {(c, a.option_strings[-1]): a.help or "" for c, p in subparsers().items() for a in p._actions
             if a.option_strings}  # fmt: skip
    params = inspect.signature(calibrate).parameters
    assert f"(default {params['percentile'].default:g})" in helps["calibrate", "--percentile"]
    assert f"{params['fp8_scale'].default} (default)" in helps["calibrate", "--fp8-scale"]
    assert f"(default {100 * DEFAULT_THRESHOLD:g})" in helps["report", "--threshold"]


def test_readme_says_which_commands_take_json_dtype_device_and_data_path() -> None:
    """The README's CLI section: every command has --json; the commands it names as running a model take --dtype
    (float32 by default) and --device (analyze and calibrate also mps); those it names take --data-path, no other."""
    text = " ".join(README.read_text().split())
    commands = subparsers()

    def options(name: str) -> dict[str, argparse.Action]:
        return {o: a for a in commands[name]._actions for o in a.option_strings}

    assert "Every command has `--help` and `--json`;" in text
    assert all("--json" in options(name) for name in commands)
    running = re.search(r"The commands that run a model \(([^)]*)\)", text)
    assert running is not None
    names = re.findall(r"`([a-z]+)`", running.group(1))
    assert sorted(names) == sorted(n for n in commands if "--dtype" in options(n))
    for name in names:
        dtype, device = options(name)["--dtype"], options(name)["--device"]
        assert dtype.default == "float32" and list(dtype.choices) == ["float32", "bfloat16", "float16"]
        assert ("mps" in device.help) == (name in ("analyze", "calibrate")), (name, device.help)
    taking = re.search(r"`eval`[^.]*? also take `--data-path`", text)
    assert taking is not None
    names = re.findall(r"`([a-z]+)`", taking.group(0).removesuffix("`--data-path`"))
    assert sorted(names) == sorted(n for n in commands if "--data-path" in options(n))


def test_the_readme_names_threads_for_exactly_the_commands_that_run_a_model() -> None:
    """The README's sentence on the commands that run a model gives them ``--threads N``: each it names takes it, and
    no other command does."""
    text = " ".join(README.read_text().split())
    sentence = re.search(r"The commands that run a model \(([^)]*)\)(.*?);\s*calibration runs", text)
    assert sentence is not None and "`--threads N`" in sentence.group(2)
    names = re.findall(r"`([a-z]+)`", sentence.group(1))
    commands = subparsers()
    assert sorted(names) == sorted(n for n, p in commands.items() if any("--threads" in a.option_strings for a in p._actions))


def test_export_help_says_a_scales_only_out_is_not_served() -> None:
    """Without --checkpoint the command says --out holds the scales alone, not a model vLLM serves; the help said
    'Serve with: vllm serve <out>' for every export."""
    epilog = " ".join((subparsers()["export"].epilog or "").split())
    assert "Without --checkpoint, --out holds the scales alone, which vLLM does not serve" in epilog
    assert "Serve with: vllm serve <out>" not in epilog


def test_report_help_says_a_newer_output_version_is_refused() -> None:
    """The report help's claim, held to check_output_versions: a run of output version READS_VERSION + 1 is refused
    naming both versions."""
    from kvbits.report.inputs import READS_VERSION, check_output_versions

    assert "newer than this kvbits reads is refused, naming both versions" in " ".join(
        (subparsers()["report"].epilog or "").split()
    )
    with pytest.raises(ValueError, match=rf"version {READS_VERSION + 1} is newer .*version {READS_VERSION}\)"):
        check_output_versions({"request": {"version": READS_VERSION + 1}}, "runs/x")


def test_eval_help_says_a_run_another_kvbits_version_recorded_is_recomputed() -> None:
    """README and evaluate/outputs.py say a finished run in --out that another kvbits version recorded is not reused
    but recomputed; ``kvbits eval --help`` said only "output folder (config.json, ...)"."""
    (out,) = (a for a in subparsers()["eval"]._actions if "--out" in a.option_strings)
    text = " ".join((out.help or "").split())
    assert "A finished run of the same settings there is reused" in text
    assert "one another kvbits version recorded, or an older output version, is recomputed" in text


def test_readme_states_the_ctrl_c_exit_status_main_returns() -> None:
    """The README's CLI section did not say what Ctrl-C does; it now states cli.EXIT_INTERRUPTED (tested in
    test_cli.py: one line on stderr, no traceback)."""
    from kvbits.cli import EXIT_INTERRUPTED

    text = " ".join(README.read_text().split())
    assert (f"Ctrl-C stops any of them with exit status {EXIT_INTERRUPTED} and one line on stderr "
            "(`kvbits eval: interrupted`), no traceback") in text  # fmt: skip


def test_readme_states_the_closed_stdout_exit_status_main_returns() -> None:
    """A closed stdout (`| head -1`) exits cli.EXIT_BROKEN_PIPE, quietly (test_cli.py runs it); the README says so."""
    from kvbits.cli import EXIT_BROKEN_PIPE

    text = " ".join(README.read_text().split())
    assert (f"a stdout closed early (`kvbits plan ... | head -1`) ends it with exit status {EXIT_BROKEN_PIPE} "
            "(128 + SIGPIPE, as `cat` would) and nothing on stderr.") in text  # fmt: skip


def test_data_path_help_lists_the_roots_the_loader_searches(tmp_path, monkeypatch) -> None:
    """The --data-path help said "then $KVBITS_DATA, then ../shared/data" (monitor's: no order at all), but the
    loader also falls back to <repo>/../shared/data and /work/shared/data: now every help lists the loader's roots."""
    import os

    from kvbits.evaluate.data import DEFAULT_DATA_ROOTS, data_search_path

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    helps = {name: a.help for name, sub in commands.items() for a in sub._actions if "--data-path" in a.option_strings}
    assert set(helps) >= {"eval", "speed", "needle", "tune", "monitor"}
    for name, text in helps.items():
        assert text.endswith("(then " + ", then ".join(DEFAULT_DATA_ROOTS) + ")"), (name, text)
    monkeypatch.setenv("KVBITS_DATA", str(tmp_path))
    repo = Path(__file__).resolve().parents[1]
    expected = [tmp_path, Path.cwd() / ".." / "shared" / "data", repo / ".." / "shared" / "data",
                Path("/work/shared/data")]  # fmt: skip
    seen, want = set(), []
    for p in expected:  # data_search_path drops a root that resolves to one listed before
        if os.path.realpath(p) not in seen:
            seen.add(os.path.realpath(p))
            want.append(p.resolve())
    assert [p.resolve() for p in data_search_path()] == want


def test_the_readme_names_the_commands_that_take_bos() -> None:
    """The README's CLI section says `kvbits eval` takes `--bos` (default auto) and names the other commands that
    take the same `--bos`: exactly the commands whose parser has `--bos`, each with the same default and choices."""
    text = " ".join(README.read_text().split())
    assert "With `--bos auto` (the default) each window of `kvbits eval` starts with the tokenizer's BOS" in text
    same = re.search(r"`kvbits speed`, `monitor`, `calibrate`, `needle` \(.*?\), `analyze` and `tune` \(every pass\) "
                     r"take the same `--bos`", text)  # fmt: skip
    assert same is not None and "the `benchmarks/` scripts still cut raw slices" in text
    takes = {n for n, p in subparsers().items() if any("--bos" in a.option_strings for a in p._actions)}
    assert takes == {"eval", "speed", "monitor", "calibrate", "needle", "analyze", "tune"}
    for name in takes:
        (bos,) = (a for a in subparsers()[name]._actions if "--bos" in a.option_strings)
        assert bos.default == "auto" and list(bos.choices) == ["auto", "always", "never"], name


def test_the_readme_quotes_the_lines_monitor_prints_for_the_files_it_wrote(capsys) -> None:
    """README's monitor row quotes what `kvbits monitor` prints after writing --prom / --events; the printed lines
    are those words."""
    from kvbits.monitor.cli import _say_written

    text = " ".join(README.read_text().split())
    assert ("`kvbits monitor` without `--json` ends by naming the files it wrote: `wrote <--prom> (Prometheus text)`, "
            "`appended N event(s) to <--events> (JSON lines)`") in text  # fmt: skip
    _say_written("runs/kvbits.prom", "runs/events.jsonl", 3)
    out = capsys.readouterr().out.splitlines()
    assert out == ["wrote runs/kvbits.prom (Prometheus text)", "appended 3 event(s) to runs/events.jsonl (JSON lines)"]


def test_the_readme_export_claims_hold(tmp_path) -> None:
    """README's export row: the *_per_token_head dtypes come with --attention-backend TRITON_ATTN, the scales' notes
    name OCP E4M3 and ROCm's E4M3FNUZ, and a tune record beside a scheme JSON gives --layers (a different one is
    refused); the export help says a re-export replaces an earlier one's links."""
    from kvbits.export.cli import _run_scheme, _tune_record_layers
    from kvbits.export.vllm_flags import FNUZ_NOTE, vllm_cache_args

    text = " ".join(README.read_text().split())
    assert "the `*_per_token_head` dtypes with `--attention-backend TRITON_ATTN`" in text
    for scheme in ("vllm-int4", "vllm-int8", "vllm-fp8-token"):
        args = vllm_cache_args(scheme)
        assert args.kv_cache_dtype.endswith("_per_token_head") and args.attention_backend == "TRITON_ATTN", scheme
    assert "the scales are for OCP E4M3 (absmax / 448), and the notes say that on ROCm MI300 vLLM's fp8 is E4M3FNUZ (max 240)" in text
    assert "OCP E4M3 (absmax / 448)" in FNUZ_NOTE and "E4M3FNUZ (max 240)" in FNUZ_NOTE
    assert "a re-export into the same `--out` replaces the links and index an earlier export made there" in text
    epilog = " ".join((subparsers()["export"].epilog or "").split())
    assert "a re-export replaces the links and index an earlier one made there" in epilog
    assert ("for a scheme JSON `kvbits tune` wrote, `--layers` defaults to `meta.layers` of the `<scheme>.tune.json` "
            "beside it (a different `--layers` is refused)") in text  # fmt: skip
    scheme = tmp_path / "tuned.json"
    scheme.write_text("{}")
    (tmp_path / "tuned.json.tune.json").write_text('{"meta": {"layers": 24}}')
    assert _tune_record_layers(str(scheme)) == (24, tmp_path / "tuned.json.tune.json")
    args = build_parser().parse_args(["export", "--scheme", str(scheme), "--layers", "12"])
    with pytest.raises(ValueError, match="--layers 12 disagrees with .*meta.layers 24"):
        _run_scheme(args)


@pytest.mark.parametrize(
    "argv, hint", [(["evall"], "did you mean eval?"), (["plan", "--contxt", "8k"], "did you mean --context?")]
)
def test_readme_states_the_did_you_mean_of_a_mistyped_command_or_option(argv, hint, capsys) -> None:
    """A mistyped command (0cdb4f4) or option is refused with exit status 2 naming the near one; the README's CLI
    section says so with these two examples."""
    from kvbits.cli import main

    text = " ".join(README.read_text().split())
    assert ("a mistyped command or option is refused with exit status 2 naming the nearest one (`kvbits evall`: "
            "`did you mean eval?`; `--contxt`: `did you mean --context?`)") in text  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and hint in capsys.readouterr().err
