"""What ``tune`` reports beside its mix: the compared schemes, and the warnings when the mix is not the one to serve."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from kvbits._spelling import spell
from kvbits.schemes import KVScheme, check_unique_names
from kvbits.tune.inputs import tune_scheme

if TYPE_CHECKING:
    from kvbits.tune.search import TuneResult

logger = logging.getLogger(__name__)

__all__ = ["better_compared"]

def better_compared(result: TuneResult) -> list[dict[str, Any]]:
    """The compared schemes (``result.compare``) within the budget whose measured KL is below the mix's: a uniform
    scheme a user would rather serve than the tuned mix."""
    mix_kl = result.measured_kl
    if mix_kl is None or not math.isfinite(mix_kl):
        return []
    return [
        c for c in result.compare
        if c["avg_bits"] <= result.budget_bits and math.isfinite(c["measured_kl"]) and c["measured_kl"] < mix_kl
    ]  # fmt: skip


def _warn_better(result: TuneResult) -> None:
    """One warning per compared scheme within the budget that measured a lower KL than the mix."""
    for c in better_compared(result):
        logger.warning(
            "uniform %s (%.3f average bits, within the %g-bit budget) measured KL %.4g, below the tuned mix's %.4g "
            "(%.3f bits) on the same windows: the mix of the candidates is not the best choice at this budget; serve "
            "%s, or tune with candidates that include it",
            c["scheme"], c["avg_bits"], result.budget_bits, c["measured_kl"], result.measured_kl, result.avg_bits,
            c["scheme"],
        )  # fmt: skip


def _compared(compare: Any, cands: list[KVScheme], name: str) -> list[KVScheme]:
    """The ``compare`` schemes resolved: flat, none a candidate (already measured uniform under ``check``), none
    named as the mix or listed twice; ``ValueError`` naming the one at fault."""
    if compare is None:
        return []
    if isinstance(compare, (str, KVScheme)):
        compare = [compare]
    others = [tune_scheme(c, "compare") for c in compare]
    names = [c.name for c in cands]
    for s in others:
        if s.is_mixed:
            raise ValueError(f"compare {s.name!r}: compared schemes must be flat (one scheme for every layer)")
        if s.name in names:
            raise ValueError(
                f"compare {s.name!r} is a candidate, measured uniform beside the mix already (unless --no-check); "
                "compare schemes that are not candidates"
            )
        if s.name == name:
            raise ValueError(f"compare {s.name!r} has the mix's name; choose another --name")
    check_unique_names([s.name for s in others], "compared")
    return others


def _warn_beyond(shape: Any, mix: KVScheme, context: int, budget_bits: float) -> None:
    """Log one warning when ``shape`` has sliding layers and ``mix`` holds more than ``budget_bits`` at the model's
    max context (``shape.max_context``, when known and longer than ``context``): the budget was priced at the
    tuning context, where the windows weigh more than they will once the full layers have grown."""
    from kvbits.plan.planner import planned_bits

    longest = shape.max_context
    if longest is None or longest <= context or not any(layer.attention == "sliding" for layer in shape.layers):
        return
    there = planned_bits(shape, mix, longest)
    if there > budget_bits:
        logger.warning(
            "the mix holds %.3f average bits at the model's max context (%d tokens), over the %g-bit budget priced at "
            "the tuning context (%d tokens): the model has sliding layers, whose share of the bytes shrinks as the "
            "context grows; pass the context you will serve (%s) to price it there",
            there, longest, budget_bits, context, spell("serve_context=", "--serve-context"),
        )  # fmt: skip
