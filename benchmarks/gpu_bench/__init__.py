"""The steps of ``benchmarks/gpu_decode.py`` (one module each; the script runs them in order)."""
