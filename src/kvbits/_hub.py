"""Whether the Hugging Face hub can be reached, asked once before a model or config is loaded by hub id.

Where there is no network, ``huggingface_hub`` retries a failed connection five times with backoff
(about 23 s) before transformers reports it. One name lookup of the hub's host says the same in
milliseconds; the load then reads the local hub cache only (``local_files_only=True``), so a model
already cached still loads offline, and one that is not fails at once with the reason. ``datasets.load_dataset``
takes no such argument: ``hub_offline()`` turns huggingface_hub's and datasets' offline switches on around it
(both read them at call time), with the same effect. Loads with ``local_files_only`` run inside it too
(``hub_offline_if``): huggingface_hub 1.x (under transformers 5.17) still connects during such a load, to fetch
its agent registry for the user-agent header (a 3 s timeout each process).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

__all__ = ["hub_failure", "hub_load_kwargs", "hub_offline", "hub_offline_if", "hub_unreachable"]

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 3.0
_DEFAULT_ENDPOINT = "https://huggingface.co"


def _endpoint() -> str:
    try:
        from huggingface_hub import constants
    except ImportError:
        return os.environ.get("HF_ENDPOINT", _DEFAULT_ENDPOINT)
    return str(getattr(constants, "ENDPOINT", _DEFAULT_ENDPOINT))


def _offline_flag() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        constants = None
    if constants is not None and getattr(constants, "HF_HUB_OFFLINE", False):
        return True
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _lookup(host: str, timeout_s: float) -> str | None:
    """Resolve ``host`` in a daemon thread (``getaddrinfo`` has no timeout of its own): the failure, or None."""
    result: list[str | None] = []

    def run() -> None:
        try:
            socket.getaddrinfo(host, 443, proto=socket.IPPROTO_TCP)
            result.append(None)
        except OSError as exc:  # socket.gaierror and friends
            result.append(f"{host} does not resolve ({exc})")

    worker = threading.Thread(target=run, name="kvbits-hub-lookup", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not result:
        return f"looking up {host} took over {timeout_s:g} s"
    return result[0]


def hub_unreachable(timeout_s: float = LOOKUP_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub can not be reached from here, or None when it may be.

    ``HF_HUB_OFFLINE`` set is a reason. With a proxy configured for https the proxy resolves names, so
    nothing is looked up (None). Otherwise the endpoint's host (``HF_ENDPOINT``, default huggingface.co)
    is looked up once, for at most ``timeout_s`` seconds.
    """
    if _offline_flag():
        return "HF_HUB_OFFLINE is set"
    endpoint = _endpoint()
    host = urlparse(endpoint).hostname
    if not host:
        return None  # an endpoint kvbits can not parse: leave the judgement to huggingface_hub
    proxies = urllib.request.getproxies()
    if proxies.get("https") or proxies.get("all"):
        return None
    return _lookup(host, timeout_s)


def hub_load_kwargs(what: str) -> tuple[dict[str, Any], str | None]:
    """Keyword arguments for a ``from_pretrained`` of ``what`` by hub id, and why the hub is unreachable.

    Returns ``({"local_files_only": True}, reason)`` where there is no network (the hub cache alone is
    read), else ``({}, None)``. The reason belongs in the error raised if the load then fails.
    """
    reason = hub_unreachable()
    if reason is None:
        return {}, None
    logger.info(
        "the Hugging Face hub is unreachable (%s): loading %s from the local hub cache only", reason, what
    )
    return {"local_files_only": True}, reason


def hub_failure(exc: BaseException, unreachable: str | None) -> str:
    """Why a load by hub id failed, for an error message: the unreachable hub when that was the case, else the
    first line of ``exc``."""
    if unreachable:
        return f"the hub is unreachable ({unreachable}) and it is not in the local hub cache"
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


OFFLINE_SWITCHES = ("huggingface_hub.constants", "datasets.config")  # modules whose HF_HUB_OFFLINE is read per call


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Within the block, huggingface_hub and datasets (where installed) run offline: the hub cache alone, no
    connection attempts and so no retries. Their ``HF_HUB_OFFLINE`` attributes are set and then restored (they
    read them at call time; the environment variable only at import)."""
    saved = []
    for name in OFFLINE_SWITCHES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "HF_HUB_OFFLINE"):
            saved.append((module, module.HF_HUB_OFFLINE))
            module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in saved:
            module.HF_HUB_OFFLINE = value


def hub_offline_if(unreachable: str | None) -> contextlib.AbstractContextManager[None]:
    """``hub_offline()`` where ``unreachable`` gives a reason (from ``hub_load_kwargs``), else a no-op: around a
    ``from_pretrained(..., local_files_only=True)`` it stops huggingface_hub 1.x's one connection attempt of such a
    load (its agent registry, fetched for the user-agent header even from the cache alone)."""
    return hub_offline() if unreachable else contextlib.nullcontext()
