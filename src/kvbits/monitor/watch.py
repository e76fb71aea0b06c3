"""``watch``: decode real text through a scheme's cache with a ``CacheMonitor``: the signals a server would
see, and which layers a policy would hold, before deploying it (``kvbits monitor`` runs it)."""

from __future__ import annotations

from typing import Any

import torch

from kvbits._argtypes import runs_on_device
from kvbits.monitor.monitor import CacheMonitor
from kvbits.monitor.policy import FallbackPolicy

__all__ = ["watch"]


@runs_on_device
def watch(
    model: Any,
    data: Any,
    context: int,
    scheme: Any,
    policy: FallbackPolicy | None = None,
    *,
    calibration: Any = None,
    data_path: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    labels: dict[str, object] | None = None,
    progress: Any = None,
    bos: str = "auto",
) -> CacheMonitor:
    """Decode the first ``context`` tokens of ``data`` one by one through ``scheme``'s ``QuantizedKVCache``
    (the stream runner's decode semantics) with a ``CacheMonitor(policy)`` attached; returns the monitor
    (``snapshot()``, ``prometheus()``, ``events``), detached.

    ``model``, ``data``, ``calibration``, ``dtype``, ``device`` as ``kvbits.evaluate.evaluate`` takes them
    (registry names, paths, hub ids, loaded models; token ids ``(N,)`` for ``data``). A calibration (artifact or
    folder) is checked as ``evaluate`` checks it: against ``scheme`` before the model loads, then against the model
    loaded, its shape always and its weights (fingerprint) where both sides pin them. The cache logs no calibration
    warnings of its own: the monitor's signals count the clipped values and say when the calibrated length is passed.
    ``bos`` (``"auto"``, ``"always"``, ``"never"``): whether the decoded tokens start with the tokenizer's BOS, as
    ``evaluate``'s windows do (the BOS and ``context - 1`` text tokens; ``kvbits.evaluate.data.resolve_bos``); the
    monitor's snapshot records it (``"run": {"bos", "bos_token" and "bos_token_id" with a BOS}``), its Prometheus
    text as ``kvbits_run_info{bos="always"} 1`` (or ``"never"``).
    """
    from kvbits.calibrate import checked_artifact
    from kvbits.evaluate.data import bos_record, check_bos
    from kvbits.evaluate.inputs import _check_calibration_models, _load_model, _load_windows
    from kvbits.evaluate.request import _resolve_dtype, check_device
    from kvbits.evaluate.stream import PeerScheme, check_schemes_fit, resolve_scheme, stream_hidden
    from kvbits.plan.config import check_context_fits

    if not isinstance(context, int) or isinstance(context, bool) or context < 2:
        raise ValueError(f"context must be an int >= 2, got {context!r}")
    check_bos(bos, model)
    resolved = resolve_scheme(scheme)
    if isinstance(resolved, PeerScheme) or resolved.is_identity:
        raise ValueError(
            f"kvbits monitor watches a quantizing kvbits scheme, got {getattr(resolved, 'name', scheme)!r}"
        )
    check_device(device)
    torch_dtype, _ = _resolve_dtype(dtype)
    if calibration is not None:
        calibration = checked_artifact(calibration, resolved)
    # a scheme the config rules out (groups not dividing head_dim) is refused before the weights load, as eval,
    # speed and needle refuse it; a model passed loaded is checked on its config here too
    lm, tokenizer, _, model_fp = _load_model(
        model, torch_dtype, device, lambda config: check_schemes_fit([resolved], config)
    )
    check_schemes_fit([resolved], lm.config)
    if calibration is not None:  # the weights too: a same-shaped model B must not serve A's calibration
        _check_calibration_models({resolved.name: calibration}, model, lm.config, model_fp)
    # as every other command that runs a model: refused past a learned position table (torch's IndexError inside the
    # model otherwise), logged as extrapolation past a RoPE model's max_position_embeddings
    check_context_fits(lm.config, context)
    windows, _, _, bos_id = _load_windows(data, tokenizer, context, 1, data_path, lm, bos)
    if windows.shape[0] == 0:
        raise ValueError(f"the text has fewer than {context} tokens")
    ids = windows[:1].to(next(lm.parameters()).device)
    run = bos_record(tokenizer, bos_id)  # the snapshot's "run" and kvbits_run_info{bos=...}
    monitors: list[CacheMonitor] = []
    stream_hidden(
        lm, ids, resolved, calibration=calibration, progress=progress, calibration_warnings=False,
        on_cache=lambda cache: monitors.append(CacheMonitor(cache, policy, labels=labels, run=run)),
    )  # fmt: skip
    (mon,) = monitors
    mon.detach()
    return mon
