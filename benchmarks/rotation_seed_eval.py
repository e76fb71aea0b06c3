"""``kvbits eval`` with another random-sign vector in the Hadamard rotation (BENCHMARKS.md §23c).

kvbits' rotation is ``R = diag(s) @ H_D / sqrt(D)`` with fixed random signs ``s`` drawn from
``kvbits.quant.rotate.SIGN_SEED`` (0). This runs ``kvbits eval`` in-process with ``SIGN_SEED`` replaced, to see
how much a rotated scheme's figures depend on the draw of ``s`` (vLLM's ``int4_per_token_head`` draws its own).
Every scheme rotated with kvbits' signs (``rotate="hadamard"``) uses the new ones; the ``vllm-int4`` preset
(``"hadamard-vllm"``: vLLM's own signs), unrotated schemes and the reference are unaffected. §23c's integer
zero-point rows are ``benchmarks/schemes/int4-token-hadamard-intzero.json`` (named ``vllm-int4`` when measured,
before that preset took vLLM's signs).

Example (the arguments after the seed are ``kvbits eval``'s)::

    PYTHONPATH=src python benchmarks/rotation_seed_eval.py 1 --model qwen2.5-coder-0.5b --data wikitext2 \\
        --context 4k --windows 1 --scheme benchmarks/schemes/int4-token-hadamard-intzero.json \\
        --scheme int4-token-hadamard --out runs/seed-hadamard-1
"""

from __future__ import annotations

import sys

from kvbits.cli import main as kvbits_main
from kvbits.quant import rotate


def main(argv: list[str]) -> int:
    if not argv or not argv[0].lstrip("-").isdigit():
        raise SystemExit("usage: rotation_seed_eval.py SEED <kvbits eval arguments>")
    rotate.SIGN_SEED = int(argv[0])
    rotate._matrix.cache_clear()  # drop any matrix built from the old signs
    return kvbits_main(["eval", *argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
