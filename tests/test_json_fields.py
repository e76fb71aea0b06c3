"""The JSON field checks (`kvbits._json`) behind summary.json, needle.json and the export's checkpoint
files: each kind takes the values it should and refuses the others, and every error names the field path
and what was expected, describing the value found one way (``is a string ('abc'); expected ...``)."""

from __future__ import annotations

import math
import re

import pytest

from kvbits._json import (
    KINDS,
    check,
    describe,
    dumps,
    entries,
    field,
    is_kind,
    is_number,
    json_object,
    loads,
    mapping,
    objects,
    path,
    whole,
)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, "null"), (True, "a boolean (true)"), (False, "a boolean (false)"), (3, "a number (3)"),
        (2.5, "a number (2.5)"), (math.nan, "a number (nan)"), ("abc", "a string ('abc')"),
        ("x" * 100, f"a string ({'x' * 40!r})"), ([1], "a list"), ((1,), "a list"), ({"a": 1}, "an object"),
    ],
)  # fmt: skip
def test_describe_says_what_a_json_value_is(value, said):
    assert describe(value) == said


def test_a_boolean_is_not_a_number():
    assert is_number(0) and is_number(1.5) and is_number(math.nan) and is_number(-math.inf)
    assert not is_number(True) and not is_number(False) and not is_number("1") and not is_number(None)
    for kind in ("number", "whole", "mean", "bytes"):
        assert not is_kind(True, kind), kind


# kind -> (values it takes, values it refuses)
_CASES = {
    "text": (["", "abc"], [None, 1, True, ["a"], {"a": "b"}]),
    "whole": ([0, 3, 3.0, 10**12], [-1, -0.5, 2.5, math.nan, math.inf, -math.inf, True, "3", None, [3]]),
    "number": ([0, -1, 2.5, math.nan, math.inf], [True, "1", None, [1], {"a": 1}]),
    "mean": ([None, 0, -2.5, math.nan], [True, "0.5", [0.5]]),
    "bytes": ([None, 0, 1024, 1.5], [-1, math.nan, math.inf, True, "1"]),
    "flag": ([True, False], [0, 1, None, "true"]),
    "object": ([{}, {"a": 1}], [None, [], "x", 1]),
    "list": ([[], [1, "a"]], [None, (), {}, "x"]),
}


def test_every_kind_is_covered():
    assert set(_CASES) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(_CASES))
def test_each_kind_takes_and_refuses_the_right_values(kind):
    takes, refuses = _CASES[kind]
    for v in takes:
        assert check(v, kind, "x") is v
    expected = KINDS[kind][1]
    for v in refuses:
        with pytest.raises(ValueError, match=re.escape(f"results[2].x is {describe(v)}; expected {expected}")):
            check(v, kind, "results[2].x")


def test_field_names_the_path_and_handles_missing_and_null():
    d = {"lo": "abc", "hi": None, "n": 4}
    assert path("", "lo") == "lo" and path("results[0]", "lo") == "results[0].lo"
    with pytest.raises(ValueError, match=re.escape("results[2].buckets[0].lo is a string ('abc'); expected a whole "
                                                   "number >= 0")):  # fmt: skip
        field(d, "lo", "whole", "results[2].buckets[0]")
    with pytest.raises(ValueError, match=re.escape("task.digits is missing; expected a whole number >= 0")):
        field(d, "digits", "whole", "task")
    with pytest.raises(ValueError, match=re.escape("seed is missing; expected a whole number >= 0")):
        field(d, "seed", "whole")
    # a present null is a value like any other: only the kinds that allow it take it
    with pytest.raises(ValueError, match=re.escape("hi is null; expected a number")):
        field(d, "hi", "number")
    assert field(d, "hi", "mean") is None and field(d, "hi", "bytes") is None
    # absent with a default: the default, unchecked
    assert field(d, "cache_bytes", "bytes", "x", default=None) is None
    assert field(d, "n", "whole", default=None) == 4


def test_whole_is_an_int_with_an_optional_default():
    assert whole({"lo": 3.0}, "lo", "b") == 3 and isinstance(whole({"lo": 3.0}, "lo", "b"), int)
    assert whole({}, "layer", "a", default=0) == 0 and whole({}, "layer", "a", default=5) == 5
    with pytest.raises(ValueError, match=re.escape("b.lo is missing; expected a whole number >= 0")):
        whole({}, "lo", "b")
    for bad in (-1, 1.5, math.nan, math.inf, True, None):
        with pytest.raises(ValueError, match=re.escape(f"b.lo is {describe(bad)}; expected a whole number >= 0")):
            whole({"lo": bad}, "lo", "b")


def test_entries_name_the_entry():
    assert entries({"contexts": [1024, 2048.0]}, "contexts", "whole") == [1024, 2048.0]
    with pytest.raises(ValueError, match=re.escape("contexts[1] is a string ('2k'); expected a whole number >= 0")):
        entries({"contexts": [1024, "2k"]}, "contexts", "whole")
    with pytest.raises(ValueError, match=re.escape("r.depths is a string ('4k'); expected a list")):
        entries({"depths": "4k"}, "depths", "number", "r")
    with pytest.raises(ValueError, match=re.escape("r.depths is missing; expected a list")):
        entries({}, "depths", "number", "r")


def test_mapping_and_objects_say_which_object():
    assert mapping({"a": 1}, "fingerprint") == {"a": 1}
    with pytest.raises(ValueError, match=re.escape("fingerprint is a string ('abc'); expected an object")):
        mapping("abc", "fingerprint")
    with pytest.raises(ValueError, match=re.escape("results[0] is null; expected a scheme result object")):
        mapping(None, "results[0]", "a scheme result object")
    assert objects(None, "results") == ()  # an absent list is empty
    assert objects([{"a": 1}], "results") == [{"a": 1}]
    with pytest.raises(ValueError, match=re.escape("results is a string ('x'); expected a list, each entry a scheme")):
        objects("x", "results", "a scheme result object")
    with pytest.raises(ValueError, match=re.escape("results[1] is a list; expected a scheme result object")):
        objects([{}, []], "results", "a scheme result object")


def test_json_object_names_the_file():
    assert json_object({"a": 1}, "run/summary.json", "a kvbits eval summary") == {"a": 1}
    for doc, said in (([], "a list"), (None, "null"), ("s", "a string ('s')"), (2, "a number (2)")):
        with pytest.raises(ValueError, match=re.escape(
            f"run/summary.json holds {said}; expected a kvbits eval summary (a JSON object)"
        )):  # fmt: skip
            json_object(doc, "run/summary.json", "a kvbits eval summary")


def test_dumps_is_strict_json_and_loads_reads_non_finite_numbers_back():
    """dumps writes NaN / +inf / -inf (at any depth, numpy floats too) as "NaN" / "+Inf" / "-Inf", never the bare
    tokens strict parsers reject; loads gives the floats back, and still reads files with the bare tokens."""
    import json

    import numpy as np

    obj = {"a": math.nan, "b": [math.inf, (-math.inf, 1.5)], "c": {"d": np.float64("inf"), "e": "x", "f": 2}}
    text = dumps(obj, indent=1)
    assert "Infinity" not in text and "NaN" in text
    strict = json.loads(text, parse_constant=lambda t: pytest.fail(f"bare {t}"))
    assert strict == {"a": "NaN", "b": ["+Inf", ["-Inf", 1.5]], "c": {"d": "+Inf", "e": "x", "f": 2}}
    for back in (loads(text), loads(json.dumps(obj))):
        assert math.isnan(back["a"]) and back["b"] == [math.inf, [-math.inf, 1.5]]
        assert back["c"] == {"d": math.inf, "e": "x", "f": 2}
    assert loads('{"NaN": "nan", "+Inf": ["Inf"]}') == {"NaN": "nan", "+Inf": ["Inf"]}  # keys, other spellings


def test_loads_decodes_the_non_finite_spellings_anywhere_but_in_keys():
    """The contract :func:`loads` states: the three exact spellings become floats wherever they stand (a text field
    included, which its ``text`` check then refuses by name); near spellings and object keys stay strings."""
    doc = loads(dumps({"NaN": ["NaN", "+Inf", "-Inf", "nan", "Inf", " NaN"], "model": "NaN"}))
    assert list(doc) == ["NaN", "model"] and doc["NaN"][3:] == ["nan", "Inf", " NaN"]
    assert math.isnan(doc["NaN"][0]) and doc["NaN"][1:3] == [math.inf, -math.inf]
    with pytest.raises(ValueError, match=re.escape("model is a number (nan); expected a string")):
        field(doc, "model", "text")
