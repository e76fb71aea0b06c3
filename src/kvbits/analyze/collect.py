"""Collect K/V statistics of a stock transformers model, layer by layer, with forward hooks.

Where the tensors come from, per attention module (any module with ``k_proj`` and ``v_proj``; which
modules, and their ``(H_kv, D)``: :mod:`kvbits.analyze.sites`, shared with ``kvbits calibrate``):

- **pre-RoPE keys**: the output of ``k_proj``, or of the key norm applied before RoPE when the
  family has one (``k_norm``: Gemma3, Qwen3, OLMo2; ``k_layernorm``: Phi, StableLM), reshaped to
  ``(B, H_kv, T, D)`` (the hooks and the norm's layout: :mod:`kvbits.analyze.taps`).
- **post-RoPE keys**: the pre-RoPE keys rotated with ``kvbits.quant.rope.RotaryTables`` (the
  model's own rotary module, per layer type), at positions ``0 .. T-1`` of each window.
- **values**: the output of ``v_proj`` (or ``v_norm`` when present).

Statistics are updated inside the hooks and the tensors dropped, so memory holds one layer's K/V of
one window at a time plus each layer's fixed-size sample (``stats.BlockReservoir``) and one cos/sin pair ``(T, D_rot)``
per distinct RoPE (shared by the layers that rotate alike). Hooks are
registered in a context manager and always removed.

An attention block several layers share (Zamba's, Zamba2's hybrid layers: :func:`kvbits._model.shared_attention`)
can not be hooked per layer, and Zamba2 adds LoRA adapters to ``k_proj``'s output: there the K/V are read where the
cache receives them, per hybrid layer (:class:`kvbits.calibrate.cache_capture.CacheKVCapture`, as ``kvbits calibrate``
reads them), keys un-rotated with the cache's own tables (kept as cached where the model does not rotate them), after
each window's forward (memory: every hybrid layer's K/V of one window, as the model's own cache holds them).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbits._argtypes import check_seed, runs_on_device
from kvbits._files import atomic_path, write_text_atomic
from kvbits._json import dumps
from kvbits.analyze.outliers import (
    DEFAULT_LAYER_FRACTION,
    DEFAULT_THRESHOLD,
    check_layer_fraction,
    check_threshold,
    recommend,
    smeared_pairs,
)
from kvbits.analyze.sites import KVSite, attention_sites
from kvbits.analyze.stats import (
    BlockReservoir,
    ChannelStats,
    KVBeyondFloat16,
    NonFiniteKV,
    TensorReport,
    blocks_in,
)
from kvbits.analyze.taps import KVTap, to_bhtd
from kvbits.analyze.verify import verify_taps
from kvbits.plan.config import check_context_fits

logger = logging.getLogger(__name__)

ANALYSIS_VERSION = 1
# tokens of the smallest per-channel group (and window): an asymmetric group of 2 quantizes nothing (TensorSpec)
MIN_GROUP = 3

Callback = Callable[[int, str, torch.Tensor], None]


def analysis_sites(model: torch.nn.Module) -> list[Any]:
    """The layers :func:`analyze` reads, ordered by layer: one ``CacheSite`` per hybrid layer of a model with a
    shared attention block (Zamba, Zamba2: K/V read at ``cache.update``,
    :func:`kvbits.calibrate.cache_capture.shared_attention_sites`), else :func:`~kvbits.analyze.sites.attention_sites`
    (``KVSite``: hooks on the attention modules). Both have ``layer_idx``, ``num_kv_heads``, ``head_dim``, ``name``.

    Raises:
        ValueError: not a decoder-only causal LM; see the two site functions.
    """
    from kvbits._model import check_causal_lm

    # not at import time: kvbits.calibrate imports this module
    from kvbits.calibrate.cache_capture import shared_attention_sites

    check_causal_lm(model)
    return shared_attention_sites(model) or attention_sites(model)


def last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """Forward kwargs asking for the last position's logits only, where the model takes ``logits_to_keep``: a full
    ``(T, vocab)`` logits tensor would dwarf the K/V of a window, and the statistics need no logits."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _site_tap(site: KVSite, kind: str, callback: Callback) -> KVTap:
    """A tap on ``site``'s keys or values calling ``callback(layer, kind, x)`` with ``x`` detached ``(B, H_kv, T, D)``."""

    def on_output(x: torch.Tensor, layout: str) -> None:
        callback(site.layer_idx, kind, to_bhtd(x.detach(), layout, site.num_kv_heads, site.head_dim))

    module, proj = (site.key_module, site.key_proj) if kind == "key" else (site.value_module, site.value_proj)
    return KVTap(module, proj, kind, site.num_kv_heads, site.head_dim, f"layer {site.layer_idx}", on_output)


@contextlib.contextmanager
def kv_hooks(model: torch.nn.Module, callback: Callback) -> Iterator[list[KVSite]]:
    """Call ``callback(layer, kind, x)`` with ``kind`` in ``{"key", "value"}`` and ``x`` ``(B, H_kv, T, D)``
    (pre-RoPE keys, values) during forwards inside the block. Every hook is removed on exit."""
    sites = attention_sites(model)
    handles: list[Any] = []
    try:
        for site in sites:
            for kind in ("key", "value"):
                handles += _site_tap(site, kind, callback).register()
        yield sites
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------ analysis


@dataclass
class LayerAnalysis:
    """Statistics of one layer. ``key_post_rope`` is None for a model without RoPE, and for one whose RoPE kvbits
    can not reproduce (interleaved pairs: ``keys_rotated_unseen``, the cache holds keys rotated after these)."""

    layer: int
    rot_dim: int
    key_pre_rope: TensorReport
    key_post_rope: TensorReport | None
    value: TensorReport
    samples: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    keys_rotated_unseen: bool = False
    pre_rope_refused: str | None = None  # why pre-RoPE keys do not run on this model (``pre_rope_problem``)

    def to_dict(self) -> dict[str, Any]:
        post = self.key_post_rope
        return {
            "layer": self.layer,
            "rot_dim": self.rot_dim,
            # in the row, so that recommend() re-run on analysis.json's rows keeps its "before RoPE" caveat
            # (files written before it have no such key: read as False)
            "keys_rotated_unseen": self.keys_rotated_unseen,
            "pre_rope_refused": self.pre_rope_refused,  # so too recommend()'s "no pre-RoPE scheme" on a re-run
            "key_outlier_channels_pre_rope": self.key_pre_rope.outliers,
            "key_outlier_channels_post_rope": post.outliers if post else None,  # None: not computed
            "value_outlier_channels": self.value.outliers,
            "key_outliers_smeared_by_rope": smeared_pairs(
                self.key_pre_rope.outliers, post.outliers, self.rot_dim
            )
            if post
            else None,
            "key_pre_rope": self.key_pre_rope.summary(),
            "key_post_rope": post.summary() if post else None,
            "value": self.value.summary(),
        }


@dataclass
class Analysis:
    """The answer to "are there outlier channels?" for one model on one text."""

    model: str
    data: str
    context: int
    windows: int
    threshold: float
    layer_fraction: float
    channel_group: int
    sample_tokens: int  # the cap asked for
    layers: list[LayerAnalysis]
    fingerprint: str | None = None
    recommendation: dict[str, Any] = field(default_factory=dict)
    sampled_tokens: int | None = None  # tokens per layer actually sampled (whole blocks); None: not recorded
    bos: str | None = None  # "always": each window starts with the BOS, "never": raw slices; None: not recorded

    def to_dict(self) -> dict[str, Any]:
        """The analysis as a dict of plain values; a non-finite figure stays the float it is (an exact int4
        reconstruction's SQNR ``inf``, ``bits_lost_per_token`` ``inf`` where ordinary channels use no range, NaN for
        a head of zeros): :func:`kvbits._json.dumps` writes them as ``"+Inf"`` / ``"NaN"``, as every kvbits JSON."""
        rows = [layer.to_dict() for layer in self.layers]
        return {
            "version": ANALYSIS_VERSION,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "data": self.data,
            "context": self.context,
            "windows": self.windows,
            "bos": self.bos,
            "tokens": self.context * self.windows,
            "threshold": self.threshold,
            "layer_fraction": self.layer_fraction,
            "sample_tokens": self.sample_tokens,
            "sampled_tokens": self.sampled_tokens,
            "channel_group": self.channel_group,
            "layers": rows,
            "recommendation": self.recommendation,
        }

    def channel_tensors(self) -> dict[str, torch.Tensor]:
        """``layer{i}.{key_pre_rope|key_post_rope|value}.{absmax|mean|std|p1|p99|kurtosis}`` → ``(H_kv, D)``."""
        out = {}
        for la in self.layers:
            for name in ("key_pre_rope", "key_post_rope", "value"):
                rep = getattr(la, name)
                if rep is not None:
                    for k, t in rep.tensors().items():
                        out[f"layer{la.layer}.{name}.{k}"] = t
        return out

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Write ``analysis.json`` and ``channel_stats.safetensors`` into ``out_dir``."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "analysis.json", "channels": out / "channel_stats.safetensors"}
        write_text_atomic(paths["json"], dumps(self.to_dict(), indent=2) + "\n")
        meta = {
            "version": str(ANALYSIS_VERSION),
            "model": self.model,
            "data": self.data,
            "fingerprint": self.fingerprint or "",
            "context": str(self.context),
        }
        with atomic_path(paths["channels"]) as tmp:
            save_file(self.channel_tensors(), str(tmp), metadata=meta)
        return paths


def _rotary_tables(model: torch.nn.Module) -> tuple[Any, bool]:
    """``(tables, reproducible)``: the model's RoPE tables, or ``(None, True)`` for a model without RoPE (its cached
    keys are the hooked ones) and ``(None, False)`` for RoPE kvbits can not reproduce (interleaved pairs: the cache
    holds keys rotated in a way the pre-RoPE figures do not show)."""
    from kvbits.quant.rope import RotaryTables

    try:
        return RotaryTables.from_model(model), True
    except (ValueError, NotImplementedError) as exc:  # no RoPE / a RoPE layout kvbits can not reproduce
        logger.warning("no post-RoPE statistics: %s", exc)
        return None, not isinstance(exc, NotImplementedError)


def _pre_rope_refused(model: torch.nn.Module) -> str | None:
    """Why the planner and the caches refuse pre-RoPE keys for ``model`` (``kvbits.plan.positions.pre_rope_problem``
    of its text config: multimodal RoPE, whose text tokens ``RotaryTables`` still rotates), logged once; else None."""
    from kvbits.plan.config import text_config
    from kvbits.plan.positions import pre_rope_problem

    config = getattr(model, "config", None)
    text = text_config(config) if config is not None else None
    problem = pre_rope_problem(text) if text is not None else None
    if problem is not None:
        logger.warning(
            "post-RoPE statistics of text tokens only; no pre-RoPE scheme is recommended: model_type %r %s",
            getattr(text, "model_type", None), problem,
        )
        problem = f"(model_type {getattr(text, 'model_type', None)!r}) {problem}"
    return problem


def rotary_table_key(tables: Any) -> tuple[Any, ...]:
    """What ``tables.cos_sin`` depends on besides the positions: layers whose keys are equal get the same cos/sin
    (a Llama's every layer; Gemma 3's local layers share one pair and its global layers, with their own base, another).
    The rotary module is shared by every ``tables_for_layer`` of one model; ``head_dim`` does not enter the tables."""
    return id(tables.rotary), tables.layer_type, tables.rot_dim, tables.half_tables


@runs_on_device
def analyze(
    model: torch.nn.Module,
    windows: torch.Tensor,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    layer_fraction: float = DEFAULT_LAYER_FRACTION,
    sample_tokens: int = 4096,
    channel_group: int = 128,
    seed: int = 0,
    model_name: str = "model",
    data_name: str = "text",
    fingerprint: str | None = None,
    keep_samples: bool = True,
    progress: Callable[[int, int], None] | None = None,
    bos: str | None = None,
) -> Analysis:
    """Run ``model`` on each window and answer, per layer, "are there outlier channels?".

    Args:
        model: a transformers causal LM (eval mode).
        windows: token ids ``(W, T)``; each window is one forward from position 0, no cache carried over.
        threshold: outlier rule multiple (see ``kvbits.analyze.outliers``).
        layer_fraction: keys go per-channel when more than this fraction of layers has outliers.
        sample_tokens: at most this many tokens per layer kept for percentiles, ranges, SQNR and plots, in whole
            blocks of ``min(channel_group, T)`` (rounded down, said in the log); ``Analysis.sampled_tokens`` is what
            the windows filled.
        channel_group: tokens per per-channel scale (and per sample block), at least ``MIN_GROUP`` (3);
            ``min(.., T)``, so windows need ``MIN_GROUP`` tokens too.
        seed: the token sample's seed, an int in [0, 2**32 - 1].
        keep_samples: keep each layer's sample in ``LayerAnalysis.samples`` (for plots).
        progress: called as ``progress(done, total)`` after each window.
        bos: what the windows start with, recorded as ``Analysis.bos`` (analysis.json's ``"bos"``): ``"always"``
            (the BOS, ``make_windows(bos_id=...)``), ``"never"`` (raw slices), None (not said).
    """
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2:
        raise TypeError(
            f"windows must be an integer tensor (W, T), got {getattr(windows, 'shape', windows)!r}"
        )
    from kvbits.evaluate.data import check_token_ids
    from kvbits.evaluate.inputs import check_int

    check_token_ids(windows, model, "windows")  # integers within the embedding table, as evaluate's
    # before the block checks below, whose messages would blame the windows for channel_group < 2, and torch's
    # deep in ChannelStats for a float
    channel_group = check_int("channel_group", channel_group, MIN_GROUP)
    sample_tokens = check_int("sample_tokens", sample_tokens, 1)
    seed = check_seed(seed)  # random.Random seeds with abs(): -1 would sample as 1
    W, T = windows.shape
    if W < 1:
        raise ValueError(f"windows must hold at least one window, got shape {tuple(windows.shape)}")
    check_threshold(threshold)
    check_layer_fraction(layer_fraction)
    block = min(channel_group, T)
    if block < MIN_GROUP:
        raise ValueError(
            f"windows of {T} token(s) are too short: the per-channel SQNR groups need at least {MIN_GROUP} tokens "
            "(an asymmetric group of 2 is stored exactly)"
        )
    if sample_tokens < block:
        raise ValueError(f"sample_tokens ({sample_tokens}) must be at least one block of {block} tokens")
    if sample_tokens % block:
        logger.warning("sample_tokens %d rounds down to %d (whole blocks of %d tokens)", sample_tokens,
                       sample_tokens // block * block, block)  # fmt: skip
    if getattr(model, "config", None) is not None:
        check_context_fits(model.config, T)
    # the sites first: a model they refuse (multi-head latent attention, fused QKV) is refused before
    # _rotary_tables warns "no post-RoPE statistics" about it (DeepSeek-V3: rope_interleave), as if it would run
    sites = analysis_sites(model)
    tables, reproducible = _rotary_tables(model)
    refused = _pre_rope_refused(model) if tables is not None else None
    from kvbits.calibrate.cache_capture import CacheKVCapture, CacheSite

    at_cache = isinstance(sites[0], CacheSite)  # a shared attention block: K/V read at cache.update
    if at_cache and not reproducible:  # the cache holds rotated keys kvbits can not un-rotate: no pre-RoPE figures
        raise NotImplementedError(
            f"{type(model).__name__}: its shared attention block's keys are read where the cache receives them, "
            "rotated by a RoPE kvbits can not reproduce (see the warning above), so there are no pre-RoPE keys to "
            "analyze; expected a rotate-half RoPE or none"
        )
    device = next(model.parameters()).device
    stats = {
        s.layer_idx: {
            name: ChannelStats(s.num_kv_heads, s.head_dim, sample_tokens // block, block, f"layer {s.layer_idx} {name}")
            for name in ("key_pre_rope", "key_post_rope", "value")
        }
        for s in sites
    }
    layer_tables = {s.layer_idx: tables.tables_for_layer(s.layer_idx) for s in sites} if tables is not None else {}
    # the hooks read what the cache holds (a family transforming K/V elsewhere is refused here, before the passes);
    # without RoPE the cached keys are the hooked ones and are compared too (None per site, as kvbits calibrate);
    # only keys rotated in a layout kvbits can not reproduce go unchecked (None as a whole)
    key_tables = [layer_tables.get(s.layer_idx) for s in sites] if reproducible else None
    if not at_cache:  # read at cache.update: what the cache holds by construction
        verify_taps(model, windows, key_tables)
    # one cos/sin pair per distinct table (not per layer: 32 layers x 32K tokens x D=128 held 1 GiB of copies)
    cos_sin: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    reservoir = BlockReservoir(sample_tokens // block, seed=seed)
    plan: list[tuple[int, int]] = []

    from kvbits.quant.rope import apply_rope

    def on_kv(layer: int, kind: str, x: torch.Tensor) -> None:
        st = stats[layer]
        if kind == "value":
            st["value"].update(x, plan)
            return
        xf = x.float()
        st["key_pre_rope"].update(xf, plan)
        if layer in layer_tables:
            key = (*rotary_table_key(layer_tables[layer]), xf.device, xf.shape[2])
            if key not in cos_sin:
                cos, sin = layer_tables[layer].cos_sin(torch.arange(xf.shape[2]), torch.float32)
                cos_sin[key] = (cos.to(xf.device), sin.to(xf.device))
            st["key_post_rope"].update(apply_rope(xf, *cos_sin[key]), plan)

    extra = last_logits_only(model)
    # at the cache: every forward runs with a recording cache; each layer's (pre-RoPE K, V) fed to on_kv after it
    capture = CacheKVCapture(model, sites, key_tables) if at_cache else kv_hooks(model, on_kv)
    with torch.no_grad(), capture as cap:
        for w in range(W):
            plan[:] = reservoir.offer(blocks_in(T, block))
            try:
                model(input_ids=windows[w : w + 1].to(device), use_cache=False, **extra)
                if at_cache:
                    for s in sites:
                        k, v = cap.activations(s.layer_idx)
                        on_kv(s.layer_idx, "key", k)
                        on_kv(s.layer_idx, "value", v)
                    cap.reset()
            except (NonFiniteKV, KVBeyondFloat16) as exc:
                raise type(exc)(f"window {w}, {exc}") from exc
            if progress is not None:
                progress(w + 1, W)
    n_blocks = reservoir.size
    layers = []
    for s in sites:
        st = stats[s.layer_idx]
        if st["key_pre_rope"].count == 0 or st["value"].count == 0:
            raise RuntimeError(f"layer {s.layer_idx} saw no keys/values during the forward passes")
        pre = TensorReport.from_stats(st["key_pre_rope"], n_blocks, threshold)
        post = (
            TensorReport.from_stats(st["key_post_rope"], n_blocks, threshold)
            if s.layer_idx in layer_tables
            else None
        )
        val = TensorReport.from_stats(st["value"], n_blocks, threshold)
        samples = {}
        if keep_samples:
            # on the host: the plots read them with .numpy(), and they would hold device memory for nothing
            samples = {k: v.sampled(n_blocks).cpu() for k, v in st.items() if v.count}
            samples["positions"] = st["key_pre_rope"].positions[:n_blocks].clone()
        rot = layer_tables[s.layer_idx].rot_dim if s.layer_idx in layer_tables else 0
        layers.append(LayerAnalysis(s.layer_idx, rot, pre, post, val, samples, keys_rotated_unseen=not reproducible,
                                    pre_rope_refused=refused))  # fmt: skip
        del stats[s.layer_idx]  # drop this layer's accumulators before finalizing the next
    result = Analysis(
        model_name, data_name, T, W, threshold, layer_fraction, block, sample_tokens, layers, fingerprint,
        sampled_tokens=n_blocks * block, bos=bos,
    )
    result.recommendation = recommend(
        [la.to_dict() for la in layers],  # their keys_rotated_unseen: not reproducible
        layer_fraction=layer_fraction,
        threshold=threshold,
        model=model_name,
        data=data_name,
        context=T,
    )
    return result
