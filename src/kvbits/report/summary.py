"""A run's numbers as typed records: ``summary.json`` -> :class:`RunSummary` of :class:`SchemeResult`.

The renderer (:mod:`.render`), the plots (:mod:`.plots`), the tables (:mod:`.tables`) and the CLI
all read these records, so they can never disagree about a number.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbits._json import describe, json_object, loads, mapping, objects, whole
from kvbits.report.fmt import DEFAULT_THRESHOLD, _num, _ok, bos_phrase, bucket_label, fmt_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "AttnLayer", "Bucket", "EntropyLayer", "Generation", "RunSummary", "SchemeResult", "calibration_record", "log_non_finite",
    "read_json",
]


def read_json(path: Path, check: Callable[[Any, Path], None] | None = None) -> Any:
    """A run's JSON file (``summary.json``, ``needle.json``, ...), ``ValueError`` naming it when it does not parse;
    ``check``: also called with the content and ``path`` (``check_speed``, ``check_needle``), which raise."""
    try:
        content = loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); was the run interrupted while writing it?") from exc
    if check is not None:
        check(content, path)
    return content


@dataclass(frozen=True)
class Bucket:
    """Metrics over the predicted-token positions ``[lo, hi)`` (averaged over all windows)."""

    lo: int
    hi: int
    tokens: int = 0
    ppl: float = math.nan
    ppl_ref: float = math.nan
    delta: float = math.nan  # relative ΔPPL, fraction
    ci: tuple[float, float] = (math.nan, math.nan)
    kl: float = math.nan
    top1: float = math.nan

    @property
    def label(self) -> str:
        return bucket_label(self.lo, self.hi)

    @property
    def judged(self) -> bool:
        """Whether the bucket has a ΔPPL to judge: a number, or +inf (worse than any budget); NaN is not."""
        return not math.isnan(self.delta)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "bucket") -> Bucket:
        """A bucket of ``summary.json``; ``ValueError`` naming ``where`` (its field path) without ``lo`` / ``hi``.

        ``delta_rel`` missing or NaN is derived from the PPLs when they allow it (an infinite ``ppl`` gives
        +inf: a failure); what stays NaN is a bucket the verdict does not judge. ``-inf`` can not be a ΔPPL
        (PPL >= 0) and reads as NaN.
        """
        d = mapping(d, where, "a position bucket object")
        lo, hi = whole(d, "lo", where), whole(d, "hi", where)
        ppl, ppl_ref = _num(d.get("ppl")), _num(d.get("ppl_ref"))
        delta = _num(d.get("delta_rel"))
        if math.isnan(delta) and (_ok(ppl) or ppl == math.inf) and _ok(ppl_ref) and ppl_ref > 0:
            delta = ppl / ppl_ref - 1
        if delta == -math.inf:
            delta = math.nan
        ci = d.get("delta_rel_ci") or (None, None)
        ci_t = (_num(ci[0]), _num(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else (math.nan,) * 2
        tokens = _num(d.get("tokens"))
        return cls(
            lo=lo, hi=hi, tokens=int(tokens) if _ok(tokens) else 0, ppl=ppl,
            ppl_ref=ppl_ref, delta=delta, ci=ci_t, kl=_num(d.get("kl")), top1=_num(d.get("top1")),
        )


@dataclass(frozen=True)
class AttnLayer:
    """Relative error of one sampled layer's attention output, per position bucket."""

    layer: int
    buckets: tuple[tuple[int, int, float], ...]  # (lo, hi, rel_err)


@dataclass(frozen=True)
class EntropyLayer:
    """Attention entropy of one sampled layer per position bucket (nats, mean over query heads):
    ``(lo, hi, entropy with the quantized K/V, entropy with exact K/V, delta)``."""

    layer: int
    buckets: tuple[tuple[int, int, float, float, float], ...]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], default_layer: int = 0, where: str = "attn_entropy") -> EntropyLayer:
        """One layer of ``attn_entropy``; ``ValueError`` naming ``where`` for a malformed entry."""
        d = mapping(d, where, "an object {layer, buckets}")
        rows = []
        for i, b in enumerate(objects(d.get("buckets"), f"{where}.buckets", "a position bucket object")):
            h, h_ref, delta = _num(b.get("entropy")), _num(b.get("entropy_ref")), _num(b.get("delta"))
            if not _ok(delta) and _ok(h) and _ok(h_ref):
                delta = h - h_ref
            at = f"{where}.buckets[{i}]"
            rows.append((whole(b, "lo", at), whole(b, "hi", at), h, h_ref, delta))
        return cls(layer=whole(d, "layer", where, default=default_layer), buckets=tuple(rows))


@dataclass(frozen=True)
class Generation:
    """Greedy continuations after each window (``results[].generation``; see
    ``kvbits.evaluate.generation``): rep-n of the scheme's and the reference's continuation
    (``{n: value}``, means over windows), agreement with the reference, first divergence per window."""

    new_tokens: int = 0
    prompt_tokens: int = 0
    rep: Mapping[int, float] = field(default_factory=dict)
    rep_ref: Mapping[int, float] = field(default_factory=dict)
    agreement: float = math.nan
    first_divergence: tuple[int, ...] = ()
    seconds: float = math.nan

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Generation:
        def reps(x: Any) -> dict[int, float]:
            if not isinstance(x, Mapping):
                return {}
            return {int(k): _num(v) for k, v in x.items() if str(k).isdigit()}

        div = d.get("first_divergence") if isinstance(d.get("first_divergence"), list) else []
        new, prompt = _num(d.get("new_tokens")), _num(d.get("prompt_tokens"))
        return cls(
            new_tokens=int(new) if _ok(new) else 0, prompt_tokens=int(prompt) if _ok(prompt) else 0,
            rep=reps(d.get("rep")), rep_ref=reps(d.get("rep_ref")), agreement=_num(d.get("agreement")),
            first_divergence=tuple(int(x) for x in div if _ok(_num(x))), seconds=_num(d.get("seconds")),
        )


@dataclass(frozen=True)
class SchemeResult:
    """One scheme's results, overall and per position bucket."""

    name: str
    avg_bits: float = math.nan
    bits_at_context: float = math.nan  # what the cache stores at the run's context (NaN: not recorded)
    ppl: float = math.nan
    ppl_ref: float = math.nan
    kl: float = math.nan
    top1: float = math.nan
    seconds: float = math.nan
    buckets: tuple[Bucket, ...] = ()
    attn: tuple[AttnLayer, ...] = ()
    entropy: tuple[EntropyLayer, ...] = ()
    generation: Generation | None = None  # with kvbits eval --generate
    calibration: Mapping[str, Any] = field(default_factory=dict)  # as in summary.json (see .calibration)
    decode: Mapping[str, Any] | None = None  # stream mode: {"fused_steps", "fallback_steps"}; else None

    @property
    def delta(self) -> float:
        """Overall relative ΔPPL (fraction), from the overall PPLs (+inf when ``ppl`` is)."""
        if (_ok(self.ppl) or self.ppl == math.inf) and _ok(self.ppl_ref) and self.ppl_ref > 0:
            return self.ppl / self.ppl_ref - 1
        return math.nan

    @property
    def is_baseline(self) -> bool:
        """True for an unquantized scheme (fp16, bf16, ...): it only checks the evaluation path."""
        from kvbits.schemes import get_scheme

        try:
            return bool(get_scheme(self.name).is_identity)
        except (ValueError, KeyError, TypeError):
            return _ok(self.avg_bits) and self.avg_bits >= 16

    @property
    def max_delta(self) -> float:
        """The worst bucket ΔPPL (+inf when a bucket's is), NaN without any; unjudged (NaN) buckets are skipped."""
        vals = [b.delta for b in self.buckets if b.judged]
        return max(vals) if vals else math.nan

    @property
    def unjudged(self) -> tuple[Bucket, ...]:
        """The buckets without a ΔPPL (missing or NaN in ``summary.json``): neither a pass nor a failure."""
        return tuple(b for b in self.buckets if not b.judged)

    def first_failure(self, threshold: float = DEFAULT_THRESHOLD) -> Bucket | None:
        """The first position bucket whose ΔPPL exceeds ``threshold`` (a fraction; +inf does), or None."""
        return next((b for b in self.buckets if b.judged and b.delta > threshold), None)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "result") -> SchemeResult:
        """One entry of ``results``; ``ValueError`` naming the field (under ``where``) that is malformed."""
        d = mapping(d, where, "a scheme result object")
        buckets = tuple(sorted(
            (Bucket.from_dict(b, f"{where}.buckets[{i}]")
             for i, b in enumerate(objects(d.get("buckets"), f"{where}.buckets", "a position bucket object"))),
            key=lambda b: b.lo,
        ))  # fmt: skip
        attn = tuple(
            _attn_layer(a, i, f"{where}.attn_error[{i}]")
            for i, a in enumerate(objects(d.get("attn_error"), f"{where}.attn_error", "a layer object"))
        )
        entropy = tuple(
            EntropyLayer.from_dict(a, i, f"{where}.attn_entropy[{i}]")
            for i, a in enumerate(objects(d.get("attn_entropy"), f"{where}.attn_entropy", "a layer object"))
        )
        gen = d.get("generation")
        return cls(
            name=str(d.get("scheme", "?")), avg_bits=_num(d.get("avg_bits")),
            bits_at_context=_num(d.get("bits_at_context")), ppl=_num(d.get("ppl")),
            ppl_ref=_num(d.get("ppl_ref")), kl=_num(d.get("kl")), top1=_num(d.get("top1")),
            seconds=_num(d.get("seconds")), buckets=buckets, attn=attn, entropy=entropy,
            generation=Generation.from_dict(gen) if isinstance(gen, Mapping) else None,
            calibration=calibration_record(d.get("calibration"), f"{where}.calibration"),
            decode=dict(d["decode"]) if isinstance(d.get("decode"), Mapping) else None,
        )


_CALIBRATION_COUNTS = ("max_calibrated_length", "positions_beyond_calibrated")


def calibration_record(value: Any, where: str = "calibration") -> dict[str, Any]:
    """``results[].calibration`` as a dict: ``{}`` when absent (or not an object: runs without one). ``ValueError``
    naming ``where.field`` for a field the report would misread: ``integer_zero`` that is not a list (of ``"keys"`` /
    ``"values"``), a negative ``max_calibrated_length`` or ``positions_beyond_calibrated`` (the evaluator writes
    counts >= 0; a hand-edited -5 printed "serves -5 positions beyond")."""
    if not isinstance(value, Mapping):
        return {}
    sides = value.get("integer_zero")
    if sides is not None and not isinstance(sides, list):
        raise ValueError(f"{where}.integer_zero is {describe(sides)}; expected a list of \"keys\" / \"values\"")
    for key in _CALIBRATION_COUNTS:
        n = _num(value.get(key))
        if _ok(n) and n < 0:
            raise ValueError(f"{where}.{key} is {describe(value[key])}; expected a whole number >= 0")
    return dict(value)


def _attn_layer(a: Mapping[str, Any], index: int, where: str) -> AttnLayer:
    """One layer of ``attn_error`` (``layer`` defaults to ``index``); ``ValueError`` naming ``where``."""
    rows = []
    for i, b in enumerate(objects(a.get("buckets"), f"{where}.buckets", "a position bucket object")):
        at = f"{where}.buckets[{i}]"
        rows.append((whole(b, "lo", at), whole(b, "hi", at), _num(b.get("rel_err"))))
    return AttnLayer(layer=whole(a, "layer", where, default=index), buckets=tuple(rows))


_EVAL_FIELDS = ("model", "data", "context", "semantics", "mode", "windows", "results")
"""The setting and results every ``kvbits eval`` summary.json records (``results`` is the one :meth:`RunSummary.parse`
requires)."""


@dataclass(frozen=True)
class RunSummary:
    """A whole ``summary.json``: the setting and one :class:`SchemeResult` per scheme."""

    model: str = "?"
    data: str = "?"
    context: int = 0
    semantics: str = "?"
    mode: str = "?"
    windows: int = 0
    bos: str = "never"  # "always": each window started with the tokenizer's BOS (a record without the field: never)
    bos_token: str | None = None  # the BOS's text ("<|im_start|>"); None where not recorded (runs before it)
    bos_token_id: int | None = None  # the BOS's id; None where not recorded
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    results: tuple[SchemeResult, ...] = ()
    reference_seconds: float = math.nan
    peak_rss_bytes: float = math.nan  # the evaluating process's peak resident set
    run_peak_rss_bytes: float = math.nan  # resident peak from the loaded model to the end of the run
    peak_cuda_bytes: float = math.nan  # torch's peak CUDA allocation over the run (CUDA runs only)
    world_size: int = 1  # ranks that evaluated (torch.distributed); seconds are summed over them
    # a merged run whose runs used different rank counts: (schemes, ranks) of each, the reference pass the first's
    # (ranks None: that run is itself such a merge)
    merged_ranks: tuple[tuple[tuple[str, ...], int | None], ...] = ()
    # a merged run: each run's own reference-pass seconds (``reference_seconds`` is the first's); () otherwise
    merged_reference_seconds: tuple[float, ...] = ()

    def bos_phrase(self, *, markdown: bool = True) -> str | None:
        """:func:`~.fmt.bos_phrase` of this run: ``"the BOS token `<|im_start|>` (id 1)"`` (its text and id where the
        record has them: a chat marker such as SmolLM2-Instruct's BOS is worth seeing), None without a BOS."""
        return bos_phrase({"bos": self.bos, "bos_token": self.bos_token, "bos_token_id": self.bos_token_id},
                          markdown=markdown)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSummary:
        """A parsed ``summary.json``: ``TypeError`` when it is not a mapping, ``ValueError`` naming the field
        (``results[2].buckets[0].lo``, ``fingerprint``) that is malformed."""
        if not isinstance(d, Mapping):
            raise TypeError(f"summary must be a mapping (parsed summary.json), got {type(d).__name__}")
        fingerprint = d.get("fingerprint")
        if fingerprint is not None:
            mapping(fingerprint, "fingerprint", 'an object such as {"model": "...", "tokens": "..."}')
        results = objects(d.get("results"), "results", "a scheme result object")
        ctx, win = _num(d.get("context")), _num(d.get("windows"))
        return cls(
            model=str(d.get("model", "?")), data=str(d.get("data", "?")),
            context=int(ctx) if _ok(ctx) else 0, semantics=str(d.get("semantics", "?")),
            mode=str(d.get("mode", "?")), windows=int(win) if _ok(win) else 0,
            bos="always" if d.get("bos") == "always" else "never",
            bos_token=d["bos_token"] if isinstance(d.get("bos_token"), str) else None,
            bos_token_id=d["bos_token_id"] if type(d.get("bos_token_id")) is int else None,
            fingerprint=dict(fingerprint or {}),
            results=tuple(SchemeResult.from_dict(r, f"results[{i}]") for i, r in enumerate(results)),
            reference_seconds=_num(d.get("reference_seconds")),
            peak_rss_bytes=_num(d.get("peak_rss_bytes")), peak_cuda_bytes=_num(d.get("peak_cuda_bytes")),
            run_peak_rss_bytes=_num(d.get("run_peak_rss_bytes")),
            world_size=int(d["world_size"]) if _ok(_num(d.get("world_size"))) else 1,
            merged_ranks=_merged_ranks(d),
            merged_reference_seconds=_merged_reference_seconds(d),
        )

    @classmethod
    def load(cls, path: str | Path) -> RunSummary:
        """Read a run folder's ``summary.json`` (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "summary.json"
        if not p.is_file():
            raise FileNotFoundError(f"no summary.json at {p}; is this an evaluation output folder?")
        return cls.parse(read_json(p), p)

    @classmethod
    def parse(cls, data: Any, path: str | Path) -> RunSummary:
        """:meth:`from_dict` of the parsed file ``path``: ``ValueError`` naming the file and the malformed field, or
        the eval fields it lacks when it has no ``results`` (every ``kvbits eval`` summary has that list, empty for a
        run without schemes): a JSON object of another kind is not reported as an empty "? on ?" run."""
        document = json_object(data, path, "a kvbits eval summary")
        if "results" not in document:
            missing = [k for k in _EVAL_FIELDS if k not in document]
            keys = ", ".join(map(str, list(document)[:8])) + (", ..." if len(document) > 8 else "")
            raise ValueError(
                f"{path} is not a kvbits eval summary: it has no {', '.join(missing)} (its fields: "
                f"{keys or 'none'}); expected the summary.json kvbits eval writes"
            )
        try:
            run = cls.from_dict(document)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        return run

    @classmethod
    def coerce(cls, summary: RunSummary | Mapping[str, Any] | str | Path) -> RunSummary:
        """A :class:`RunSummary` from a summary dict, a run folder, a summary.json path or itself."""
        if isinstance(summary, RunSummary):
            return summary
        if isinstance(summary, (str, Path)):
            return cls.load(summary)
        return cls.from_dict(summary)

    @property
    def bucket_spans(self) -> list[tuple[int, int]]:
        """All (lo, hi) bucket spans of any scheme, in position order."""
        return sorted({(b.lo, b.hi) for r in self.results for b in r.buckets})

    @property
    def ppl_ref(self) -> float:
        return next((r.ppl_ref for r in self.results if _ok(r.ppl_ref)), math.nan)

    @property
    def peak_memory(self) -> str:
        """``1.20 GiB resident (process peak), 3.50 GiB CUDA allocated (run peak)``: what the run
        recorded, or '' for neither (runs from before it was recorded). Run and process peaks that print
        alike are said once."""
        parts = []
        run = fmt_bytes(self.run_peak_rss_bytes) if _ok(self.run_peak_rss_bytes) and self.run_peak_rss_bytes > 0 else ""
        proc = fmt_bytes(self.peak_rss_bytes) if _ok(self.peak_rss_bytes) and self.peak_rss_bytes > 0 else ""
        if run and run == proc:
            parts.append(f"{run} resident (run peak, model loaded; also the process peak)")
        else:
            if run:
                parts.append(f"{run} resident (run peak, model loaded)")
            if proc:
                parts.append(f"{proc} resident (process peak)")
        if _ok(self.peak_cuda_bytes) and self.peak_cuda_bytes > 0:
            parts.append(f"{fmt_bytes(self.peak_cuda_bytes)} CUDA allocated (run peak)")
        return ", ".join(parts)


def _merged_ranks(d: Mapping[str, Any]) -> tuple[tuple[tuple[str, ...], int | None], ...]:
    """``(schemes, ranks)`` of each run of a merged summary whose runs differ in ``world_size`` (it is null then,
    ``merged_from`` names each run's, null for a run that is itself such a merge); ``()`` for any other summary."""
    sources = d.get("merged_from")
    if d.get("world_size") is not None or not isinstance(sources, list):
        return ()
    sources = [src for src in sources if isinstance(src, Mapping)]
    if not sources or any("world_size" not in src for src in sources):
        return ()  # a merge from before the rank counts were recorded
    return tuple(
        (tuple(str(x) for x in src.get("schemes") or ()), int(k) if _ok(k := _num(src["world_size"])) else None)
        for src in sources
    )


def log_non_finite(run: RunSummary, path: str | Path) -> None:
    """Warn (naming ``path``) about each scheme's buckets whose ΔPPL is NaN (not judged) or +inf (a failure)."""
    for r in run.results:
        if r.unjudged and len(r.unjudged) < len(r.buckets):
            logger.warning(
                "%s: %s has no ΔPPL (delta_rel and ppl missing or NaN) at %s; those buckets are not judged",
                path, r.name, ", ".join(b.label for b in r.unjudged),
            )  # fmt: skip
        infinite = [b.label for b in r.buckets if b.delta == math.inf]
        if infinite:
            logger.warning("%s: %s has an infinite ΔPPL at %s (judged as a failure)", path, r.name, ", ".join(infinite))


def _bucket_at(r: SchemeResult, span: tuple[int, int]) -> Bucket | None:
    return next((b for b in r.buckets if (b.lo, b.hi) == span), None)


def _merged_reference_seconds(d: Mapping[str, Any]) -> tuple[float, ...]:
    """Each merged run's reference-pass seconds (``merged_from``), NaN where a run records none; ``()`` for a
    summary that is not a merge or one from before they were recorded."""
    sources = d.get("merged_from")
    if not isinstance(sources, list) or not all(isinstance(src, Mapping) for src in sources):
        return ()
    if not sources or any("reference_seconds" not in src for src in sources):
        return ()
    return tuple(_num(src["reference_seconds"]) for src in sources)
