"""The Markdown tables of a ``gpu_decode.py`` run (the sweep, break-even contexts, end to end)."""

from __future__ import annotations


def markdown(records: list[dict], be: list[dict], copy_gbps: float | None, e2e: list[dict] | None = None) -> str:
    lines = [
        "Copy bandwidth (read + write): " + ("not measured" if copy_gbps is None else f"{copy_gbps:.0f} GB/s"),
        "",
        "| shape | batch | context | kernel | scheme | ms (p10-p90) | GB/s | of copy | speed-up vs fp16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['kernel']} | {r['scheme']} | "
                         f"did not launch: {r['error']} | | | |")  # fmt: skip
            continue
        sp = "" if r["speedup_vs_fp16"] is None else f"{r['speedup_vs_fp16']:.2f}x"
        frac = "" if r["frac_of_copy"] is None else f"{100 * r['frac_of_copy']:.0f}%"  # None: step 1 failed
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['kernel']} | {r['scheme']} | "
            f"{r['ms']:.4f} ({r['ms_p10']:.4f}-{r['ms_p90']:.4f}) | "
            f"{r['gbps']:.0f} | {frac} | {sp} |"
        )
    lines += ["", "| shape | batch | kernel | scheme | break-even context |", "|---|---|---|---|---|"]
    for b in be:
        ctx = b["break_even_context"]
        if ctx is None and not b.get("break_even_measured", True):  # absent from runs before it
            gaps = [("did not launch at", b["not_launched"]), ("not run at", b.get("not_run", []))]  # not_run: later
            ctx = "not measured (" + "; ".join(w + " " + ", ".join(map(str, cs)) for w, cs in gaps if cs) + ")"
        elif ctx is None:
            ctx = f"> {b['max_context_measured']}"
        lines.append(f"| {b['shape']} | {b['batch']} | {b['kernel']} | {b['scheme']} | {ctx} |")
    if e2e:
        head = ("| cache | scheme | batch | context | tokens/s | ms/step | vs fp16 | vs faster fp16 (cuDNN or not) | "
                "cache bytes | GPU held / planned | note |")  # fmt: skip
        lines += ["", head, "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e:
            if "skipped" in r or "failure" in r:
                why = r.get("skipped") or f"**{r['failure']}**"
                lines.append(f"| {r['cache']} | {r['scheme']} | {r['batch']} | {r['context']} | | | | | | | {why} |")
                continue
            sp = "" if r["speedup_vs_fp16"] is None else f"{r['speedup_vs_fp16']:.2f}x"
            best = r.get("speedup_vs_best_fp16")  # absent from runs before the second DynamicCache run
            sp_best = "" if best is None else f"{best:.2f}x"
            held, planned, extra = r.get("resident_bytes"), r.get("planned_bytes"), r.get("extra_bytes")
            if planned is None:
                held = ""
            else:
                held = f"- / {planned}" if held is None else f"{held} / {planned} ({held / planned:.3f}x)"
                held += f" + {extra} apart" if extra else ""
            lines.append(f"| {r['cache']} | {r['scheme']} | {r['batch']} | {r['context']} | {r['tokens_per_s']} | "
                         f"{r['ms_per_step']} | {sp} | {sp_best} | {r['cache_bytes'] or ''} | {held} | {r['note'] or ''} |")  # fmt: skip
    return "\n".join(lines)
