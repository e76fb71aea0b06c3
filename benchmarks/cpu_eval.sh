#!/usr/bin/env bash
# The CPU measurements recorded in BENCHMARKS.md (2 cores; float32 unless a step says bfloat16). Each step writes runs/<name>/
# with summary.json, records, per-token arrays and report.{md,html}; reruns are skipped (DONE marker).
set -euo pipefail
cd "$(dirname "$0")/.."
K=".venv/bin/python -m kvbits"
step="${1:-all}"
need_qwen_calibrations() {  # exits unless the smooth / smooth-prerope(-int8) steps calibrated each scheme given
  for s in "$@"; do
    [[ -f runs/calib-qwen2.5-coder-0.5b-$s/calibration.json ]] || \
      { echo "missing runs/calib-qwen2.5-coder-0.5b-$s: run the smooth, smooth-prerope(-int8) steps" >&2; exit 1; }
  done
}

if [[ $step == all || $step == smollm2 ]]; then
  # The demo (make demo) covers fp16 int8-token int4-token int4-channel kivi-4 kivi-2; this adds the rest.
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme int2-token --scheme int8-channel --scheme int2-channel --scheme int4-channel-prerope \
    --out runs/smollm2-wp-8k-b
fi
if [[ $step == all || $step == kvquant ]]; then
  # Calibrate on a different text (Pride and Prejudice), evaluate on War and Peace.
  for b in 4 2; do
    [[ -f runs/calib-smollm2-kvq$b/calibration.json ]] || \
      $K calibrate --model smollm2-135m --data pride-and-prejudice --context 2048 --windows 2 \
        --scheme kvquant-$b --out runs/calib-smollm2-kvq$b
  done
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme kvquant-4 --scheme kvquant-2 \
    --calibration runs/calib-smollm2-kvq4 --calibration runs/calib-smollm2-kvq2 \
    --out runs/smollm2-wp-8k-kvquant
fi
if [[ $step == all || $step == qwen ]]; then
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme int8-token --scheme int4-token --scheme int4-channel --scheme int4-channel-prerope \
    --out runs/qwen-wiki-4k
fi
if [[ $step == all || $step == peer ]]; then
  # transformers' own QuantizedCache (optimum-quanto) beside kvbits at similar bits, same tokens,
  # both through a real cache token by token (stream mode; hf-quanto has no simulate path).
  $K eval --model smollm2-135m --data war-and-peace --context 1024 --windows 1 --no-progress --mode stream --threads 1 \
    --scheme hf-quanto-int4 --scheme int4-g64 --scheme kivi-4 --scheme hf-quanto-int2 --scheme kivi-2 \
    --out runs/smollm2-wp-1k-peer
fi
if [[ $step == all || $step == rotation ]]; then
  # Hadamard-rotated per-token schemes (QuaRot-style) beside the demo's and 3c's unrotated ones: same
  # model, text, window and semantics, so their rows compare directly with BENCHMARKS.md §2 and §3c.
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme int8-token-hadamard --scheme int4-token-hadamard --scheme int3-token --scheme int3-token-hadamard \
    --scheme int2-token-hadamard --out runs/smollm2-wp-8k-hadamard
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme int8-token-hadamard --scheme int4-token-hadamard --scheme int3-token-hadamard \
    --scheme int2-token-hadamard --scheme int2-token --out runs/qwen-wiki-4k-hadamard
fi
if [[ $step == all || $step == symmetric ]]; then
  # Symmetric per-token INT8/INT4 (absmax / 127, no zero-point: the format of vLLM's int8_per_token_head)
  # beside §3a/§3c's asymmetric rows: same model, text, window and semantics.
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme benchmarks/schemes/int8-token-sym.json --scheme benchmarks/schemes/int4-token-sym.json \
    --out runs/qwen-wiki-4k-sym
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme benchmarks/schemes/int8-token-sym.json --scheme benchmarks/schemes/int4-token-sym.json \
    --out runs/smollm2-wp-8k-sym
fi
if [[ $step == all || $step == vllm-int4 ]]; then
  # vLLM's int4_per_token_head format (vllm-int4: Hadamard rotation, per-token INT4, integer zero-point), and
  # the integer zero-point without the rotation, beside §11's int4-token-hadamard and §2/§3c's int4-token:
  # same model, text, window and semantics (BENCHMARKS.md §23). §23 measured vllm-int4 with kvbits' own Hadamard
  # signs (now benchmarks/schemes/int4-token-hadamard-intzero.json); the preset has vLLM's since §23d.
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme vllm-int4 --scheme benchmarks/schemes/int4-token-intzero.json --out runs/qwen-wiki-4k-vllm-int4
  # which side the integer zero-point hurts on Qwen2.5: one side as vllm-int4, the other as int4-token-hadamard
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme benchmarks/schemes/vllm-int4-keys.json --scheme benchmarks/schemes/vllm-int4-values.json \
    --out runs/qwen-wiki-4k-vllm-int4-sides
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme vllm-int4 --scheme benchmarks/schemes/int4-token-intzero.json --out runs/smollm2-wp-8k-vllm-int4
fi
if [[ $step == all || $step == vllm-int4-layers ]]; then
  # Where vllm-int4 breaks Qwen2.5 (BENCHMARKS.md §23b): one layer or range stored as vllm-int4, the rest as
  # int4-token-hadamard (mixed scheme strings), and the reverse; a float16 first token (sinks); layer 0 kept
  # at higher precision. Then kvbits tune on another text (Pride and Prejudice, 1K) choosing between the two.
  # §23b measured vllm-int4 with kvbits' own Hadamard signs; the preset has vLLM's since §23d (reruns differ).
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme benchmarks/schemes/vllm-int4-sink1.json --scheme benchmarks/schemes/int4-token-hadamard-sink1.json \
    --out runs/qwen-wiki-4k-sink1
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme "int4-token-hadamard,1=vllm-int4" --scheme "vllm-int4,1=int4-token-hadamard" \
    --out runs/qwen-wiki-4k-vllm-int4-layer1
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme "int4-token-hadamard,0-11=vllm-int4" --scheme "int4-token-hadamard,12-23=vllm-int4" \
    --scheme "int4-token-hadamard,0-5=vllm-int4" --out runs/qwen-wiki-4k-vllm-int4-halves
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme "int4-token-hadamard,0=vllm-int4" --scheme "int4-token-hadamard,2=vllm-int4" \
    --scheme "int4-token-hadamard,3-5=vllm-int4" --out runs/qwen-wiki-4k-vllm-int4-early
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme "vllm-int4,0=fp16" --scheme "int4-token-hadamard,0=fp16" --scheme "vllm-int4,0=int8-token-hadamard" \
    --out runs/qwen-wiki-4k-vllm-int4-layer0
  [[ -f runs/tune-qwen-vllm-int4/tuned.json ]] || \
    $K tune --model qwen2.5-coder-0.5b --data pride-and-prejudice --candidates vllm-int4 \
      --candidates int8-token-hadamard --budget-bits 4.7 --context 1k --no-progress \
      --out runs/tune-qwen-vllm-int4/tuned.json
  # the layers' attention with the model's own queries (under a minute each)
  PYTHONPATH=src .venv/bin/python benchmarks/layer_attention_kl.py --model qwen2.5-coder-0.5b --data wikitext2 \
    --context 4096 --layers 0 1 2 12 --out runs/layer-attention-kl-qwen-wiki-4k.json
  PYTHONPATH=src .venv/bin/python benchmarks/layer_attention_kl.py --model smollm2-135m --data war-and-peace \
    --context 8192 --layers 0 1 14 --scheme vllm-int4 --scheme int4-token-hadamard --scheme int4-token \
    --scheme int4-channel --out runs/layer-attention-kl-smollm2-wp-8k.json
  # the layer-0 repair out to 32K (bfloat16 as §3f; about 40 min on 2 cores)
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
    --scheme "vllm-int4,0=fp16" --scheme vllm-int4 --scheme "vllm-int4,0=int8-token-hadamard" \
    --out runs/qwen-wiki-32k-vllm-int4
fi
if [[ $step == all || $step == vllm-int4-signs ]]; then
  # the vllm-int4 preset with vLLM's own Hadamard signs (BENCHMARKS.md §23d): §23's and §23b's windows, layer 0's
  # attention, and 32K (bfloat16, about 30 min)
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme vllm-int4 --scheme "vllm-int4,0=fp16" --scheme "vllm-int4,0=int8-token-hadamard" \
    --out runs/qwen-wiki-4k-vllm-int4-vllm-signs
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme vllm-int4 --out runs/smollm2-wp-8k-vllm-int4-vllm-signs
  PYTHONPATH=src .venv/bin/python benchmarks/layer_attention_kl.py --model qwen2.5-coder-0.5b --data wikitext2 \
    --context 4096 --layers 0 1 12 --scheme vllm-int4 --scheme benchmarks/schemes/int4-token-hadamard-intzero.json \
    --scheme int4-token-hadamard --out runs/layer-attention-kl-qwen-wiki-4k-vllm-signs.json
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
    --scheme "vllm-int4,0=fp16" --scheme vllm-int4 --out runs/qwen-wiki-32k-vllm-int4-vllm-signs
fi
if [[ $step == all || $step == vllm-int8 ]]; then
  # vLLM's int8_per_token_head as its write kernel stores it (vllm-int8: symmetric per-token INT8, codes rounded
  # toward zero; BENCHMARKS.md §24) beside the same format rounded to nearest (§20's scheme file): §20's windows,
  # then §3f's 32K window (bfloat16, about 30 min)
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme vllm-int8 --scheme benchmarks/schemes/int8-token-sym.json --scheme "vllm-int8,0=fp16" \
    --out runs/qwen-wiki-4k-vllm-int8
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme vllm-int8 --scheme benchmarks/schemes/int8-token-sym.json --out runs/smollm2-wp-8k-vllm-int8
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
    --scheme vllm-int8 --scheme benchmarks/schemes/int8-token-sym.json --out runs/qwen-wiki-32k-vllm-int8
fi
if [[ $step == all || $step == rotation-seeds ]]; then
  # the same rotated formats with other random-sign vectors in the Hadamard rotation (BENCHMARKS.md §23c; seed 0,
  # kvbits' own, is the runs above); about 1.5 min per Qwen2.5 run, 3 min per SmolLM2 run. The integer zero-point
  # under kvbits' signs is a scheme file: the vllm-int4 preset has vLLM's own signs since §23d, which no seed moves.
  IZ=benchmarks/schemes/int4-token-hadamard-intzero.json
  for seed in 1 2 3 4 5; do
    PYTHONPATH=src .venv/bin/python benchmarks/rotation_seed_eval.py $seed --model qwen2.5-coder-0.5b --data wikitext2 \
      --context 4k --windows 1 --no-progress --scheme $IZ --scheme int4-token-hadamard --out runs/seed-hadamard-$seed
  done
  for seed in 1 2 3; do
    PYTHONPATH=src .venv/bin/python benchmarks/rotation_seed_eval.py $seed --model qwen2.5-coder-0.5b --data wikitext2 \
      --context 4k --windows 1 --no-progress --scheme "$IZ,0=fp16" --scheme "int4-token-hadamard,0=fp16" \
      --out runs/seed-hadamard-layer0-$seed
  done
  for seed in 1 2; do
    PYTHONPATH=src .venv/bin/python benchmarks/rotation_seed_eval.py $seed --model smollm2-135m --data war-and-peace \
      --context 8k --windows 1 --no-progress --scheme $IZ --scheme int4-token-hadamard \
      --out runs/seed-hadamard-smollm2-$seed
  done
fi
if [[ $step == all || $step == vllm-int8-sides ]]; then
  # which side carries vllm-int8's truncation (BENCHMARKS.md §24): keys truncated and values rounded, and the reverse
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme benchmarks/schemes/vllm-int8-keys.json --scheme benchmarks/schemes/vllm-int8-values.json \
    --out runs/qwen-wiki-4k-vllm-int8-sides
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme benchmarks/schemes/vllm-int8-keys.json --scheme benchmarks/schemes/vllm-int8-values.json \
    --out runs/smollm2-wp-8k-vllm-int8-sides
fi
if [[ $step == all || $step == vllm-int8-layers ]]; then
  # every layer's attention with the model's own queries, truncated against rounded INT8 keys (BENCHMARKS.md §24):
  # KL, entropy and the slope of the quantized logits on the exact ones
  SYM8=benchmarks/schemes/int8-token-sym.json
  PYTHONPATH=src .venv/bin/python benchmarks/layer_attention_kl.py --model qwen2.5-coder-0.5b --data wikitext2 \
    --context 4096 --layers $(seq 0 23) --scheme vllm-int8 --scheme $SYM8 --out runs/layer-attention-kl-qwen-wiki-4k-int8.json
  PYTHONPATH=src .venv/bin/python benchmarks/layer_attention_kl.py --model smollm2-135m --data war-and-peace \
    --context 8192 --layers $(seq 0 29) --scheme vllm-int8 --scheme $SYM8 --out runs/layer-attention-kl-smollm2-wp-8k-int8.json
fi
if [[ $step == all || $step == needle-vllm-int8 ]]; then
  # passkeys through vLLM's truncated INT8 and the same format rounded: §17b's 15 trials (4K-16K; about 30 min)
  $K needle --model qwen2.5-coder-0.5b --context 4k --context 8k --context 16k --trials 1 --no-progress \
    --scheme vllm-int8 --scheme benchmarks/schemes/int8-token-sym.json --out runs/needle-qwen-vllm-int8
fi
if [[ $step == all || $step == vllm-fp8-token ]]; then
  # vLLM's other per-token-head format, fp8_per_token_head (fp8-e4m3-token), on §24's windows beside vllm-int8
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme fp8-e4m3-token --out runs/qwen-wiki-4k-fp8-token
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme fp8-e4m3-token --out runs/smollm2-wp-8k-fp8-token
fi
if [[ $step == all || $step == vllm-fp32-scales ]]; then
  # the vllm-* per-token presets with vLLM's float32 scales (scale_dtype="fp32", since 2026-12-04; §24's runs above
  # stored vllm-int8's scale in float16) and vllm-fp8-token, fp8-e4m3-token's codes under float32 scales
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme vllm-int8 --scheme vllm-fp8-token --out runs/qwen-wiki-4k-vllm-fp32-scales
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme vllm-int8 --scheme vllm-fp8-token --out runs/smollm2-wp-8k-vllm-fp32-scales
fi
if [[ $step == all || $step == vllm-32k-fp8 ]]; then
  # vLLM's two FP8 caches on §3f's 32K window (bfloat16, about 30 min): fp8 (per-tensor scale 1.0, uncalibrated)
  # and fp8_per_token_head (vllm-fp8-token), beside §24's vllm-int8 and §23d's vllm-int4 there (BENCHMARKS.md §24b)
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
    --scheme vllm-fp8-token --scheme fp8-e4m3 --out runs/qwen-wiki-32k-vllm-fp8
fi
if [[ $step == all || $step == vllm-32k-fp8-calibrated ]]; then
  # vLLM's fp8 with kvbits-calibrated scales (centred, §10's best on Qwen2.5; calibrated on §19's 4 x 4K of Pride and
  # Prejudice, so served 8x past the calibrated length) on the 32K window of vllm-32k-fp8 (BENCHMARKS.md §24c; ~20 min)
  $K calibrate --model qwen2.5-coder-0.5b --data pride-and-prejudice --scheme fp8-e4m3 --context 4k --windows 4 \
    --fp8-scale centred --out runs/cal-qwen-fp8-centred --overwrite
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
    --scheme fp8-e4m3 --calibration runs/cal-qwen-fp8-centred --out runs/qwen-wiki-32k-fp8-calibrated
fi
if [[ $step == all || $step == rotation-seeds-int8 ]]; then
  # §11's rotated INT8 and INT3 (one draw of the signs there) under three more sign vectors (BENCHMARKS.md §23e)
  for seed in 1 2 3; do
    PYTHONPATH=src .venv/bin/python benchmarks/rotation_seed_eval.py $seed --model qwen2.5-coder-0.5b --data wikitext2 \
      --context 4k --windows 1 --no-progress --scheme int8-token-hadamard --scheme int3-token-hadamard \
      --out runs/seed-hadamard-int8-$seed
  done
fi
if [[ $step == all || $step == rotation-seeds-fp8 ]]; then
  # §19's rotated static FP8 at scale 1.0 (uncalibrated) under kvbits' signs (seed 0) and three other sign vectors,
  # on §19's evaluation text (War and Peace, 2 x 4K); seed 0 also runs unrotated fp8-e4m3 beside it (BENCHMARKS.md §19b)
  for seed in 0 1 2 3; do
    extra=""; [[ $seed == 0 ]] && extra="--scheme fp8-e4m3"
    for model in smollm2-135m qwen2.5-coder-0.5b; do
      PYTHONPATH=src .venv/bin/python benchmarks/rotation_seed_eval.py $seed --model $model --data war-and-peace \
        --context 4k --windows 2 --no-progress --scheme fp8-e4m3-hadamard $extra --out runs/seed-fp8-$model-$seed
    done
  done
fi
if [[ $step == all || $step == smooth ]]; then
  # Per-token keys centred and smoothed with calibrated channel vectors (int*-token-smooth, BENCHMARKS.md §21),
  # calibrated on Pride and Prejudice (2 x 2,048) as the kvquant step is; on Qwen2.5 also the halves of the
  # recipe apart (benchmarks/schemes/int4-token-centre.json, int4-token-smooth-only.json). Windows of §3c and §2.
  cal() {  # --scheme S --calibration DIR for each scheme, calibrating those not yet calibrated
    for s in "$@"; do
      d="runs/calib-$m-$(basename "$s" .json)"
      [[ -f $d/calibration.json ]] || \
        $K calibrate --model $m --data pride-and-prejudice --context 2048 --windows 2 --scheme "$s" --out "$d" >&2
      echo --scheme "$s" --calibration "$d"
    done
  }
  m=qwen2.5-coder-0.5b
  args=$(cal int8-token-smooth int4-token-smooth int2-token-smooth benchmarks/schemes/int4-token-centre.json \
    benchmarks/schemes/int4-token-smooth-only.json)
  $K eval --model $m --data wikitext2 --context 4k --windows 1 --no-progress $args --out runs/qwen-wiki-4k-smooth
  m=smollm2-135m
  args=$(cal int8-token-smooth int4-token-smooth int2-token-smooth)
  $K eval --model $m --data war-and-peace --context 8k --windows 1 --no-progress $args --out runs/smollm2-wp-8k-smooth
fi
if [[ $step == all || $step == smooth-hadamard ]]; then
  # The centred and smoothed keys, then Hadamard-rotated (values rotated too, as int4-token-hadamard), on Qwen2.5.
  m=qwen2.5-coder-0.5b
  d=runs/calib-$m-int4-token-smooth-hadamard
  [[ -f $d/calibration.json ]] || $K calibrate --model $m --data pride-and-prejudice --context 2048 --windows 2 \
    --scheme benchmarks/schemes/int4-token-smooth-hadamard.json --out $d
  $K eval --model $m --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme benchmarks/schemes/int4-token-smooth-hadamard.json --calibration $d --out runs/qwen-wiki-4k-smooth-hadamard
fi
if [[ $step == all || $step == smooth-prerope ]]; then
  # Why int4-token-smooth grows with position on SmolLM2 (calibrated on 2K, served 8K): post-RoPE channel means
  # move with position. Centred / smoothed before RoPE instead (int4-token-smooth-prerope; the runs of 2026-12-03
  # used a scheme JSON of that name and the same specs, made the preset after them), both models; and the
  # post-RoPE preset calibrated on 8K-token windows for SmolLM2's 8K window.
  for m in qwen2.5-coder-0.5b smollm2-135m; do
    d=runs/calib-$m-int4-token-smooth-prerope
    [[ -f $d/calibration.json ]] || $K calibrate --model $m --data pride-and-prejudice --context 2048 --windows 2 \
      --scheme int4-token-smooth-prerope --out $d
  done
  d=runs/calib-smollm2-135m-int4-token-smooth-8k
  [[ -f $d/calibration.json ]] || $K calibrate --model smollm2-135m --data pride-and-prejudice --context 8192 \
    --windows 1 --scheme int4-token-smooth --out $d
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme int4-token-smooth-prerope \
    --calibration runs/calib-qwen2.5-coder-0.5b-int4-token-smooth-prerope --out runs/qwen-wiki-4k-smooth-prerope
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme int4-token-smooth-prerope --scheme int4-token-smooth \
    --calibration runs/calib-smollm2-135m-int4-token-smooth-prerope --calibration $d --out runs/smollm2-wp-8k-smooth-8kcal
fi
if [[ $step == all || $step == smooth-prerope-int8 ]]; then
  # INT8 keys centred and smoothed before RoPE on Qwen2.5 (beside int8-token-smooth, after RoPE).
  m=qwen2.5-coder-0.5b
  d=runs/calib-$m-int8-token-smooth-prerope
  [[ -f $d/calibration.json ]] || $K calibrate --model $m --data pride-and-prejudice --context 2048 --windows 2 \
    --scheme int8-token-smooth-prerope --out $d
  $K eval --model $m --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme int8-token-smooth-prerope --calibration $d --out runs/qwen-wiki-4k-smooth-prerope-int8
fi
if [[ $step == all || $step == smooth-prerope-tied ]]; then
  # int4-token-smooth-prerope with its smoothing factors tied over RoPE pairs (--tie-rope-pairs: fused decode folds
  # them into the query), beside the untied runs of the smooth-prerope step. The runs of 2026-12-03 calibrated
  # with tying on for pre-RoPE specs in the fit (before it became this flag): same factors.
  for m in qwen2.5-coder-0.5b smollm2-135m; do
    d=runs/calib-$m-int4-token-smooth-prerope-tied
    [[ -f $d/calibration.json ]] || $K calibrate --model $m --data pride-and-prejudice --context 2048 --windows 2 \
      --scheme int4-token-smooth-prerope --tie-rope-pairs --out $d
  done
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme int4-token-smooth-prerope \
    --calibration runs/calib-qwen2.5-coder-0.5b-int4-token-smooth-prerope-tied --out runs/qwen-wiki-4k-smooth-prerope-tied
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme int4-token-smooth-prerope \
    --calibration runs/calib-smollm2-135m-int4-token-smooth-prerope-tied --out runs/smollm2-wp-8k-smooth-prerope-tied
fi
if [[ $step == all || $step == kvquant-rotation ]]; then
  # KVQuant's recipe with K and V Hadamard-rotated (benchmarks/schemes/*.json), calibrated as the kvquant
  # step calibrates (Pride and Prejudice, 2 x 2,048), beside the unrotated recipe on the same 8K window.
  for b in 4 2; do
    [[ -f runs/calib-smollm2-kvq$b/calibration.json ]] || \
      $K calibrate --model smollm2-135m --data pride-and-prejudice --context 2048 --windows 2 \
        --scheme kvquant-$b --out runs/calib-smollm2-kvq$b
    [[ -f runs/calib-smollm2-kvq$b-hadamard/calibration.json ]] || \
      $K calibrate --model smollm2-135m --data pride-and-prejudice --context 2048 --windows 2 \
        --scheme benchmarks/schemes/kvquant-$b-hadamard.json --out runs/calib-smollm2-kvq$b-hadamard
  done
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme kvquant-4 --scheme benchmarks/schemes/kvquant-4-hadamard.json \
    --scheme kvquant-2 --scheme benchmarks/schemes/kvquant-2-hadamard.json \
    --calibration runs/calib-smollm2-kvq4 --calibration runs/calib-smollm2-kvq4-hadamard \
    --calibration runs/calib-smollm2-kvq2 --calibration runs/calib-smollm2-kvq2-hadamard \
    --out runs/smollm2-wp-8k-kvquant-hadamard
fi
if [[ $step == all || $step == kvquant-mixed ]]; then
  # Mixed per-layer schemes with calibrated sides on Qwen2.5 (layer 0's biased keys): each scheme calibrated
  # as itself (a mix fits each layer by its own scheme), WikiText-2 4K, the window of 3c and §13.
  for s in kvquant-4 "kvquant-4,0=fp16" kvquant-2 "kvquant-2,0=kvquant-4"; do
    d="runs/calib-qwen-$(echo "$s" | tr ',=' '__')"
    [[ -f $d/calibration.json ]] || \
      $K calibrate --model qwen2.5-coder-0.5b --data pride-and-prejudice --context 2048 --windows 2 --scheme "$s" --out "$d"
  done
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme kvquant-4 --scheme "kvquant-4,0=fp16" --scheme kvquant-2 --scheme "kvquant-2,0=kvquant-4" \
    --calibration runs/calib-qwen-kvquant-4 --calibration runs/calib-qwen-kvquant-4_0_fp16 \
    --calibration runs/calib-qwen-kvquant-2 --calibration runs/calib-qwen-kvquant-2_0_kvquant-4 \
    --out runs/qwen-wiki-4k-kvquant-mixed
fi
if [[ $step == all || $step == mixed ]]; then
  # Per-layer mixed precision: Qwen2.5's layer 0 (large k_proj bias channels) held at higher precision,
  # every other layer as the base scheme; compare with 3c and the rotation step (same window).
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme int8-token,0=fp16 --scheme int4-token,0=fp16 --scheme int4-token-hadamard,0=fp16 \
    --scheme int4-token-hadamard,0=int8-token --out runs/qwen-wiki-4k-mixed
fi
if [[ $step == all || $step == tune ]]; then
  # Per-layer schemes from measured sensitivity (kvbits tune), tuned on Pride and Prejudice (1K) at the
  # bits of uniform int4-token, then evaluated on held-out text (WikiText-2, 4K; same window as 3c).
  [[ -f runs/tune-qwen-4.5.json ]] || \
    $K tune --model qwen2.5-coder-0.5b --data pride-and-prejudice --context 1k --windows 1 --no-progress \
      --candidates int8-token --candidates int4-token --candidates int2-token --budget-bits 4.5 \
      --name tuned-qwen-4.5 --out runs/tune-qwen-4.5.json
  # the same budget with fp16 among the candidates (a layer may stay unquantized)
  [[ -f runs/tune-qwen-4.5-fp16.json ]] || \
    $K tune --model qwen2.5-coder-0.5b --data pride-and-prejudice --context 1k --windows 1 --no-progress \
      --candidates fp16 --candidates int4-token --candidates int2-token --budget-bits 4.5 \
      --name tuned-qwen-4.5-fp16 --out runs/tune-qwen-4.5-fp16.json
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme runs/tune-qwen-4.5.json --scheme runs/tune-qwen-4.5-fp16.json --out runs/qwen-wiki-4k-tuned2
fi
if [[ $step == tune-rounds ]]; then
  # the fp16 candidate set again, with one refinement round from marginal KLs around the first mix
  [[ -f runs/tune-qwen-4.5-fp16-r2.json ]] || \
    $K tune --model qwen2.5-coder-0.5b --data pride-and-prejudice --context 1k --windows 1 --no-progress \
      --candidates fp16 --candidates int4-token --candidates int2-token --budget-bits 4.5 --rounds 2 \
      --name tuned-qwen-4.5-fp16-r2 --out runs/tune-qwen-4.5-fp16-r2.json
  $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 4k --windows 1 --no-progress \
    --scheme runs/tune-qwen-4.5-fp16-r2.json --out runs/qwen-wiki-4k-tuned-r2
fi
if [[ $step == all || $step == mismatch ]]; then
  # Calibration/serving mismatch: calibrate on 512-token windows, serve 8K.
  [[ -f runs/calib-smollm2-kvq4-512/calibration.json ]] || \
    $K calibrate --model smollm2-135m --data pride-and-prejudice --context 512 --windows 2 \
      --scheme kvquant-4 --out runs/calib-smollm2-kvq4-512
  $K eval --model smollm2-135m --data war-and-peace --context 8k --windows 1 --no-progress \
    --scheme kvquant-4 --calibration runs/calib-smollm2-kvq4-512 --out runs/smollm2-wp-8k-kvquant-cal512
fi
if [[ $step == qwen32k-wp || $step == qwen32k-wiki ]]; then
  # Qwen2.5-Coder-0.5B at its 32K context. bfloat16 compute (3.9x faster than float32 on these AMX
  # cores: one float32 32K forward takes > 20 min); the `bf16` identity scheme measures the noise
  # floor of the simulated attention path against the reference path in that precision.
  # Peak memory: /usr/bin/time -v beside the run (runs/<name>/time.txt) and peak_rss in summary.json.
  # WikiText-2 drops the noise floor and INT2 (measured on War and Peace) to save CPU time.
  data=war-and-peace; name=qwen-wp-32k; extra=(--scheme bf16 --scheme int2-token --scheme int2-channel)
  [[ $step == qwen32k-wiki ]] && { data=wikitext2; name=qwen-wiki-32k; extra=(); }
  mkdir -p runs/$name
  /usr/bin/time -v -o runs/$name.time.txt \
    $K eval --model qwen2.5-coder-0.5b --data $data --context 32k --windows 1 --no-progress --dtype bfloat16 \
      "${extra[@]}" --scheme int8-token --scheme int8-channel --scheme int4-token --scheme int4-channel \
      --out runs/$name
fi
if [[ $step == qwen32k-kvquant ]]; then
  # KVQuant-class recipes on Qwen at 32K, calibrated on Pride and Prejudice (2 x 2,048 tokens, float32
  # Fisher pass), plus kvquant-4 calibrated on 2 x 512 tokens: the calibration-mismatch case at 32K.
  /usr/bin/time -v -o runs/qwen-wp-32k-kvquant.time.txt \
    .venv/bin/python benchmarks/kvquant_ablation.py --set goals --model qwen2.5-coder-0.5b --context 32768 \
      --dtype bfloat16 --out runs/qwen-wp-32k-kvquant
fi
if [[ $step == peak-memory ]]; then
  # Peak resident memory of one evaluation (reference + one scheme) at 8K, for both models; the
  # 32K figures come from the qwen32k steps (same measurement: /usr/bin/time -v and peak_rss_bytes).
  for m in smollm2-135m qwen2.5-coder-0.5b; do
    dt=float32; [[ $m == qwen2.5-coder-0.5b ]] && dt=bfloat16
    /usr/bin/time -v -o runs/peak-$m-8k.time.txt \
      $K eval --model $m --data war-and-peace --context 8k --windows 1 --no-progress --dtype $dt \
        --scheme int4-channel --out runs/peak-$m-8k --overwrite
  done
fi
if [[ $step == qwen32k-wiki-int2 ]]; then
  # INT2 per-token vs per-channel keys on WikiText-2 at 32K (the rest of qwen32k-wiki's comparison).
  /usr/bin/time -v -o runs/qwen-wiki-32k-int2.time.txt \
    $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
      --scheme int2-token --scheme int2-channel --out runs/qwen-wiki-32k-int2
fi
if [[ $step == all || $step == smooth-alpha ]]; then
  # The smoothing exponent: int4-token-smooth-prerope at alpha 0.25 / 0.75 / 1.0 (benchmarks/schemes/*-a0*.json)
  # beside the preset's 0.5 (the smooth-prerope step), same calibration text and windows.
  for m in qwen2.5-coder-0.5b smollm2-135m; do
    cals=()
    for a in a025 a075 a100; do
      d=runs/calib-$m-int4-token-smooth-prerope-$a
      [[ -f $d/calibration.json ]] || $K calibrate --model $m --data pride-and-prejudice --context 2048 --windows 2 \
        --scheme benchmarks/schemes/int4-token-smooth-prerope-$a.json --out $d
      cals+=(--scheme benchmarks/schemes/int4-token-smooth-prerope-$a.json --calibration $d)
    done
    if [[ $m == qwen2.5-coder-0.5b ]]; then
      $K eval --model $m --data wikitext2 --context 4k --windows 1 --no-progress "${cals[@]}" --out runs/qwen-wiki-4k-smooth-alpha
    else
      $K eval --model $m --data war-and-peace --context 8k --windows 1 --no-progress "${cals[@]}" --out runs/smollm2-wp-8k-smooth-alpha
    fi
  done
fi
if [[ $step == qwen32k-wiki-smooth ]]; then
  # Centred / smoothed per-token keys out to 32K on WikiText-2 (§3f's window and precision), from the 2 x 2,048-token
  # calibrations of the smooth and smooth-prerope steps: does the post-RoPE preset drift with length, the pre-RoPE not?
  c=runs/calib-qwen2.5-coder-0.5b
  need_qwen_calibrations int8-token-smooth int4-token-smooth int8-token-smooth-prerope int4-token-smooth-prerope
  /usr/bin/time -v -o runs/qwen-wiki-32k-smooth.time.txt \
    $K eval --model qwen2.5-coder-0.5b --data wikitext2 --context 32k --windows 1 --no-progress --dtype bfloat16 \
      --scheme int8-token-smooth --scheme int8-token-smooth-prerope --scheme int4-token-smooth \
      --scheme int4-token-smooth-prerope --calibration $c-int8-token-smooth --calibration $c-int8-token-smooth-prerope \
      --calibration $c-int4-token-smooth --calibration $c-int4-token-smooth-prerope --out runs/qwen-wiki-32k-smooth
fi
if [[ $step == all || $step == needle ]]; then
  # Passkey retrieval by context and depth (BENCHMARKS.md §17): War and Peace as the haystack, prefill
  # semantics (the document prefilled exactly and stored in each scheme's real cache, the question and
  # the key decoded over it); kvquant-4 calibrated on Pride and Prejudice as in the kvquant step.
  [[ -f runs/calib-smollm2-kvq4/calibration.json ]] || \
    $K calibrate --model smollm2-135m --data pride-and-prejudice --context 2048 --windows 2 \
      --scheme kvquant-4 --out runs/calib-smollm2-kvq4
  [[ -f runs/needle-smollm2-prefill/needle.json ]] || \
    $K needle --model smollm2-135m --context 2k --context 4k --context 8k --trials 2 --no-progress \
      --scheme int8-token --scheme int4-token --scheme int4-channel --scheme kivi-4 --scheme kivi-2 \
      --scheme int2-token --scheme kvquant-4 --calibration runs/calib-smollm2-kvq4 \
      --out runs/needle-smollm2-prefill
fi
if [[ $step == needle-wide ]]; then
  # §17a's trials widened to 4 per cell (trials 0-1 of each cell are §17a's: keys and offsets come from the seed,
  # context, depth and index), with the centred / smoothed per-token INT4 keys of §21 (2K calibrations) beside them.
  for b in 4; do
    [[ -f runs/calib-smollm2-kvq$b/calibration.json ]] || \
      $K calibrate --model smollm2-135m --data pride-and-prejudice --context 2048 --windows 2 \
        --scheme kvquant-$b --out runs/calib-smollm2-kvq$b
  done
  for s in int4-token-smooth int4-token-smooth-prerope; do
    d=runs/calib-smollm2-135m-$s
    [[ -f $d/calibration.json ]] || $K calibrate --model smollm2-135m --data pride-and-prejudice --context 2048 \
      --windows 2 --scheme $s --out $d
  done
  [[ -f runs/needle-smollm2-wide/needle.json ]] || \
    $K needle --model smollm2-135m --context 2k --context 4k --context 8k --trials 4 --no-progress \
      --scheme int8-token --scheme int4-token --scheme int4-channel --scheme kivi-4 --scheme kivi-2 \
      --scheme int2-token --scheme kvquant-4 --scheme int4-token-smooth --scheme int4-token-smooth-prerope \
      --calibration runs/calib-smollm2-kvq4 --calibration runs/calib-smollm2-135m-int4-token-smooth \
      --calibration runs/calib-smollm2-135m-int4-token-smooth-prerope --out runs/needle-smollm2-wide
fi
if [[ $step == kvquant-depth0 ]]; then
  # §17g's kvquant-4 losses (2K, depth 0): the same trials and more, through kvquant-4 with one ingredient changed
  # at a time (calibrations sampled as `kvbits calibrate` samples for each scheme's sinks; not part of `all`).
  [[ -f runs/needle-smollm2-kvquant-depth0/needle.json ]] || \
    PYTHONPATH=src .venv/bin/python benchmarks/kvquant_ablation.py --set loo --set edges --calib-sinks scheme \
      --task needle --context 2048 --depths 0 --trials 4 --out runs/needle-smollm2-kvquant-depth0
  [[ -f runs/needle-smollm2-kvquant-depth0-16/needle.json ]] || \
    PYTHONPATH=src .venv/bin/python benchmarks/kvquant_ablation.py --set loo --set edges --calib-sinks scheme \
      --only kvquant-4 --only kvquant-4-p100 --only kvquant-4-sinks4 --only kvquant-4-sinks32 \
      --only kvquant-4-no-nuq --only kvquant-4-no-outl --only kvquant-4-no-sink --only kvquant-4-block \
      --task needle --context 2048 --depths 0 --trials 16 --out runs/needle-smollm2-kvquant-depth0-16
  # the same 16 trials through the uncalibrated 4- and 2-bit schemes of §17g
  [[ -f runs/needle-smollm2-depth0-16-uncalibrated/needle.json ]] || \
    $K needle --model smollm2-135m --context 2k --depths 0 --trials 16 --no-progress --scheme int4-token \
      --scheme int4-channel --scheme kivi-4 --scheme kivi-2 --out runs/needle-smollm2-depth0-16-uncalibrated
fi
if [[ $step == all || $step == needle-qwen ]]; then
  # The same task on Qwen2.5-Coder-0.5B (32K-trained, GQA 7:1, layer-0 key bias) at 4K-16K, one trial per cell.
  [[ -f runs/needle-qwen-prefill/needle.json ]] || \
    $K needle --model qwen2.5-coder-0.5b --context 4k --context 8k --context 16k --trials 1 --no-progress \
      --scheme int8-token --scheme int4-token --scheme int4-channel --scheme kivi-4 --scheme kivi-2 \
      --scheme int2-token --out runs/needle-qwen-prefill
fi
if [[ $step == needle-qwen-32k ]]; then
  # Qwen2.5-Coder-0.5B at its trained maximum, 32K, one trial at each of three depths (float32: about 25 min
  # per trial here, almost all of it the exact prefill; not part of `all`).
  [[ -f runs/needle-qwen-32k/needle.json ]] || \
    $K needle --model qwen2.5-coder-0.5b --context 32k --depths 0.25,0.5,0.75 --trials 1 --no-progress \
      --scheme int8-token --scheme int4-token --scheme int4-channel --scheme kivi-4 --scheme kivi-2 \
      --scheme int2-token --out runs/needle-qwen-32k
fi
if [[ $step == needle-qwen-smooth ]]; then
  # §17b's trials (4K-16K, one per cell, the same seed) through the centred / smoothed per-token INT4 keys, from the
  # Pride and Prejudice calibrations of the smooth and smooth-prerope steps, beside plain per-token INT4 again.
  c=runs/calib-qwen2.5-coder-0.5b
  need_qwen_calibrations int4-token-smooth int4-token-smooth-prerope
  [[ -f runs/needle-qwen-smooth/needle.json ]] || \
    $K needle --model qwen2.5-coder-0.5b --context 4k --context 8k --context 16k --trials 1 --no-progress \
      --scheme int4-token --scheme int4-token-smooth --scheme int4-token-smooth-prerope \
      --calibration $c-int4-token-smooth --calibration $c-int4-token-smooth-prerope --out runs/needle-qwen-smooth
fi
if [[ $step == needle-qwen-32k-smooth ]]; then
  # §17d's depths at 32K through the centred / smoothed INT4 keys beside plain per-token and per-channel INT4, in
  # bfloat16 (the float32 prefills of §17d took 71 min; bfloat16 has float32's range): not §17d's reference.
  c=runs/calib-qwen2.5-coder-0.5b
  need_qwen_calibrations int4-token-smooth int4-token-smooth-prerope
  [[ -f runs/needle-qwen-32k-smooth/needle.json ]] || \
    $K needle --model qwen2.5-coder-0.5b --context 32k --depths 0.25,0.5,0.75 --trials 1 --no-progress \
      --dtype bfloat16 --scheme int4-token --scheme int4-channel --scheme int4-token-smooth \
      --scheme int4-token-smooth-prerope --calibration $c-int4-token-smooth \
      --calibration $c-int4-token-smooth-prerope --out runs/needle-qwen-32k-smooth
  # then five depths, two trials each (10 more trials; about 45 min here)
  [[ -f runs/needle-qwen-32k-smooth-wide/needle.json ]] || \
    $K needle --model qwen2.5-coder-0.5b --context 32k --trials 2 --seed 1 --no-progress \
      --dtype bfloat16 --scheme int4-token --scheme int4-channel --scheme int4-token-smooth \
      --scheme int4-token-smooth-prerope --calibration $c-int4-token-smooth \
      --calibration $c-int4-token-smooth-prerope --out runs/needle-qwen-32k-smooth-wide
fi
if [[ $step == all || $step == needle-decode ]]; then
  # Decode semantics for the same SmolLM2 trials at 4K (every token attends over the quantized history,
  # the simulator): the harsher case beside needle's prefill semantics.
  [[ -f runs/needle-smollm2-decode/needle.json ]] || \
    $K needle --model smollm2-135m --context 4k --trials 2 --semantics decode --no-progress \
      --scheme int4-token --scheme int4-channel --scheme kivi-4 --scheme kivi-2 \
      --out runs/needle-smollm2-decode
fi
if [[ $step == all || $step == speed ]]; then
  # Decode tokens/s and cache bytes by context and batch (BENCHMARKS.md §18), this CPU, 2 threads: every
  # kvbits step dequantizes the history (no fused kernel off CUDA); transformers' QuantizedCache (quanto)
  # beside it; then the same with kvbits' dequantized workspace. (§18a/b ran at dc01ddc, before 0d6ca3c's
  # byte-wise unpacking; §18c reran the 2- and 4-bit caches after it: runs/speed-smollm2-unpack.)
  [[ -f runs/speed-smollm2/speed.json ]] || \
    $K speed --model smollm2-135m --context 1k --context 4k --context 8k --batch 1 --batch 4 --tokens 16 \
      --warmup 4 --threads 2 --no-progress --scheme int8-token --scheme int4-token --scheme kivi-4 \
      --scheme kivi-2 --scheme hf-quanto-int4 --out runs/speed-smollm2
  # §18e: 18c's run again after 51c7d10 (the history decoded into its place): runs/speed-smollm2-into
  [[ -f runs/speed-smollm2-into/speed.json ]] || \
    $K speed --model smollm2-135m --context 1k --context 4k --context 8k --batch 1 --batch 4 --tokens 16 \
      --warmup 4 --threads 2 --no-progress --scheme int4-token --scheme kivi-4 --scheme kivi-2 \
      --scheme hf-quanto-int4 --out runs/speed-smollm2-into
  [[ -f runs/speed-smollm2-workspace/speed.json ]] || \
    $K speed --model smollm2-135m --context 1k --context 4k --context 8k --batch 1 --batch 4 --tokens 16 \
      --warmup 4 --threads 2 --no-progress --workspace --scheme kivi-4 --scheme kivi-2 \
      --out runs/speed-smollm2-workspace
fi
if [[ $step == all || $step == speed-qwen ]]; then
  # The same on Qwen2.5-Coder-0.5B (GQA 7:1, 24 layers) at 4K and 16K, batch 1 (BENCHMARKS.md §18d).
  [[ -f runs/speed-qwen/speed.json ]] || \
    $K speed --model qwen2.5-coder-0.5b --context 4k --context 16k --batch 1 --tokens 16 --warmup 4 \
      --threads 2 --no-progress --scheme int8-token --scheme int4-channel --scheme kivi-4 --scheme kivi-2 \
      --scheme hf-quanto-int4 --out runs/speed-qwen
fi
if [[ $step == all || $step == fold-real-kv ]]; then
  # The folded-scale decode kernel on real caches, through Triton's interpreter (BENCHMARKS.md §6, sessions 39-40;
  # about 10, 13 and 4 minutes)
  PYTHONPATH=src .venv/bin/python benchmarks/fold_real_kv.py --model qwen2.5-coder-0.5b --data wikitext2 \
    --context 2048 --steps 2 --out benchmarks/results/fold-real-kv-qwen-wiki-2k.json
  PYTHONPATH=src .venv/bin/python benchmarks/fold_real_kv.py --model smollm2-135m --data war-and-peace \
    --context 2048 --steps 2 --out benchmarks/results/fold-real-kv-smollm2-wp-2k.json
  # the other rotated stores the split query serves (session 40; about 4 minutes)
  PYTHONPATH=src .venv/bin/python benchmarks/fold_real_kv.py --model qwen2.5-coder-0.5b --data wikitext2 \
    --context 2048 --steps 2 --scheme int8-token-hadamard --scheme int2-token-hadamard --scheme vllm-int4 \
    --out benchmarks/results/fold-real-kv-qwen-wiki-2k-rotated.json
  # step by step, the product kernel's per-token keys as codes (K_ROWS) and dequantized and rounded (session 43;
  # about 5 minutes each)
  for flag in "" --rounded-keys; do
    for model in smollm2-135m:smollm2 qwen2.5-coder-0.5b:qwen; do
      PYTHONPATH=src .venv/bin/python benchmarks/fold_real_kv.py --model ${model%%:*} --data wikitext2 \
        --context 1024 --steps 4 --scheme int4-token --scheme int8-token --scheme int4-token-hadamard $flag \
        --out benchmarks/results/fold-real-kv-${model##*:}-wiki-1k-steps${flag:+-rounded-keys}.json
    done
  done
fi
