"""File helpers shared by the stages that write files others read (calibration artifacts, metrics, reports).

Every file kvbits writes goes through :func:`atomic_path` (or its :func:`write_text_atomic` /
:func:`write_bytes_atomic`): a temporary file in the target's folder with a name unique to the process and call
(``tempfile.mkstemp``: two processes writing one folder do not collide), given the permissions of a normally created
file, then renamed over the target (a reader never sees half a file); on any failure it is removed. A target that is
a symbolic link is written through: the file it points to is replaced, the link kept."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where the OS allows (Linux: the ``Umask:`` line of
    ``/proc/self/status``). ``os.umask`` can only be read by setting it: between ``os.umask(0)`` and setting it back,
    a file another thread creates gets mode 0666 whatever the umask, so that toggle is only the fallback (other
    systems, no ``/proc``), done under a lock (which serializes kvbits' own readers, not other code's file creation)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        umask = os.umask(0o077)  # a file created meanwhile is private, not world-writable
        os.umask(umask)
    return umask


def chmod_default(path: str | os.PathLike[str]) -> None:
    """Give ``path`` the permissions of a normally created file (``0666 & ~umask``): ``tempfile.mkstemp``
    creates its files 0600, which a reader running as another user (node_exporter, a server) can not open."""
    os.chmod(path, 0o666 & ~current_umask())


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path ``<folder>/<name>.<unique>.tmp`` beside ``path`` to write to; when the block ends
    without an exception it gets ``0666 & ~umask`` and replaces ``path`` (``os.replace``). The temporary file is
    removed whatever happens (an exception in the block, a failed chmod or rename). ``path``'s folder must exist.
    A symbolic link ``path`` is followed (``os.path.realpath``): the temporary file goes beside the file it names,
    which it replaces; renamed over the link itself, it replaced the link with a file and left its target stale."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    try:
        fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError as e:  # it named the temporary file ('x.json.k2j4d9.tmp'), which the caller never asked for
        raise type(e)(e.errno, f"{e.strerror}: can not write {path} (a temporary file in its folder)") from e
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        chmod_default(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` in UTF-8 (whatever the locale) through :func:`atomic_path`; returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through :func:`atomic_path`; returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)
