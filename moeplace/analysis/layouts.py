"""EP x TP layouts: G expert-parallel groups on N GPUs, each expert split over the N/G GPUs of its group.

Dimension letters: S steps, L MoE layers, E logical experts, P physical slots, G EP groups.

SGLang 0.5.23 runs MoE tensor parallelism inside EP groups: ``--tp-size N --ep-size G`` gives
``moe_tp_size = N // G`` (``model_runner_components/moe_ep_setup.py``); each of the G groups holds
``P / G`` slots (the placement's ranks are the groups), and each of its N/G GPUs holds 1/(N/G) of
every one of those experts' intermediate dimension (``fused_moe_triton/layer.py`` asserts it divides).
With ``--moe-a2a-backend none`` every GPU sees every token and runs its group's activated experts, at
1/(N/G) width, on the pairs routed to its group; the partial outputs are summed. So a layer costs its
slowest group's GPU: ``a' * distinct_g + b' * pairs_g + c'`` with a cost model for experts of
intermediate ``I / (N/G)`` and ``P / G`` local slots (``moeplace.cost.derive``). EP N is G = N; TP-MoE
is G = 1, where every GPU runs every activated expert on every pair. Communication (EP dispatch and
combine, the all-reduce) is not counted.

A layout with spare slots uses moeplace's rule by cost (``moeplace.dispatch.by_cost``: balanced dispatch
at verify batch) on stepaware's placement for it; without, the better of DeepSeek EPLB and stepaware.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from moeplace.algorithms import PlacementProblem, solve
from moeplace.analysis.advise import counts_work, crossing, work_cost
from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import step_expert_counts
from moeplace.dispatch.by_cost import PLACED_AS, rule_weights
from moeplace.errors import MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.parallel import PARALLEL_CELLS, layer_workers, map_layers
from moeplace.trace.steps import RoutingSteps

SPARE_RULE = "cost"
EVEN = 0.01          # layouts this close (relative) are reported as even, not as a flip


@dataclass(frozen=True)
class Layout:
    """``ep`` EP groups on ``gpus`` GPUs (MoE TP ``gpus // ep`` inside each), ``spares`` spare slots."""

    gpus: int
    ep: int
    spares: int = 0

    @property
    def moe_tp(self) -> int:
        return self.gpus // self.ep

    @property
    def name(self) -> str:
        base = f"TP{self.gpus}" if self.ep == 1 else f"EP{self.ep}" + (f"xTP{self.moe_tp}" if self.moe_tp > 1 else "")
        return base + (f"+{self.spares}" if self.spares else "")

    @property
    def rule(self) -> str:
        """The replica rule the layout is costed with (one replica each: every rule is the same)."""
        return SPARE_RULE if self.spares else "dynamic"

    def local_slots(self, num_experts: int) -> int:
        return (num_experts + self.spares) // self.ep


def split_refusal(gpus: int, ep: int, num_experts: int, intermediate: int, spares: int = 0) -> str | None:
    """Why SGLang cannot run ``ep`` groups on ``gpus`` GPUs for this model (one line), or None where it can."""
    if ep < 1 or gpus % ep:
        return f"--ep-size {ep} must divide the {gpus} GPUs (--ranks)"
    moe_tp = gpus // ep
    if intermediate % moe_tp:
        return (f"the experts' intermediate size {intermediate} does not split over MoE TP {moe_tp} "
                f"({gpus} GPUs / --ep-size {ep}); SGLang refuses it")
    if (num_experts + spares) % ep:
        return f"{num_experts} experts + {spares} spare slots do not split over {ep} EP groups"
    return None


def check_split(gpus: int, ep: int, num_experts: int, intermediate: int, spares: int = 0) -> None:
    """Raise MoeplaceError (one line) unless SGLang can run ``ep`` groups on ``gpus`` GPUs for this model."""
    reason = split_refusal(gpus, ep, num_experts, intermediate, spares)
    if reason:
        raise MoeplaceError(reason)


def candidate_layouts(gpus: int, num_experts: int, intermediate: int, spares: int) -> list[Layout]:
    """Every EP size dividing ``gpus`` (EP N first, TP-MoE last) that SGLang can run: without spare slots
    where the experts split over its groups, with ``spares`` where they and the experts do (none for TP-MoE;
    384 experts on EP 320 run only with spares)."""
    out = []
    for ep in (g for g in range(gpus, 0, -1) if gpus % g == 0):
        if split_refusal(gpus, ep, num_experts, intermediate) is None:
            out.append(Layout(gpus, ep))
        if (ep > 1 and spares and split_refusal(gpus, ep, num_experts, intermediate, spares) is None
                and (num_experts + spares) // ep <= num_experts):
            out.append(Layout(gpus, ep, spares))
    return out


def fit_layout(model: ModelSpec, fit: RoutingSteps, layout: Layout, cost: CostModel,
               effort: float) -> dict[str, np.ndarray]:
    """name -> phy2log [L, P] of the placements a layout is costed with (fitted on ``fit``)."""
    E, L = model.num_experts, model.num_moe_layers
    if layout.ep == 1:
        return {"all experts": np.broadcast_to(np.arange(E), (L, E)).copy()}

    def place(algorithm: str, spares: int, rule: str) -> np.ndarray:
        return solve(algorithm, PlacementProblem(model, fit, layout.ep, redundant=spares,
                                                 dispatch=PLACED_AS.get(rule, rule), cost_model=cost, effort=effort))
    if layout.spares:
        return {"stepaware": place("stepaware", layout.spares, layout.rule)}
    return {name: place(name, 0, "dynamic") for name in ("deepseek", "stepaware")}


def layer_counts(steps: RoutingSteps) -> list[np.ndarray]:
    """[L] of [S, E]: each MoE layer's ``step_expert_counts``, all that a layout's cost reads (``counts_work``),
    counted once for every layout and placement."""
    return [step_expert_counts(steps, layer) for layer in range(steps.model.num_moe_layers)]


def layout_step_costs(counts: list[np.ndarray], placements: dict[str, np.ndarray], layout: Layout,
                      cost: CostModel) -> dict[str, np.ndarray]:
    """[S] µs per step (all MoE layers) of each of a layout's placements: its slowest group's GPU per layer.
    counts: ``layer_counts`` of the steps."""
    return sets_step_costs([counts], placements, layout, [cost])[0]


def sets_step_costs(sets: list[list[np.ndarray]], placements: dict[str, np.ndarray], layout: Layout,
                    costs: list[CostModel]) -> list[dict[str, np.ndarray]]:
    """``layout_step_costs`` of several sets of steps (``layer_counts`` each), each with its cost model. The sets
    whose cost models give the rule the same weights are dispatched in one call: the cost rule chooses each
    step's dispatch from that step's counts and the weights alone (the other rules from the counts alone)."""
    groups: dict[object, list[int]] = {}
    for i, cost in enumerate(costs):
        groups.setdefault(rule_weights(cost) if layout.rule == "cost" else None, []).append(i)
    out: list[dict[str, np.ndarray]] = [{} for _ in sets]
    for members in groups.values():
        bounds = np.cumsum([0, *(sets[i][0].shape[0] for i in members)])
        stacked = [np.concatenate([sets[i][layer] for i in members]) for layer in range(len(sets[members[0]]))]
        for name, phy2log in placements.items():
            totals = [0] * len(members)
            for layer, counts in enumerate(stacked):
                work = counts_work(counts, phy2log[layer], layout.ep, layout.rule, costs[members[0]])
                for j, i in enumerate(members):
                    totals[j] = totals[j] + work_cost(work[bounds[j]:bounds[j + 1]], costs[i])
            for j, i in enumerate(members):
                out[i][name] = totals[j]
    return out


@dataclass(frozen=True)
class LayoutCosts:
    """A layout's mean µs per step (all MoE layers) at the trace's batch and at each batch size,
    with the better of its placements (named in ``placement``)."""

    layout: Layout
    at_trace: float
    grid: dict[int, float]
    placement: dict[int, str]
    trace_batch: int = 0
    at_trace_placement: str = ""


def fitting_order(layout: Layout) -> int:
    """A rough rank of a layout's fitting work, dearest highest: the spare search enumerates the 2^G rank sets
    of its G groups; stepaware's swaps without spares grow with G."""
    return 1 << layout.ep if layout.spares else layout.ep


def compare_layouts(model: ModelSpec, fit: RoutingSteps, at_trace: RoutingSteps, grid: dict[int, RoutingSteps],
                    layouts: list[Layout], cost: Callable[[Layout, int], CostModel], trace_batch: int,
                    effort: float, progress: Callable[[int], None] = lambda done: None) -> list[LayoutCosts]:
    """Fit every layout's placements on ``fit`` (costed at ``trace_batch``) and cost them on ``at_trace``
    and on the batches of ``grid`` (batch tokens -> steps), each with its cost model ``cost(layout, batch)``.

    The layouts are independent jobs: they run on the machine's CPUs (``parallel.map_layers``), the dearest
    first (``fitting_order``); ``progress(1)`` as each one ends. Results in the order of ``layouts``."""
    batches = [trace_batch, *grid]                          # the trace's steps first, then the grid's
    counts = [layer_counts(steps) for steps in (at_trace, *grid.values())]
    order = sorted(range(len(layouts)), key=lambda i: fitting_order(layouts[i]), reverse=True)

    def fit_and_cost(job: int) -> LayoutCosts:
        layout = layouts[order[job]]
        placements = fit_layout(model, fit, layout, cost(layout, trace_batch), effort)
        best = []                                            # (mean µs, placement) of each set of steps
        for step_costs in sets_step_costs(counts, placements, layout, [cost(layout, b) for b in batches]):
            name = min(step_costs, key=lambda k: step_costs[k].mean())
            best.append((float(step_costs[name].mean()), name))
        (here, here_name), per_batch = best[0], dict(zip(batches[1:], best[1:]))
        return LayoutCosts(layout, here, {b: v[0] for b, v in per_batch.items()},
                           {trace_batch: here_name, **{b: v[1] for b, v in per_batch.items()}}, trace_batch,
                           here_name)
    out: dict[int, LayoutCosts] = {}
    for job, result in map_layers(fit_and_cost, len(layouts), layer_workers(PARALLEL_CELLS)):
        out[order[job]] = result
        progress(1)
    return [out[i] for i in range(len(layouts))]


def fastest(results: list[LayoutCosts], batch: int | None = None) -> LayoutCosts:
    """The layout with the lowest cost at ``batch`` (None: at the trace's batch); ties: the earlier one."""
    return min(results, key=lambda r: r.at_trace if batch is None else r.grid[batch])


def fastest_column(results: list[LayoutCosts]) -> dict[int, LayoutCosts]:
    """The layouts table's fastest column: batch -> layout. At the smallest batch the fastest (``fastest``); at
    each larger one the layout of the batch before while it stays within EVEN of the fastest there, else the
    fastest. So a difference of EVEN or less never changes the column, and every change is a real flip."""
    column: dict[int, LayoutCosts] = {}
    kept = None
    for batch in sorted(results[0].grid):
        best = fastest(results, batch)
        if kept is None or kept.grid[batch] > best.grid[batch] * (1 + EVEN):
            kept = best
        column[batch] = kept
    return column


def layout_flips(results: list[LayoutCosts]) -> list[tuple[float, str, str]]:
    """(batch where it flips, fastest below, fastest above) for each change of ``fastest_column``: between the
    two batches where it changes, the batch where the layout above becomes more than EVEN faster than the one
    below (their cost ratio interpolated as ``advise.crossing`` does)."""
    column = fastest_column(results)
    batches = sorted(column)
    flips = []
    for lo, hi in zip(batches, batches[1:]):
        a, b = column[lo], column[hi]
        if a.layout != b.layout:
            at = crossing(lo, hi, a.grid[lo] / b.grid[lo] / (1 + EVEN), a.grid[hi] / b.grid[hi] / (1 + EVEN))
            flips.append((at, a.layout.name, b.layout.name))
    return flips


# advise fits and costs every layout on at most max(LAYOUT_LAYER_CELLS / E, MIN_LAYOUT_LAYERS) MoE layers,
# evenly spaced, and scales their cost to all layers: on a 60-layer, 384-expert model (Kimi K2) 6 layers,
# where the layers' costs differ by a few percent and every layout is costed on the same ones.
LAYOUT_LAYER_CELLS = 2304
MIN_LAYOUT_LAYERS = 4


def layer_sample(steps: RoutingSteps) -> tuple[RoutingSteps, float]:
    """(the steps on a sample of their MoE layers, the factor from that sample's cost to all layers'):
    all layers where layers x experts stay within LAYOUT_LAYER_CELLS (then the factor is 1)."""
    model = steps.model
    L, E = model.num_moe_layers, model.num_experts
    keep = min(L, max(LAYOUT_LAYER_CELLS // E, MIN_LAYOUT_LAYERS))
    if keep >= L:
        return steps, 1.0
    idx = np.unique(np.linspace(0, L - 1, keep).round().astype(np.int64))
    sub = replace(model, moe_layers=tuple(model.moe_layers[i] for i in idx))
    return (RoutingSteps(sub, steps.modes, steps.num_tokens, steps.ranks, steps.token_offsets,
                         np.ascontiguousarray(steps.topk_ids[:, idx]), steps.count_steps,
                         np.ascontiguousarray(steps.counts[:, idx])), L / idx.size)


def scaled(result: LayoutCosts, factor: float) -> LayoutCosts:
    """``result`` with its costs multiplied by ``factor`` (``layer_sample``'s)."""
    return replace(result, at_trace=result.at_trace * factor, grid={b: v * factor for b, v in result.grid.items()})

