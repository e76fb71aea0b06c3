"""Plots of an ``Analysis`` (matplotlib, imported lazily with the Agg backend).

- ``plot_key_heatmaps``: |K| over tokens × channels for one layer and KV head, before and after
  RoPE, beside |V| (the view of KVQuant's Figure 2): pre-RoPE outlier channels are steady vertical
  stripes; after RoPE each one's energy oscillates between the channel and its rotation partner.
- ``plot_layer_summary``: per layer, outlier channel counts (pre-RoPE keys, post-RoPE keys, values)
  and int4 key SQNR per-token vs per-channel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvbits._files import atomic_path
from kvbits.analyze.collect import Analysis, LayerAnalysis
from kvbits.analyze.outliers import channel_median


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib: pip install 'kvbits[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` atomically (creating its folder; the format is ``path``'s suffix,
    PNG without one) and close it."""
    fig.tight_layout()
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=110, format=out.suffix[1:] or "png")
    finally:
        plt.close(fig)
    return out


def pick_layer_head(analysis: Analysis, layer: int | None = None, head: int | None = None) -> tuple[int, int]:
    """The layer and KV head whose pre-RoPE keys have the largest absmax / median-channel ratio; among the heads
    of ``layer`` and the layers' ``head`` when given (a fixed layer gets its own strongest head)."""
    layers = analysis.layers if layer is None else [_layer(analysis, layer)]
    best, where = -1.0, (layers[0].layer, 0 if head is None else head)
    for la in layers:
        a = la.key_pre_rope.absmax
        ratio = (a.max(dim=-1).values / channel_median(a)[:, 0].clamp_min(1e-12)).nan_to_num(0.0)  # as outliers
        if head is not None and not 0 <= head < ratio.shape[0]:
            continue
        h = int(ratio.argmax()) if head is None else head
        if float(ratio[h]) > best:
            best, where = float(ratio[h]), (la.layer, h)
    return where


def _keys_rotate(la: LayerAnalysis) -> bool:
    """Does ``la``'s model rotate its keys: post-RoPE statistics, or a RoPE kvbits could not reproduce (the key
    figures are then from before it). False for a model without RoPE, whose hooked keys are the cached ones."""
    return la.key_post_rope is not None or la.keys_rotated_unseen


def _layer(analysis: Analysis, layer: int) -> LayerAnalysis:
    for la in analysis.layers:
        if la.layer == layer:
            return la
    raise ValueError(f"layer must be one of {[la.layer for la in analysis.layers]}, got {layer}")


def plot_key_heatmaps(
    analysis: Analysis,
    path: str | Path,
    *,
    layer: int | None = None,
    head: int | None = None,
    max_tokens: int = 512,
) -> Path:
    """Write the |K| pre/post-RoPE (and |V|) heatmaps of ``layer``/``head`` (default: ``pick_layer_head``, the
    strongest outlier head of ``layer`` / layer of ``head`` when one of them is given)."""
    plt = _pyplot()
    if layer is None or head is None:
        layer, head = pick_layer_head(analysis, layer, head)
    la = _layer(analysis, layer)
    if not la.samples:
        raise ValueError("the analysis kept no samples (analyze(..., keep_samples=False)); nothing to plot")
    n_heads = la.key_pre_rope.absmax.shape[0]
    if not 0 <= head < n_heads:
        raise ValueError(f"head must be in [0, {n_heads}), got {head}")
    # a model without RoPE: its keys are not "before RoPE", they are the cached ones
    pre_title = "|K| before RoPE" if _keys_rotate(la) else "|K|"
    panels = [("key_pre_rope", pre_title), ("key_post_rope", "|K| after RoPE"), ("value", "|V|")]
    panels = [(k, t) for k, t in panels if k in la.samples]

    def tokens(name: str) -> torch.Tensor:
        s = la.samples[name][:, head]  # (N, block, D)
        return s.reshape(-1, s.shape[-1])[:max_tokens].abs().cpu()  # .numpy() below reads host memory

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (name, title) in zip(axes[0], panels):
        m = tokens(name).numpy()
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis")
        outl = [c for h, c in getattr(la, name).outliers if h == head]
        suffix = f"\noutlier channels: {outl}" if outl else ""
        ax.set_title(f"{title}{suffix}", fontsize=9)
        ax.set_xlabel("channel")
        ax.set_ylabel("sampled token")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(
        f"{analysis.model}, layer {layer}, KV head {head} ({analysis.data}, context {analysis.context})",
        fontsize=10,
    )
    return _save(plt, fig, path)


def plot_layer_summary(analysis: Analysis, path: str | Path) -> Path:
    """Outlier channels per layer and int4 key SQNR per layer (per-token vs per-channel)."""
    plt = _pyplot()
    xs = [la.layer for la in analysis.layers]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(6, 0.3 * len(xs) + 3), 6), sharex=True)
    # post-RoPE figures only where every layer has them (as the JSON's null, not 0: "none found after RoPE"), and
    # keys called pre-RoPE only where the model rotates them
    has_post = all(la.key_post_rope for la in analysis.layers)
    pre = "pre-RoPE" if any(_keys_rotate(la) for la in analysis.layers) else "cached"
    series = [("pre-RoPE keys" if pre == "pre-RoPE" else "keys", [len(la.key_pre_rope.outliers) for la in analysis.layers])]
    if has_post:
        series.append(("post-RoPE keys", [len(la.key_post_rope.outliers) for la in analysis.layers]))
    series.append(("values", [len(la.value.outliers) for la in analysis.layers]))
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series):
        a1.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], ys, width=width, label=label)
    a1.set_ylabel(f"outlier channels\n(absmax > {analysis.threshold:g}x median)")
    a1.legend(fontsize=8)
    a2.plot(xs, [la.key_pre_rope.sqnr_token for la in analysis.layers], "o-", label=f"{pre} keys, per-token")
    a2.plot(xs, [la.key_pre_rope.sqnr_channel for la in analysis.layers], "s-", label=f"{pre} keys, per-channel")
    if has_post:
        a2.plot(
            xs, [la.key_post_rope.sqnr_token for la in analysis.layers], "o--", label="post-RoPE, per-token"
        )
        a2.plot(
            xs,
            [la.key_post_rope.sqnr_channel for la in analysis.layers],
            "s--",
            label="post-RoPE, per-channel",
        )
    a2.set_ylabel("int4 key SQNR (dB)")
    a2.set_xlabel("layer")
    a2.legend(fontsize=8)
    fig.suptitle(
        f"{analysis.model} on {analysis.data}, {analysis.windows} x {analysis.context} tokens", fontsize=10
    )
    return _save(plt, fig, path)
