"""Three left-overs of the CLI's light checks and paths: ``kvbits monitor`` offered peers in its refusal of a misspelled
scheme though it refuses peers; ``kvbits export`` looked for ``<scheme>.tune.json`` under a literal ``~``; ``kvbits tune
--out ~/mix.json`` checked (and wrote) a folder named ``~`` in the working folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_scheme_refusal import MD, _refuse


def test_monitor_refusal_does_not_offer_peers() -> None:
    """monitor refuses peers (``watch``), so its refusal of ``kivi2`` must not end ``peers (stream mode only): ...``;
    eval still offers them."""
    rc, err, heavy = _refuse(["monitor", *MD, "--context", "1k", "--scheme", "kivi2"])
    assert rc == 2 and "unknown scheme 'kivi2'" in err, err
    assert "peers" not in err and "hf-quanto" not in err, err
    assert heavy == [], heavy
    rc, err, _ = _refuse(["eval", *MD, "--scheme", "kivi2"])
    assert rc == 2 and "peers (stream mode only): hf-quanto-int4" in err, err


def test_check_scheme_args_is_exported() -> None:
    import kvbits._argtypes as argtypes

    assert "check_scheme_args" in argtypes.__all__


def test_export_finds_the_tune_record_under_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--scheme ~/tuned.json`` resolves (get_scheme expands ``~``), and so must the tune record beside it."""
    from kvbits.export.cli import _tune_record_layers

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tuned.json").write_text("{}")
    (tmp_path / "tuned.json.tune.json").write_text('{"meta": {"layers": 24}}')
    assert _tune_record_layers("~/tuned.json") == (24, tmp_path / "tuned.json.tune.json")


def test_tune_out_expands_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``--out ~/mix.json`` is the home's mix.json: a file there that tune did not write is refused before the model
    loads (it was not seen: the check looked at ``./~/mix.json``, and the model load failed instead)."""
    from kvbits.cli import main

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "mix.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    argv = ["tune", "--model", str(tmp_path / "no-such-model"), "--data", "pride-and-prejudice", "--candidates",
            "int4-token", "--candidates", "int2-token", "--budget-bits", "3", "--out", "~/mix.json"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{home / 'mix.json'} exist(s) but {home / 'mix.json'}.tune.json does not" in err, err
    assert not (work / "~").exists()
