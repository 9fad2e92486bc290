"""Evaluate placements on a trace and render the comparison as text, JSON or PNG plots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from moeplace.costmodel import CostModel
from moeplace.metrics import LayerSums, accumulate, gap_closed, static_dispatch_table, summarize
from moeplace.placement import Placement
from moeplace.trace.steps import RoutingSteps


@dataclass
class Evaluation:
    """One placement measured on some steps."""

    name: str
    placement: Placement
    sums: LayerSums
    summary: dict[str, Any]


def evaluate(placements: dict[str, Placement], chunks: Iterable[RoutingSteps], cost_model: CostModel,
             dispatch: str = "dynamic") -> list[Evaluation]:
    """Measure every placement on the same stream of step chunks (one pass over the trace)."""
    items = list(placements.items())
    sums = [LayerSums(p.model.num_moe_layers, p.ranks) for _, p in items]
    tables = [[static_dispatch_table(p.phy2log[layer], p.model.num_experts, p.ranks, p.nodes)
               for layer in range(p.model.num_moe_layers)] if dispatch == "static" else None
              for _, p in items]
    for chunk in chunks:
        for (name, p), s, t in zip(items, sums, tables):
            accumulate(s, chunk, p, cost_model, dispatch, static_tables=t)
    return [Evaluation(name, p, s, summarize(s)) for (name, p), s in zip(items, sums)]


def comparison_rows(evals: list[Evaluation], baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per placement with the headline metrics; gap closed is measured against ``baseline``."""
    base = next((e for e in evals if e.name == baseline), evals[0])
    rows = []
    for e in evals:
        s = e.summary
        rows.append({
            "placement": e.name, "steps": s["steps"],
            "e_max_distinct": s["e_max_distinct"], "lower_bound": s["lower_bound"],
            "vs_baseline_pct": 100.0 * (s["e_max_distinct"] / base.summary["e_max_distinct"] - 1.0),
            "gap_closed_pct": 100.0 * gap_closed(s["e_max_distinct"], base.summary["e_max_distinct"],
                                                 s["lower_bound"]),
            "token_balancedness": s["token_balancedness"],
            "moe_us_per_step": s["moe_us_per_step"],
        })
    return rows


def format_table(rows: list[dict[str, Any]], baseline_name: str) -> str:
    """Rows as an aligned text table."""
    head = ["placement", "E[max distinct]", "lower bound", f"vs {baseline_name}", "gap closed",
            "token bal.", "MoE µs/step"]
    body = [[r["placement"], f"{r['e_max_distinct']:.3f}", f"{r['lower_bound']:.3f}",
             f"{r['vs_baseline_pct']:+.1f}%", f"{r['gap_closed_pct']:.0f}%", f"{r['token_balancedness']:.3f}",
             f"{r['moe_us_per_step']:.0f}"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def hottest_experts(token_counts: np.ndarray, moe_layers: tuple[int, ...], n: int = 5) -> list[dict[str, Any]]:
    """The n (layer, expert) pairs with the largest share of their layer's tokens. token_counts: [L, E]."""
    share = token_counts / np.maximum(token_counts.sum(axis=1, keepdims=True), 1e-12)
    flat = np.argsort(-share, axis=None)[:n]
    L, E = share.shape
    return [{"layer": int(moe_layers[i // E]), "expert": int(i % E), "share": float(share.flat[i]),
             "uniform_share": 1.0 / E} for i in flat]


def write_plots(evals: list[Evaluation], plot_dir: str) -> list[str]:
    """PNG heatmaps (layer x rank token load, layer x rank mean distinct experts) and the per-step
    max-distinct distribution, for each placement side by side. Returns the files written."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeplace.atomic import atomic_open

    os.makedirs(plot_dir, exist_ok=True)
    written = []
    n = len(evals)

    def save(fig, name: str) -> None:
        path = os.path.join(plot_dir, name)
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    for key, title, fname in (("rank_tokens", "token load per rank / layer mean", "token_load_heatmap.png"),
                              ("rank_distinct", "mean distinct experts per rank per step", "distinct_heatmap.png")):
        fig, axes = plt.subplots(1, n, figsize=(3.2 * n + 1.5, 6), squeeze=False, constrained_layout=True)
        panels = []
        for e in evals:
            data = getattr(e.sums, key)
            panels.append(data / np.maximum(data.mean(axis=1, keepdims=True), 1e-12) if key == "rank_tokens"
                          else data / e.sums.steps)
        vmin, vmax = min(p.min() for p in panels), max(p.max() for p in panels)  # one scale for all
        for i, (ax, e, data) in enumerate(zip(axes[0], evals, panels)):
            im = ax.imshow(data, aspect="auto", cmap="magma", interpolation="nearest", vmin=vmin, vmax=vmax)
            ax.set_title(e.name, fontsize=9)
            ax.set_xlabel("rank")
            if i == 0:
                ax.set_ylabel("MoE layer")
        fig.colorbar(im, ax=axes[0].tolist(), fraction=0.04)
        fig.suptitle(title)
        save(fig, fname)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / n
    for i, e in enumerate(evals):
        hist = e.sums.step_max_hist.sum(axis=0)
        top = max(int(np.flatnonzero(hist).max(initial=0)) + 1, 2)
        x = np.arange(top)
        ax.bar(x + i * width, hist[:top] / hist.sum(), width=width,
               label=f"{e.name} (E={e.summary['e_max_distinct']:.2f})")
    ax.set_xlabel("max distinct experts on one rank in a step (per layer)")
    ax.set_ylabel("share of layer-steps")
    ax.set_title("per-step maximum rank load: lower is better")
    ax.legend(fontsize=8)
    save(fig, "step_max_distribution.png")
    return written
