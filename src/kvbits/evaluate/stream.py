"""Ground truth: run the real cache token by token and collect the final hidden states.

``stream_hidden(model, ids, scheme)`` decodes a window one token per forward through
``QuantizedKVCache`` (decode semantics), or prefills a prompt in full precision with a
``DynamicCache``, loads its K/V into the quantized cache with ``cache.update`` (which appends and
flushes exactly as during generation) and decodes the rest (prefill semantics). The one-pass
simulator (``kvbits.evaluate.simulate``) must agree with this; tests hold them together.

Fused decode (``fused_decode``, as ``QuantizedKVCache``'s): ``"auto"`` (the default) runs every decode
step of the stream through ``kvbits_fused`` (``kvbits.cache.use_fused_decode``), the fused kernel over
the packed store, wherever the cache would pick it (CUDA with Triton): the evaluation then measures the
numerics a server running kvbits gets. Elsewhere, and with ``False``, the cache dequantizes into SDPA
(with a dequantized workspace: faster token by token on CPU); ``True`` forces the fused path (the torch
reference on CPU). The model's attention implementation is restored afterwards.

Peers: ``hf-quanto-int4`` / ``hf-quanto-int2`` run transformers' own ``QuantizedCache`` (quanto
backend, residual 128, groups of 64), the baseline users already have. Their average bits are
``nbits + 2 * 8 * dtype_bytes / q_group_size`` (``PeerScheme.bits``: one scale and one zero-point per group of 64
elements, both in the dtype the model runs in, as quanto stores them): 4.5 and 2.5 on a float16 or bfloat16
model, 5.0 and 3.0 on a float32 one. ``cache_bytes`` counts what their cache holds: quanto's packed codes, scales
and zero-points and the full-precision residual. They only exist as a cache, so they run in stream mode only.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvbits._argtypes import PEERS, runs_on_device
from kvbits._model import check_model
from kvbits.cache.cache import _holds_state, _is_state_layer, linear_state_bytes
from kvbits.cache.compat import cache_kwarg
from kvbits.cache.hybrid import HYBRID_TYPES
from kvbits.schemes.presets import get_scheme
from kvbits.schemes.spec import KVScheme

logger = logging.getLogger(__name__)

__all__ = [
    "PEER_SCHEMES",
    "PeerScheme",
    "add_decode_counts",
    "base_model",
    "cache_bytes",
    "decode_hidden",
    "linear_state_bytes",
    "load_kv",
    "make_cache",
    "prefill_kv",
    "resolve_scheme",
    "stream_hidden",
    "tensor_bytes",
]

QUANTO_INSTALL = "pip install optimum-quanto  (or: pip install 'kvbits[quanto]')"
# what each QuantizedCache backend a PeerScheme can name imports, and how to install it
PEER_BACKENDS = {
    "quanto": ("optimum.quanto", "optimum-quanto", QUANTO_INSTALL),
    "hqq": ("hqq", "hqq", "pip install hqq"),
}


@dataclass(frozen=True)
class PeerScheme:
    """A cache implementation outside kvbits, evaluated as it ships (stream mode only).

    Attributes:
        name: the name used on the command line.
        backend: transformers ``QuantizedCache`` backend.
        nbits: code width.
        residual_length: most recent tokens kept in full precision.
        q_group_size: elements per scale group.
    """

    name: str
    backend: str
    nbits: int
    residual_length: int = 128
    q_group_size: int = 64
    description: str = ""

    def __post_init__(self) -> None:
        if self.backend not in PEER_BACKENDS:
            raise ValueError(
                f"peer {self.name!r}: backend must be one of {sorted(PEER_BACKENDS)} (transformers' group-wise "
                f"QuantizedCache backends), got {self.backend!r}"
            )

    @property
    def avg_bits(self) -> float:
        """``bits(2)``: on a float16 / bfloat16 model (``long_run_avg_bits`` passes the model's own dtype)."""
        return self.bits(2)

    def bits(self, dtype_bytes: int) -> float:
        """``nbits + 2 * 8 * dtype_bytes / q_group_size``: codes plus a scale and a zero-point per group, both in
        the dtype of the K/V (the model's: 4.5 bits for int4 on a float16 model, 5.0 on a float32 one, whose
        quanto scales are float32)."""
        return self.nbits + 2 * 8 * dtype_bytes / self.q_group_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "nbits": self.nbits,
            "residual_length": self.residual_length,
            "q_group_size": self.q_group_size,
            "peer": True,
        }

    def check_widths(self, widths: dict[int, int]) -> None:
        """``ValueError`` where quanto can not store some layer: it quantizes a layer's K/V ``(B, H_kv, T, D)`` in
        groups of ``q_group_size`` consecutive elements, so ``H_kv * D`` (``widths``: layer -> ``H_kv * D``) must be
        a multiple of it, or a prefill or flush of some lengths fails inside quanto ("Group size (64) must be a
        divisor of (240)": one KV head of 80 channels, 3 tokens). The batch does not enter: transformers quantizes
        along axis 0, and quanto's ``group`` splits each of its ``B`` rows (``H_kv * T * D`` elements) apart, so 4
        sequences of 3 tokens (960 elements, 15 whole groups) fail as one does. Not narrowed to the token counts a
        run would flush at (decode semantics: 1 first; prefill: any prompt length): one layer refused up front rather
        than a run failing at a prompt length. HQQ groups otherwise: not checked."""
        if self.backend != "quanto":
            return
        bad = {i: w for i, w in widths.items() if w % self.q_group_size}
        if bad:
            i, w = next(iter(bad.items()))
            raise ValueError(
                f"scheme {self.name!r}: quanto quantizes each layer's K/V (B, H_kv, T, D) in groups of "
                f"{self.q_group_size} consecutive elements of each sequence (the batch size does not help), so "
                f"H_kv x D must be a multiple of {self.q_group_size}; "
                f"layer {i}{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''} has H_kv x D = {w}: "
                f"token counts that are not a multiple of {self.q_group_size // math.gcd(w, self.q_group_size)} "
                "would fail inside quanto"
            )

    def make_cache(self, config: Any) -> Any:
        """transformers' ``QuantizedCache`` for a model of ``config``; ``RuntimeError`` naming the package (and its
        install command) where the backend's is not installed, ``ValueError`` naming the peer where transformers
        refuses the model or the options (sliding layers, an ``nbits`` the backend has not)."""
        module, package, install = PEER_BACKENDS[self.backend]
        try:
            importlib.import_module(module)
        except ImportError:
            raise RuntimeError(
                f"scheme {self.name!r} needs {package}, which is not installed: {install}"
            ) from None
        from transformers import QuantizedCache

        try:
            return QuantizedCache(
                backend=self.backend,
                config=config,
                nbits=self.nbits,
                residual_length=self.residual_length,
                q_group_size=self.q_group_size,
            )
        except ImportError as exc:
            raise RuntimeError(f"scheme {self.name!r}: {exc} ({install})") from exc
        except ValueError as exc:
            raise ValueError(f"scheme {self.name!r}: transformers' QuantizedCache refuses it here: {exc}") from exc


PEER_SCHEMES: dict[str, PeerScheme] = {
    name: PeerScheme(name, "quanto", nbits, description=description) for name, (nbits, description) in PEERS.items()
}


def resolve_schemes(schemes: Any) -> list[KVScheme | PeerScheme]:
    """``resolve_scheme`` of each entry of the list ``schemes``; ``TypeError`` for one scheme given bare (a
    string was read letter by letter: "unknown scheme 'i'")."""
    if isinstance(schemes, (str, dict, KVScheme, PeerScheme)) or not hasattr(schemes, "__iter__"):
        raise TypeError(f"schemes must be a list of schemes, got {schemes!r}; for one scheme pass [{schemes!r}]")
    return [resolve_scheme(s) for s in schemes]


def check_schemes_fit(schemes: list[KVScheme | PeerScheme], config: Any) -> None:
    """``ValueError`` (``check_scheme_layer_head_dims``'s, naming the scheme, the side and, where the model's
    layers differ, the layers) for a kvbits scheme of ``schemes`` that can not store some layer's head dim: each
    layer's as the cache reads it (``layer_heads``; Gemma 4's global layers are wider than layer 0), layers
    without K/V left out, and sliding layers whose window the scheme keeps in full precision (``layer_windows``,
    ``sliding_falls_back``: the cache quantizes nothing there), and for pre-RoPE keys on a model that rotates none
    (``kvbits.plan.planner.check_pre_rope_config``). Checked once the model's config is read, before
    any forward pass, so that a run does not fail at that scheme after the others' work. A peer's cache is made once
    here (it holds nothing until its first update): a backend package that is not installed, or a model transformers'
    ``QuantizedCache`` refuses (sliding layers), is said before the reference's forward passes, not at the first
    window's peer (``PeerScheme.make_cache``'s errors), and so is a layer quanto can not group
    (``PeerScheme.check_widths``). A mixed scheme overriding a layer the model lacks (``"int4-token,40=fp16"`` on a
    30-layer model) is refused here too (``KVScheme.check_layer_count``): it was refused only by the simulator or the
    cache, after the reference's forward pass and the schemes before it."""
    from kvbits.cache import attention_shape
    from kvbits.cache.cache import layer_windows
    from kvbits.plan.config import layer_heads
    from kvbits.plan.planner import check_pre_rope_config
    from kvbits.schemes.accounting import check_scheme_layer_head_dims

    n_layers = attention_shape(config)[0]
    head_dims = {i: d for i in range(n_layers) for _, kv, d in [layer_heads(config, i)] if kv}
    windows = layer_windows(config)
    widths = {i: kv * d for i in range(n_layers) for _, kv, d in [layer_heads(config, i)] if kv}
    for s in schemes:
        if isinstance(s, PeerScheme):
            s.make_cache(config)
            s.check_widths(widths)
        else:
            s.check_layer_count(n_layers)
            check_scheme_layer_head_dims(s, head_dims, windows)
            check_pre_rope_config(s, config)  # pre-RoPE keys on a model that rotates none (Zamba2, Falcon alibi)


def resolve_scheme(spec: str | dict | KVScheme | PeerScheme) -> KVScheme | PeerScheme:
    """A kvbits scheme (preset, dict, JSON path, object) or a peer name from ``PEER_SCHEMES``."""
    if isinstance(spec, PeerScheme):
        return spec
    if isinstance(spec, str) and spec in PEER_SCHEMES:
        return PEER_SCHEMES[spec]
    try:
        return get_scheme(spec)
    except ValueError as exc:
        raise ValueError(f"{exc}; peers (stream mode only): {', '.join(PEER_SCHEMES)}") from None


def make_cache(
    scheme: KVScheme | PeerScheme,
    model: Any,
    *,
    calibration: Any = None,
    fused_decode: bool = False,
    workspace: bool | None = None,
    max_cache_len: int | None = None,
    calibration_warnings: bool = True,
) -> Any:
    """The cache that stores K/V following ``scheme`` (``QuantizedKVCache``, or a peer's).

    ``calibration_warnings=False``: the caller reports calibration/serving mismatch itself (``QuantizedKVCache``).

    Pre-RoPE key specs get the model's own RoPE tables; ``calibration`` (an artifact or its folder)
    supplies static scales and NUQ codebooks. ``fused_decode``: decode steps through the fused kernel.
    ``workspace``: keep a dequantized history (``None``: exactly when not ``fused_decode``, the fast
    token-by-token path on CPU; the fused path never reads it). ``max_cache_len``: quantized storage reserved
    for that many tokens per sequence (``QuantizedKVCache``; peers take none).
    """
    if isinstance(scheme, PeerScheme):
        if calibration is not None:
            raise ValueError(f"{scheme.name} takes no calibration")
        return scheme.make_cache(model.config)
    from kvbits.cache import QuantizedKVCache

    rotary = None
    if any(s.key.pre_rope and not s.is_identity for s in scheme.layer_schemes()):
        from kvbits.quant.rope import RotaryTables

        rotary = RotaryTables.from_model(model)
    if isinstance(calibration, (str, bytes)) or hasattr(calibration, "__fspath__"):
        from kvbits.calibrate import load_calibration

        calibration = load_calibration(calibration, model_config=model.config, scheme=scheme)
    return QuantizedKVCache(
        config=model.config, scheme=scheme, workspace=(not fused_decode) if workspace is None else workspace,
        rotary=rotary, calibration=calibration,
        fused_decode=bool(fused_decode), max_cache_len=max_cache_len, calibration_warnings=calibration_warnings,
    )  # fmt: skip


def base_model(model: Any) -> Any:
    """The decoder that returns ``last_hidden_state`` (``model.model`` of a ``*ForCausalLM``).

    ``Llama4ForCausalLM`` (and ``MllamaForCausalLM``) name a ``base_model_prefix`` (``language_model``) they do not
    hold, so transformers' ``base_model`` and ``get_decoder()`` give the causal LM itself: its ``model`` is taken then
    (before, every evaluation of it failed with "'MoeCausalLMOutputWithPast' object has no attribute
    'last_hidden_state'")."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        if hasattr(model, "get_decoder"):
            try:
                decoder = model.get_decoder()
            except (AttributeError, NotImplementedError):
                decoder = model
            if decoder is not model:
                return decoder
        inner = getattr(model, "model", None)
        head = getattr(model, "get_output_embeddings", None)
        if isinstance(inner, torch.nn.Module) and inner is not model and callable(head) and head() is not None:
            return inner  # a causal LM: its output embedding beside the decoder
        return model
    return base


def _step(base: Any, ids: torch.Tensor, cache: Any, kw: str) -> torch.Tensor:
    return base(input_ids=ids, use_cache=True, **{kw: cache}).last_hidden_state


def _prefill_cache(model: Any) -> Any:
    """The ``DynamicCache`` a full-precision prefill fills: no config, so every attention layer keeps all its tokens
    (a sliding layer would keep only the last ``W - 1``, and the quantized cache counts its blocks from token 0); a
    hybrid model's convolution / linear-attention layers (``conv``, ``linear_attention``) get transformers'
    ``LinearAttentionLayer``, as ``DynamicCache(config=...)`` and ``QuantizedKVCache`` give them."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from kvbits.cache.cache import _STATE_TYPES, _layer_types, _state_layer
    from kvbits.plan.config import text_config

    full = DynamicCache()
    text = text_config(model.config)
    n_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(n_layers, int):
        return full
    types, kwargs = _layer_types(text, n_layers)
    if not any(t in _STATE_TYPES or t in HYBRID_TYPES for t in types):
        return full
    full.layers = [_state_layer(i, t, kw) if t in _STATE_TYPES else _hybrid_layer(kw) if t in HYBRID_TYPES
                   else DynamicLayer() for i, (t, kw) in enumerate(zip(types, kwargs))]  # fmt: skip
    return full


def _hybrid_layer(kwargs: dict) -> Any:
    """transformers' layer for a ``hybrid`` layer (Zamba, Falcon-H1: full attention plus a linear state), as
    ``DynamicCache(config=...)`` builds it."""
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer

    return LinearAttentionAndFullAttentionLayer(number_of_states=kwargs.get("number_of_states", 1))


def _is_hybrid_layer(layer: Any) -> bool:
    """``layer`` attends and holds a linear state (transformers' ``LinearAttentionAndFullAttentionLayer``)."""
    return _holds_state(layer) and not _is_state_layer(layer)


@torch.no_grad()
def prefill_kv(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """A full-precision prefill of ``ids`` ``(B, T)``: final hidden states ``(B, T, hidden)`` and each
    layer's ``(keys, values)`` ``(B, H_kv, T, D)`` as the model cached them (``DynamicCache``; every layer keeps
    all its tokens, a sliding one too: the quantized cache counts its blocks from token 0); for a hybrid model's
    convolution / linear-attention layer, its transformers ``LinearAttentionLayer`` (conv / recurrent states after
    the prompt), which :func:`load_kv` copies into each cache.
    """
    base = base_model(model)
    full = _prefill_cache(model)
    hidden = _step(base, ids, full, cache_kwarg(base))
    return hidden, [layer if _holds_state(layer) else (layer.keys, layer.values) for layer in full.layers]


def cache_bytes(cache: Any) -> int | None:
    """Bytes a cache holds: kvbits' ``memory_report()["total_bytes"]``; every K/V tensor of a ``DynamicCache`` or a
    ``StaticCache`` (all its reserved slots); for transformers' ``QuantizedCache`` (a peer) each layer's quantized
    states (quanto's packed codes, scales and zero-points, HQQ's codes and metadata: :func:`tensor_bytes`) and its
    full-precision residual (``keys`` / ``values``: counting only these, as a ``DynamicLayer``'s, undercounts it);
    None for any other cache. K/V only, as ``kvbits.plan`` prices: a hybrid model's convolution / linear-attention
    states are not counted (:func:`linear_state_bytes`)."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    report = getattr(cache, "memory_report", None)
    if callable(report):
        return int(report()["total_bytes"])
    if isinstance(cache, QuantizedCache):
        layers = [layer for layer in cache.layers if layer.is_initialized]
        if not all(hasattr(layer, "_quantized_keys") for layer in layers):
            return None  # a layout this transformers does not have: not counted rather than undercounted
        return sum(tensor_bytes((layer._quantized_keys, layer._quantized_values, layer.keys, layer.values))
                   for layer in layers)  # fmt: skip
    if not isinstance(cache, (DynamicCache, StaticCache)):
        return None
    return int(sum(t.numel() * t.element_size() for layer in cache.layers
                   if not _is_state_layer(layer) and layer.is_initialized for t in (layer.keys, layer.values)))  # fmt: skip


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (tensors, tuples, lists, dict values), each counted once; a tensor subclass
    that is a wrapper (quanto's ``WeightQBitsTensor``: ``__tensor_flatten__``) by its inner tensors (the packed
    codes, scales and zero-points), not by its logical shape."""
    seen: set[int] = set()

    def walk(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            flatten = getattr(type(x), "__tensor_flatten__", None)
            if flatten is not None and type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter):
                names, _ = x.__tensor_flatten__()
                return sum(walk(getattr(x, n)) for n in names)
            return x.numel() * x.element_size()
        if isinstance(x, (tuple, list)):
            return sum(walk(v) for v in x)
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        return 0

    return int(walk(obj))


def load_kv(cache: Any, kv: list[Any]) -> None:
    """Append a prefill's per-layer ``(keys, values)`` (``prefill_kv``) to ``cache`` with ``update``,
    which stores (and, for a quantized cache, flushes) them exactly as during generation; a hybrid model's
    convolution / linear-attention layer (a ``LinearAttentionLayer`` in ``kv``) is copied into ``cache`` (a deep
    copy: the model updates those states in place). The tensors are not modified, so one prefill can be loaded
    into several caches; ``ValueError`` when ``cache`` has no such layer there (a cache of attention layers only)."""
    import copy

    for idx, entry in enumerate(kv):
        if _is_hybrid_layer(entry):  # K/V through update, the state copied (QuantizedHybridLayer.linear)
            target = cache.layers[idx] if idx < len(cache.layers) else None
            if not _is_hybrid_layer(target):
                raise ValueError(
                    f"layer {idx} of the prefill is a hybrid layer (attention plus a linear state) but "
                    f"{type(cache).__name__} has {type(target).__name__} there: build the cache from the model's "
                    "config (DynamicCache(config=...), QuantizedKVCache(config=...))"
                )
            cache.update(entry.keys, entry.values, idx)
            _copy_linear_state(entry, getattr(target, "linear", target))
        elif _is_state_layer(entry):
            if idx >= len(cache.layers) or not _is_state_layer(cache.layers[idx]):
                have = type(cache.layers[idx]).__name__ if idx < len(cache.layers) else "no layer"
                raise ValueError(
                    f"layer {idx} of the prefill is a convolution / linear-attention layer but {type(cache).__name__} "
                    f"has {have} there: build the cache from the model's config (DynamicCache(config=...), "
                    "QuantizedKVCache(config=...))"
                )
            cache.layers[idx] = copy.deepcopy(entry)
        else:
            cache.update(entry[0], entry[1], idx)


def _copy_linear_state(src: Any, dst: Any) -> None:
    """Deep copies of ``src``'s linear-attention state attributes (transformers' ``LinearAttentionCacheLayerMixin``)
    into ``dst``; its K/V, if any, are left alone."""
    import copy

    for name in _LINEAR_STATE_ATTRS:
        if hasattr(src, name):
            setattr(dst, name, copy.deepcopy(getattr(src, name)))


# what LinearAttentionCacheLayerMixin.__init__ / lazy_initialization / activate_past_recording set
_LINEAR_STATE_ATTRS = (
    "number_of_states", "conv_states", "recurrent_states", "is_conv_states_initialized",
    "is_recurrent_states_initialized", "has_previous_state", "conv_kernel_size", "cumulative_length_linear",
    "record_past", "recurrent_states_to_keep", "recurrent_states_history", "device", "dtype",
)  # fmt: skip


@torch.no_grad()
def decode_hidden(
    model: Any, ids: torch.Tensor, cache: Any, *, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """Final hidden states ``(B, T, hidden)`` of ``ids`` ``(B, T)`` fed one token per forward through
    ``cache`` (which already holds whatever came before them), as generation decodes."""
    base = base_model(model)
    kw = cache_kwarg(base)
    chunks = []
    for t in range(ids.shape[1]):
        chunks.append(_step(base, ids[:, t : t + 1], cache, kw))
        if progress:
            progress(1)
    if not chunks:
        raise ValueError(f"decode_hidden needs at least one token, got ids of shape {tuple(ids.shape)}")
    return torch.cat(chunks, dim=1)


@runs_on_device
@torch.no_grad()
def stream_hidden(
    model: Any,
    ids: torch.Tensor,
    scheme: str | KVScheme | PeerScheme,
    *,
    semantics: str = "decode",
    prompt_len: int | None = None,
    progress: Callable[[int], None] | None = None,
    calibration: Any = None,
    fused_decode: bool | str = "auto",
    stats: dict[str, int] | None = None,
    on_cache: Callable[[Any], None] | None = None,
    calibration_warnings: bool = True,
) -> torch.Tensor:
    """Final hidden states ``(B, T, hidden)`` of ``ids`` ``(B, T)`` run through the scheme's cache.

    Args:
        model: a transformers causal LM (or its base model).
        ids: token ids, unpadded.
        scheme: kvbits scheme or peer.
        semantics: ``"decode"``: one token per forward from token 0. ``"prefill"``: the first
            ``prompt_len`` tokens in one full-precision forward (``DynamicCache``), their K/V loaded
            into the scheme's cache with ``update`` per layer, then one token per forward.
        progress: called with the number of tokens just processed (for a progress bar).
        calibration: artifact or folder for schemes with static scales / NUQ codebooks.
        fused_decode: ``"auto"``, ``True`` or ``False`` (module docstring); ignored for peers.
        stats: kvbits schemes: ``"fused_steps"`` and ``"fallback_steps"`` (layer x token decode steps
            attended by the fused kernel / over dequantized K/V after a claim) are added to it.
        on_cache: called with the cache once it is built, before any token reaches it (e.g. to attach a
            ``kvbits.monitor.CacheMonitor``).
        calibration_warnings: ``False`` when the caller reports calibration/serving mismatch itself (the
            cache then logs none; ``QuantizedKVCache``), as ``kvbits eval`` does once per run.
    """
    check_model(model, "stream_hidden", attention=True)
    from kvbits.cache.fused import check_mode

    scheme = resolve_scheme(scheme)
    if ids.dim() != 2 or 0 in ids.shape:  # (1, 0) failed in the cache: "max_cache_len must be a positive int"
        raise ValueError(f"ids must be (B, T) with B >= 1 sequences of T >= 1 tokens, got shape {tuple(ids.shape)}")
    from kvbits.evaluate.data import check_token_ids

    check_token_ids(ids, model, "ids")
    fused = not isinstance(scheme, PeerScheme) and fuses(model, check_mode(fused_decode), ids.device)
    with _fused_attention(model) if fused else contextlib.nullcontext():
        return _stream(model, ids, scheme, semantics, prompt_len, progress, calibration, stats, fused=fused,
                       on_cache=on_cache, calibration_warnings=calibration_warnings)  # fmt: skip


_UNFUSABLE_SAID: set[str] = set()  # model classes whose unfusable attention was logged (once per process)


def fuses(model: Any, mode: bool | str, device: torch.device) -> bool:
    """Whether ``model``'s decode steps on ``device`` go through ``kvbits_fused`` under ``mode`` (``True``,
    ``False`` or ``"auto"``, as ``kvbits.cache.fused.check_mode`` returns it): the mode wants the fused path
    there (``wants``) and the model's attention can be routed through it (tried, then undone).

    When it can not (``kvbits.cache.UnsupportedAttention``: its attention does not dispatch through
    transformers' ``AttentionInterface``): raised when fused decode was asked for (``mode`` True), else
    (``"auto"``) logged once per model class and ``False``, so the run decodes over dequantized K/V and says
    so (``fused_steps`` stay 0; ``kvbits speed`` labels the path ``dequantize``).
    """
    from kvbits.cache import UnsupportedAttention
    from kvbits.cache.fused import wants

    if not wants(mode, device):
        return False
    try:
        with _fused_attention(model):
            return True
    except UnsupportedAttention as e:
        if mode is True:
            raise
        if type(model).__name__ not in _UNFUSABLE_SAID:
            _UNFUSABLE_SAID.add(type(model).__name__)
            logger.warning("%s; decoding over dequantized K/V", e)
        return False


@contextlib.contextmanager
def _fused_attention(model: Any) -> Iterator[None]:
    """``model`` attends through ``kvbits_fused`` inside, through its previous implementation after."""
    from kvbits.cache import use_fused_decode

    previous = use_fused_decode(model)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _stream(
    model: Any,
    ids: torch.Tensor,
    scheme: KVScheme | PeerScheme,
    semantics: str,
    prompt_len: int | None,
    progress: Callable[[int], None] | None,
    calibration: Any,
    stats: dict[str, int] | None,
    *,
    fused: bool,
    on_cache: Callable[[Any], None] | None = None,
    calibration_warnings: bool = True,
) -> torch.Tensor:
    """``stream_hidden`` once the attention implementation is set."""
    _B, T = ids.shape
    start = 0
    chunks: list[torch.Tensor] = []
    if semantics == "prefill":
        from kvbits.evaluate.inputs import check_int

        given = prompt_len
        try:  # NumPy's ints too, as evaluate() takes them; not a bool (True prefilled 1 token)
            prompt_len = check_int("prompt_len", prompt_len, 1)
        except ValueError:
            prompt_len = T
        if not prompt_len < T:
            raise ValueError(f"semantics='prefill' needs 0 < prompt_len < T={T}, got {given!r}")
        hidden, kv = prefill_kv(model, ids[:, :prompt_len])
        chunks.append(hidden)
        # the cache ends holding all T tokens: reserved for them, flushes write in place (peers take none)
        cache = make_cache(scheme, model, calibration=calibration, fused_decode=fused, max_cache_len=T,
                           calibration_warnings=calibration_warnings)  # fmt: skip
        if on_cache is not None:
            on_cache(cache)
        load_kv(cache, kv)
        del kv
        start = prompt_len
        if progress:
            progress(prompt_len)
    elif semantics == "decode":
        if prompt_len not in (None, 0):  # as evaluate() and simulate(): not ignored without a word
            raise ValueError(f"prompt_len is only used with semantics='prefill', got prompt_len={prompt_len!r}")
        cache = make_cache(scheme, model, calibration=calibration, fused_decode=fused, max_cache_len=T,
                           calibration_warnings=calibration_warnings)  # fmt: skip
        if on_cache is not None:
            on_cache(cache)
    else:
        raise ValueError(f"semantics must be 'decode' or 'prefill', got {semantics!r}")
    chunks.append(decode_hidden(model, ids[:, start:], cache, progress=progress))
    if not isinstance(scheme, PeerScheme):
        rep = cache.fused_report()
        if fused:
            logger.info("%s: %d fused decode steps, %d fallback steps (layers x tokens)", scheme.name,
                        rep["fused_steps"], rep["fallback_steps"])  # fmt: skip
        if stats is not None:
            add_decode_counts(stats, rep)
    return torch.cat(chunks, dim=1)


def add_decode_counts(stats: dict[str, int], report: dict[str, Any]) -> None:
    """Add a ``QuantizedKVCache.fused_report()``'s ``"fused_steps"`` and ``"fallback_steps"`` to ``stats``."""
    for key in ("fused_steps", "fallback_steps"):
        stats[key] = stats.get(key, 0) + int(report[key])
