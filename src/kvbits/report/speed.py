"""The decode-speed report (``kvbits speed``): Markdown, a figure, the output folder.

``write_speed(summary, out_dir)`` writes ``speed.json`` (the summary of
``kvbits.evaluate.speed.speed_eval``, every step time included), ``report.md`` and, with matplotlib,
``speed.png``: decode tokens/s against context, one line per cache, one panel per batch, and the bytes
each cache holds at the end of the run. ``load_speed(path)`` reads a ``speed.json`` back, checked
(:func:`check_speed`): a hand-edited, cut or foreign file is a ``ValueError`` naming the file and the field.
A run that raised (its record holds ``error``, no timings) reads ``failed: <type>`` in every table, its message listed
under them; the merge keeps it as any other run of its cell.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbits._json import check, checked_object, entries, field
from kvbits.report.fmt import (
    bos_phrase,
    fmt_bytes,
    fmt_float,
    fmt_float_sig,
    fmt_frac,
    fmt_pos,
    merged_runs_table,
)
from kvbits.report.inline import code
from kvbits.report.markdown import md_cell
from kvbits.report.render import check_out_folder, write_json_report
from kvbits.report.summary import read_json

__all__ = [
    "READS_VERSION", "SPEED_FILES", "check_speed", "check_speed_out", "load_speed", "plot_speed", "speed_markdown", "write_speed",
]  # fmt: skip

SPEED_FILES = ("speed.json", "report.md", "speed.png")

READS_VERSION = 1
"""The ``speed.json`` version this report reads: ``kvbits.evaluate.speed.SPEED_VERSION`` (not imported from there,
which needs torch; a test keeps the two equal). A file of another version is refused, not rendered as if its fields
meant what this kvbits's do."""
BASELINE = "DynamicCache"

_PATHS = {
    "dynamic": "transformers' `DynamicCache`, the model's own K/V tensors (the baseline)",
    "fused": "decode attention over the packed store (`kvbits.kernels.decode_attention`; the cache builds no "
    "dequantized history)",
    "dequantize": "each step dequantizes the whole history, then SDPA (the cache holds only what it reports)",
    "workspace": "a dequantized copy of the history is kept and appended to (faster; holds the float history "
    "too, `workspace` below)",
    "peer": "a cache outside kvbits, as it ships",
    "static-float": "transformers' `StaticCache`, float K/V in slots reserved for the run's tokens (the static "
    "baseline)",
    "static-fused": "`StaticQuantizedKVCache` (fixed slabs, lengths on the device), the fused kernel launched over "
    "every reserved slot",
    "static-dequantize": "`StaticQuantizedKVCache`, every reserved slot dequantized each step, then SDPA",
}
_GRAPHS = "; each step after the warm-up replayed from a captured CUDA graph"


def _path_text(path: str) -> str:
    base = path.removesuffix("-graphs")
    return _PATHS.get(base, base) + (_GRAPHS if path.endswith("-graphs") else "")


def _served_by(summary: Mapping[str, Any], name: str) -> str:
    """What attended cache ``name``'s fused steps in this run, from its runs' ``kernel_calls``: the Triton kernel,
    or the torch reference, which dequantizes the history in torch (``kvbits.kernels.reference``): its timings are
    a correctness path's, not the kernel's. ``""`` when nothing was counted (runs from before the count)."""
    calls = [r["decode"].get("kernel_calls") for r in summary["runs"] if r["cache"] == name and r.get("decode")]
    triton = sum(c["triton"] for c in calls if c)
    reference = sum(c["reference"] for c in calls if c)
    if not triton and not reference:
        return ""
    if not reference:
        return "; attended by the Triton kernel"
    ref = ("the torch reference (`KVBITS_KERNEL`, or no Triton on this device), which dequantizes the history in "
           "torch each step: these timings are a correctness path's, not the fused kernel's")  # fmt: skip
    return f"; attended by {ref}" if not triton else f"; {reference} of {triton + reference} calls attended by {ref}"


def _eager_steps(summary: Mapping[str, Any]) -> int | str:
    """The decode steps run eagerly before the captured one, as the graphed runs recorded them."""
    return next((r["graph"]["eager_steps"] for r in summary["runs"] if r.get("graph")), "?")


def _caches(summary: Mapping[str, Any]) -> list[str]:
    return list(summary.get("baselines") or [BASELINE]) + [s["scheme"] for s in summary["schemes"]]


def _run(summary: Mapping[str, Any], cache: str, context: int, batch: int) -> Mapping[str, Any] | None:
    for r in summary["runs"]:
        if r["cache"] == cache and r["context"] == context and r["batch"] == batch:
            return r
    return None


def _table(summary: Mapping[str, Any], batch: int, cell) -> list[str]:
    contexts = summary["contexts"]
    lines = [
        "| cache | " + " | ".join(fmt_pos(c) for c in contexts) + " |",
        "|:---|" + "---:|" * len(contexts),
    ]
    for cache in _caches(summary):
        runs = [_run(summary, cache, c, batch) for c in contexts]
        cells = [failed_cell(r) if r is not None and r.get("error") else cell(r) for r in runs]
        lines.append(f"| {md_cell(str(cache))} | " + " | ".join(cells) + " |")
    return lines + [""]


def failed_cell(r: Mapping[str, Any]) -> str:
    """A failed run's cell in every table: ``failed: OutOfMemoryError`` (the message is listed under the tables)."""
    return f"failed: {md_cell(str(r['error'].get('type') or 'error'))}"


def _speed_cell(r: Mapping[str, Any] | None) -> str:
    """``tokens/s (speedup x)``; a NaN (``"NaN"`` in speed.json) prints as ``n/a``, never ``nan (nanx)``, and a
    factor that is NaN is left out."""
    if r is None:
        return "n/a"
    tps, speedup = fmt_float_sig(r["tokens_per_s"], 1), r["speedup"]
    return tps if speedup is None or math.isnan(speedup) else f"{tps} ({fmt_float_sig(speedup, 2)}x)"


def _ms_cell(r: Mapping[str, Any] | None) -> str:
    """``median [p10–p90]`` milliseconds per step, and the host's; NaN prints as ``n/a``."""
    if r is None:
        return "n/a"
    cell = f"{fmt_float(r['ms_per_step'], 2)} [{fmt_float(r['ms_p10'], 2)}–{fmt_float(r['ms_p90'], 2)}]"
    host = r.get("host_ms_per_step")
    return cell if host is None else f"{cell}, host {fmt_float(host, 2)}"


def _size_ratio(ratio: float) -> str:
    """``base / held`` bytes in words: ``"2.00x smaller"``, ``"1.42x larger"``; within half a percent, where two
    decimals round to 1.00 (a StaticCache as large as DynamicCache read "1.00x smaller"), ``"the same size"``
    (exactly equal) or ``"about the same size"``."""
    if ratio == 1:
        return "the same size"
    if f"{ratio:.2f}" == "1.00" or f"{1 / ratio:.2f}" == "1.00":
        return "about the same size"
    return f"{ratio:.2f}x smaller" if ratio > 1 else f"{1 / ratio:.2f}x larger"


def _bytes_cell(r: Mapping[str, Any] | None, base: Mapping[str, Any] | None) -> str:
    if r is None or r.get("cache_bytes") is None:
        return "n/a"
    cell = fmt_bytes(r["cache_bytes"])
    if r.get("workspace_bytes"):  # the ratio is of all the cache holds: its workspace too, as speed.png draws it
        cell += f" + workspace {fmt_bytes(r['workspace_bytes'])}"
    held, base_held = _held_bytes(r), None if base is None else _held_bytes(base)
    # no ratio against or for an empty cache (0 bytes, which the input check allows): it would divide by zero
    if base_held and held and r is not base:
        ratio = base_held / held  # a StaticCache, a reserved cache or a workspace may hold more, not less
        cell += f" ({_size_ratio(ratio)})"
    if r.get("planned_bytes") is not None and r["planned_bytes"] != r["cache_bytes"]:
        cell += f" **≠ plan {fmt_bytes(r['planned_bytes'])}**"
    if r.get("linear_state_bytes"):
        cell += f" + linear states {fmt_bytes(r['linear_state_bytes'])}"
    return cell


def held_beside(r: Mapping[str, Any]) -> str:
    """What run ``r``'s cache holds beside its K/V bytes, as report.md's table and the console's add it:
    ``" + workspace X"`` (a ``--workspace`` run's dequantized history) and ``" + linear states Y"`` (a hybrid
    model's conv / recurrent states: not K/V, not in the plan), or ``""``."""
    out = ""
    if r.get("workspace_bytes"):
        out += f" + workspace {fmt_bytes(r['workspace_bytes'])}"
    if r.get("linear_state_bytes"):
        out += f" + linear states {fmt_bytes(r['linear_state_bytes'])}"
    return out


def _agree_cell(r: Mapping[str, Any] | None) -> str:
    if r is None:
        return "n/a"
    if r["agreement"] is None:  # the baseline failed at this cell
        return "n/a (no baseline)"
    first = r.get("first_divergence")
    return fmt_frac(r["agreement"], 0) + ("" if first is None else f", from step {first}")


def _merged_table(merged: list[Mapping[str, Any]]) -> list[str]:
    """The runs a merged report was made of: the cells each timed, when and with what."""
    return merged_runs_table(merged, [
        ("contexts", ":---", lambda m: ", ".join(fmt_pos(c) for c in m.get("contexts") or [])),
        ("batches", ":---", lambda m: ", ".join(str(b) for b in m.get("batches") or [])),
    ], note="*Each (context, batch) cell comes whole from one run: its baseline and schemes timed together.*")  # fmt: skip


def _kernel_line(summary: Mapping[str, Any]) -> list[str]:
    """The decode-kernel settings line (none for a run from before they were recorded)."""
    ks = summary.get("kernel_settings")
    if not isinstance(ks, Mapping):
        return []
    line = (f"- **Decode kernel:** `KVBITS_KERNEL={ks.get('kernel')}`, `KVBITS_DEQUANT={ks.get('dequant')}`, "
            f"`KVBITS_AUTOTUNE={ks.get('autotune')}`")  # fmt: skip
    counts = Counter((summary.get("tuned_launches") or {}).values())
    if counts:
        line += "; tuned launches: " + ", ".join(f"{n} ({c} key{'s' * (c > 1)})" for n, c in sorted(counts.items()))
    return [line]


def _sdpa_line(summary: Mapping[str, Any]) -> list[str]:
    """SDPA's backends for the baseline and the dequantizing paths (none for a run from before they were recorded)."""
    mode = summary.get("sdpa")
    head = "- **SDPA** (`DynamicCache`, dequantizing paths, prefill): "
    if mode == "no-cudnn":
        return [head + "flash, memory-efficient or math, not cuDNN (which builds a plan for every new key length, so "
                "every decode step)"]  # fmt: skip
    if mode == "auto":
        return [head + "torch's choice of backend; where it picks cuDNN (a GPU), a plan is built for every new key "
                "length, so every decode step through SDPA pays for one on the host, and `--sdpa no-cudnn` times the "
                "baseline without it"]  # fmt: skip
    return []


def speed_markdown(summary: Mapping[str, Any], *, figure: bool = True) -> str:
    """The report as Markdown: the setting, tokens/s and step times by context for each batch, the bytes
    each cache holds, CUDA memory where measured, and greedy-token agreement; ``figure``: link speed.png."""
    dev = summary["device"]
    paths = {s["scheme"]: s["path"] for s in summary["schemes"]}
    lines = [
        f"# Decode speed: {md_cell(str(summary['model']))} on {md_cell(str(dev['name']))}",
        "",
        (
            f"- **Model:** {code(str(summary['model']))} (fingerprint {code(str(summary['fingerprint']['model']))}), "
            f"{code(str(summary['dtype']))}"
        ),
        f"- **Device:** {md_cell(str(dev['type']))}, {md_cell(str(dev['name']))}"
        + (f", {dev['threads']} threads" if dev["type"] == "cpu" else ""),
        (
            f"- **Prompts:** {code(str(summary['data']))}, contexts {', '.join(fmt_pos(c) for c in summary['contexts'])} tokens; "
            f"batches {', '.join(str(b) for b in summary['batches'])}"
            + ("" if (bos := bos_phrase(summary)) is None else f"; each prompt starts with {bos} (then context - 1 "
               "text tokens)")
        ),
        f"- **Decode:** {summary['tokens']} timed greedy steps after {summary['warmup']} warm-up steps, per run"
        + ("" if summary.get("static") else {  # runs from before the setting say nothing (their caches grew)
            True: "; kvbits caches reserve quantized storage for the run's tokens (`max_cache_len`: a flush writes "
            "in place" + ("; the workspace holds every token in attention's order and a step returns views of it)"
                          if summary.get("workspace") else ")"),
            False: "; kvbits caches grow by concatenation (a flush copies the layer's quantized history)",
        }.get(summary.get("reserve"), ""))
        + ("; kvbits schemes in `StaticQuantizedKVCache` (every slot reserved for the run's tokens), transformers' "
           "`StaticCache` timed beside `DynamicCache`"
           + (f"; the static caches' steps replayed from a captured CUDA graph after {_eager_steps(summary)} eager "
              "steps and the captured one, in the warm-up; a windowed scheme's flushing step is a graph of its own, run "
              "eagerly at its first flush and captured at its second, wherever they fall (`graph` in speed.json lists "
              "the steps)" if summary.get("graphs") else "")
           if summary.get("static") else ""),
        *_kernel_line(summary),
        *_sdpa_line(summary),
        (
            f"- **Date:** {summary.get('date', 'n/a')}; **commit:** {code(str((summary.get('commit') or {}).get('sha', 'n/a')))}; "
            f"versions {', '.join(f'{k} {v}' for k, v in (summary.get('versions') or {}).items())}"
        ),
        "",
        (
            "Each run prefills the prompts once in full precision, loads their K/V into the cache, and decodes "
            "greedily one token per sequence per forward; every timed step is measured on its own, with the "
            "device synchronised. Tokens/s = batch / median step; the factor is against `DynamicCache` at the "
            "same context and batch. Memory is what the cache holds after the last step, next to "
            "`kvbits plan`'s bytes for the same tokens (marked where they differ)."
        ),
        "",
        "How each cache's decode steps attend:",
        "",
        f"- `{BASELINE}`: {_PATHS['dynamic']}",
    ]
    for name in (summary.get("baselines") or [BASELINE])[1:]:  # StaticCache in a static run
        path = next(r["path"] for r in summary["runs"] if r["cache"] == name)
        lines.append(f"- {code(str(name))}: {code(str(path))}, {_path_text(path)}")
    for name, path in paths.items():
        lines.append(f"- {code(str(name))}: {code(str(path))}, {_path_text(path)}{_served_by(summary, name)}")
    lines.append("")
    for batch in summary["batches"]:
        lines += [f"## Batch {batch}", ""]
        lines += ["*Decode tokens/s (× DynamicCache).*", ""] + _table(summary, batch, _speed_cell)
        timed_host = any(r.get("host_ms_per_step") is not None for r in summary["runs"] if r["batch"] == batch)
        caption = "*Milliseconds per step, median [p10–p90]" + (
            "; host: the median time until the step's Python returned, before the device sync (close to the step's "
            "time: the step waits on the host, Python and kernel launches, not on the GPU).*" if timed_host else ".*"
        )
        lines += [caption, ""] + _table(summary, batch, _ms_cell)
        caption = "*Bytes the cache holds after the last step.*"
        if any(r.get("workspace_bytes") for r in summary["runs"] if r["batch"] == batch):
            caption += " *The factor against DynamicCache counts a workspace's dequantized history with the K/V.*"
        if any(r["path"].startswith("static-") and r.get("planned_bytes") not in (None, r.get("cache_bytes"))
               for r in summary["runs"] if r["batch"] == batch):  # fmt: skip
            caption += (" *A scheme in `StaticQuantizedKVCache` holds more than the plan by design where it has a window "
                        "or static ranges: a windowed scheme its whole ring of `residual + block` full-precision slots "
                        "and one quantized block written ahead; calibrated static integer ranges (KVQuant's keys) a copy "
                        "per sequence in the kernels' layout.*")
        if any(r.get("linear_state_bytes") for r in summary["runs"] if r["batch"] == batch):
            caption += (" *Linear states: the hybrid model's convolution / recurrent states of its non-attention "
                        "layers, unquantized and the same in every cache, held beside the K/V bytes (not in them, nor "
                        "in the plan).*")
        lines += [caption, ""]
        lines += _table(
            summary,
            batch,
            lambda r, b=batch: _bytes_cell(r, _run(summary, BASELINE, r["context"], b) if r else None),
        )
        if any(r.get("cuda_peak_bytes") is not None for r in summary["runs"] if r["batch"] == batch):
            lines += [
                "*CUDA: allocator bytes the cache held after the run · peak above the pre-cache baseline.*",
                "",
            ]
            lines += _table(
                summary, batch,
                lambda r: "n/a" if r is None or r.get("cuda_peak_bytes") is None
                else f"{fmt_bytes(r['cuda_resident_bytes'])} · {fmt_bytes(r['cuda_peak_bytes'])}",
            )  # fmt: skip
        lines += [
            ("*Greedy tokens equal to DynamicCache's, and the first step where some sequence differs, over all "
             f"{summary['warmup']} warm-up and {summary['tokens']} timed steps, counted from 0 at the first warm-up "
             f"step (step {summary['warmup']} is the first timed one).*"),
            "",
        ]
        lines += _table(summary, batch, _agree_cell)
    failed = [r for r in summary["runs"] if r.get("error")]
    if failed:
        lines += ["## Failed runs", "", "*These runs raised; the others went on. Their cells read `failed`.*", ""]
        lines += [f"- {md_cell(str(r['cache']))} at {fmt_pos(r['context'])} × {r['batch']}: "
                  f"{md_cell(str(r['error'].get('type')))}: {md_cell(str(r['error'].get('message')))}"
                  for r in failed] + [""]  # fmt: skip
    if summary.get("merged_from"):
        lines += _merged_table(summary["merged_from"])
    if figure:
        lines += ["## Figure", "", "![decode tokens/s by context](speed.png)", ""]
    short = [r for r in summary["runs"] if r["path"] in ("fused", "static-fused") and r.get("decode")
             and r["decode"]["timed_fused_steps"] != _counted_layers(summary, r) * summary["tokens"]]  # fmt: skip
    if short:
        lines += ["## Timed steps not all fused", "",
                  ("*Layer × step decodes of the timed steps through the fused kernel (of the cache's attention "
                   f"layers × {summary['tokens']} steps), and those that fell back to SDPA over dequantized K/V.*"),
                  ""]  # fmt: skip
        lines += [f"- {r['cache']} at {fmt_pos(r['context'])} × {r['batch']}: {r['decode']['timed_fused_steps']} fused "
                  f"of {_counted_layers(summary, r)} × {summary['tokens']}, {r['decode']['timed_fallback_steps']} "
                  "fallback" for r in short] + [""]  # fmt: skip
    return "\n".join(lines) + "\n"


def _counted_layers(summary: Mapping[str, Any], r: Mapping[str, Any]) -> int:
    """The layers of run ``r``'s cache that count decode steps (a hybrid model's attention layers, not its
    convolution or linear-attention layers); ``summary["layers"]`` for a run from before they were recorded."""
    return r["decode"].get("counted_layers", summary["layers"])


def _linear_state_note(summary: Mapping[str, Any], batch: int) -> str:
    """The bytes panel's title for ``batch``: ``""`` where no run holds linear states (every layer attends) nor a
    workspace, else ``"K/V only; + linear states 1.50 MiB"`` (a range ``"0.75–1.50 MiB"`` where runs differ), as the
    table adds, and ``"workspace included"`` where a run kept a dequantized history (drawn in its bytes)."""
    runs = [r for r in summary["runs"] if r["batch"] == batch]
    held = sorted({r["linear_state_bytes"] for r in runs if r.get("linear_state_bytes")})
    notes = []
    if held:
        span = fmt_bytes(held[0]) if len(held) == 1 else f"{fmt_bytes(held[0])}–{fmt_bytes(held[-1])}"
        notes.append(f"K/V only; + linear states {span}")
    if any(r.get("workspace_bytes") for r in runs):
        notes.append("workspace included")
    return "; ".join(notes)


def _held_bytes(r: Mapping[str, Any]) -> int | None:
    """What run ``r``'s cache holds at the end: its K/V bytes and a workspace's dequantized history (``None``: not
    counted, a peer's)."""
    if r.get("cache_bytes") is None:
        return None
    return r["cache_bytes"] + (r.get("workspace_bytes") or 0)


def plot_speed(summary: Mapping[str, Any], path: Path) -> Path:
    """One column per batch: decode tokens/s against context (top) and the MiB each cache holds at the end
    of the run (bottom), one line per cache, context on a log axis. The bytes are K/V (``cache_bytes``) and a
    workspace's dequantized history (``workspace_bytes``, said in the panel's title where a run kept one); a hybrid
    model's linear states (``linear_state_bytes``, the same in every cache) are named in the bytes panel's title."""
    import numpy as np

    from kvbits.report.plots.figure import BASELINE_COLOR, PALETTE, new_figure, save_png, unique_legend

    batches, contexts = summary["batches"], summary["contexts"]
    fig = new_figure(max(4.5, 3.6 * len(batches) + 1.6), 5.6)
    axes = np.atleast_2d(fig.subplots(2, len(batches), squeeze=False))
    colors = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(_caches(summary)[1:])}
    colors[BASELINE] = BASELINE_COLOR
    panels = ((lambda r: r.get("tokens_per_s"), "decode tokens/s", 1.0), (_held_bytes, "cache MiB", 2.0**-20))
    for col, batch in enumerate(batches):
        for row, (value, label, scale) in enumerate(panels):
            ax = axes[row, col]
            for cache in _caches(summary):
                pts = [(c, v * scale) for c in contexts
                       if (r := _run(summary, cache, c, batch)) is not None and (v := value(r)) is not None]  # fmt: skip
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", ms=3, label=cache, color=colors[cache],
                            ls="--" if cache == BASELINE else "-")  # fmt: skip
            if len(contexts) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [fmt_pos(c) for c in contexts], fontsize=7)
            ax.minorticks_off()
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"batch {batch}", fontsize=9)
            else:
                ax.set_xlabel("context (tokens)", fontsize=8)
                ax.set_ylim(bottom=0)
                if note := _linear_state_note(summary, batch):
                    ax.set_title(note, fontsize=7)
    handles, labels = unique_legend(axes.reshape(-1))
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    fig.suptitle(
        f"Decode speed and cache memory, {summary['model']} on {summary['device']['name']}", fontsize=10
    )
    return save_png(fig, path)


def _check_run(r: Mapping[str, Any], where: str) -> None:
    """One entry of ``runs``: a cache's timings, bytes and greedy agreement at one (context, batch)."""
    for key in ("cache", "path"):
        field(r, key, "text", where)
    for key in ("context", "batch"):
        field(r, key, "whole", where)
    error = field(r, "error", "object", where, default=None)
    if error is not None:  # a failed run: no timings, bytes or agreement
        for key in ("type", "message"):
            field(error, key, "text", f"{where}.error")
        return
    for key in ("tokens_per_s", "ms_per_step", "ms_p10", "ms_p90"):
        field(r, key, "number", where)
    for key in ("speedup", "agreement"):  # null where the cell's baseline failed
        field(r, key, "mean", where)
    field(r, "host_ms_per_step", "mean", where, default=None)
    for key in ("cache_bytes", "planned_bytes", "workspace_bytes", "linear_state_bytes", "cuda_resident_bytes",
                "cuda_peak_bytes", "cuda_graph_bytes"):
        field(r, key, "bytes", where, default=None)
    first = r.get("first_divergence")
    if first is not None:
        check(first, "whole", f"{where}.first_divergence")
    decode = r.get("decode")
    if decode is not None:
        check(decode, "object", f"{where}.decode")
        for key in ("timed_fused_steps", "timed_fallback_steps"):
            field(decode, key, "whole", f"{where}.decode")
        field(decode, "counted_layers", "whole", f"{where}.decode", default=None)
        calls = field(decode, "kernel_calls", "object", f"{where}.decode", default=None)
        for key in ("triton", "reference") if calls is not None else ():
            field(calls, key, "whole", f"{where}.decode.kernel_calls")
    if r.get("graph") is not None:
        field(check(r["graph"], "object", f"{where}.graph"), "eager_steps", "whole", f"{where}.graph")


def _check_speed_fields(s: Mapping[str, Any]) -> None:
    """Every field :func:`speed_markdown`, :func:`plot_speed` and the merge read, of the kind they need."""
    version = field(s, "version", "whole")
    if version != READS_VERSION:
        raise ValueError(
            f"version is {version}; this kvbits reads speed.json version {READS_VERSION} (a newer kvbits wrote it? "
            "upgrade kvbits, or run kvbits speed again)"
        )
    for key in ("model", "data", "dtype"):
        field(s, key, "text")
    device = field(s, "device", "object")
    for key in ("type", "name"):
        field(device, key, "text", "device")
    field(device, "threads", "whole", "device", default=None)
    field(field(s, "fingerprint", "object"), "model", "text", "fingerprint")
    for key in ("contexts", "batches"):
        entries(s, key, "whole")
    for key in ("tokens", "warmup", "layers"):
        field(s, key, "whole")
    for i, x in enumerate(entries(s, "schemes", "object")):
        for key in ("scheme", "path"):
            field(x, key, "text", f"schemes[{i}]")
    runs = entries(s, "runs", "object")
    for i, r in enumerate(runs):
        _check_run(r, f"runs[{i}]")
    baselines = entries(s, "baselines", "text") if "baselines" in s else [BASELINE]
    for name in baselines[1:]:  # the report names each extra baseline's decode path from its runs
        if not any(r["cache"] == name for r in runs):
            raise ValueError(f"baselines names {name!r}, but no entry of runs timed it")
    for key in ("commit", "versions", "kernel_settings", "tuned_launches"):
        if s.get(key) is not None:
            field(s, key, "object")
    if s.get("merged_from") is not None:
        entries(s, "merged_from", "object")


def check_speed(summary: Any, source: str | os.PathLike[str]) -> None:
    """``ValueError`` naming ``source`` (the file) and the field unless ``summary`` is a ``speed.json`` this kvbits
    reports: every field the report and the merge use, of the kind they use."""
    checked_object(summary, source, "a kvbits speed summary", _check_speed_fields)


def load_speed(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``speed.json`` read back and checked (:func:`check_speed`)."""
    return read_json(Path(path), check_speed)


def check_speed_out(out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """``out_dir`` as a ``Path`` if a speed run may be written there (see :func:`write_speed`), else
    ``ValueError``; call it before the runs, so a wrong folder fails in a moment."""
    return check_out_folder(out_dir, "speed", SPEED_FILES, overwrite=overwrite)


def write_speed(
    summary: Mapping[str, Any], out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Write ``speed.json``, ``report.md`` and (with matplotlib) ``speed.png`` into ``out_dir``.

    A non-empty folder that holds no ``speed.json`` is refused (``ValueError``) unless ``overwrite``; then
    only the files named in :data:`SPEED_FILES` are replaced, nothing else is deleted.
    """
    return write_json_report(summary, out_dir, "speed", SPEED_FILES, speed_markdown, plot_speed,
                             overwrite=overwrite)  # fmt: skip
