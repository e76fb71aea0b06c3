"""Field checks for the JSON files kvbits reads back (``summary.json``, ``needle.json``, a checkpoint's
``config.json``): a hand-edited or foreign file is a ``ValueError`` naming the field and what it should hold,

    results[2].buckets[0].lo is a string ('abc'); expected a whole number >= 0

never a ``KeyError`` or ``TypeError`` from deep inside a report. Standard library only: the export
(:mod:`kvbits.export`) uses it without importing the report package.

Every JSON kvbits writes goes through :func:`dumps` and is strict JSON (RFC 8259): a non-finite float (an
infinite PPL, a NaN KL, the tokens/s of a zero-time step) is written as the string ``"NaN"``, ``"+Inf"`` or
``"-Inf"`` (Prometheus' spelling, as ``kvbits monitor`` writes it), never as Python's bare ``NaN`` /
``Infinity`` tokens, which jq, Go's ``encoding/json`` and ``JSON.parse`` reject. :func:`loads` reads those
strings back as the floats they stand for (and still reads the bare tokens of files written before).
``kvbits analyze``'s ``analysis.json`` (and its ``--json``) does too; files it wrote before wrote a non-finite
figure as ``null``, the same as a figure not computed. ``kvbits.analyze.recommend`` takes the rows of either, read
by any JSON parser (``null``, the spelled strings, or the floats :func:`loads` gives).

:func:`loads` does not know which fields are numbers: a string value that is exactly ``"NaN"``, ``"+Inf"``
or ``"-Inf"`` reads back as a float wherever it is, a text field included (a model or data name spelled so
would then fail its ``text`` check). No field kvbits reads as text is written so by kvbits itself; object keys
are never changed.

A field path (``at``) is the dotted, indexed path of a value in its file; the callers prefix the file's
name (``summary.json: results[2]...``). Each check is of a *kind* (:data:`KINDS`): what a value may be,
and what the error says was expected.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

__all__ = [
    "KINDS", "NON_FINITE", "Kind", "check", "describe", "dumps", "entries", "field", "is_kind", "is_number",
    "json_object", "loads", "mapping", "objects", "path", "whole",
]  # fmt: skip

NON_FINITE: Final[Mapping[str, float]] = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}
"""How :func:`dumps` spells a non-finite float, and the float :func:`loads` reads back for each spelling."""


def _spelled(v: float) -> str:
    return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")


def _to_strict(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _spelled(obj)
    if isinstance(obj, Mapping):
        return {k: _to_strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_strict(v) for v in obj]
    return obj


def _from_strict(obj: Any) -> Any:
    if isinstance(obj, str):
        return NON_FINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _from_strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_strict(v) for v in obj]
    return obj


def dumps(obj: Any, indent: int | None = None, **kwargs: Any) -> str:
    """``obj`` as strict JSON (``json.dumps(..., allow_nan=False)``): a non-finite float, at any depth, becomes
    the string of :data:`NON_FINITE` (``"NaN"``, ``"+Inf"``, ``"-Inf"``). ``kwargs``: ``json.dumps``'s others
    (``sort_keys``, ``default``, ...)."""
    return json.dumps(_to_strict(obj), indent=indent, allow_nan=False, **kwargs)


def loads(text: str | bytes) -> Any:
    """A JSON text that :func:`dumps` wrote: ``json.loads``, then each string value that is a key of
    :data:`NON_FINITE` (``"NaN"``, ``"+Inf"``, ``"-Inf"``, exactly) as its float, so that a NaN or inf written
    reads back as itself, wherever it is: a text field holding exactly one of those strings reads back as a float
    too (the document carries no types to tell them apart). Object keys are left as they are."""
    return _from_strict(json.loads(text))


Kind = Literal["text", "whole", "number", "mean", "bytes", "flag", "object", "list"]


def describe(value: Any) -> str:
    """What a JSON value is, for error messages: ``a string ('abc')``, ``a number (2.5)``, ``a boolean
    (true)``, ``a list``, ``an object``, ``null`` (strings cut at 40 characters)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, (list, tuple)):
        return "a list"
    return "an object" if isinstance(value, Mapping) else type(value).__name__


def is_number(value: Any) -> bool:
    """Whether ``value`` is a JSON number: an int or float (NaN and infinities included), not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value: Any) -> bool:
    return is_number(value) and math.isfinite(value) and value == int(value) and value >= 0


KINDS: Final[Mapping[Kind, tuple[Callable[[Any], bool], str]]] = {
    "text": (lambda v: isinstance(v, str), "a string"),
    "whole": (_is_whole, "a whole number >= 0"),
    "number": (is_number, "a number"),
    "mean": (lambda v: v is None or is_number(v), "a number or null"),
    "bytes": (lambda v: v is None or (is_number(v) and math.isfinite(v) and v >= 0), "a byte count or null"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, Mapping), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
}
"""Each kind of field: (whether a value is of it, what an error says was expected). ``whole`` is a finite
number >= 0 without a fraction (``3.0`` is one); ``mean`` and ``bytes`` may be null."""

_MISSING: Final[Any] = object()


def path(where: str, key: str) -> str:
    """The field path of ``key`` under ``where``: ``where.key``, or ``key`` at the top (``where`` empty)."""
    return f"{where}.{key}" if where else key


def is_kind(value: Any, kind: Kind) -> bool:
    """Whether ``value`` is of ``kind`` (:data:`KINDS`)."""
    return KINDS[kind][0](value)


def check(value: Any, kind: Kind, at: str) -> Any:
    """``value`` when it is of ``kind``, else ``ValueError``: ``{at} is {describe(value)}; expected ...``."""
    if not is_kind(value, kind):
        raise ValueError(f"{at} is {describe(value)}; expected {KINDS[kind][1]}")
    return value


def field(d: Mapping[str, Any], key: str, kind: Kind, where: str = "", *, default: Any = _MISSING) -> Any:
    """``d[key]`` when it is of ``kind``, else ``ValueError`` naming ``where.key``.

    Absent: ``default`` when one is given (returned as is, unchecked), else ``ValueError`` (``... is missing;
    expected ...``). A present ``null`` is checked like any value: only ``mean`` and ``bytes`` allow it.
    """
    at = path(where, key)
    if key not in d:
        if default is not _MISSING:
            return default
        raise ValueError(f"{at} is missing; expected {KINDS[kind][1]}")
    return check(d[key], kind, at)


def entries(d: Mapping[str, Any], key: str, kind: Kind, where: str = "") -> list[Any]:
    """``d[key]``: a list (required) whose every entry is of ``kind``, else ``ValueError`` naming the list or
    the entry (``where.key[3]``)."""
    at = path(where, key)
    return [check(v, kind, f"{at}[{i}]") for i, v in enumerate(field(d, key, "list", where))]


def whole(d: Mapping[str, Any], key: str, where: str = "", *, default: int | None = None) -> int:
    """``d[key]`` as an ``int``: a whole number >= 0 (``3.0`` is 3), ``default`` when absent and given, else
    ``ValueError`` naming ``where.key``."""
    return int(field(d, key, "whole", where, default=_MISSING if default is None else default))


def mapping(value: Any, at: str, what: str = "an object") -> Mapping[str, Any]:
    """``value`` when it is a JSON object, else ``ValueError``: ``{at} is ...; expected {what}`` (``what``
    says which object, e.g. ``a position bucket object``)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{at} is {describe(value)}; expected {what}")  # noqa: TRY004 - bad file content
    return value


def objects(value: Any, at: str, what: str = "an object") -> Sequence[Mapping[str, Any]]:
    """``value`` as a list of JSON objects, each ``what``; ``null`` (an absent field) is an empty list. Else
    ``ValueError`` naming ``at`` or the entry (``at[2]``)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError(f"{at} is {describe(value)}; expected a list, each entry {what}")  # noqa: TRY004
    return [mapping(v, f"{at}[{i}]", what) for i, v in enumerate(value)]


def json_object(document: Any, source: object, what: str) -> Mapping[str, Any]:
    """A parsed file's top level when it is a JSON object, else ``ValueError``: ``{source} holds ...;
    expected {what} (a JSON object)``, ``source`` naming the file."""
    if not isinstance(document, Mapping):
        raise ValueError(f"{source} holds {describe(document)}; expected {what} (a JSON object)")  # noqa: TRY004
    return document


def checked_object(document: Any, source: object, what: str, check_fields: Callable[[Mapping[str, Any]], None]) -> None:
    """:func:`json_object`, then ``check_fields(document)``; its ``ValueError`` is said with ``source`` (the file)
    in front, as ``{source}: {field} is ...``."""
    document = json_object(document, source, what)
    try:
        check_fields(document)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc
