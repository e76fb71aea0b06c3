"""Offline calibration for KVQuant-style schemes: run the model, collect K/V samples, fit, write.

``calibrate(model, data, scheme)`` runs the model over a few windows of calibration text, captures
every layer's pre-RoPE keys and values (and, with ``fisher=True``, their loss gradients) at a
bounded number of sampled positions, and fits static per-channel scales and NUQ codebooks
(``kvbits.calibrate.fit``).

The first ``scheme.sinks`` tokens of each window are excluded: the cache keeps them exact (KVQuant
§3.6), and attention-sink tokens have outsized K/V that would stretch every channel's range.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvbits._argtypes import check_seed, runs_on_device
from kvbits._spelling import spell
from kvbits.analyze.collect import rotary_table_key
from kvbits.analyze.verify import verify_taps
from kvbits.calibrate.artifact import (
    META_FILE,
    TENSORS_FILE,
    CalibrationArtifact,
    describe_model,
    spec_calibratable,
)
from kvbits.calibrate.cache_capture import CacheKVCapture, CacheSite, shared_attention_sites
from kvbits.calibrate.fisher import activation_gradients, window_loss
from kvbits.calibrate.fit import (
    Progress,
    artifact_from_samples,
    check_calibratable,
    check_fp8_scale,
    check_tie_rope_pairs,
)
from kvbits.calibrate.kmeans import ITERATIONS, MAX_POINTS, check_kmeans_args
from kvbits.calibrate.observers import KVCapture, find_kv_sites, sample_positions
from kvbits.plan.config import check_context_fits, layer_heads
from kvbits.quant.rope import apply_rope
from kvbits.quant.rotate import check_rotatable, rotate
from kvbits.schemes.presets import get_scheme
from kvbits.schemes.spec import ROTATIONS, KVScheme

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ model path


DEVICES = ("cpu", "cuda", "mps")
# window positions whose |K|/|V| calibration keeps apart (FP8 scales leave a scheme's sinks out); every
# later position is folded into one running maximum, so the record does not grow with the context
ABSMAX_POSITIONS = 256
"""Device types calibration runs on (``check_device``): the passes run there, the samples are
gathered to the CPU in float32 and fitted there (float32 / float64 sums)."""


def _resolve_model(
    model: Any, dtype: torch.dtype | None = None, device: str | None = None
) -> tuple[torch.nn.Module, Any, str | None, str | None]:
    """``(module, tokenizer or None, fingerprint or None, name or None)`` from a spec, LoadedModel or
    module; a spec is loaded with ``dtype``/``device``, a model given is cast to them (when given) as
    ``kvbits eval`` does (float32 buffers such as RoPE frequencies stay float32)."""
    if isinstance(model, str):
        from kvbits.evaluate.models import load_model

        model = load_model(model, dtype=dtype, device=device or "cpu")
    elif dtype is not None or device is not None:
        from kvbits.evaluate.inputs import cast_model

        inner = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
        if isinstance(inner, torch.nn.Module):
            cast_model(inner, dtype, device)
    if isinstance(model, torch.nn.Module):
        return model, None, None, getattr(getattr(model, "config", None), "_name_or_path", None) or None
    inner = getattr(model, "model", None)
    if isinstance(inner, torch.nn.Module):  # kvbits.evaluate.models.LoadedModel
        source = getattr(model, "source", None)
        return (
            inner,
            getattr(model, "tokenizer", None),
            getattr(model, "fingerprint", None),
            getattr(source, "name", None),
        )
    raise TypeError(
        f"model must be a model spec (str), a LoadedModel or a torch module, got {type(model).__name__}"
    )


def _tokenizer_fingerprint(tokenizer: Any) -> str | None:
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items())
    h = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
    return f"{type(tokenizer).__name__}:{len(tokenizer)}:{h}"


def _check_windows(context: int, windows: int) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"context must be an int >= 2, got {context!r}")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be a positive int, got {windows!r}")


def _check_max_tokens(max_tokens: Any) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1 (tokens sampled per layer), got {max_tokens!r}")


def check_calibrate_args(
    scheme: KVScheme | str,
    context: int,
    windows: int,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_tokens: int = 8192,
    kmeans_points: int = MAX_POINTS,
    kmeans_iterations: int = ITERATIONS,
    percentile: float = 99.9,
    overwrite: bool = False,
) -> KVScheme:
    """The scheme ``calibrate`` would fit, after the checks that need no model: something to calibrate
    that this module can fit, ``context >= 2`` and above the sinks of every layer scheme that calibrates a side
    (calibration leaves them out), ``windows >= 1``, ``max_tokens``, ``kmeans_points`` and
    ``kmeans_iterations`` ints >= 1, a ``percentile`` in [50, 100], an ``out_dir`` that is not an existing file
    and holds no calibration unless ``overwrite`` (:func:`check_calibration_out`), a known ``dtype`` and a
    ``device`` this torch can use (``ValueError`` otherwise)."""
    from kvbits.evaluate.request import _resolve_dtype, check_device

    scheme = get_scheme(scheme)
    check_calibratable(scheme)
    _check_windows(context, windows)
    _check_sinks_fit(scheme, context)
    _check_max_tokens(max_tokens)
    _check_groups_fit(scheme, context, windows, max_tokens)
    check_kmeans_args(kmeans_points, kmeans_iterations, ("kmeans_points", "kmeans_iterations"))
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 50 <= percentile <= 100:
        # checked before the passes (the fit checks it too, after every window has run)
        raise ValueError(f"percentile must be a number in [50, 100], got {percentile!r}")
    _resolve_dtype(dtype)
    check_device(device, DEVICES)
    if out_dir is not None:
        check_calibration_out(out_dir, overwrite=overwrite)
    return scheme


def _check_sinks_fit(scheme: KVScheme, context: int) -> None:
    """``ValueError`` when some layer's scheme calibrates a side and keeps at least ``context`` sink tokens exact:
    its statistics leave the sinks out, so a window holds no position to take them from. Checked before the
    passes: they ran over every window, then the fit failed ("keys[0] (layer 0) has no tokens")."""
    subs = scheme.layer_schemes() if scheme.is_mixed else [scheme]
    sinks = max((sub.sinks for sub in subs if sub.calibratable()), default=0)
    if sinks >= context:
        raise ValueError(
            f"scheme {scheme.name!r} keeps the first {sinks} tokens exact (sinks), which calibration leaves out, "
            f"and a window has context={context} tokens: no position to calibrate from; use a context above {sinks}"
        )


def _check_groups_fit(scheme: KVScheme, context: int, windows: int, max_tokens: int) -> None:
    """``ValueError`` when some layer's scheme fits a side with per-channel groups of ``group_size`` tokens
    (``kvquant-4-block``) and the calibration samples fewer tokens per layer than one group: at most
    ``min(max_tokens, windows * (context - sinks))``. Checked before the passes: they ran over every window, then
    the fit failed ("need at least 128 sampled tokens per layer")."""
    for sub in scheme.layer_schemes() if scheme.is_mixed else [scheme]:
        if not sub.calibratable():
            continue
        most = min(max_tokens, windows * (context - sub.sinks))
        for side, spec in (("key", sub.key), ("value", sub.value)):
            grouped = spec_calibratable(spec) and spec.kind != "fp8" and spec.granularity == "channel"
            if grouped and spec.group_size and most < spec.group_size:
                raise ValueError(
                    f"scheme {sub.name!r} fits its {side}s in per-channel groups of {spec.group_size} tokens, and "
                    f"calibration samples at most {most} per layer (min(max_tokens={max_tokens}, windows={windows} "
                    f"x (context={context} - {sub.sinks} sinks))): expected at least {spec.group_size}; use more "
                    "or longer windows"
                )


def check_calibration_out(out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """``out_dir`` as a ``Path`` if a calibration may be written there, else ``ValueError``: a path that is
    an existing file, or a folder already holding a calibration (``calibration.json`` or
    ``calibration.safetensors``) unless ``overwrite``, which replaces those two files (and only those).
    Checked before any pass runs: a second ``kvbits calibrate --out`` into the same folder silently replaced
    the first (hours of Fisher passes on a large model, and what earlier ``eval --calibration`` runs used)."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"output path {str(out_dir)!r} exists and is not a folder; expected a folder to write "
            f"{META_FILE} and {TENSORS_FILE} into"
        )
    held = [name for name in (META_FILE, TENSORS_FILE) if (out / name).exists()]
    if held and not overwrite:
        meta = out / META_FILE
        try:
            old = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {}
        except (OSError, ValueError):
            old = {}
        what = ""
        if isinstance(old, dict) and isinstance(old.get("scheme"), dict):
            model = old.get("model") if isinstance(old.get("model"), dict) else {}
            made = model.get("name") or model.get("model_type")
            what = f" (scheme {old['scheme'].get('name')}" + (f", model {made}" if made else "") + ")"
        raise ValueError(
            f"{out} already holds a calibration{what}: {', '.join(held)}; use another output folder, or "
            f"{spell('overwrite=True', '--overwrite')} to replace {META_FILE} and {TENSORS_FILE}"
        )
    return out


def _windows(
    data: Any, tokenizer: Any, context: int, windows: int, model: Any = None, bos: str = "never"
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(W, context)`` token windows spread evenly over the data, and the ``data`` JSON record; token ids
    must be integers within ``model``'s embedding table. ``bos`` (``"auto"``, ``"always"``, ``"never"``;
    ``kvbits.evaluate.data.resolve_bos``): a text's windows start with the tokenizer's BOS, then ``context - 1``
    text tokens from each start, as an evaluation's windows do; token ids are taken as they are (a BOS only with
    ``"always"``, for ``(N,)`` ids). The record's ``"bos"`` says what ran (``"always"`` / ``"never"``)."""
    from kvbits.evaluate.calib_text import content_sha256  # the hashes an evaluation compares with its data's
    from kvbits.evaluate.data import BOS_MODES, resolve_bos

    _check_windows(context, windows)
    if bos not in BOS_MODES:
        raise ValueError(f"bos must be one of {BOS_MODES}, got {bos!r}")
    record: dict[str, Any] = {}
    bos_id: int | None = None
    if isinstance(data, torch.Tensor):
        from kvbits.evaluate.data import check_token_ids

        if data.dim() not in (1, 2):
            raise TypeError(f"token ids must be an integer tensor (N,) or (W, T), got shape {tuple(data.shape)}")
        check_token_ids(data, model)
        ids = data.long()
        if bos == "always":
            if ids.dim() == 2:
                raise ValueError(
                    f"bos='always' (CLI: --bos always) with token windows (W, T) = {tuple(ids.shape)}: rows are "
                    "calibrated on as they are; give (N,) ids, or put the BOS in the rows yourself and use bos='never'"
                )
            bos_id = resolve_bos(tokenizer, "always")
        record.update(
            name="token-ids",
            documents=1 if ids.dim() == 1 else ids.shape[0],
            sha256=content_sha256(ids),
            tokenizer=None,
        )
        if ids.dim() == 2:
            if ids.shape[1] < context:
                raise ValueError(f"token windows have {ids.shape[1]} tokens, fewer than context={context}")
            if ids.shape[0] == 0:
                raise ValueError(f"token windows (W, T) = {tuple(ids.shape)}: no window; expected at least one row")
            width = int(ids.shape[1])
            if windows > ids.shape[0]:  # as for text: fewer windows than asked calibrates on fewer tokens
                logger.warning(
                    "asked for %d windows of %d tokens; the token windows (W, T) = %s hold %d",
                    windows, context, tuple(ids.shape), ids.shape[0],
                )  # fmt: skip
            ids = ids[:, :context]
            pick = torch.linspace(0, ids.shape[0] - 1, min(windows, ids.shape[0])).round().long().unique()
            out = ids[pick]
            # rows: which rows were calibrated on, so an evaluation of the same ids can say what it shares with them;
            # row_width: their T, so it can in any shape of the same bytes (row r is tokens [r * T, (r + 1) * T))
            record.update(windows=out.shape[0], tokens=out.numel(), context=context, starts=None, rows=pick.tolist(),
                          row_width=width, bos="never")  # fmt: skip
            return out, record
    else:
        from kvbits.evaluate.data import check_tokenized, load_text, tokenize

        source = data if hasattr(data, "text") and hasattr(data, "sha256") else load_text(str(data))
        if tokenizer is None:
            raise ValueError(
                "text data needs the model's tokenizer: pass a model spec or a LoadedModel, or token ids"
            )
        bos_id = resolve_bos(tokenizer, bos)
        ids = tokenize(source, tokenizer)
        check_tokenized(ids, tokenizer, model, f"the text {source.name!r}")
        record.update(
            name=source.name,
            documents=1,
            sha256=source.sha256,
            path=source.path,
            tokenizer=_tokenizer_fingerprint(tokenizer),
            # the token ids' hash too: an evaluation given these ids (N,) instead of the file is the same text
            ids_sha256=content_sha256(ids),
        )
    if bos_id is not None and context < 2:
        raise ValueError(f"context must be >= 2 with a BOS (the BOS and at least one text token), got {context}")
    step = context - (bos_id is not None)  # text tokens per window
    fit = ids.numel() // step
    if fit == 0:
        raise ValueError(f"calibration data has {ids.numel()} tokens, fewer than one window of {context}")
    if windows > fit:
        logger.warning("asked for %d windows of %d tokens; the data holds %d", windows, context, fit)
    # spread windows evenly over the text (more diverse than the first W windows, and apart from
    # the opening windows an evaluation usually reads)
    slots = torch.linspace(0, fit - 1, min(windows, fit)).round().long().unique()
    starts = (slots * step).tolist()
    out = torch.stack([ids[s : s + step] for s in starts])
    if bos_id is not None:
        out = torch.cat([out.new_full((out.shape[0], 1), int(bos_id)), out], dim=1)
    record.update(
        windows=len(starts), tokens=out.numel(), context=context, starts=starts, total_tokens=int(ids.numel()),
        bos="never" if bos_id is None else "always",
    )  # fmt: skip
    return out, record


@torch.no_grad()
def _check_finite(tensors: list[tuple[int, str, torch.Tensor]], w: int, windows: int, dtype: torch.dtype) -> None:
    """``NonFiniteKV`` naming the window, layer and tensor when one of ``tensors`` (layer, what, a window's
    ``(1, H, T, D)`` K/V or its sampled ``(H, N, D)`` gradients) holds NaN / inf: one host sync per window
    (calibration only). Without it a NaN past the 16 tokens ``verify_taps`` probes surfaced only in the fit,
    after every pass, as ``keys[i] (layer i) contains non-finite values``, without the window or a cause."""
    if not tensors or bool(torch.stack([torch.isfinite(t).all().to("cpu") for _, _, t in tensors]).all()):
        return
    from kvbits.analyze.stats import NonFiniteKV

    for i, what, t in tensors:
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            n_nan, first = int(torch.isnan(t).sum()), int(bad.nonzero()[0, -2])
            cause = (
                "a float16 overflow? try --dtype float32 or bfloat16" if dtype == torch.float16
                else "weights or embeddings holding NaN / inf?"
            )  # fmt: skip
            raise NonFiniteKV(
                f"calibration window {w + 1} of {windows}, layer {i}: {n_nan} NaN and {int(bad.sum()) - n_nan} "
                f"inf in its {what}, the first at {'position' if t.dim() == 4 else 'sampled token'} {first}; "
                f"expected finite activations (the model runs in {str(dtype).removeprefix('torch.')}: {cause})"
            )


def _take(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``(1, H, T, D)`` -> ``(H, len(pos), D)`` float32 on CPU."""
    return t[0][:, pos.to(t.device)].float().cpu()


@dataclass
class CalibrationSamples:
    """K/V activations (and loss gradients) sampled from a model on calibration text, per layer.

    ``keys``/``values``/``key_grads``/``value_grads``: one ``(H_kv, N, D)`` float32 tensor per layer
    (gradients None without Fisher); ``positions`` ``(N,)``: each sample's position in its window,
    so schemes with more sink tokens can drop theirs (``without_sinks``). ``model``/``data``: the
    JSON records an artifact carries; ``losses``: mean loss per window; ``seconds``: time taken;
    ``dtype``/``device``: the model's parameter dtype and device during the passes (``"bfloat16"``,
    ``"cuda:0"``), recorded in the artifact; the samples themselves are float32 on the CPU.
    ``absmax``: ``"key"`` (pre-RoPE), ``"key_post_rope"`` and ``"value"``, each ``(layers, H_kv, P)``:
    the largest ``|x|`` of each head at each of the first ``ABSMAX_POSITIONS`` window positions over all
    windows and channels, every position (not only the sampled ones), and in one last column the largest
    at every later position (``P = min(T, ABSMAX_POSITIONS + 1)``: a scheme's sinks can be left out, and
    the size does not grow with the window), for FP8 per-tensor and per-head scales; ``"key_post_rope"`` is absent for
    a model whose RoPE ``kvbits.quant.rope`` can not reproduce (and equals ``"key"`` without RoPE). Each
    name also with ``"@hadamard"`` (``"key@hadamard"``, ...): the same after the Hadamard rotation of the
    head dim (``kvbits.quant.rotate``), what a rotated FP8 side stores; absent when the head dim is not
    a power of two.
    ``keys_post_rope``: the sampled keys after RoPE (what a post-RoPE cache stores), like ``keys``;
    None where ``"key_post_rope"`` is absent.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_grads: list[torch.Tensor] | None
    value_grads: list[torch.Tensor] | None
    positions: torch.Tensor
    model: dict[str, Any]
    data: dict[str, Any]
    losses: list[float]
    seconds: float
    excluded_sinks: int = 0
    dtype: str | None = None
    device: str | None = None
    absmax: dict[str, torch.Tensor] | None = None
    keys_post_rope: list[torch.Tensor] | None = None

    def layer_absmax(self, name: str, sinks: int, *, per_head: bool = False) -> list[Any] | None:
        """Per layer, the largest ``|x|`` of ``absmax[name]`` at positions ``>= sinks``: a float, or with
        ``per_head`` a ``(H_kv,)`` tensor (None if absent)."""
        if self.absmax is None or name not in self.absmax:
            return None
        if sinks > ABSMAX_POSITIONS and self.absmax[name].shape[-1] > ABSMAX_POSITIONS:
            raise ValueError(
                f"the samples keep |x| per position for the first {ABSMAX_POSITIONS} tokens only; a scheme with "
                f"{sinks} sinks needs them apart: use at most {ABSMAX_POSITIONS} sinks for FP8 scales"
            )
        per_pos = self.absmax[name][..., sinks:]
        if per_pos.shape[-1] == 0:
            raise ValueError(f"no positions past the {sinks} sink tokens to take an FP8 scale from")
        per_layer_head = per_pos.amax(dim=-1)  # (layers, H_kv)
        if per_head:
            return list(per_layer_head)
        return [float(v) for v in per_layer_head.amax(dim=-1)]

    def without_sinks(self, sinks: int) -> CalibrationSamples:
        """The samples at positions ``>= sinks`` (the cache keeps the first ``sinks`` tokens exact)."""
        if sinks < self.excluded_sinks:
            raise ValueError(
                f"samples were collected without the first {self.excluded_sinks} tokens; can not serve a "
                f"scheme with {sinks} sinks (collect with sinks={sinks})"
            )
        keep = self.positions >= sinks

        def sel(ts: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if ts is None else [t[:, keep] for t in ts]

        return replace(
            self,
            keys=sel(self.keys),
            keys_post_rope=sel(self.keys_post_rope),
            values=sel(self.values),
            key_grads=sel(self.key_grads),
            value_grads=sel(self.value_grads),
            positions=self.positions[keep],
            excluded_sinks=sinks,
        )


def collect_samples(
    model: Any,
    data: Any,
    *,
    sinks: int = 0,
    context: int = 2048,
    windows: int = 4,
    fisher: bool = True,
    max_tokens: int = 8192,
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    scheme: KVScheme | None = None,
    bos: str = "auto",
) -> CalibrationSamples:
    """Run ``model`` over ``windows`` windows of ``data`` and sample every layer's pre-RoPE K/V.

    The first ``sinks`` tokens of each window are not sampled; ``max_tokens`` bounds the samples
    per layer over all windows. Arguments as in ``calibrate``; ``scheme``, when given, is refused before the
    first forward pass when it quantizes keys before RoPE on a model that rotates none
    (``kvbits.plan.planner.check_pre_rope_config``: Zamba2 without ``use_mem_rope``, Zamba, Falcon ``alibi=True``).
    """
    from kvbits.evaluate.data import check_bos
    from kvbits.evaluate.request import _resolve_dtype, check_device

    t0 = time.perf_counter()
    _check_max_tokens(max_tokens)
    seed = check_seed(seed)
    torch_dtype, _ = _resolve_dtype(dtype)
    check_device(device, DEVICES)  # before the model loads
    check_bos(bos, model)  # a bad bos was refused only once the weights had loaded (in _windows)
    module, tokenizer, fingerprint, name = _resolve_model(model, torch_dtype, device)
    if scheme is not None:
        from kvbits.plan.planner import check_pre_rope_config

        check_pre_rope_config(scheme, module.config)
    ids, data_record = _windows(data, tokenizer, context, windows, module, bos)
    check_context_fits(module.config, ids.shape[1])
    # an attention block several layers share (Zamba, Zamba2): K/V read at cache.update, else at k_proj / v_proj
    sites: list[Any] = shared_attention_sites(module) or find_kv_sites(module)
    at_cache = isinstance(sites[0], CacheSite)
    model_record = describe_model(module.config, fingerprint=fingerprint, name=name)
    # the attention modules' qualified names, layer by layer: engines name their scales after them
    # (vLLM loads `model.layers.{i}.self_attn.k_scale`; kvbits.export.vllm)
    model_record["attention_modules"] = [s.name for s in sites]
    # the layers the artifact holds: every layer, or a hybrid model's attention layers (find_kv_sites checked them)
    model_record["kv_layers"] = [s.layer_idx for s in sites]
    site_shape = {(s.num_kv_heads, s.head_dim) for s in sites}
    if len(site_shape) > 1 and all(  # Gemma 4: wider (or fewer) heads on its global layers, as its config says
        layer_heads(module.config, s.layer_idx)[1:] == (s.num_kv_heads, s.head_dim) for s in sites
    ):
        where = {shape: [s.layer_idx for s in sites if (s.num_kv_heads, s.head_dim) == shape] for shape in site_shape}
        listed = "; ".join(f"{h} KV heads of dim {d} on layers {idx}" for (h, d), idx in sorted(where.items()))
        raise ValueError(
            f"the model's layers cache K/V of different shapes ({listed}): a calibration artifact holds one "
            "(H_kv, D) for every layer, so kvbits calibrate supports models whose layers are alike only; "
            "use a scheme without calibrated parameters"
        )
    if site_shape != {(model_record["num_kv_heads"], model_record["head_dim"])} or not (
        0 < len(sites) <= model_record["num_layers"]
    ):
        raise ValueError(
            f"attention modules ({len(sites)} layers, (H_kv, D) in {site_shape}) disagree with the "
            f"config ({model_record['num_layers']} layers, {model_record['num_kv_heads']} KV heads, "
            f"head dim {model_record['head_dim']})"
        )
    from kvbits.evaluate.measures import floating_dtype

    param = next(module.parameters())  # its device; the dtype is the first floating parameter's (an int8 one may lead)
    run_dtype = floating_dtype(module) or param.dtype
    if fisher and run_dtype != torch.float32:
        logger.warning(
            "Fisher pass in %s: the loss gradients carry its rounding (float16 also flushes the smallest "
            "to zero); float32 is recommended for the Fisher weights",
            run_dtype,
        )
    W, T = ids.shape
    tables = _layer_rotary_tables(module, sites)
    names = ["key", "value", *(("key_post_rope",) if tables is not None else ())]
    if _rotatable(model_record["head_dim"]):
        names += [f"{n}@{r}" for r in ROTATIONS for n in list(names)]
    absmax = {name: torch.zeros(len(sites), model_record["num_kv_heads"], min(T, ABSMAX_POSITIONS + 1)) for name in names}
    # max_tokens split over the windows, the remainder one each to the first (a window may get none):
    # max(1, ceil(max_tokens / W)) each sampled up to W - 1 tokens more than max_tokens
    per_window = [max_tokens // W + (w < max_tokens % W) for w in range(W)]
    gen = torch.Generator().manual_seed(seed)
    samples: dict[str, list[list[torch.Tensor]]] = {
        k: [[] for _ in sites] for k in ("k", "kp", "v", "gk", "gv")
    }
    positions: list[torch.Tensor] = []
    # one cos/sin pair per distinct table, dtype, device and length (as kvbits.analyze), not per layer and window
    cos_sin: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    losses = []
    was_training = module.training
    module.eval()
    try:
        if at_cache:  # read as the cache receives them: nothing to verify
            capture: Any = CacheKVCapture(module, sites, tables, retain_grad=fisher)
        else:
            verify_taps(module, ids, tables)  # the hooks read what the cache holds (kvbits.analyze.verify)
            capture = KVCapture(module, sites, retain_grad=fisher)
        with capture as cap:
            for w in range(W):
                if fisher:
                    with activation_gradients(module):
                        losses.append(window_loss(module, ids[w : w + 1], backward=True))
                else:
                    losses.append(window_loss(module, ids[w : w + 1], backward=False))
                if not math.isfinite(losses[-1]) and all(map(math.isfinite, losses[:-1])):  # once per run
                    logger.warning(
                        "calibration window %d of %d: the loss is %s (the logits overflow in %s?); the K/V are "
                        "checked apart, but the recorded mean_loss will not be finite", w + 1, W, losses[-1],
                        str(run_dtype).removeprefix("torch."),
                    )  # fmt: skip
                pos = sample_positions(T, sinks, per_window[w], gen)
                positions.append(pos)
                finite: list[tuple[int, str, torch.Tensor]] = []  # what the fit and the ranges read, this window
                for i, site in enumerate(sites):  # i: the site's sample list; site.layer_idx: its model layer
                    k, v = cap.activations(site.layer_idx)
                    finite += [(site.layer_idx, "keys", k), (site.layer_idx, "values", v)]
                    post = _update_absmax(absmax, i, k, v, None if tables is None else tables[i], cos_sin)
                    samples["k"][i].append(_take(k, pos))
                    if post is not None:
                        samples["kp"][i].append(_take(post, pos))
                    samples["v"][i].append(_take(v, pos))
                    if fisher:
                        gk, gv = cap.gradients(site.layer_idx)
                        samples["gk"][i].append(_take(gk, pos))
                        samples["gv"][i].append(_take(gv, pos))
                        finite += [(site.layer_idx, "key gradients", samples["gk"][i][-1]), (site.layer_idx, "value gradients", samples["gv"][i][-1])]
                _check_finite(finite, w, W, run_dtype)
                cap.reset()
                if progress is not None:
                    progress("windows", w + 1, W)
    finally:
        module.train(was_training)

    def cat(key: str) -> list[torch.Tensor] | None:
        if (key in ("gk", "gv") and not fisher) or (key == "kp" and tables is None):
            return None
        return [torch.cat(chunks, dim=1) for chunks in samples[key]]

    return CalibrationSamples(
        keys=cat("k"),
        keys_post_rope=cat("kp"),
        values=cat("v"),
        key_grads=cat("gk"),
        value_grads=cat("gv"),
        positions=torch.cat(positions),
        model=model_record,
        data=data_record,
        losses=losses,
        seconds=time.perf_counter() - t0,
        excluded_sinks=sinks,
        dtype=str(run_dtype).removeprefix("torch."),
        device=str(param.device),
        absmax=absmax,
    )


def _layer_rotary_tables(module: torch.nn.Module, sites: list[Any]) -> list[Any] | None:
    """Per site, the RoPE tables its keys are rotated with (``kvbits.quant.rope``), or None when this
    model's RoPE can not be reproduced (then no post-RoPE key range: FP8 post-RoPE key scales refuse)."""
    from kvbits.quant.rope import RotaryTables

    try:
        tables = RotaryTables.from_model(module)
    except ValueError:  # no RoPE module in this family: the stored keys are the captured ones
        return [None for _ in sites]
    except NotImplementedError as exc:
        logger.warning("no post-RoPE key range (FP8 post-RoPE key scales can not be fitted): %s", exc)
        return None
    return [tables.tables_for_layer(s.layer_idx) for s in sites]


def _cos_sin(
    cache: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]], tables: Any, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tables.cos_sin`` at positions ``0 .. T-1`` of keys ``k`` ``(1, H_kv, T, D)``, in ``k``'s dtype and on its
    device, as ``tables.rotate`` computes them; kept in ``cache`` per distinct table (``rotary_table_key``), so the layers
    and windows sharing one are not recomputed (every layer of a Llama, every window of a run)."""
    tables._check_x(k)
    key = (*rotary_table_key(tables), k.dtype, k.device, k.shape[2])
    if key not in cache:
        cos, sin = tables.cos_sin(torch.arange(k.shape[2], device=k.device), k.dtype)
        cache[key] = (cos.to(k.device), sin.to(k.device))
    return cache[key]


@torch.no_grad()
def _update_absmax(
    absmax: dict[str, torch.Tensor],
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: Any,
    cos_sin: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor | None:
    """Fold one window's ``k``/``v`` ``(1, H_kv, T, D)`` into ``absmax[name][layer]`` ``(H_kv, P)``
    (``CalibrationSamples.absmax``); returns the keys after RoPE (``k`` itself without RoPE; None when
    post-RoPE keys are not tracked). ``cos_sin``: the RoPE tables computed so far (``_cos_sin``)."""
    def peak(x: torch.Tensor) -> torch.Tensor:
        per_pos = x[0].abs().amax(dim=2).float()  # (H_kv, T)
        if per_pos.shape[1] > ABSMAX_POSITIONS:
            tail = per_pos[:, ABSMAX_POSITIONS:].amax(dim=1, keepdim=True)
            per_pos = torch.cat([per_pos[:, :ABSMAX_POSITIONS], tail], dim=1)
        return per_pos.cpu()

    post = None
    if "key_post_rope" in absmax:
        post = k if tables is None else apply_rope(k, *_cos_sin(cos_sin, tables, k))
    for name, x in (("key", k), ("value", v), ("key_post_rope", post)):
        if x is None:
            continue
        absmax[name][layer] = torch.maximum(absmax[name][layer], peak(x))
        for r in ROTATIONS:  # what a rotated side stores: x @ R
            if f"{name}@{r}" in absmax:
                absmax[f"{name}@{r}"][layer] = torch.maximum(absmax[f"{name}@{r}"][layer], peak(rotate(x, r)))
    return post


def _rotatable(head_dim: int) -> bool:
    try:
        check_rotatable(head_dim, ROTATIONS[0])
    except ValueError:
        return False
    return True


def fit_artifact(
    samples: CalibrationSamples,
    scheme: KVScheme | str,
    *,
    percentile: float = 99.9,
    kmeans_points: int = MAX_POINTS,
    kmeans_iterations: int = ITERATIONS,
    seed: int = 0,
    max_tokens: int | None = None,
    progress: Progress | None = None,
    fp8_scale: str = "centred",
    tie_rope_pairs: bool = False,
) -> CalibrationArtifact:
    """Fit ``scheme``'s calibration from collected ``samples`` (the sinks it keeps exact are dropped).

    A static FP8 key spec that stores keys after RoPE is fitted on the post-RoPE samples and range; a
    dynamic FP8 key spec fits nothing, so it needs no post-RoPE keys. A mixed scheme fits each layer by
    its own scheme (``KVScheme.for_layer``), without that scheme's sinks."""
    t0 = time.perf_counter()
    scheme = get_scheme(scheme)
    check_calibratable(scheme)
    # samples.keys[j]: model layer kv_layers[j] (a hybrid model's attention layers; every layer otherwise)
    kv_layers = samples.model.get("kv_layers") or list(range(len(samples.keys)))
    if len(kv_layers) != len(samples.keys):
        raise ValueError(
            f"the samples hold {len(samples.keys)} layers, their model record names {len(kv_layers)} (kv_layers "
            f"{kv_layers}): expected one sample list per layer that stores K/V"
        )
    layer_schemes = [scheme.for_layer(i) for i in kv_layers]
    sinks = [ls.sinks for ls in layer_schemes]
    by_sinks = {k: samples.without_sinks(k) for k in sorted(set(sinks))}
    per_layer = [by_sinks[k] for k in sinks]  # layer i's samples: without its scheme's sinks
    s = per_layer[0]
    data_record = dict(s.data)
    sampled = [int(p.keys[i].shape[1]) for i, p in enumerate(per_layer)]
    data_record["sampled_tokens_per_layer"] = sampled[0] if len(set(sampled)) == 1 else sampled
    data_record["excluded_sink_tokens"] = sinks[0] if len(set(sinks)) == 1 else sinks
    meta: dict[str, Any] = {
        "model": s.model,
        "data": data_record,
        "fisher": s.key_grads is not None,
        "mean_loss": sum(s.losses) / len(s.losses),
    }
    if max_tokens is not None:
        meta["max_tokens_per_layer"] = max_tokens
    if any(spec.kind == "fp8" for ls in layer_schemes for spec in (ls.key, ls.value)):
        meta["fp8_scale"] = fp8_scale
    keys = []
    for i, (ls, p) in enumerate(zip(layer_schemes, per_layer)):
        post_rope_fp8 = ls.key.kind == "fp8" and ls.key.static
        if (post_rope_fp8 or ls.key.has_channel_transform) and not ls.key.pre_rope:
            if p.keys_post_rope is None:
                what = (
                    "an FP8 per-tensor key scale" if post_rope_fp8 else "the channel means / smoothing factors"
                )
                raise ValueError(
                    f"{what} of post-RoPE keys needs the keys after RoPE, and this model's RoPE could not be "
                    "reproduced (kvbits.quant.rope; see the warning above); use pre_rope=True keys"
                    + (" or a dynamic FP8 spec (fp8-e4m3-token)" if post_rope_fp8 else "")
                )
            keys.append(p.keys_post_rope[i])
        else:
            keys.append(p.keys[i])
    for key in ("dtype", "device"):  # what the passes ran in; the fit is float32/float64 on the CPU
        if getattr(s, key) is not None:
            meta[key] = getattr(s, key)

    def layer_list(name: str) -> list[torch.Tensor] | None:
        got = [getattr(p, name) for p in per_layer]
        return None if got[0] is None else [g[i] for i, g in enumerate(got)]

    art = artifact_from_samples(
        scheme,
        keys,
        layer_list("values"),
        key_grads=layer_list("key_grads"),
        value_grads=layer_list("value_grads"),
        percentile=percentile,
        kmeans_points=kmeans_points,
        kmeans_iterations=kmeans_iterations,
        seed=seed,
        meta=meta,
        progress=progress,
        key_absmax=_fp8_absmax(samples, layer_schemes, "key"),
        value_absmax=_fp8_absmax(samples, layer_schemes, "value"),
        fp8_scale=fp8_scale,
        tie_rope_pairs=tie_rope_pairs,
        layers=kv_layers,
    )
    art.meta["timing_s"] = {"passes": round(s.seconds, 2), "total": round(s.seconds + time.perf_counter() - t0, 2)}
    return art


def _fp8_absmax(samples: CalibrationSamples, layer_schemes: list[KVScheme], side: str) -> list[Any] | None:
    """Per layer, the largest ``|K|`` / ``|V|`` a static FP8 spec of layer ``i``'s scheme stores past its
    sinks (keys pre- or post-RoPE as the spec says; per head for per-head specs), None for other layers;
    None when no layer has a static FP8 ``side``."""
    out: list[Any] = []
    ranges: dict[tuple[str, int, bool], list[Any] | None] = {}  # layer_absmax per (name, sinks, per head)
    for i, ls in enumerate(layer_schemes):
        spec = getattr(ls, side)
        if not (spec.kind == "fp8" and spec.static):
            out.append(None)
            continue
        name = "value" if side == "value" else "key" if spec.pre_rope else "key_post_rope"
        if spec.rotate is not None:
            name = f"{name}@{spec.rotate}"
        how = (name, ls.sinks, spec.granularity == "head")
        if how not in ranges:
            ranges[how] = samples.layer_absmax(name, ls.sinks, per_head=how[2])
        if ranges[how] is None and spec.rotate is not None:
            raise ValueError(
                f"a {spec.rotate}-rotated FP8 {side} scale needs the largest |x @ R|, which the samples do not "
                f"carry (a {spec.rotate} rotation needs a head dim that is a power of two, got "
                f"{samples.model.get('head_dim')})"
            )
        if ranges[how] is None and side == "key":
            raise ValueError(
                "an FP8 per-tensor key scale needs the largest post-RoPE key, and this model's RoPE could not be "
                "reproduced (kvbits.quant.rope; see the warning above) or the samples carry no key range; "
                "use pre_rope=True keys or a dynamic FP8 spec (fp8-e4m3-token)"
            )
        out.append(None if ranges[how] is None else ranges[how][i])  # values: None -> the samples' own max
    return None if all(a is None for a in out) else out


def fisher_weights(scheme: KVScheme) -> bool:
    """Whether Fisher gradients weight anything ``scheme`` calibrates: the NUQ codebooks' k-means only, so
    ``calibrate(fisher=True)`` runs the backward pass for those schemes alone (FP8, static int: forward)."""
    subs = scheme.layer_schemes() if scheme.is_mixed else [scheme]
    return any(spec.kind == "nuq" for sub in subs for spec in (sub.key, sub.value))


@runs_on_device
def calibrate(
    model: Any,
    data: Any,
    scheme: KVScheme | str,
    *,
    context: int = 2048,
    windows: int = 4,
    percentile: float = 99.9,
    fisher: bool = True,
    out_dir: str | None = None,
    max_tokens: int = 8192,
    kmeans_points: int = MAX_POINTS,
    kmeans_iterations: int = ITERATIONS,
    seed: int = 0,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    progress: Progress | None = None,
    fp8_scale: str = "centred",
    tie_rope_pairs: bool = False,
    overwrite: bool = False,
    bos: str = "auto",
) -> CalibrationArtifact:
    """Calibrate ``scheme`` for ``model`` on ``data``; write it to ``out_dir`` when given.

    Args:
        model: a model spec for ``kvbits.evaluate.models.load_model``, a ``LoadedModel``, or a
            transformers causal LM (then ``data`` must be token ids and the fingerprint is the
            config's shape hash).
        data: a text spec for ``kvbits.evaluate.data.load_text`` (``pride-and-prejudice``, a path),
            a ``TextSource``, or token ids ``(N,)`` / ``(W, T)``.
        scheme: a scheme with static int/NUQ scales or NUQ codebooks (e.g. ``kvquant-4``), or static
            FP8 scales (``fp8-e4m3``: ``absmax / 448`` per layer and side; ``fp8-e4m3-head``: per KV head).
        context: tokens per calibration window (recorded as ``max_calibrated_length``).
        windows: number of windows, spread evenly over the data.
        percentile: per-channel range ``[100 - p, p]`` for static scales.
        fisher: weight k-means by squared gradients (forward + backward per window, float32
            recommended); False: unweighted, forward only. Schemes without a NUQ codebook (static
            int scales, FP8 scales) have nothing to weight: their passes are forward only anyway.
        out_dir: folder for ``calibration.safetensors`` + ``calibration.json``; one that already holds a
            calibration is refused (``ValueError``, before any pass runs) unless ``overwrite``.
        max_tokens: tokens sampled per layer over all windows (memory bound:
            ``layers x max_tokens x H_kv x D x 4 bytes x (2, or 4 with Fisher)``).
        kmeans_points, kmeans_iterations, seed: k-means subsample size, Lloyd iterations, seed (of the token
            sampling too; an int in [0, 2**32 - 1], checked before the model loads).
        dtype: model dtype (``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype) to load
            or cast the model to; None: as loaded (float32) or as given. Only the passes run in it:
            the samples are gathered in float32 and fitted in float32/float64, and the artifact
            records the dtype and device the passes ran in.
        device: ``"cpu"``, ``"cuda"`` (``"cuda:N"``) or ``"mps"``; refused (``ValueError``) before
            the model loads when this torch can not use it. None: as loaded (CPU) or as given.
        progress: ``callback(stage, done, total)`` with stages ``"windows"`` and ``"fit"``.
        fp8_scale: static FP8 sides: ``"centred"`` (default: the amax scale raised by up to 2x to the
            least squared error on the sampled tokens, for keys without each channel's mean error over
            the tokens, which shifts all of a query's logits alike; ``kvbits.calibrate.fit``), ``"mse"``
            (plain squared error for keys too) or ``"amax"`` (the largest ``|x|`` over every calibration
            token / ``fp8_max``, llm-compressor's minmax observer). On Qwen2.5-Coder-0.5B ``mse`` had
            40 % less KL than ``amax`` per tensor but none per head; ``centred`` about a third less with
            either (BENCHMARKS.md §8, §10). None saturates on the calibration tokens.
        tie_rope_pairs: pre-RoPE centred / smoothed keys (``int*-token-smooth-prerope``) get one smoothing
            factor per RoPE pair (channels ``d`` and ``d + D/2``, the larger spread: QServe's rule). Such a
            factor commutes with RoPE, so fused decode moves it into the query and the kernel decodes only
            ``code + mean / factor`` (fewer registers per thread). It costs quality: KL 0.0345 → 0.0393 on
            Qwen2.5-Coder-0.5B at 4K, 0.035 → 0.046 on SmolLM2-135M at 8K (BENCHMARKS.md §21). Default: one
            factor per channel, decoded in the kernel.
        overwrite: replace the calibration ``out_dir`` holds.
        bos: ``"auto"`` (each window of a text starts with the tokenizer's BOS where ``tokenizer(text)`` adds one,
            then ``context - 1`` text tokens, as ``evaluate``'s windows), ``"always"`` or ``"never"``; the
            artifact's ``data["bos"]`` says what ran (an artifact without it: ``"never"``).
    """
    scheme = check_calibrate_args(
        scheme, context, windows, out_dir, dtype=dtype, device=device, max_tokens=max_tokens,
        kmeans_points=kmeans_points, kmeans_iterations=kmeans_iterations, percentile=percentile,
        overwrite=overwrite,
    )  # fmt: skip
    check_fp8_scale(fp8_scale)
    check_tie_rope_pairs(scheme, tie_rope_pairs)
    subs = scheme.layer_schemes() if scheme.is_mixed else [scheme]
    if fisher and not fisher_weights(scheme):
        # the gradients weight the NUQ codebooks' k-means and nothing else: no backward pass for naught
        logger.info("scheme %s has no NUQ codebook to weight: Fisher pass skipped (forward only)", scheme.name)
        fisher = False
    samples = collect_samples(
        model, data, sinks=min(sub.sinks for sub in subs), context=context, windows=windows, fisher=fisher,
        max_tokens=max_tokens, seed=seed, dtype=dtype, device=device, progress=progress, scheme=scheme, bos=bos,
    )
    art = fit_artifact(
        samples, scheme, percentile=percentile, kmeans_points=kmeans_points,
        kmeans_iterations=kmeans_iterations, seed=seed, max_tokens=max_tokens, progress=progress,
        fp8_scale=fp8_scale, tie_rope_pairs=tie_rope_pairs,
    )
    if out_dir is not None:
        art.save(out_dir)
    logger.info(
        "calibrated %s for %s on %d x %d tokens in %.1f s",
        scheme.name,
        samples.model["fingerprint"],
        samples.data["windows"],
        samples.data["context"],
        art.meta["timing_s"]["total"],
    )
    return art
