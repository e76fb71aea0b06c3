"""Whether a calibration saw the text an evaluation scores (``kvbits eval`` on its own calibration text).

A calibrated scheme's scales, codebooks and channel vectors were fitted to the K/V of its calibration windows;
scoring it on those very windows (or on the rest of the same text) flatters it. ``kvbits calibrate`` records the
calibration data's content hash (``data.sha256``: the text file's bytes, or the int64 token ids given), the
tokenizer (``data.tokenizer``) and where its windows start in the tokenized text (``data.starts``; ``data.rows`` for
windows given as a ``(W, T)`` tensor, recorded since this check, and their ``T``, ``data.row_width``, since later),
so an evaluation can tell and say how many of the tokens it scores were calibration tokens.

The same text given once as a file and once as its token ids (``(N,)``, as ``tokenize`` gives them) is caught too:
an artifact calibrated on a text file records its token ids' hash as well (``data.ids_sha256``, since this check), and
an evaluation of a text file against an artifact calibrated on ``(N,)`` ids hashes its own token ids. ``(W, T)``
windows that are the calibrated ``(N,)`` ids reshaped have the same bytes: the same text, the same token sequence
(row ``r`` its tokens ``r * T .. (r + 1) * T - 1``), so their overlap is counted too; so is that of calibrated
``(W, T)`` ids evaluated in another shape (``(4, 512)`` as ``(2, 1024)`` or ``(N,)``) or as their text, by
``data.row_width`` (an older artifact without it: counted for ``(W, T)`` ids as the same shape, not for ``(N,)``
ids, and not the same text as a file). Not caught: ``(W, T)``
windows of other bytes than the ``(N,)`` ids or the text (cut by ``make_windows``, which drops the tail), ids of
another tokenization, a slice of the text, and artifacts written before ``data.ids_sha256`` that were calibrated on a
file and are evaluated on ids.

``kvbits eval`` and ``kvbits needle`` (passkey retrieval scored on a haystack cut from the text) check it before the
run, and ``kvbits eval`` again when ``--out`` holds the finished run it reuses (:func:`warn_stored`). ``kvbits speed``
does not: it measures time and bytes, which calibrating on the text does not flatter (its greedy-token agreement is a
sanity check, not a quality figure).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from kvbits._spelling import spell

logger = logging.getLogger(__name__)

__all__: list[str] = []

# measured once (kvbits eval, SmolLM2-135M, float32, CPU, wikitext2 at 512 tokens, 2 windows; reference PPL 26.82):
# kvquant-2 calibrated on wikitext2 (4 windows of 512 tokens, the first of them the first window scored: 512 of the
# 1,024 tokens scored) against calibrated on pride-and-prejudice (4 windows of 512). The gap mixes the shared windows
# with the shared domain: both are what calibrating on the evaluated text buys.
MEASURED = (
    "on SmolLM2-135M, kvquant-2 on wikitext2 at 512 tokens scored PPL 38.71 and KL 0.331 calibrated on wikitext2 "
    "itself, 39.94 and 0.364 calibrated on pride-and-prejudice"
)


def content_sha256(data: Any) -> str | None:
    """The evaluated data's content hash as ``kvbits calibrate`` records it (``data.sha256``): a ``TextSource``'s
    ``sha256`` (of the file's bytes), the sha256 of token ids' int64 bytes (a ``(N,)`` or ``(W, T)`` tensor); None for
    anything else."""
    if isinstance(data, torch.Tensor):
        return hashlib.sha256(data.detach().long().cpu().numpy().tobytes()).hexdigest()
    sha = getattr(data, "sha256", None)
    return sha if isinstance(sha, str) else None


def _row_width(record: dict[str, Any]) -> int | None:
    """The row width ``T`` of the ``(W, T)`` ids a calibration record (an artifact's ``data``) was calibrated on
    (``data.row_width``, recorded since ``rows`` had no shape: ``(4, 512)`` evaluated as ``(2, 1024)`` counted row 3
    at 3 * 1024); None where it does not record one (older artifacts, text and ``(N,)`` ids)."""
    width = record.get("row_width")
    return width if isinstance(width, int) and not isinstance(width, bool) and width >= 1 else None


def _flat(record: dict[str, Any]) -> bool:
    """Whether ``record``'s windows are token positions of one flat sequence: ``starts`` (text, ``(N,)`` ids), or
    ``rows`` of a recorded ``row_width`` (row ``r`` at ``r * T``); not ``rows`` without it."""
    return record.get("rows") is None or _row_width(record) is not None


def _intervals(
    record: dict[str, Any], tokens_2d: bool, windows: int, context: int
) -> list[tuple[int, int]] | None:
    """The token ranges ``[start, end)`` the calibration windows ``record`` (an artifact's ``data``) names, as
    positions of the evaluated tokens (evaluated ``(W, T)`` ids have ``T == context``: row ``i`` is tokens
    ``i * context ..`` of their flat sequence, the same positions as for ``(N,)`` ids): ``starts``; or rows ``r`` of
    calibrated ``(W, T)`` ids at ``r * T`` (``data.row_width``), their first ``min(T, calibrated context)``
    tokens, whatever shape the same bytes are evaluated in. An older record of ``rows`` without ``row_width``: for
    ``(W, T)`` ids evaluated, row ``r`` at ``r * context`` (rows ``0 .. windows - 1``, as the same shape), and None
    for ``(N,)`` ids. None where the record does not name them."""
    cal = record.get("context")
    if not isinstance(cal, int):
        return None
    rows = record.get("rows")
    width = _row_width(record)
    if isinstance(rows, list) and width is not None:
        return [(r * width, r * width + min(width, cal)) for r in rows if isinstance(r, int) and r >= 0]
    if isinstance(rows, list) and tokens_2d:
        return [(r * context, r * context + min(context, cal)) for r in rows if isinstance(r, int) and 0 <= r < windows]
    starts = record.get("starts")
    if rows is not None or not isinstance(starts, list):
        return None
    text = cal - (record.get("bos") == "always")  # a window with a BOS holds context - 1 text tokens
    return [(s, s + text) for s in starts if isinstance(s, int)]


def _count(intervals: list[tuple[int, int]], spans: list[tuple[int, int]]) -> int:
    """Tokens of ``spans`` (``(start, length)``, each counted on its own) inside the union of ``intervals``
    (``[start, end)``; overlapping ones, as the windows of two calibrations a composed artifact joins, count once)."""
    merged: list[list[int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    total = 0
    for a, n in spans:
        b = a + n
        total += sum(max(0, min(b, e) - max(a, s)) for s, e in merged)
    return total


def _data_records(artifact: Any) -> list[dict[str, Any]]:
    """``artifact``'s calibration data records: ``meta["data"]`` (``{}`` where it has none), or for an artifact
    ``compose_artifact`` built (a tuned mix) each source's (``meta["composed"]["sources"][i]["data"]``: its own
    ``meta["data"]`` keeps only what all sources agree on, so a mix with one layer calibrated on the evaluated
    text and another on other text recorded no hash and was not judged)."""
    meta = getattr(artifact, "meta", None) or {}
    sources = (meta.get("composed") or {}).get("sources") if isinstance(meta.get("composed"), dict) else None
    if isinstance(sources, list) and sources:
        records = [s.get("data") for s in sources if isinstance(s, dict)]
        return [r if isinstance(r, dict) else {} for r in records] or [{}]
    data = meta.get("data") or {}
    return [data if isinstance(data, dict) else {}]


def _judge(
    data: dict[str, Any],
    sha256: str | None,
    tokenizer_fp: str | None,
    tokens_2d: bool,
    windows: int,
    context: int,
    ids_sha256: str | None,
) -> tuple[bool | None, list[tuple[int, int]] | None]:
    """``(same text, calibration token ranges in the evaluated tokens' positions)`` for one calibration data
    record: as ``eval_text_record`` says, the ranges None where not known (and where not the same text)."""
    recorded = data.get("sha256")
    if not isinstance(recorded, str) or sha256 is None:
        return None, None
    same = recorded == sha256
    if same and data.get("tokenizer") == tokenizer_fp:  # token positions of one tokenization (the same bytes in
        return True, _intervals(data, tokens_2d, windows, context)  # any shape: one sequence, row r at r * T)
    if not same and not tokens_2d and (
        (tokenizer_fp is None and data.get("ids_sha256") == sha256)  # ids evaluated, their text calibrated on
        or (ids_sha256 is not None and data.get("tokenizer") is None and _flat(data)
            and recorded == ids_sha256)  # text evaluated, its ids calibrated on ((N,), or (W, T) of a known T)
    ):  # fmt: skip
        return True, _intervals(data, False, windows, context)  # one token sequence: its positions are the same
    return same, None


def eval_text_record(
    artifact: Any,
    sha256: str | None,
    tokenizer_fp: str | None,
    *,
    tokens_2d: bool,
    windows: int,
    context: int,
    ids_sha256: str | None = None,
    spans: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """``{"calibrated_on_eval_text", "calibration_overlap_tokens"}`` for one scheme's results: whether ``artifact``'s
    calibration data has the evaluated data's content hash ``sha256`` (``content_sha256``; None: either side does
    not record one, not known), and how many of the ``windows * context`` evaluated tokens were calibration tokens
    (None where not known: another tokenizer than ``tokenizer_fp``, or an artifact that records no window starts).

    The same tokens in the other form count as the same text, with the same token positions: ``(N,)`` ids (then
    ``sha256``) equal to the token ids of the text calibrated on (``data.ids_sha256``), or the evaluated text's
    token ids (``ids_sha256``, its ``content_sha256``) equal to the ``(N,)`` ids calibrated on. Text and ``(N,)``
    ids are evaluated as ``[0, windows * context)`` (``make_windows``), ``(W, T)`` ids as rows ``0 .. windows - 1``;
    ``spans``: ``(start, length)`` token ranges of the text scored instead (``kvbits needle``'s haystacks), each
    counted on its own. A composed artifact (a tuned mix) is judged by each source calibration's record: the same text
    where any source's is, its tokens the union of theirs."""
    judged = [
        _judge(d, sha256, tokenizer_fp, tokens_2d, windows, context, ids_sha256) for d in _data_records(artifact)
    ]
    if not any(same for same, _ in judged):
        unknown = any(same is None for same, _ in judged)
        return {"calibrated_on_eval_text": None if unknown else False, "calibration_overlap_tokens": None if unknown
                else 0}  # fmt: skip
    ranges = [iv for same, iv in judged if same]
    overlap = None
    if all(iv is not None for iv in ranges):
        overlap = _count([x for iv in ranges for x in iv or []], spans if spans is not None else [(0, windows * context)])
    return {"calibrated_on_eval_text": True, "calibration_overlap_tokens": overlap}


def _needs_ids_hash(calibrations: dict[str, Any], sha256: str | None) -> bool:
    """Whether an evaluated text's token ids must be hashed: some artifact (or a source of a composed one) was
    calibrated on ids of other bytes than the text's (its ``data.tokenizer`` null; ``(N,)``, or ``(W, T)`` with
    ``data.row_width``)."""
    for art in calibrations.values():
        for data in _data_records(art):
            rec = data.get("sha256")
            if isinstance(rec, str) and rec != sha256 and data.get("tokenizer") is None and _flat(data):
                return True
    return False


def _records(
    calibrations: dict[str, Any],
    data: Any,
    tokenizer: Any,
    text_ids: Callable[[], torch.Tensor],
    windows: int,
    context: int,
    spans: list[tuple[int, int]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Scheme name -> ``eval_text_record`` of its calibration for ``data`` (a ``TextSource`` tokenized by
    ``tokenizer``, or token ids ``(N,)`` / ``(W, T)``); ``text_ids``: the text's token ids ``(N,)``, called only where
    an artifact was calibrated on ids of other bytes than the text's (``_needs_ids_hash``)."""
    from kvbits.calibrate.calibrate import _tokenizer_fingerprint

    if not calibrations:
        return {}
    sha = content_sha256(data)
    is_ids = isinstance(data, torch.Tensor)
    tokenizer_fp = None if is_ids else _tokenizer_fingerprint(tokenizer)
    tokens_2d = is_ids and data.dim() == 2
    ids_sha = None
    if not is_ids and sha is not None and tokenizer is not None and _needs_ids_hash(calibrations, sha):
        ids_sha = content_sha256(text_ids())
    where = {"tokens_2d": tokens_2d, "windows": windows, "context": context, "ids_sha256": ids_sha, "spans": spans}
    return {name: eval_text_record(art, sha, tokenizer_fp, **where) for name, art in calibrations.items()}


def calibrated_on_eval_text(
    calibrations: dict[str, Any], data: Any, tokenizer: Any, windows: int, context: int, *, bos: bool = False
) -> dict[str, dict[str, Any]]:
    """Scheme name -> ``eval_text_record`` of its calibration, for an evaluation of ``windows`` windows of
    ``context`` tokens of ``data`` (a ``TextSource`` tokenized by ``tokenizer``, or token ids ``(N,)`` /
    ``(W, T)``). ``bos``: each window was a BOS and ``context - 1`` text tokens (``make_windows(..., bos_id)``), so
    the text scored is ``[0, windows * (context - 1))``, not ``[0, windows * context)``."""

    def text_ids() -> torch.Tensor:
        from kvbits.evaluate.data import tokenize

        return tokenize(data, tokenizer)  # the token cache's ids: no second tokenization

    spans = [(0, windows * (context - 1))] if bos and not (isinstance(data, torch.Tensor) and data.dim() == 2) else None
    return _records(calibrations, data, tokenizer, text_ids, windows, context, spans=spans)


def needle_text_record(
    calibrations: dict[str, Any], text: Any, tokenizer: Any, text_ids: torch.Tensor, spans: list[tuple[int, int]]
) -> dict[str, dict[str, Any]]:
    """Scheme name -> ``eval_text_record`` for ``kvbits needle``: haystacks cut from ``text`` (a ``TextSource``
    whose token ids are ``text_ids`` ``(N,)``) at ``spans`` (``(offset, tokens)`` per trial). The overlap counts the
    haystack tokens of all trials that lie in the calibration windows (a haystack token the needle's separator
    displaces still counts)."""
    return _records(calibrations, text, tokenizer, lambda: text_ids, 0, 0, spans=spans)


def warn_calibrated_on_eval_text(
    scheme: str,
    artifact: Any,
    record: dict[str, Any],
    windows: int,
    context: int,
    *,
    total: int | None = None,
    what: str = "evaluated tokens",
    unknown: str = "the artifact does not record which of its tokens it was fitted on",
) -> bool:
    """Log a warning when ``record`` (``eval_text_record``) says ``scheme``'s calibration saw the evaluated text:
    once per calibration (a calibration serves one scheme of a run). ``total``: the tokens scored (default
    ``windows * context``), named ``what``; ``unknown``: why the overlap is not known where it is None. Returns
    whether it warned."""
    if record.get("calibrated_on_eval_text") is not True:
        return False
    where = "" if getattr(artifact, "path", None) is None else f" ({artifact.path})"
    n = record.get("calibration_overlap_tokens")
    total = windows * context if total is None else total
    if n is None:
        overlap = unknown
    elif n:
        overlap = f"{n:,} of the {total:,} {what} ({n / max(total, 1):.0%}) lie in its calibration windows"
    else:
        overlap = f"none of the {total:,} {what} lie in its calibration windows, but the text is the same"
    logger.warning(
        "%s's calibration%s was fitted on the evaluated text (same sha256): %s, so its calibrated scales, codebooks "
        "or channel vectors saw these K/V and its PPL and KL flatter it (%s); calibrate on another text (kvbits "
        "calibrate --data OTHER) for a fair figure",
        scheme, where, overlap, MEASURED,
    )  # fmt: skip
    return True


def warn_bos_mismatch(scheme: str, artifact: Any, bos: str, *, served_as: str = "this evaluation's windows") -> bool:
    """Log a warning when ``scheme``'s calibration was fitted on windows cut with another BOS choice than the
    evaluation's (``bos``: ``"always"`` / ``"never"``; an artifact's ``data["bos"]``, ``"never"`` where it has none):
    the BOS is the attention sink, so the K/V the scales saw at the first positions are not those served.
    ``served_as`` names what was served (``"this run's trials"`` for ``kvbits needle``). Returns whether it warned."""
    cal = sorted({"always" if r.get("bos") == "always" else "never" for r in _data_records(artifact)})
    if cal == [bos]:
        return False
    where = "" if getattr(artifact, "path", None) is None else f" ({artifact.path})"
    fitted = {  # in words: "bos always" read as a setting's value, not as what the windows held
        ("always",): "windows that each start with the BOS token",
        ("never",): "windows without a BOS token (raw slices of the text)",
    }.get(tuple(cal), "windows some of which start with the BOS token")
    served = "start with the BOS token" if bos == "always" else "have none"
    again, other = spell(f"bos={bos!r}", f"--bos {bos}"), spell(f"bos={cal[0]!r}", f"--bos {cal[0]}")
    logger.warning(
        "%s's calibration%s was fitted on %s, but %s %s: the BOS is the attention sink, so "
        "its scales saw other keys and values at the first positions than those served (calibrate again with %s, "
        "or evaluate with %s)",
        scheme, where, fitted, served_as, served, again, other,
    )  # fmt: skip
    return True


def warn_stored(summary: dict[str, Any], calibrations: dict[str, Any], data: Any, data_path: str | None) -> None:
    """The warning of ``warn_calibrated_on_eval_text`` for a finished run ``kvbits eval --out`` reuses: from each
    result's stored ``calibrated_on_eval_text`` and ``calibration_overlap_tokens``; a summary written before them
    gets them (in ``summary``, not on disk) from the content hashes of ``calibrations`` and ``data`` (a text spec
    loaded from ``data_path``, a ``TextSource`` or token ids), which are exact; its overlap stays None (its token
    positions need the tokenizer, which a reused run does not load) unless the data are token ids."""
    if not calibrations:
        return
    W, T = summary.get("windows"), summary.get("context")
    if not isinstance(W, int) or not isinstance(T, int):
        return
    # with a BOS the text scored is W * (T - 1) tokens, as the live run says it (evaluate's total=)
    total = W * (T - (summary.get("bos") == "always"))
    sha: Any = ...
    for res in summary.get("results") or []:
        name = res.get("scheme") if isinstance(res, dict) else None
        if name not in calibrations:
            continue
        rec = res.get("calibration")
        if not isinstance(rec, dict):
            rec = res["calibration"] = {}
        unknown = "the artifact does not record which of its tokens it was fitted on"
        if "calibrated_on_eval_text" not in rec:  # a run stored before the record: recomputed from the hashes
            if sha is ...:
                sha = _stored_data_sha(data, data_path)
            is_ids = isinstance(data, torch.Tensor)
            new = eval_text_record(
                calibrations[name], sha, None, tokens_2d=is_ids and data.dim() == 2, windows=W, context=T
            )
            if not is_ids and new["calibrated_on_eval_text"]:
                new["calibration_overlap_tokens"] = None
            rec.update(new)
            unknown = "the stored run predates the count of the tokens it shares (overwrite to redo it)"
        warn_calibrated_on_eval_text(name, calibrations[name], rec, W, T, total=total, unknown=unknown)


def _stored_data_sha(data: Any, data_path: str | None) -> str | None:
    """``content_sha256`` of a reused run's data, loading a text spec's file (no tokenizer); None where it does not
    load (the run reused stays reused: the check is then not known)."""
    if isinstance(data, str):
        from kvbits.evaluate.data import load_text

        try:
            data = load_text(data, data_path)
        except (OSError, ValueError, KeyError) as e:
            logger.debug("the reused run's text %r does not load (%s): not checked against its calibrations", data, e)
            return None
    return content_sha256(data)
