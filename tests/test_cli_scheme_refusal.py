"""A misspelled scheme name (or a scheme JSON that does not exist) is refused before a command imports torch: ``kvbits
tune --candidates int4-tokn`` took 4-6 s to refuse it (``kvbits calibrate`` ~9 s), all import time, and now ~0.2 s
(``kvbits._argtypes.check_scheme_args`` at the top of each command's ``run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
HEAVY = ("torch", "transformers", "numpy", "triton")
MD = ["--model", "smollm2-135m", "--data", "pride-and-prejudice"]

CASES = {
    "tune-candidates": (["tune", *MD, "--candidates", "int4-tokn", "--candidates", "int2-token", "--budget-bits", "3"],
                        "unknown scheme 'int4-tokn' (did you mean 'int4-token'?)"),
    "tune-compare": (["tune", *MD, "--candidates", "int4-token", "--candidates", "int2-token", "--compare",
                      "kvquant-3x", "--budget-bits", "3"], "unknown scheme 'kvquant-3x' (did you mean 'kvquant-3'?)"),
    "tune-json": (["tune", *MD, "--candidates", "int4-token", "--candidates", "no-such-mix.json", "--budget-bits", "3"],
                  "scheme file 'no-such-mix.json' does not exist"),
    "tune-mix": (["tune", *MD, "--candidates", "int4-token,0=int8-tokn", "--candidates", "int2-token",
                  "--budget-bits", "3"], "int8-tokn"),
    "eval": (["eval", *MD, "--scheme", "int4-tokn"], "(did you mean 'int4-token'?)"),
    "speed": (["speed", "--model", "smollm2-135m", "--context", "1k", "--scheme", "int4-tokn"], "(did you mean"),
    "needle": (["needle", "--model", "smollm2-135m", "--context", "1k", "--scheme", "int4-tokn"], "(did you mean"),
    "monitor": (["monitor", *MD, "--context", "1k", "--scheme", "int4-tokn"], "(did you mean 'int4-token'?)"),
    "export": (["export", "--format", "vllm", "--scheme", "vllm-int4x"], "(did you mean"),
    "calibrate": (["calibrate", *MD, "--scheme", "kvquant-4x", "--out", "OUT"], "(did you mean"),
}


def _refuse(argv: list[str]) -> tuple[int, str, list[str]]:
    """(exit status, stderr, heavy modules imported) of ``kvbits.cli.main(argv)`` in a fresh interpreter."""
    code = (
        "import sys\nfrom kvbits.cli import main\nrc = main(sys.argv[1:])\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\nsys.exit(rc)"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code, *argv], check=False, capture_output=True, text=True, env=env)
    return out.returncode, out.stderr, [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unknown_scheme_is_refused_before_torch_is_imported(case: str, tmp_path: Path) -> None:
    argv, said = CASES[case]
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    rc, err, heavy = _refuse(argv)
    assert rc == 2, err
    assert said in err and f"kvbits {argv[0]}: error:" in err, err
    assert heavy == [], (case, heavy)


def test_peer_names_are_left_to_the_commands_that_resolve_them() -> None:
    from kvbits._argtypes import PEER_NAMES, check_scheme_args
    from kvbits.evaluate.stream import PEER_SCHEMES

    assert PEER_NAMES == tuple(PEER_SCHEMES)
    check_scheme_args(["hf-quanto-int4", "int4-token"], peers=True)
    check_scheme_args(None)
    with pytest.raises(ValueError, match=r"did you mean 'int4-token'\?.*peers \(stream mode only\): hf-quanto-int4"):
        check_scheme_args(["int4-tokn"], peers=True)


@pytest.mark.parametrize("flag,role", [("--candidates", "candidate"), ("--compare", "compare")])
def test_tune_explains_a_peer_before_torch_is_imported(flag: str, role: str) -> None:
    """A peer name given to ``kvbits tune`` was explained only by ``tune_scheme``, after ~4 s of imports (torch); the
    light check now says the same (``tune_peer_refusal``, one text) before them."""
    cands = ["--candidates", "int4-token", "--candidates", "int2-token"]
    argv = ["tune", *MD, *(cands[:2] if flag == "--candidates" else cands), flag, "hf-quanto-int4", "--budget-bits",
            "3", "--device", "cpu"]  # fmt: skip
    rc, err, heavy = _refuse(argv)
    assert rc == 2 and f"{role} 'hf-quanto-int4' is a comparison peer (transformers QuantizedCache" in err, err
    assert "e.g. int4-token or kivi-4" in err, err
    assert heavy == [], heavy


def test_tune_scheme_says_the_same_of_a_peer() -> None:
    """The library path (``tune_scheme``) and the light check share the message and the peer table."""
    from kvbits._argtypes import PEERS, tune_peer_refusal
    from kvbits.evaluate.stream import PEER_SCHEMES
    from kvbits.tune.inputs import tune_scheme

    assert {n: (p.nbits, p.description) for n, p in PEER_SCHEMES.items()} == PEERS
    with pytest.raises(ValueError) as info:
        tune_scheme("hf-quanto-int2", "compare")
    assert str(info.value) == tune_peer_refusal("hf-quanto-int2", "compare")
