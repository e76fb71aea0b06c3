"""Per-token quality metrics and their aggregation by context position.

Per predicted token (position ``t`` predicts token ``t + 1``): the negative log-likelihood under the
reference (unquantized) run and under the scheme, the KL divergence ``KL(ref || scheme)`` of the two
next-token distributions (the damage measure llama.cpp's ``--kl-divergence`` popularised: it sees
changes that perplexity averages away), and whether both runs rank the same token first.

Logits are computed from final hidden states in chunks of positions, so a ``T x vocab`` float32
matrix never exists (Qwen's vocabulary is 152K: one 32K window would be 20 GB).

Aggregation is by *bucket* of positions, ``[0, 1K), [1K, 2K), [2K, 4K), ...`` cut at the context:
quantization error compounds with the number of quantized keys a query attends to, so damage must
be shown by position, not only averaged. ``delta_rel = PPL / PPL_ref - 1`` comes with a paired
bootstrap 95% interval over contiguous chunks of 128 tokens (tokens are not independent; chunks
of neighbouring tokens keep most of the correlation inside the resampling unit).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbits._json import is_number
from kvbits.plan.config import text_config

__all__ = [
    "BUCKET_EDGES",
    "TOKEN_FIELDS",
    "BucketRecord",
    "LogitHead",
    "attn_entropy_buckets",
    "attn_error_buckets",
    "bootstrap_delta_rel",
    "bucket_bounds",
    "bucket_records",
    "check_logit_head",
    "exact_log_softmax",
    "kl_divergence",
    "logits_chunk_size",
    "summarize",
    "token_metrics",
]

BUCKET_EDGES = (0, 1024, 2048, 4096, 8192, 16384, 32768)
TOKEN_FIELDS = ("nll", "nll_ref", "kl", "top1")
BOOTSTRAP_CHUNK = 128
BOOTSTRAP_RESAMPLES = 1000


# ------------------------------------------------------------------------------------ per token


def logits_chunk_size(vocab_size: int, budget_elements: int = 1 << 24) -> int:
    """Positions per logits chunk so one float64 ``(chunk, vocab)`` log-probability matrix stays near 128 MB."""
    return int(max(16, min(512, budget_elements // max(1, vocab_size))))


# model types whose causal LM multiplies its logits by ``config.logits_scaling`` (the Granite family divides by it)
_MULTIPLY_LOGITS_SCALING = frozenset({"hyperclovax"})


@dataclass(frozen=True)
class LogitHead:
    """Final hidden states ``(N, hidden)`` -> float32 logits ``(N, vocab)`` as the model's forward
    computes them: the output embedding, then the family's post-processing, which changes every
    probability (and so PPL and KL) when left out.

    Attributes:
        proj: the output embedding (``model.get_output_embeddings()``).
        scale: a factor on the logits: Cohere's ``logit_scale``, ``1 / logits_scaling`` for Granite,
            ``logits_scaling`` for HyperCLOVAX, ``lm_head_multiplier`` for Falcon-H1.
        softcap: ``final_logit_softcapping`` (Gemma 2/3): ``tanh(x / c) * c``.
    """

    proj: torch.nn.Module
    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_model(cls, model: Any) -> LogitHead:
        """The head of a transformers causal LM, with the post-processing its family applies. Families
        this does not know are caught by :func:`check_logit_head` against the model's own logits.

        ``ValueError`` for a model without an output embedding (a bare decoder such as ``LlamaModel``): it
        computes no logits to score (``evaluate`` failed on it with "'BaseModelOutputWithPast' object has no
        attribute 'logits'")."""
        get = getattr(model, "get_output_embeddings", None)
        proj = get() if callable(get) else None
        if proj is None:
            raise ValueError(
                f"{type(model).__name__} has no output embedding (get_output_embeddings() gives None), so it "
                "computes no logits to score: pass the causal LM (a *ForCausalLM, e.g. from "
                "AutoModelForCausalLM.from_pretrained), not its bare decoder"
            )
        cfg = text_config(model.config)  # the decoder's, as everything else in kvbits reads it
        scale = 1.0
        cohere = getattr(model, "logit_scale", None)  # CohereForCausalLM & co: logits * self.logit_scale
        if is_number(cohere):
            scale *= float(cohere)
        granite = getattr(cfg, "logits_scaling", None)  # Granite family: logits / config.logits_scaling
        if is_number(granite) and granite:
            # HyperCLOVAX multiplies by it (MuP), where Granite divides: dividing was off by logits_scaling ** 2
            multiplies = getattr(cfg, "model_type", None) in _MULTIPLY_LOGITS_SCALING
            scale = scale * float(granite) if multiplies else scale / float(granite)
        falcon = getattr(cfg, "lm_head_multiplier", None)  # Falcon-H1: logits * config.lm_head_multiplier
        if is_number(falcon):
            scale *= float(falcon)
        softcap = getattr(cfg, "final_logit_softcapping", None)
        return cls(proj, scale, float(softcap) if softcap else None)

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.proj, "out_features", None) or self.proj.weight.shape[0])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.proj(hidden).float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def check_logit_head(
    head: LogitHead, hidden: torch.Tensor, logits: torch.Tensor, *, tolerance: float
) -> float:
    """Check that ``head(hidden)`` gives the model's own ``logits`` (both ``(N, ...)`` for the same
    positions), so a post-processing the head does not know can not go unnoticed into the metrics.

    The measure is, per position, ``std(head - model) / std(model)`` over the vocabulary (a constant
    shift changes no probability): a missing factor ``s`` on the logits gives ``|1 - 1/s|``, rounding
    in float32 ~1e-6, in bfloat16 ~1e-2.

    Returns:
        The largest relative difference.

    Raises:
        RuntimeError: it exceeds ``tolerance``, or the model's logits are not finite.
    """
    ours = head(hidden).double()
    theirs = logits.double().reshape(ours.shape)
    bad = int((~torch.isfinite(theirs)).any(dim=-1).sum())
    if bad:
        raise RuntimeError(
            f"the model's own logits hold NaN or inf at {bad} of {theirs.shape[0]} positions (unquantized, before "
            "any KV scheme): its weights or inputs are broken, so no PPL or KL can be measured"
        )
    err = float(((ours - theirs).std(dim=-1) / theirs.std(dim=-1).clamp_min(1e-12)).max())
    if not err <= tolerance:  # also NaN
        raise RuntimeError(
            f"the logits kvbits computes from the final hidden states differ from the model's own logits "
            f"(relative difference {err:.3g} > {tolerance:g} on {ours.shape[0]} positions): the model "
            "post-processes its logits in a way kvbits does not reproduce (known: the output embedding, "
            "final_logit_softcapping, logits_scaling, logit_scale, lm_head_multiplier), so its PPL and KL would be wrong"
        )
    return err


def exact_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """float64 log-probabilities ``(..., V)`` over the last axis of ``logits`` ``(..., V)`` (any float dtype;
    ``-inf`` for masked entries): the KL of two nearly equal distributions is a sum of differences of
    log-probabilities ~-20 whose float32 rounding (~1e-6 each) does not cancel; float32 overstated a KL of 2.5e-7
    by a median 50 % per token and one of 2.5e-9 thirteenfold. Every KL kvbits reports goes through here."""
    return torch.log_softmax(logits.double(), dim=-1)


def kl_divergence(lp_ref: torch.Tensor, lp: torch.Tensor, p_ref: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(ref || other)`` in nats ``(...)`` from log-probabilities ``(..., V)`` (:func:`exact_log_softmax`).

    Terms where the reference has probability 0 contribute 0 (masked entries ``-inf`` in both included); the
    result is clamped at 0 (rounding), NaN stays NaN. ``p_ref``: ``lp_ref.exp()`` when the caller already holds
    it (one reference against several schemes). One ``(..., V)`` temporary, worked in place.
    """
    if lp_ref.shape != lp.shape:
        raise ValueError(f"log-probabilities must have one shape, got {tuple(lp_ref.shape)} and {tuple(lp.shape)}")
    p_ref = lp_ref.exp() if p_ref is None else p_ref
    d = lp_ref - lp
    d.mul_(p_ref).masked_fill_(p_ref == 0, 0.0)
    return d.sum(-1).clamp_min(0.0)


def _logprobs(head: LogitHead, hidden: torch.Tensor) -> torch.Tensor:
    """float64 log-probabilities ``(N, vocab)`` of the float32 logits ``head(hidden)`` (:func:`exact_log_softmax`)."""
    return exact_log_softmax(head(hidden))


@torch.no_grad()
def token_metrics(
    head: LogitHead | torch.nn.Module,
    hidden_ref: torch.Tensor,
    hidden: Sequence[torch.Tensor],
    targets: torch.Tensor,
    *,
    softcap: float | None = None,
    chunk: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per-token metrics of one window for several runs against one reference run.

    Args:
        head: hidden -> logits: a :class:`LogitHead` (``LogitHead.from_model(model)``), or the bare
            output embedding (then ``softcap`` is its only post-processing).
        hidden_ref: final hidden states of the reference run, ``(N, hidden)`` for the ``N`` positions
            that predict ``targets``.
        hidden: the same for each scheme run.
        targets: ``(N,)`` the token each position predicts.
        softcap: ``final_logit_softcapping`` of the config (Gemma 2/3), with a bare output embedding.
        chunk: positions per logits chunk (default from the vocabulary size).

    Returns:
        One dict per scheme run, float32 CPU tensors ``(N,)``: ``nll``, ``nll_ref``, ``kl``
        (``KL(ref || scheme)`` in nats, from float64 log-probabilities of the float32 logits) and ``top1`` (1.0
        where both argmaxes agree).
    """
    n = targets.shape[0]
    if hidden_ref.shape[0] != n or any(h.shape[0] != n for h in hidden):
        raise ValueError(
            f"hidden states must have one row per target ({n}); got reference {tuple(hidden_ref.shape)} and "
            f"{[tuple(h.shape) for h in hidden]}"
        )
    if not isinstance(head, LogitHead):
        head = LogitHead(head, softcap=softcap)
    elif softcap is not None:
        raise ValueError("softcap is part of the LogitHead; pass it there, not to token_metrics")
    chunk = chunk or logits_chunk_size(head.vocab_size)
    out = [{k: torch.empty(n, dtype=torch.float32) for k in TOKEN_FIELDS} for _ in hidden]
    tgt = targets.to(hidden_ref.device).long()
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lp_ref = _logprobs(head, hidden_ref[a:b])
        t = tgt[a:b, None]
        nll_ref = -lp_ref.gather(-1, t).squeeze(-1)
        p_ref = lp_ref.exp()
        top_ref = lp_ref.argmax(-1)
        for h, rec in zip(hidden, out):
            lp = _logprobs(head, h[a:b])
            rec["nll_ref"][a:b] = nll_ref.cpu()
            rec["nll"][a:b] = (-lp.gather(-1, t).squeeze(-1)).cpu()
            rec["kl"][a:b] = kl_divergence(lp_ref, lp, p_ref).cpu()
            rec["top1"][a:b] = (lp.argmax(-1) == top_ref).float().cpu()
            del lp
    return out


# -------------------------------------------------------------------------------------- buckets


def bucket_bounds(n_positions: int, first: int = 0) -> list[tuple[int, int]]:
    """Buckets of positions ``[first, n_positions)``: ``[0, 1K), [1K, 2K), [2K, 4K)``, ... doubling.

    Each bucket is cut to the scored range; empty buckets are left out. ``hi`` is exclusive, so a
    window of ``T`` tokens (``T - 1`` predicting positions) ends its last bucket at ``T - 1``.
    """
    edges = list(BUCKET_EDGES)
    while edges[-1] < n_positions:
        edges.append(edges[-1] * 2)
    out = []
    for lo, hi in itertools.pairwise(edges):
        lo_c, hi_c = max(lo, first), min(hi, n_positions)
        if hi_c > lo_c:
            out.append((lo_c, hi_c))
    return out


@dataclass(frozen=True)
class BucketRecord:
    """Sums of one scheme x window x bucket (one line of ``records.jsonl``)."""

    scheme: str
    window: int
    lo: int
    hi: int
    tokens: int
    nll_sum: float
    nll_ref_sum: float
    kl_sum: float
    top1_sum: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def bucket_records(scheme: str, per_token: dict[str, np.ndarray], first: int = 0) -> list[BucketRecord]:
    """Per window x bucket sums of ``per_token`` arrays ``(W, N)`` (float64 sums)."""
    W, N = per_token["nll"].shape
    rows = []
    for w in range(W):
        for lo, hi in bucket_bounds(N, first):
            sl = slice(lo, hi)
            rows.append(
                BucketRecord(
                    scheme,
                    w,
                    lo,
                    hi,
                    hi - lo,
                    *(
                        float(np.sum(per_token[k][w, sl], dtype=np.float64))
                        for k in ("nll", "nll_ref", "kl", "top1")
                    ),
                )
            )
    return rows


def bootstrap_delta_rel(
    d: np.ndarray,
    *,
    chunk: int = BOOTSTRAP_CHUNK,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``PPL / PPL_ref - 1 = exp(mean(nll - nll_ref)) - 1``.

    Args:
        d: ``(W, n)`` per-token ``nll - nll_ref`` of one bucket in ``W`` windows (paired: both runs
            scored the same tokens, so the difference is resampled as one unit).
        chunk: tokens per resampling unit; each window's bucket is cut into contiguous chunks (the
            last one may be shorter) and chunks are drawn with replacement across all windows.

    Returns:
        ``(lo, hi)``; ``(nan, nan)`` with fewer than two resampling units (one window whose bucket holds at
        most ``chunk`` tokens): every resample is then that one unit, and the interval collapsed onto the point
        estimate, a zero-width "95% CI" (a 75-token tail bucket read ``[3.98 %, 3.98 %]`` for a ΔPPL whose standard
        error was 5.6 %).
    """
    sums, counts = [], []
    for row in np.atleast_2d(d):
        for a in range(0, row.shape[0], chunk):
            part = row[a : a + chunk]
            sums.append(float(np.sum(part, dtype=np.float64)))
            counts.append(part.shape[0])
    if len(sums) < 2:  # nothing to resample: no spread to measure, not a zero-width interval
        return (math.nan, math.nan)
    s, c = np.asarray(sums), np.asarray(counts, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(s), size=(resamples, len(s)))
    with np.errstate(over="ignore"):  # a mean difference past ~709 nats: +inf, as summarize says it
        stats = np.expm1(s[idx].sum(axis=1) / c[idx].sum(axis=1))
    alpha = (1.0 - level) / 2
    big = np.finfo(np.float64).max  # +inf resamples as the largest float, so quantiles interpolate no inf - inf
    lo, hi = (math.inf if v >= big else float(v) for v in np.quantile(np.minimum(stats, big), [alpha, 1.0 - alpha]))
    return lo, hi


def _exp(x: float, minus_one: bool = False) -> float:
    """``exp(x)`` (``expm1`` with ``minus_one``), ``+inf`` past float64's range (a mean NLL above ~709 nats)
    instead of ``OverflowError``: the report prints an infinite PPL or ΔPPL as such."""
    try:
        return math.expm1(x) if minus_one else math.exp(x)
    except OverflowError:
        return math.inf


def _ppl(nll_sum: float, n: int) -> float:
    return _exp(nll_sum / n) if n else math.nan


def summarize(
    per_token: dict[str, np.ndarray],
    *,
    first: int = 0,
    seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> dict[str, Any]:
    """Overall and per-bucket metrics of one scheme from per-token arrays ``(W, N)``.

    Only positions ``t >= first`` are scored (prefill semantics: the continuation).

    Returns ``{"ppl", "ppl_ref", "kl", "top1", "tokens", "buckets": [{"lo", "hi", "tokens", "ppl",
    "ppl_ref", "delta_rel", "delta_rel_ci", "kl", "top1"}]}``; ``kl`` is the mean per-token KL in
    nats and ``top1`` the fraction of positions whose argmax agrees with the reference; ``delta_rel_ci``
    is ``[nan, nan]`` for a bucket of one resampling unit (:func:`bootstrap_delta_rel`).
    """
    nll, nll_ref, kl, top1 = (np.asarray(per_token[k], dtype=np.float64) for k in TOKEN_FIELDS)
    shapes = {k: a.shape for k, a in zip(TOKEN_FIELDS, (nll, nll_ref, kl, top1))}
    if nll.ndim != 2 or len(set(shapes.values())) > 1:  # (N,) failed with "not enough values to unpack"
        raise ValueError(f"per_token arrays must all be (windows, positions), got shapes {shapes}")
    W, N = nll.shape
    buckets = []
    for i, (lo, hi) in enumerate(bucket_bounds(N, first)):
        sl = (slice(None), slice(lo, hi))
        n = W * (hi - lo)
        s, s_ref = float(nll[sl].sum()), float(nll_ref[sl].sum())
        ci = bootstrap_delta_rel(nll[sl] - nll_ref[sl], seed=seed + i, resamples=resamples)
        buckets.append(
            {
                "lo": lo,
                "hi": hi,
                "tokens": n,
                "ppl": _ppl(s, n),
                "ppl_ref": _ppl(s_ref, n),
                "delta_rel": _exp((s - s_ref) / n, minus_one=True),
                "delta_rel_ci": [ci[0], ci[1]],
                "kl": float(kl[sl].sum()) / n,
                "top1": float(top1[sl].sum()) / n,
            }
        )
    sl = (slice(None), slice(first, N))
    n = W * max(0, N - first)
    return {
        "ppl": _ppl(float(nll[sl].sum()), n),
        "ppl_ref": _ppl(float(nll_ref[sl].sum()), n),
        "kl": float(kl[sl].sum()) / n if n else math.nan,
        "top1": float(top1[sl].sum()) / n if n else math.nan,
        "tokens": n,
        "buckets": buckets,
    }


def attn_error_buckets(
    errors: dict[int, np.ndarray], n_positions: int, first: int = 0
) -> list[dict[str, Any]]:
    """Mean relative attention-output error by bucket of query positions, per sampled layer.

    Args:
        errors: layer -> ``(W, T)`` relative error per window and query position.
        n_positions: predicting positions per window (``T - 1``): buckets match the token buckets.
        first: first scored position.
    """
    out = []
    for layer in sorted(errors):
        e = np.asarray(errors[layer], dtype=np.float64)
        out.append(
            {
                "layer": int(layer),
                "buckets": [
                    {"lo": lo, "hi": hi, "rel_err": float(e[:, lo:hi].mean())}
                    for lo, hi in bucket_bounds(n_positions, first)
                ],
            }
        )
    return out


def attn_entropy_buckets(
    entropy: dict[int, np.ndarray],
    entropy_ref: dict[int, np.ndarray],
    n_positions: int,
    first: int = 0,
) -> list[dict[str, Any]]:
    """Mean attention entropy by bucket of query positions, per sampled layer.

    Args:
        entropy: layer -> ``(W, T)`` entropy (nats, mean over query heads) of each query's attention
            with the quantized K/V, per window and query position.
        entropy_ref: the same with exact K/V for the same queries.
        n_positions: predicting positions per window (``T - 1``): buckets match the token buckets.
        first: first scored position.

    Returns:
        ``[{"layer", "buckets": [{"lo", "hi", "entropy", "entropy_ref", "delta"}]}]``; ``delta =
        entropy - entropy_ref`` (> 0: quantization flattened the attention, < 0: sharpened it).
    """
    out = []
    for layer in sorted(entropy):
        e = np.asarray(entropy[layer], dtype=np.float64)
        r = np.asarray(entropy_ref[layer], dtype=np.float64)
        buckets = []
        for lo, hi in bucket_bounds(n_positions, first):
            h, h_ref = float(e[:, lo:hi].mean()), float(r[:, lo:hi].mean())
            # the mean of the per-position differences: equal to h - h_ref up to rounding, and 0
            # exactly when every position agrees
            delta = float((e[:, lo:hi] - r[:, lo:hi]).mean())
            buckets.append({"lo": lo, "hi": hi, "entropy": h, "entropy_ref": h_ref, "delta": delta})
        out.append({"layer": int(layer), "buckets": buckets})
    return out
