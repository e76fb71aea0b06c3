"""``kvbits export``: a calibration's parameters in a serving engine's format (thin wrapper over
``kvbits.export``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvbits._argtypes import bounded, check_scheme_args
from kvbits._json import dumps, loads

__all__ = ["add_parser", "run"]

EPILOG = """\
examples:
  kvbits calibrate --model smollm2-135m --data pride-and-prejudice --scheme fp8-e4m3 --context 4k --out cal-fp8/
  kvbits export --format vllm --calibration cal-fp8/ --out vllm-scales/
  kvbits export --format vllm --calibration cal-fp8/ --checkpoint /models/SmolLM2-135M --out smollm2-fp8kv/
  kvbits calibrate --model qwen2.5-coder-0.5b --data pride-and-prejudice --scheme fp8-e4m3-head --out cal-head/
  kvbits export --format vllm --calibration cal-head/ --out vllm-head-scales/
  kvbits export --format vllm --scheme "vllm-int4,0=fp16"

--scheme S prints vLLM's KV-cache settings for a scheme vLLM stores as kvbits measured it: vllm-int4
(int4_per_token_head), vllm-int8 (int8_per_token_head), vllm-fp8-token / fp8-e4m3-token (fp8_per_token_head; these
three with --attention-backend TRITON_ATTN, which vLLM's docs require for them), fp8-e4m3 /
fp8-e4m3-head (fp8, with --attention-backend FLASH_ATTN), fp16 / bf16 (auto), each with layers stored as fp16 or
bf16 given to --kv-cache-dtype-skip-layers (read from vLLM's source, not run here); anything else is refused,
saying why. --json: {"scheme", "kv_cache_dtype", "skip_layers", "attention_backend", "cli", "engine_kwargs", "notes"}.

vllm: kv_cache_scales.safetensors ({module}.k_scale / .v_scale, float32, one per layer (a hybrid model's attention
layers only, under their index among all layers), or one per KV head as (H_kv, 1, 1) for fp8-e4m3-head) and quantization_config.json (compressed-tensors
kv_cache_scheme: 8-bit float, strategy tensor or attn_head, static, symmetric). vLLM applies
per-head scales in its FlashAttention backend only (--attention-backend FLASH_ATTN); with an FP8 cache that backend
also rounds each query to FP8 at a q_scale kvbits does not calibrate or export (vLLM then uses k_scale or 1.0 and
says so), an error kvbits' figures (queries kept at the model's precision) leave out. With --checkpoint DIR (a Hugging Face folder, left untouched) --out becomes a servable
checkpoint: DIR's files linked, config.json (and model.safetensors.index.json, when DIR has one) written
with the scales added. DIR's config.json must match the calibrated model's (layers, KV heads, the shape fields the
calibration records); its weights are not compared, so give the checkpoint the calibration was made on (a fine-tune
of the same architecture is accepted, and its scales may be wrong). A failed export leaves --out as it was; a re-export
replaces the links and index an earlier one made there (weights it did not make are refused).
Without --checkpoint, --out holds the scales alone, which vLLM does not serve (the command says so).
Serve a --checkpoint export with: vllm serve <out> --kv-cache-dtype fp8, without --calculate-kv-scales (vLLM
versions that have it then compute scales from the first batch and skip the exported ones). The scales are for
OCP E4M3 (absmax / 448); on ROCm MI300 vLLM's fp8 is E4M3FNUZ (max 240): the notes say so.
--json prints the export record (kvbits_export.json): {"format", "created", "calibration",
"kv_cache_scheme", "layers": [{"layer", "k_scale", "v_scale" (numbers, or lists per head), "k_absmax",
"v_absmax", "module"}], "serve", "notes",
"out_dir", "checkpoint"}.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        help="write calibrated FP8 KV-cache scales in the format vLLM loads, or vLLM's flags for a scheme",
        description="Export a kvbits calibration for a serving engine. vllm: the per-layer (or per-head) FP8 "
        "K/V scales of an fp8-e4m3 (fp8-e4m3-head) calibration as a compressed-tensors checkpoint carries them; "
        "with --scheme, vLLM's KV-cache flags for a scheme it stores as kvbits measured it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--format", choices=("vllm",), default="vllm", help="target engine format (default vllm)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--calibration", metavar="DIR", help="kvbits calibrate folder (fp8-e4m3 or fp8-e4m3-head)")
    what.add_argument(
        "--scheme", metavar="S", help="print vLLM's serving flags for this scheme (preset, JSON, mixed string)"
    )
    p.add_argument(
        "--out", metavar="DIR", help="folder for the scales, the config block and the record (with --calibration)"
    )
    p.add_argument(
        "--checkpoint", metavar="DIR", help="Hugging Face checkpoint folder: --out becomes it plus the scales"
    )
    p.add_argument(
        "--module-template",
        metavar="NAME",
        help="attention module names with {i} for the layer (default: as calibrated, else "
        "model.layers.{i}.self_attn)",
    )
    p.add_argument(
        "--layers", metavar="N", type=bounded(int, 1),
        help="the model's layer count (with --scheme): needed by a mix whose base is fp16/bf16 and whose other "
        "layers store one vLLM format, to list the layers vLLM skips (default: meta.layers of the kvbits tune record "
        "<scheme>.tune.json beside a scheme JSON, which a different --layers contradicts)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the export record as JSON")
    return p


def _windows(cal: dict[str, Any]) -> str:
    """``"W x T"`` for a calibration record of W windows of T tokens; ``"T"`` where it records no window count."""
    w = cal.get("windows")
    return f"{w} x {cal['context']}" if isinstance(w, int) else f"{cal['context']}"


def run(args: argparse.Namespace) -> int:
    check_scheme_args(args.scheme)  # torch-free: a misspelled name is refused in ~0.2 s, not after the imports
    from kvbits.export import export_vllm

    if args.scheme is not None:
        return _run_scheme(args)
    if args.layers is not None:
        raise ValueError("--layers goes with --scheme, not --calibration (the calibration records its layers)")
    if args.out is None:
        raise ValueError("--calibration needs --out DIR (the folder for the scales)")
    record = export_vllm(
        args.calibration, args.out, checkpoint=args.checkpoint, module_template=args.module_template
    )
    if args.json:
        sys.stdout.write(dumps(record, indent=2) + "\n")
        return 0
    layers = record["layers"]
    ks = [x for r in layers for x in _flat(r["k_scale"])]
    vs = [x for r in layers for x in _flat(r["v_scale"])]
    per = f", {record['kv_cache_scheme']['strategy']} strategy" if record["kv_cache_scheme"]["strategy"] != "tensor" else ""
    print(
        f"{len(layers)} layers{per}: k_scale {min(ks):.4g}..{max(ks):.4g}, v_scale {min(vs):.4g}..{max(vs):.4g} "
        f"(calibrated on {record['calibration']['data']}, {_windows(record['calibration'])} tokens)"
    )
    print(f"written to {record['out_dir']}")
    if "checkpoint" in record:
        ck = record["checkpoint"]
        print(
            f"checkpoint {ck['path']}: {len(ck['linked'])} files linked, {', '.join(ck['written'])} written"
        )
    if "checkpoint" in record:
        print(f"serve: {record['serve']}")
    else:  # the scales alone: vLLM serves a model folder, which --checkpoint makes of --out
        flags = record["serve"].partition("<checkpoint>")[2]
        print(
            f"serve: {record['out_dir']} holds the scales only, not a model vLLM can serve: rerun with --checkpoint DIR "
            f"(the calibrated model's Hugging Face folder) to write a servable folder there, then: vllm serve "
            f"{record['out_dir']}{flags}"
        )
    for note in record.get("notes", ()):
        print(f"note: {note}")
    return 0


def _run_scheme(args: argparse.Namespace) -> int:
    from kvbits.export.vllm_flags import vllm_cache_args

    extra = [f for f, v in (("--out", args.out), ("--checkpoint", args.checkpoint),
                            ("--module-template", args.module_template)) if v is not None]  # fmt: skip
    if extra:
        raise ValueError(f"{', '.join(extra)} go with --calibration, not --scheme")
    layers = args.layers
    recorded = _tune_record_layers(args.scheme)
    if recorded is not None:
        count, record = recorded
        if layers is not None and layers != count:
            raise ValueError(
                f"--layers {layers} disagrees with {record}: meta.layers {count}, the layer count of the model tune "
                "measured this mix on; drop --layers (the record gives it), or export the mix tuned for that model"
            )
        layers = count
    serve = vllm_cache_args(args.scheme, layers)
    if args.json:
        sys.stdout.write(dumps(serve.to_dict(), indent=2) + "\n")
        return 0
    print(f"serve: vllm serve <model> {' '.join(serve.cli())}".rstrip())
    print(f"python: vllm.LLM(<model>, {', '.join(f'{k}={v!r}' for k, v in serve.engine_kwargs().items())})")
    for note in serve.notes:
        print(f"note: {note}")
    return 0


def _tune_record_layers(scheme: str) -> tuple[int, Path] | None:
    """``(meta.layers, record path)`` of the ``kvbits tune`` record beside a scheme JSON (``<scheme>.tune.json``,
    which tune writes with it), None where there is none; ``ValueError`` for a record without a layer count. ``~`` is
    expanded, as ``get_scheme`` expands it for the scheme itself."""
    record = Path(str(Path(scheme).expanduser()) + ".tune.json")
    if not scheme.lower().endswith(".json") or not record.is_file():
        return None
    try:
        data = loads(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{record}: expected the kvbits tune record of {scheme}, could not read it ({exc})") from None
    meta = data.get("meta") if isinstance(data, dict) else None
    count = meta.get("layers") if isinstance(meta, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"{record}: expected a kvbits tune record with meta.layers (the model's layer count, a positive int), "
            f"got {count!r}"
        )
    return count, record


def _flat(x: float | list[float]) -> list[float]:
    return x if isinstance(x, list) else [x]
