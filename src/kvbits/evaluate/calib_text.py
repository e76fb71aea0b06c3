"""Whether a calibration saw the text an evaluation scores (``kvbits eval`` on its own calibration text).

A calibrated scheme's scales, codebooks and channel vectors were fitted to the K/V of its calibration windows;
scoring it on those very windows (or on the rest of the same text) flatters it. ``kvbits calibrate`` records the
calibration data's content hash (``data.sha256``: the text file's bytes, or the int64 token ids given), the
tokenizer (``data.tokenizer``) and where its windows start in the tokenized text (``data.starts``; ``data.rows`` for
windows given as a ``(W, T)`` tensor, recorded since this check), so an evaluation can tell and say how many of the
tokens it scores were calibration tokens.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

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


def _overlap(record: dict[str, Any], tokens_2d: bool, windows: int, context: int) -> int | None:
    """Tokens of the ``windows`` evaluated windows of ``context`` tokens that lie in the calibration windows
    ``record`` (an artifact's ``data``) names, or None where it does not record them. Text and ``(N,)`` ids are
    evaluated as ``[0, windows * context)`` (``make_windows``); ``(W, T)`` ids as rows ``0 .. windows - 1``."""
    cal = record.get("context")
    if not isinstance(cal, int):
        return None
    if tokens_2d:
        rows = record.get("rows")
        if not isinstance(rows, list):
            return None
        return sum(min(context, cal) for r in rows if isinstance(r, int) and 0 <= r < windows)
    starts = record.get("starts")
    if not isinstance(starts, list):
        return None
    end = windows * context
    return sum(max(0, min(end, s + cal) - max(0, s)) for s in starts if isinstance(s, int))


def eval_text_record(
    artifact: Any, sha256: str | None, tokenizer_fp: str | None, *, tokens_2d: bool, windows: int, context: int
) -> dict[str, Any]:
    """``{"calibrated_on_eval_text", "calibration_overlap_tokens"}`` for one scheme's results: whether ``artifact``'s
    calibration data has the evaluated data's content hash ``sha256`` (``content_sha256``; None: either side does
    not record one, not known), and how many of the ``windows * context`` evaluated tokens were calibration tokens
    (None where not known: another tokenizer than ``tokenizer_fp``, or an artifact that records no window starts)."""
    data = (getattr(artifact, "meta", None) or {}).get("data") or {}
    recorded = data.get("sha256") if isinstance(data, dict) else None
    if not isinstance(recorded, str) or sha256 is None:
        return {"calibrated_on_eval_text": None, "calibration_overlap_tokens": None}
    same = recorded == sha256
    overlap = None
    if same and data.get("tokenizer") == tokenizer_fp:  # token positions of one tokenization
        overlap = _overlap(data, tokens_2d, windows, context)
    return {"calibrated_on_eval_text": same, "calibration_overlap_tokens": overlap if same else 0}


def calibrated_on_eval_text(
    calibrations: dict[str, Any], data: Any, tokenizer: Any, windows: int, context: int
) -> dict[str, dict[str, Any]]:
    """Scheme name -> ``eval_text_record`` of its calibration, for an evaluation of ``windows`` windows of
    ``context`` tokens of ``data`` (a ``TextSource`` tokenized by ``tokenizer``, or token ids ``(N,)`` /
    ``(W, T)``)."""
    from kvbits.calibrate.calibrate import _tokenizer_fingerprint

    if not calibrations:
        return {}
    sha = content_sha256(data)
    is_ids = isinstance(data, torch.Tensor)
    tokenizer_fp = None if is_ids else _tokenizer_fingerprint(tokenizer)
    tokens_2d = is_ids and data.dim() == 2
    return {
        name: eval_text_record(art, sha, tokenizer_fp, tokens_2d=tokens_2d, windows=windows, context=context)
        for name, art in calibrations.items()
    }


def warn_calibrated_on_eval_text(scheme: str, artifact: Any, record: dict[str, Any], windows: int, context: int) -> bool:
    """Log a warning when ``record`` (``eval_text_record``) says ``scheme``'s calibration saw the evaluated text:
    once per calibration (a calibration serves one scheme of a run). Returns whether it warned."""
    if record.get("calibrated_on_eval_text") is not True:
        return False
    where = "" if getattr(artifact, "path", None) is None else f" ({artifact.path})"
    n = record.get("calibration_overlap_tokens")
    total = windows * context
    if n is None:
        overlap = "the artifact does not record which of its tokens it was fitted on"
    elif n:
        overlap = f"{n:,} of the {total:,} evaluated tokens ({n / total:.0%}) lie in its calibration windows"
    else:
        overlap = f"none of the {total:,} evaluated tokens lie in its calibration windows, but the text is the same"
    logger.warning(
        "%s's calibration%s was fitted on the evaluated text (same sha256): %s, so its calibrated scales, codebooks "
        "or channel vectors saw these K/V and its PPL and KL flatter it (%s); calibrate on another text (kvbits "
        "calibrate --data OTHER) for a fair figure",
        scheme, where, overlap, MEASURED,
    )  # fmt: skip
    return True
