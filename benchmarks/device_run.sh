#!/usr/bin/env bash
# The one prepared GPU run of issue 5: gpu_decode.py (steps 0-3b under a 280 s budget), then the CUDA-only tests,
# then where session 37's two CUDA-only failures occur (kernel_failure_map.py, its two maps side by side, 70 s).
#
#   OUT=/some/dir bash benchmarks/device_run.sh [COMMIT]     # on the GPU machine, from the repo root
#
# At most 585 s, each part cut by its timeout: the carried wheels' install and device.txt (host_speed.py cut at
# 30 s; about 20 s in all), gpu_decode.py (280 s budget, prewarm included, killed at 305), the CUDA-only tests (140:
# 8 processes, SIGINT at 125 s, so pytest's summaries stay), the failure map's two halves side by side (95: 70 s
# budget each). Give the device tool's run a timeout_s of 595 (one call may run 600 s); what is under $OUT comes back
# even if it is cut short. Any kind of machine: the run measures its own fp16 baselines and copy bandwidth and
# records the device (gpu_decode.json's env, device.txt); compare milliseconds only with figures of the same card.
# COMMIT goes into device.txt and, as $KVBITS_COMMIT, into every JSON (the device's copy of the tree has no .git).
#
# Default gpu_decode arguments: "--e2e no --budget-s 280 --prewarm-s 90". Step 6 (end to end) was measured on the
# H200 twice (§6, §6z) and is bound by the host, while the sweep is what the folded kernel (session 38) needs: with
# e2e on, its 90 s share and a 120 s prewarm left the sweep under a minute of a 290 s budget (session 37's first call).
# GPU_DECODE_ARGS replaces them (e.g. "--e2e only --budget-s 200" for step 6 alone).
#
# A second call, if the machine is still warm (handed back after 30 s idle) and device time is left: 15 minutes in
# all, machine starts included, leave about 200 s after the first call. transformers' QuantizedCache (the issue's
# third end-to-end peer) has never been measured; its quanto backend builds a CUDA extension on its first use (1 to
# 2.5 minutes of nvcc inside the first quanto run; a failed build is not retried), so the second call measures it
# beside the fp16 and kvbits runs it is compared with, and little else (timeout_s about 200):
#   KVBITS_COMMIT=<commit> PYTHONUNBUFFERED=1 PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_decode.py --e2e only \
#       --prewarm-s 0 --budget-s 170 --e2e-batch 1 \
#       --e2e-runs dynamic-fp16,kvbits-fused:kivi-4,hf-quantized-quanto:4,kvbits-static-graphs,static-fp16-graphs \
#       --out $OUT/gpu_decode_peers.json
# (kvbits-static-graphs: StaticQuantizedKVCache (session 49, int8-token and kivi-4) replayed from one captured CUDA
# graph; static-fp16-graphs runs last: transformers' StaticCache decoded through CUDA graphs, the host-free fp16
# decode kvbits-static-graphs is to be compared with; its compile falls in the warm-up steps. Other runs, each named
# as cache or cache:scheme: dynamic-fp16-no-cudnn, kvbits-fused:int8-token, kvbits-static-fused,
# kvbits-fused:kvquant-4-block with kvbits-static-graphs:kvquant-4-block.) Later calls, if any time is left: the split
# merge before and after session 45 (about 20 s) and the decode autotuner (kvbits.kernels.autotune, session 44;
# about 3 minutes, its candidates mostly step 3b's launches, in Triton's cache on a warm machine):
#   PYTHONPATH=src python3 benchmarks/reduce_ab.py --out $OUT/reduce_ab.json; \
#   PYTHONPATH=src python3 benchmarks/autotune_decode.py --budget-s 150 --prewarm-s 60 --out $OUT/autotune_decode.json
#
# Writes under $OUT (default benchmarks/results): gpu_decode.json (rewritten after every step, so a run cut
# short keeps its figures; a step that raises is recorded under "failures" and the next one runs), gpu_decode.log,
# failure_map_{f16,meta32}.json / .log, cuda_tests.log, device.txt (nvidia-smi, versions, COMMIT, the host's speed:
# benchmarks/host_speed.py): 8 files, the most a device call returns (parallel_pytest.py keeps its workers' logs
# in /tmp). With .whl/ carried (benchmarks/device_wheels.sh), its wheels are installed first (optimum-quanto, step
# 6's peer). Needs only torch, Triton and transformers (the GPU machine cannot install packages); the tests run when
# pytest is importable there, else cuda_tests.log says so. Python's output is unbuffered (PYTHONUNBUFFERED), so a
# part cut by its timeout leaves its log up to that moment.
#
# DEVICE_RUN_DRY=1 runs the same steps on this CPU in under a minute, to check the plumbing before device time is
# spent on it (tests/test_device_run.py): gpu_decode.py --smoke --device cpu, the failure map's --smoke on Triton's
# interpreter, and the CUDA tests' selection collected (parallel_pytest.py --collect-only), not run; wheels go under
# $OUT/site.
set -u
OUT=${OUT:-benchmarks/results}
# the GPU image's interpreter with torch is python3 (/opt/torch/.venv, Python 3.12); "python" may not exist
PY=${PYTHON:-$(command -v python3 || command -v python)}
DRY=${DEVICE_RUN_DRY:-0}
if [ "$DRY" = 1 ]; then
    DECODE_DEFAULT="--smoke --device cpu" MAP_ARGS="--device cpu --smoke" TEST_ARGS="--collect-only" SITE="$OUT/site"
else
    DECODE_DEFAULT="--e2e no --budget-s 280 --prewarm-s 90" MAP_ARGS="--budget-s 70" TEST_ARGS="" SITE=/tmp/site
fi
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 KVBITS_COMMIT=${1:-unknown}
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (benchmarks/device_wheels.sh): step 6's quanto peer
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="src:$SITE"
fi
{
    echo "commit: ${1:-unknown}"
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "python: $PY $("$PY" --version 2>&1)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1
    # the host's CPU, load, and times of a Python call and of a tiny torch op on the CPU and launched on CUDA: §6z's
    # end-to-end steps were bound by the host (benchmarks/host_speed.py, a few seconds)
    timeout 30 "$PY" benchmarks/host_speed.py $([ "$DRY" = 1 ] && echo "--calls 200") 2>&1
} > "$OUT/device.txt"
cat "$OUT/device.txt"

timeout 305 "$PY" benchmarks/gpu_decode.py --out "$OUT/gpu_decode.json" \
    ${GPU_DECODE_ARGS:-$DECODE_DEFAULT} 2>&1 | tee "$OUT/gpu_decode.log"
echo "gpu_decode exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_decode.log"

if "$PY" -c "import pytest" 2>/dev/null; then
    # one -k for all (a -k also filters explicit node ids): the CUDA-only tests; the scales' rounding on the
    # device; the kernel tests on CUDA tensors (compiled, inline PTX included): dequant="f16" bit for bit, the
    # attention error of every preset path against float64, bfloat16 queries, scales read as int32 words
    # (meta32; over odd slot counts too) and the padding mask read as words, against the 2-byte (byte) reads, bit
    # for bit, the rotated query kept exact (Q_SPLIT), and per-token keys entering the dots as codes (K_ROWS)
    # (tests/test_fold.py: the folded-scale kernel, its inline PTX compiled, on CUDA tensors; not its real-model
    # check, which needs a model wheel the machine cannot fetch); the decode autotuner through dispatch, its CUDA-event
    # timer included (tests/test_autotune.py, "tuned")
    # Before the failure map: these cover code no GPU has run yet, the map diagnoses two known failures.
    # 138 tests, about 133 kernel specialisations to compile (session 37's 59 tests took 100 s in one process):
    # parallel_pytest.py deals them out to 8 processes on the one GPU, each test function's cases together, and
    # sends SIGINT to any still running at 125 s (pytest then prints its failures and summary; killed 10 s later).
    timeout 140 "$PY" benchmarks/parallel_pytest.py --workers 8 --timeout-s 125 --log "$OUT/cuda_tests.log" \
        $TEST_ARGS -- -m "not realmodel" \
        tests/test_cache.py tests/test_evaluate.py tests/test_quant.py tests/test_kernels.py tests/test_fold.py \
        tests/test_autotune.py \
        -k "cuda_decode_steps_do_not_sync or peak_cuda_bytes_on_cuda or exact_quotient or f16_dequant_rounds_once \
        or decode_f16_dequant or within_twice or bf16_queries or meta32 or word_reads or mask_words \
        or rotated_query_exact or per_token_keys or k_rows or fold or tuned"
    echo "cuda tests exit: $?; $(tail -1 "$OUT/cuda_tests.log")"
else
    echo "pytest is not installed on this machine: CUDA-only tests not run" | tee "$OUT/cuda_tests.log"
fi

# session 37's f16 (head dim 16) and meta32 (case2) failures, variant by variant (tier 1 first; needs tests/): the two
# maps side by side, each with the whole budget (one process compiles one kernel at a time)
declare -A MAP_PID
for part in f16 meta32; do
    PYTHONPATH=src:tests timeout 95 "$PY" benchmarks/kernel_failure_map.py --only $part \
        --out "$OUT/failure_map_$part.json" $MAP_ARGS > "$OUT/failure_map_$part.log" 2>&1 &
    MAP_PID[$part]=$!
done
for part in f16 meta32; do
    wait "${MAP_PID[$part]}"
    echo "failure map $part exit: $?; $(tail -1 "$OUT/failure_map_$part.log" | cut -c1-300)"
done
