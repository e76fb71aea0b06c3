"""One process at a time fills a cache entry: an inter-process lock per entry of the kvbits cache.

Two processes that need the same model on a cold cache (the ranks of ``torchrun -m kvbits eval``, test
workers, two shells) would otherwise each download its wheels and each convert its GGUF file. Both copies
are written atomically, so neither would be corrupt, but the work is done twice (480 MB and a minute of
conversion for Qwen2.5-Coder-0.5B), and a conversion that finishes second replaces the folder the first
process may be loading from. The filler takes the entry's lock, checks the cache again under it, and
fills it only if it is still missing; the others wait on the lock, then find it filled.

A filler killed midway (SIGKILL, out of memory) leaves its temporary files behind: hundreds of MB that
no later fill would reuse. The next filler, holding the lock, removes them first
(:func:`remove_leftovers`): no other process can be writing them then.

The locks are ``fcntl.flock`` locks on files under ``$KVBITS_CACHE/locks/``: the kernel releases them
when their holder exits, however it exits, so a crashed filler never leaves a stale lock. A lock file
another user made in a shared cache is locked through a read-only descriptor; a cache that can not be
written at all is a ``PermissionError`` saying to set ``KVBITS_CACHE`` to a writable folder. Where
``fcntl`` does not exist (Windows) the lock is a no-op, logged once: concurrent fills there stay safe,
only duplicated. So is a cache on a filesystem without file locks (Lustre mounted without ``-o flock``: ``flock``
fails with ``ENOSYS``), logged as a warning, rather than every fetch and conversion failing there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

__all__ = ["cache_lock", "lock_path", "remove_leftovers"]

_NO_FCNTL_LOGGED = False
# flock's errors on a filesystem without file locks (Lustre mounted without -o flock: ENOSYS; some NFS: ENOLCK)
_NO_FLOCK_ERRNOS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


def lock_path(cache_root: Path, name: str) -> Path:
    """The lock file of cache entry ``name`` under ``cache_root`` (``locks/<name>.lock``).

    ``name`` may hold only letters, digits, ``.``, ``_`` and ``-``: it becomes a file name.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"a cache lock name may hold only letters, digits, '.', '_' and '-', got {name!r}")
    return cache_root / "locks" / f"{name}.lock"


@contextlib.contextmanager
def cache_lock(cache_root: Path, name: str, what: str) -> Iterator[bool]:
    """Hold the exclusive lock of cache entry ``name`` while the block runs.

    Args:
        cache_root: the kvbits cache root (``registry.cache_dir()``).
        name: the entry's lock name (``model-smollm2-135m``, ``convert-b179c9523d0e6a0f``).
        what: what the holder is doing, for the log line of a process that has to wait
            (``"fetching model 'smollm2-135m'"``).

    A process that finds the lock held logs that it waits, and for how long it waited once it has the
    lock. The lock is not re-entrant: do not take the same entry's lock twice in one thread.

    Yields:
        True when the lock is held; False where there is no ``fcntl`` or the cache's filesystem has no file locks
        (another process may be filling the same entry, so its temporary files are not leftovers).
    """
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        global _NO_FCNTL_LOGGED
        if not _NO_FCNTL_LOGGED:
            logger.info("no fcntl on this platform: concurrent processes may fill the kvbits cache twice")
            _NO_FCNTL_LOGGED = True
        yield False
        return
    with _open_lock(lock_path(cache_root, name), cache_root) as fh:
        path = Path(fh.name)
        unsupported = None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is %s; waiting for it (lock %s)", what, path)
            t0 = time.perf_counter()
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            logger.info("waited %.1f s for another process %s", time.perf_counter() - t0, what)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK_ERRNOS:
                raise
            unsupported = exc.strerror
        if unsupported is not None:
            logger.warning(
                "the kvbits cache %s does not support file locks (%s): %s without one; concurrent processes "
                "may fill the same entry twice", cache_root, unsupported, what,
            )  # fmt: skip
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _open_lock(path: Path, cache_root: Path) -> BinaryIO:
    """The lock file ``path`` opened for ``flock``: for appending, creating it (and ``locks/``) if missing; read-only
    where it exists and can not be written (a shared cache, the file another user's: ``flock`` takes an exclusive
    lock on a read-only descriptor too). ``PermissionError`` naming the cache and ``KVBITS_CACHE`` where the cache
    can not be written (filling an entry writes to it anyway), rather than the bare ``EACCES`` of ``locks/``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+b")
    except PermissionError as exc:
        if path.is_file():
            try:
                return open(path, "rb")
            except OSError:
                pass
        raise PermissionError(
            exc.errno,
            f"can not create the lock file {path}: the kvbits cache {cache_root} is not writable here "
            f"({exc.strerror}); filling it (fetching or converting a model) writes to it: set KVBITS_CACHE to a "
            "writable folder, or fill the cache where it is writable",
        ) from exc


def remove_leftovers(folder: Path, patterns: tuple[str, ...]) -> None:
    """Remove the files and folders in ``folder`` matching the glob ``patterns``: the temporary files of
    a fill that was killed before it could clean up. Call it only while holding the entry's lock."""
    for pattern in patterns:
        for path in sorted(folder.glob(pattern)):
            files = [path] if not path.is_dir() else [p for p in path.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files if not p.is_symlink())
            logger.warning("removing %s (%.0f MB), left by an interrupted fill", path, size / 1e6)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
