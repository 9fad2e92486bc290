"""Evaluate placements on a trace and render the comparison as text, JSON or PNG plots."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from moeplace.analysis.metrics import LayerSums, accumulate_all, gap_closed, summarize
from moeplace.cost.model import CostModel
from moeplace.dispatch.loads import static_dispatch_table
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement
from moeplace.trace.steps import RoutingSteps


@dataclass
class Evaluation:
    """One placement measured on some steps."""

    name: str
    placement: Placement
    sums: LayerSums
    summary: dict[str, Any]


def evaluate(placements: dict[str, Placement], chunks: Iterable[RoutingSteps],
             cost_model: CostModel | Mapping[str, CostModel], dispatch: str | Mapping[str, str] = "dynamic",
             workers: int = 1) -> list[Evaluation]:
    """Measure every placement on the same stream of step chunks (one pass over the trace).

    cost_model: one for all placements, or one per placement name (placements that differ in slots
    per rank cost differently); dispatch likewise. workers: processes for the layers of steps held in
    memory (``analysis.metrics.accumulate_all``).
    """
    items = list(placements.items())
    costs = [cost_model[name] if isinstance(cost_model, Mapping) else cost_model for name, _ in items]
    rules = [dispatch[name] if isinstance(dispatch, Mapping) else dispatch for name, _ in items]
    sums = [LayerSums(p.model.num_moe_layers, p.ranks) for _, p in items]
    tables = [[static_dispatch_table(p.phy2log[layer], p.model.num_experts, p.ranks, p.nodes)
               for layer in range(p.model.num_moe_layers)] if rule == "static" else None
              for (_, p), rule in zip(items, rules)]
    for chunk in chunks:
        accumulate_all(sums, chunk, [p for _, p in items], costs, rules, tables, workers)
    if sums and (sums[0].expert_tokens is None or not sums[0].expert_tokens.any()):
        raise MoeplaceError("the steps read route no token to any expert (every expert id is -1, none): "
                            "nothing to measure")
    return [Evaluation(name, p, s, summarize(s)) for (name, p), s in zip(items, sums)]


# What a row carries of a placement over nodes (``analysis.metrics.cross_node_traffic``)
CROSS_NODE_KEYS = ("nodes", "cross_node_share", "cross_node_sends_per_layer", "cross_node_sends_per_step",
                   "source_ranks")


def comparison_rows(evals: list[Evaluation], baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per placement with the headline metrics; "vs" and gap closed are against ``baseline``
    (default: the first placement)."""
    base = next((e for e in evals if e.name == baseline), evals[0])
    rows = []
    for e in evals:
        s = e.summary
        rows.append({
            "placement": e.name, "steps": s["steps"],
            "e_max_distinct": s["e_max_distinct"], "optimum": s["optimum"], "lower_bound": s["lower_bound"],
            "spare_slots": e.placement.num_redundant,
            "vs_baseline_pct": 100.0 * (s["e_max_distinct"] / base.summary["e_max_distinct"] - 1.0),
            "gap_closed_pct": 100.0 * gap_closed(s["e_max_distinct"], base.summary["e_max_distinct"],
                                                 s["lower_bound"]),
            "token_balancedness": s["token_balancedness"],
            "moe_us_per_step": s["moe_us_per_step"],
            **{k: s[k] for k in CROSS_NODE_KEYS if k in s},
        })
    return rows


def format_table(rows: list[dict[str, Any]], baseline: str | None) -> str:
    """Rows as an aligned text table. With a baseline (a placement's name), "vs baseline" and
    "gap closed" columns and a last line that names it; without one (a single placement), neither.
    When a placement has spare slots, a "per-step opt." column: the E[max distinct] its replicas allow
    with the best replica choice in every step (what balanced dispatch reaches when its rule is exact).
    When every row has ``fitted_e_max_distinct`` (optimize with a holdout), a "fitted" column beside
    E[max distinct]: the same on fitted steps. When every placement spans nodes, "cross-node" and
    "cross-node/layer" columns: its cross-node token traffic (``analysis.metrics.cross_node_traffic``)."""
    head = ["placement", "E[max distinct]", "fitted", "per-step opt.", "lower bound", "vs baseline", "gap closed",
            "token bal.", "MoE µs/step", "cross-node", "cross-node/layer"]
    body = [[r["placement"], f"{r['e_max_distinct']:.3f}", f"{r.get('fitted_e_max_distinct', 0):.3f}",
             f"{r['optimum']:.3f}", f"{r['lower_bound']:.3f}", f"{r['vs_baseline_pct']:+.1f}%",
             f"{r['gap_closed_pct']:.0f}%", f"{r['token_balancedness']:.3f}", f"{r['moe_us_per_step']:.0f}",
             f"{100 * r.get('cross_node_share', 0):.1f}%", f"{r.get('cross_node_sends_per_layer', 0):.1f}"]
            for r in rows]
    spares = any(r["spare_slots"] for r in rows)
    fitted = all("fitted_e_max_distinct" in r for r in rows)
    cross = all("cross_node_share" in r for r in rows)
    keep = [i for i in range(len(head)) if (baseline is not None or head[i] not in ("vs baseline", "gap closed"))
            and (spares or head[i] != "per-step opt.") and (fitted or head[i] != "fitted")
            and (cross or not head[i].startswith("cross-node"))]
    head, body = [head[i] for i in keep], [[b[i] for i in keep] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [line(head), line(["-" * w for w in widths])] + [line(b) for b in body]
    if baseline is not None:
        lines.append(f"baseline: {baseline} (vs baseline: E[max distinct] against it; gap closed: share of its "
                     f"distance to the lower bound removed)")
    if spares:
        lines.append("per-step opt.: the best E[max distinct] each placement's replicas allow, choosing the "
                     "replica of every active expert per step (exact; balanced dispatch's rule reaches it)")
    if cross:
        nodes = rows[0]["nodes"]
        lines.append(f"cross-node: share of the (token, expert) sends whose replica is on another of the {nodes} nodes "
                     f"than the step's source rank (ranks split evenly over the nodes, in order); cross-node/layer: "
                     f"those sends per step and MoE layer")
        if any(r["source_ranks"] == "round robin" for r in rows):
            lines.append("note: the steps name fewer source ranks than the layout has ranks, so they are taken to "
                         "come from its ranks round robin (DP attention spreads requests over the ranks)")
    return "\n".join(lines)


def hottest_experts(token_counts: np.ndarray, moe_layers: tuple[int, ...], n: int = 5) -> list[dict[str, Any]]:
    """The n (layer, expert) pairs with the largest share of their layer's tokens. token_counts: [L, E]."""
    share = token_counts / np.maximum(token_counts.sum(axis=1, keepdims=True), 1e-12)
    flat = np.argsort(-share, axis=None)[:n]
    L, E = share.shape
    return [{"layer": int(moe_layers[i // E]), "expert": int(i % E), "share": float(share.flat[i]),
             "uniform_share": 1.0 / E} for i in flat]


def steps_phrase(steps: int, mode: str, which: str = "") -> str:
    """"902 held-out verify steps", "2,105 steps (all modes)". which: "held-out", "fitted" or ""."""
    kind = "steps (all modes)" if mode == "all" else f"{mode} steps"
    return " ".join(w for w in (f"{steps:,}", which, kind) if w)


def plot_context(trace: str, mode: str, steps: int, which: str, ranks: int) -> str:
    """The line every plot title carries: trace, mode, how many steps of which kind, ranks."""
    return f"{os.path.basename(os.path.normpath(trace))}: {steps_phrase(steps, mode, which)}, {ranks} ranks"


def check_plotting(plot_dir: str | None) -> None:
    """Raise MoeplaceError if ``--plot-dir`` is given and matplotlib is not installed: said before the work that
    the plots end, not after it."""
    if plot_dir is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as e:
        raise MoeplaceError(f"--plot-dir needs matplotlib, which is not installed here ({e}); "
                            "pip install matplotlib, or leave --plot-dir out") from e


def write_plots(evals: list[Evaluation], plot_dir: str, context: str) -> list[str]:
    """Two PNGs, placements side by side; every title carries ``context`` (``plot_context``).

    step_max_distribution.png: ``distribution_figure``; step_max_by_layer.png: ``by_layer_figure``.
    Returns the files written: both, or none if one fails.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeplace.files.atomic import all_or_nothing, atomic_open

    written = []
    with all_or_nothing():
        for name, make in (("step_max_distribution.png", distribution_figure), ("step_max_by_layer.png",
                                                                               by_layer_figure)):
            fig = make(evals, context)
            path = os.path.join(plot_dir, name)
            try:
                with atomic_open(path, "wb") as f:
                    fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
            finally:
                plt.close(fig)
            written.append(path)
    return written


def _busiest_values(evals: list[Evaluation]) -> np.ndarray:
    """The busiest-rank distinct-expert counts that occur in any placement's histogram (the x range)."""
    seen = np.flatnonzero(sum(e.sums.step_max_hist.sum(axis=0) for e in evals))
    return np.arange(int(seen.min()), int(seen.max()) + 1) if seen.size else np.arange(0, 2)


def distribution_figure(evals: list[Evaluation], context: str):
    """How often the busiest rank read k distinct experts, over all layer-steps, a bar per placement,
    with the per-step lower bound's mean (the table's "lower bound") as a dashed line."""
    import matplotlib.pyplot as plt

    x = _busiest_values(evals)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(evals)
    for i, e in enumerate(evals):
        total = e.sums.step_max_hist.sum(axis=0)
        ax.bar(x - 0.4 + width * (i + 0.5), total[x] / max(total.sum(), 1), width=width,
               label=f"{e.name} (mean {e.summary['e_max_distinct']:.2f})")
    bound = evals[0].summary["lower_bound"]   # the same steps and ranks for every placement
    ax.axvline(bound, color="black", lw=1, ls="--", label=f"lower bound (mean {bound:.2f})")
    ax.set_xticks(x)
    ax.set_xlabel("distinct experts on the busiest rank (one layer, one step)")
    ax.set_ylabel("share of layer-steps")
    ax.set_title(f"Busiest rank per step: lower is faster\n{context}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    return fig


def by_layer_figure(evals: list[Evaluation], context: str):
    """The busiest rank's distinct experts per MoE layer, one heatmap panel per placement, with each
    layer's mean and per-step lower bound drawn over it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = _busiest_values(evals)
    lo, top = int(x[0]), int(x[-1]) + 1
    n = len(evals)
    L = evals[0].sums.step_max_hist.shape[0]
    fig, axes = plt.subplots(1, n, figsize=(2.6 * n + 1.8, 2.7 + 0.12 * L), squeeze=False,
                             sharey=True, constrained_layout=True)
    layers = np.arange(L)
    shares = [h[:, lo:top] / np.maximum(h.sum(axis=1, keepdims=True), 1)
              for h in (e.sums.step_max_hist for e in evals)]                      # [L, top-lo]
    vmax = max(float(sh.max()) for sh in shares)                                    # one scale
    for i, (ax, e, share) in enumerate(zip(axes[0], evals, shares)):
        im = ax.imshow(share, aspect="auto", cmap="Blues", vmin=0, vmax=vmax, interpolation="nearest",
                       extent=(lo - 0.5, top - 0.5, L - 0.5, -0.5))
        ax.plot(e.sums.max_distinct / e.sums.steps, layers, color="tab:red", lw=1.5, label="mean")
        ax.plot(e.sums.lower_bound / e.sums.steps, layers, color="black", lw=1, ls="--", label="lower bound")
        ax.set_title(f"{e.name}\nmean {e.summary['e_max_distinct']:.2f}", fontsize=9)
        ax.set_xlabel("busiest rank's\ndistinct experts")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if i == 0:
            ax.set_ylabel("MoE layer (index among MoE layers)")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.04, label="share of the layer's steps")
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Busiest rank per step, per layer\n{context}", fontsize=10)
    return fig
