"""Every file kvbits writes goes through ``kvbits._files.atomic_path``: a temporary file beside the target with a name
unique to the process and call, the permissions of a normally created file, UTF-8 for text, renamed over the target,
and removed when the write fails. Each test here failed before the writers shared that helper."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def _half_then_fail(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``Path.write_text`` writes half its text, then raises ``OSError`` (a full disk); returns the names written."""
    real, names = Path.write_text, []

    def half(self: Path, text: str, *a, **k):
        names.append(self.name)
        real(self, text[: len(text) // 2], *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    return names


def test_text_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """Under a C locale (ASCII, coercion off) a non-ASCII text raised UnicodeEncodeError through ``Path.write_text``
    (``evaluate.outputs._atomic_write``, ``tune``'s ``--out``); it is written in UTF-8."""
    path = tmp_path / "t.json"
    code = "import sys; from kvbits._files import write_text_atomic; write_text_atomic(sys.argv[1], 'Qwen\\u2013\\u00fc')"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert path.read_bytes().decode("utf-8") == "Qwen\u2013\u00fc"


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    from kvbits._files import write_text_atomic

    path = tmp_path / "summary.json"
    write_text_atomic(path, "old\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    names = _half_then_fail(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(path, "new text\n")
    assert names and names[0] != "summary.json" and names[0].startswith("summary.json.")
    assert not names[0].endswith(".json")  # a reader globbing *.json does not take it
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"] and path.read_text() == "old\n"


def test_report_figures_do_not_share_a_temporary_name(tmp_path: Path) -> None:
    """``save_png`` wrote through the fixed name ``<name>.tmp.png``: two processes saving one figure name wrote one
    temporary file, and a failed save left it behind."""
    from kvbits.report.plots.figure import save_png

    used: list[str] = []

    class Fig:
        def savefig(self, path, **kwargs) -> None:
            used.append(Path(path).name)
            Path(path).write_bytes(b"\x89PNG half")
            if len(used) == 3:
                raise RuntimeError("renderer failed")

    save_png(Fig(), tmp_path / "a.png")
    save_png(Fig(), tmp_path / "a.png")
    assert used[0] != used[1], used  # a name of its own per call (mkstemp), so per process
    with pytest.raises(RuntimeError, match="renderer failed"):
        save_png(Fig(), tmp_path / "a.png")
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]


def test_analysis_plots_are_written_atomically(tmp_path: Path) -> None:
    """``analyze.plots._save`` wrote the PNG in place: a failing save left a truncated ``heat.png`` (and did not close
    the figure); now the old file stays, no temporary file is left, and a good save still writes a PNG."""
    pytest.importorskip("matplotlib")
    from kvbits.analyze.plots import _pyplot, _save

    plt = _pyplot()
    out = tmp_path / "plots" / "heat.png"
    fig = plt.figure()
    assert _save(plt, fig, out) == out and out.read_bytes()[:4] == b"\x89PNG"
    good = out.read_bytes()

    class Broken:
        def tight_layout(self) -> None:
            pass

        def savefig(self, path, **kwargs) -> None:
            Path(path).write_bytes(b"\x89PNG half")
            raise RuntimeError("renderer failed")

    closed: list[object] = []

    class Plt:
        def close(self, f) -> None:
            closed.append(f)

    broken = Broken()
    with pytest.raises(RuntimeError, match="renderer failed"):
        _save(Plt(), broken, out)
    assert out.read_bytes() == good and [p.name for p in out.parent.iterdir()] == ["heat.png"]
    assert closed == [broken]


def test_an_evaluation_output_that_fails_to_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    """``evaluate.outputs._atomic_write`` left ``generations.jsonl.tmp<pid>`` in the run folder when the write
    failed."""
    from kvbits.evaluate.outputs import _write_generations

    names = _half_then_fail(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        _write_generations(tmp_path, ["reference", "int4"], np.zeros((2, 1, 3), dtype=np.int64))
    assert names and list(tmp_path.iterdir()) == []


def test_a_hash_record_that_fails_to_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    """``registry.cached_file_sha256`` left ``hashes/<key>.json.tmp<pid>`` in the cache when recording failed (the
    failure is only logged: the hash is still returned)."""
    import hashlib

    from kvbits.evaluate.models.registry import cached_file_sha256

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"weights")
    names = _half_then_fail(monkeypatch)
    assert cached_file_sha256(f) == hashlib.sha256(b"weights").hexdigest()
    assert names and list((tmp_path / "cache" / "hashes").iterdir()) == []


def test_a_symlinked_target_is_written_through(tmp_path: Path) -> None:
    """``os.replace`` over a symbolic link replaced the link with a file: the file it pointed to (a run folder kept
    elsewhere, a summary shared by link) stayed stale and the link was gone. Now the link's target is written."""
    from kvbits._files import write_text_atomic

    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "summary.json"
    target.write_text("old\n")
    link = tmp_path / "summary.json"
    link.symlink_to(target)
    assert write_text_atomic(link, "new\n") == link
    assert link.is_symlink() and target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real", "summary.json"]
    assert [p.name for p in target.parent.iterdir()] == ["summary.json"]  # no temporary file left beside it
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "real" / "new.json")  # a link to a file not yet written: created there
    write_text_atomic(dangling, "x\n")
    assert dangling.is_symlink() and (tmp_path / "real" / "new.json").read_text() == "x\n"


def test_a_missing_folder_is_said_by_the_target_not_the_temporary_name(tmp_path: Path) -> None:
    """A write into a folder that does not exist said ``No such file or directory: '.../x.json.k2j4d9.tmp'``, a
    name the caller never gave; it names the target now (same exception type)."""
    from kvbits._files import write_text_atomic

    target = tmp_path / "nope" / "x.json"
    with pytest.raises(FileNotFoundError) as err:
        write_text_atomic(target, "x")
    assert str(target) in str(err.value) and ".tmp" not in str(err.value)


def test_the_umask_is_read_without_setting_it(tmp_path: Path, monkeypatch) -> None:
    """``chmod_default`` read the umask by ``os.umask(0)`` then setting it back: a file another thread created in
    that moment got mode 0666 whatever the umask. On Linux it is read from ``/proc/self/status``, the umask never
    changed; the mode is still ``0666 & ~umask``."""
    from kvbits import _files

    if not Path("/proc/self/status").is_file():
        pytest.skip("no /proc/self/status (not Linux)")
    real = os.umask
    old = real(0o027)
    try:
        calls: list[int] = []
        monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
        path = tmp_path / "f.txt"
        _files.write_text_atomic(path, "x")
        assert calls == []  # never set (to 0 or anything)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert _files.current_umask() == 0o027
    finally:
        real(old)
