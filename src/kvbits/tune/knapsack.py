"""The choice of one candidate per layer over measured costs: a multiple-choice knapsack, solved exactly.

The assignment of least summed cost (``kvbits tune``'s sensitivities) whose bits stay within a budget, by
dynamic programming over integer weights: either every layer weighs the same (``choose_layers``: average bits,
read as exact fractions) or each layer is priced by the bytes it really holds (``choose_layers_by_bytes``:
``kvbits plan``'s ``avg_bits``).
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any

__all__ = ["BIT_DENOMINATOR", "choose_layers", "choose_layers_by_bytes"]

BIT_DENOMINATOR = 1 << 20  # bits are ratios of bytes to elements: read as fractions of at most this denominator


def _fraction(x: float, *, budget: bool = False) -> Fraction:
    """The fraction a float stands for: the simplest one of denominator <= ``BIT_DENOMINATOR`` within float64's
    rounding of ``x`` (``4.333333333333333`` -> 13/3), else ``x``'s exact binary value. A ``budget`` is read as such
    a fraction only when float64 rounds it to ``x`` itself: one a few ulps above it (13/3 for ``4.333333333333332``)
    would let a mix's float ``avg_bits`` exceed the budget."""
    x = float(x)  # numpy's float32 too (Fraction takes only Python floats and rationals)
    exact = Fraction(x)
    near = exact.limit_denominator(BIT_DENOMINATOR)
    if budget:
        return near if float(near) == x else exact
    return near if abs(near - exact) <= abs(exact) * Fraction(1, 1 << 50) else exact


def _is_int(x: Any) -> bool:
    """A Python or NumPy integer (``numbers.Integral``), not a bool and not a float that equals an int."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_budget(budget_bits: Any) -> None:
    """``ValueError`` unless ``budget_bits`` is a finite real number > 0 (not a bool, a string or NaN/inf, which
    ``Fraction`` would take as 1, parse, or refuse with an ``OverflowError`` of its own)."""
    if (
        isinstance(budget_bits, bool)
        or not isinstance(budget_bits, numbers.Real)
        or not math.isfinite(budget_bits)
        or budget_bits <= 0
    ):
        raise ValueError(f"budget_bits must be a positive number, got {budget_bits!r}")


def _units(bits: list[float], budget_bits: float, n: int) -> tuple[list[int], int]:
    """The candidates' bits and the budget of ``n`` layers in exact knapsack units: each number read as the
    fraction it stands for (``4.333...`` as 13/3, a budget ``5.67`` as 567/100; denominators up to
    ``BIT_DENOMINATOR``), all over their common denominator, so no mix within the budget is lost to rounding;
    ``ValueError`` when even the cheapest candidate in every layer exceeds the budget."""
    _check_budget(budget_bits)
    if any(isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) or b <= 0 for b in bits):
        raise ValueError(f"bits must be finite numbers > 0, got {bits!r}")
    exact = [_fraction(b) for b in bits]
    budget = _fraction(budget_bits, budget=True)
    scale = math.lcm(*(f.denominator for f in exact), budget.denominator)
    units = [int(f * scale) for f in exact]
    cap = math.floor(budget * n * scale)
    if cap < n * min(units):
        raise ValueError(
            f"budget {budget_bits:g} bits is below the cheapest candidate ({min(bits):.3g} bits) in every layer"
        )
    return units, cap


def choose_layers(sensitivity: list[list[float]], bits: list[float], budget_bits: float) -> list[int]:
    """The candidate index per layer minimising ``sum_i sensitivity[i][c_i]`` subject to
    ``mean_i bits[c_i] <= budget_bits`` (exact: the bits and the budget as fractions, ``_units``). Every layer
    weighs the same here; ``tune`` prices layers by their real bytes (``choose_layers_by_bytes``).

    Args:
        sensitivity: ``(layers, candidates)`` cost of each candidate in each layer (finite, ``>= 0``).
        bits: ``(candidates,)`` average bits of each candidate.
        budget_bits: the largest allowed average.

    Raises:
        ValueError: malformed inputs, or a budget below the cheapest candidate in every layer.
    """
    n = len(sensitivity)
    _check_costs(sensitivity, len(bits))
    units, cap = _units(bits, budget_bits, n)
    return _knapsack(sensitivity, [units] * n, cap)


def choose_layers_by_bytes(
    sensitivity: list[list[float]], layer_bytes: list[list[int]], elements: int, budget_bits: float
) -> list[int]:
    """The candidate index per layer minimising ``sum_i sensitivity[i][c_i]`` subject to
    ``8 * sum_i layer_bytes[i][c_i] <= budget_bits * elements``: the mix's bits per stored element as
    ``kvbits plan`` counts them (``avg_bits``), with the budget read as the fraction it stands for
    (``_fraction``: 5.67 as 567/100), so the mix's float ``avg_bits`` never exceeds ``budget_bits``.

    Args:
        sensitivity: ``(layers, candidates)`` cost of each candidate in each layer (finite, ``>= 0``).
        layer_bytes: ``(layers, candidates)`` bytes (ints ``>= 0``) layer ``i`` holds when stored by candidate ``c``.
        elements: the elements the budget is a mean over (``plan``'s ``elements``), ``> 0``.
        budget_bits: the largest allowed bits per element.

    Raises:
        ValueError: malformed inputs, or a budget below the cheapest candidate of every layer.
    """
    n = len(sensitivity)
    _check_costs(sensitivity, len(layer_bytes[0]) if layer_bytes else 0)
    if len(layer_bytes) != n or any(len(row) != len(layer_bytes[0]) for row in layer_bytes):
        raise ValueError(
            f"layer_bytes must be (layers={n}, candidates) like the sensitivity, got {len(layer_bytes)} rows"
        )
    # negative bytes ended in "min() arg is an empty sequence" (the pruned states never reach the cap again)
    if any(not _is_int(b) or b < 0 for row in layer_bytes for b in row):
        raise ValueError(f"layer_bytes must be ints >= 0 (bytes a layer holds), got {layer_bytes!r}")
    if not _is_int(elements) or elements < 1:  # NumPy's ints too, as the bytes
        raise ValueError(f"elements must be a positive int, got {elements!r}")
    _check_budget(budget_bits)
    cap = math.floor(_fraction(budget_bits, budget=True) * elements / 8)
    least = sum(min(row) for row in layer_bytes)
    if least > cap:
        raise ValueError(
            f"budget {budget_bits:g} bits is below the cheapest mix of the candidates ({8 * least / elements:.4g} "
            "bits per element, as kvbits plan counts them)"
        )
    return _knapsack(sensitivity, layer_bytes, cap)


def _check_costs(sensitivity: list[list[float]], n_candidates: int) -> None:
    n = len(sensitivity)
    if n == 0 or not n_candidates or any(len(row) != n_candidates for row in sensitivity):
        raise ValueError(f"sensitivity must be (layers, {n_candidates} candidates), got {n} rows")
    if any(not math.isfinite(x) or x < 0 for row in sensitivity for x in row):
        raise ValueError("sensitivities must be finite and >= 0")


def _knapsack(sensitivity: list[list[float]], weights: list[list[int]], cap: int) -> list[int]:
    """The candidate per layer of least summed ``sensitivity`` whose summed integer ``weights`` stay within
    ``cap`` (ties: the fewest weight units): exact dynamic programming over the reachable weights, keeping
    only the states no lighter state matches in cost (a dominated state completes no better)."""
    inf = math.inf
    # best[u]: least cost of the layers so far using exactly u units; how[i][u]: (candidate, previous u)
    best = {0: 0.0}
    how: list[dict[int, tuple[int, int]]] = []
    for row, units in zip(sensitivity, weights):
        nxt: dict[int, float] = {}
        back: dict[int, tuple[int, int]] = {}
        for u, cost in best.items():
            for c, (w, s) in enumerate(zip(units, row)):
                v = u + w
                if v <= cap and cost + s < nxt.get(v, inf):
                    nxt[v] = cost + s
                    back[v] = (c, u)
        best, least = {}, inf
        for v in sorted(nxt):  # Pareto front: a state survives only if cheaper than every lighter one
            if nxt[v] < least:
                best[v] = least = nxt[v]
        how.append(back)
    u = min(best, key=lambda k: (best[k], k))  # least cost, then fewest units
    choice = []
    for back in reversed(how):
        c, u = back[u]
        choice.append(c)
    return choice[::-1]
