"""Imbalance metrics of placements over a trace: per-layer sums streamed over chunks of steps, summarised.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts, P physical
slots, R ranks. A rank's load in a step is the number of distinct physical experts it must read
(``distinct``) and the tokens it runs (``tokens``); the step waits for its slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import active_pairs, step_expert_counts
from moeplace.dispatch.loads import (balanced_loads, balancedness, layer_rank_loads, max_step_tokens,
                                     rank_extra_blocks, replica_optimum, static_dispatch_table)
from moeplace.dispatch.traffic import rank_cross_sends, source_ranks, static_cross_sends
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement
from moeplace.parallel import map_layers
from moeplace.trace.steps import RoutingSteps


@dataclass
class LayerSums:
    """Running sums for one placement over streamed chunks (so a 10M-step trace fits in memory)."""

    num_layers: int
    ranks: int
    steps: int = 0
    max_distinct: np.ndarray = field(default=None)      # [L] sum over steps of max_r distinct
    mean_distinct: np.ndarray = field(default=None)     # [L] sum over steps of mean_r distinct
    lower_bound: np.ndarray = field(default=None)       # [L] sum over steps of ceil(distinct / R)
    optimum: np.ndarray = field(default=None)           # [L] sum over steps of the best max distinct the
                                                        #     placement allows (balanced dispatch, exact)
    max_cost: np.ndarray = field(default=None)          # [L] sum over steps of max_r cost
    mean_cost: np.ndarray = field(default=None)         # [L] sum over steps of mean_r cost
    rank_tokens: np.ndarray = field(default=None)       # [L, R] tokens per rank
    rank_distinct: np.ndarray = field(default=None)     # [L, R] sum of distinct per rank
    step_max_hist: np.ndarray = field(default=None)     # [L, 65] histogram of per-step max distinct (last bin: 64+)
    expert_tokens: np.ndarray | None = None             # [L, E] tokens per logical expert (set on first chunk)
    nodes: int = 1                                      # nodes the ranks span; > 1: cross-node traffic too
    cross_node_sends: np.ndarray = field(default=None)  # [L] (token, expert) sends to another node than the
    sends: np.ndarray = field(default=None)             # [L]     step's source rank's, and all sends
    round_robin: bool = False                           # the steps' source ranks were taken round robin
                                                        #     (``moeplace.dispatch.traffic.source_ranks``)

    def __post_init__(self) -> None:
        L, R = self.num_layers, self.ranks
        for name in ("max_distinct", "mean_distinct", "lower_bound", "optimum", "max_cost", "mean_cost",
                     "cross_node_sends", "sends"):
            setattr(self, name, np.zeros(L))
        self.rank_tokens = np.zeros((L, R))
        self.rank_distinct = np.zeros((L, R))
        self.step_max_hist = np.zeros((L, 65), np.int64)


@dataclass(frozen=True)
class LayerActivity:
    """One MoE layer of a chunk of steps in the form every placement without spare slots is measured
    from; made once per layer and shared by all of them.

    step, expert: [N] step and logical expert of each valid (token row, top-k) pair
    hit_step, hit_expert: [H] each (step, expert) pair where the step activates the expert, once
        (token rows and count steps)
    count_tokens: [S_c, E] tokens of the count steps, whole (as ``layer_rank_loads`` rounds them)
    """

    num_steps: int
    num_experts: int
    step: np.ndarray
    expert: np.ndarray
    hit_step: np.ndarray
    hit_expert: np.ndarray
    count_tokens: np.ndarray

    def distinct_total(self) -> np.ndarray:
        """[S] distinct logical experts each step activates."""
        return np.bincount(self.hit_step, minlength=self.num_steps)


def layer_activity(steps: RoutingSteps, layer: int) -> LayerActivity:
    """``LayerActivity`` of one layer of ``steps``."""
    S, E = steps.num_steps, steps.model.num_experts
    step, _, expert = steps.layer_pairs(layer)
    hit = np.zeros(S * E, bool)
    hit[step * E + expert] = True
    count_tokens = np.ceil(steps.counts[:, layer, :])
    hit.reshape(S, E)[steps.count_steps] = count_tokens > 0       # a count step owns no token rows
    flat = np.flatnonzero(hit)
    return LayerActivity(S, E, step, expert, flat // E, flat % E, count_tokens)


def single_copy_loads(activity: LayerActivity, phy2log: np.ndarray, ranks: int, count_steps: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(distinct [S, R], tokens [S, R]) of one layer under a map ``phy2log [P]`` that holds every expert
    once: each dispatch rule sends an expert's tokens to its one slot, so this is ``layer_rank_loads``
    for any rule, counted from the layer's (step, expert) pairs."""
    S, R = activity.num_steps, ranks
    rank_of = np.empty(activity.num_experts, np.int64)
    rank_of[phy2log] = np.arange(phy2log.shape[0]) // (phy2log.shape[0] // R)
    distinct = np.bincount(activity.hit_step * R + rank_of[activity.hit_expert], minlength=S * R).reshape(S, R)
    tokens = np.bincount(activity.step * R + rank_of[activity.expert], minlength=S * R).reshape(S, R)
    if count_steps.size:
        tokens[count_steps] += (activity.count_tokens @ np.eye(R)[rank_of]).astype(np.int64)
    return distinct, tokens


def accumulate(sums: LayerSums, steps: RoutingSteps, placement: Placement, cost_model: CostModel,
               dispatch: str = "dynamic",
               static_tables: list[np.ndarray] | None = None) -> None:
    """Add one chunk of steps to ``sums`` under ``placement``."""
    accumulate_all([sums], steps, [placement], [cost_model], dispatch, [static_tables])


def accumulate_all(sums: list[LayerSums], steps: RoutingSteps, placements: list[Placement],
                   cost_models: list[CostModel], dispatch: str | list[str] = "dynamic",
                   static_tables: list[list[np.ndarray] | None] | None = None, workers: int = 1) -> None:
    """Add one chunk of steps to each ``sums[i]`` under ``placements[i]``, layer by layer, so that what
    does not depend on the placement (the step-expert presence, the lower bound) is computed once.

    dispatch: one rule for all placements, or one each. workers: processes to spread the layers over
    (``moeplace.parallel``; only where no other thread is running, as forking beside a trace reader's
    decoding threads is not safe)."""
    static_tables = static_tables or [None] * len(placements)
    rules = [dispatch] * len(placements) if isinstance(dispatch, str) else list(dispatch)
    sources = [source_ranks(steps.ranks, p.ranks, s.steps) if p.nodes > 1 else (None, False)
               for p, s in zip(placements, sums)]   # the source rank of each step, for cross-node traffic

    def layer_totals(layer: int) -> list[dict[str, Any]]:
        activity = layer_activity(steps, layer)
        distinct_total = activity.distinct_total()
        counts = pairs = None   # [S, E] and its active pairs, made once for the placements with spare slots
        out = []
        for placement, cost_model, tables, rule, (source, _) in zip(placements, cost_models, static_tables, rules,
                                                                   sources):
            R, phy2log = placement.ranks, placement.phy2log[layer]
            table = tables[layer] if tables is not None else None
            if placement.num_redundant == 0:
                # one replica each: every rule sends an expert to its one rank, which is also the optimum
                distinct, tokens = single_copy_loads(activity, phy2log, R, steps.count_steps)
                optimum = distinct.max(axis=1)
            else:
                counts = step_expert_counts(steps, layer) if counts is None else counts
                if rule == "balanced":
                    pairs = active_pairs(counts) if pairs is None else pairs
                    balanced, optimum = balanced_loads(steps, layer, phy2log, R, counts, pairs)
                    distinct, tokens = balanced.distinct, balanced.tokens
                else:
                    distinct, tokens = layer_rank_loads(steps, layer, phy2log, R, rule, table, cost_model)
                    optimum = replica_optimum(counts > 0, phy2log, R)
            extra = (rank_extra_blocks(steps, layer, phy2log, R, rule, cost_model, table)
                     if cost_model.needs_blocks(step_tokens) else 0)
            out.append(_totals(distinct, tokens, optimum, np.ceil(distinct_total / R), cost_model, extra))
            if placement.nodes > 1:   # the source decides the replica only under static, with spare slots
                cross, sent = (static_cross_sends(counts, phy2log, R, placement.nodes, source)
                               if rule == "static" and placement.num_redundant else
                               rank_cross_sends(tokens, source, placement.nodes))
                out[-1].update(cross_node_sends=cross, sends=sent)
        return out

    step_tokens = max_step_tokens(steps)

    for layer, totals in map_layers(layer_totals, steps.model.num_moe_layers, workers):
        for layer_sums, placement_totals in zip(sums, totals):
            for name, value in placement_totals.items():
                getattr(layer_sums, name)[layer] += value
    tokens = steps.expert_token_counts()
    for layer_sums, placement, (_, round_robin) in zip(sums, placements, sources):
        layer_sums.nodes = placement.nodes
        layer_sums.round_robin |= round_robin
        layer_sums.steps += steps.num_steps
        layer_sums.expert_tokens = tokens if layer_sums.expert_tokens is None else layer_sums.expert_tokens + tokens


def max_distinct_means(steps: RoutingSteps, placements: list[Placement], rules: list[str],
                       cost_models: list[CostModel], workers: int = 1) -> list[float]:
    """E[max distinct] of each placement under its dispatch rule on ``steps``, and nothing else
    (optimize's fitted column): ``layer_maxima`` averaged over steps, then over layers."""
    def layer_means(layer: int) -> list[float]:
        return [float(m.mean()) for m in layer_maxima(steps, layer, placements, rules, cost_models)]

    per_layer = np.zeros((steps.model.num_moe_layers, len(placements)))
    for layer, means in map_layers(layer_means, steps.model.num_moe_layers, workers):
        per_layer[layer] = means
    return per_layer.mean(axis=0).tolist()


def step_max_distinct(steps: RoutingSteps, placements: list[Placement], rules: list[str],
                      cost_models: list[CostModel], workers: int = 1) -> np.ndarray:
    """[n, L, S] ``layer_maxima`` of the n placements in every layer: the step by step figures a paired comparison
    needs."""
    maxima = np.zeros((len(placements), steps.model.num_moe_layers, steps.num_steps))
    job = lambda layer: layer_maxima(steps, layer, placements, rules, cost_models)   # noqa: E731
    for layer, values in map_layers(job, steps.model.num_moe_layers, workers):
        maxima[:, layer] = values
    return maxima


def layer_maxima(steps: RoutingSteps, layer: int, placements: list[Placement], rules: list[str],
                 cost_models: list[CostModel]) -> list[np.ndarray]:
    """[S] distinct experts on the busiest rank in each step of one layer, for each placement under its rule.

    Under balanced dispatch a placement with spare slots is given its per-step optimum
    (``replica_optimum``), the figure the fast rule reaches wherever its cap on augmenting paths does
    not bind (on every step measured: the held-out table shows both), at a fraction of the rule's cost.
    """
    activity = layer_activity(steps, layer)
    active = None   # [S, E] 0/1 float32, made once for the placements with spare slots
    out = []
    for placement, rule, cost_model in zip(placements, rules, cost_models):
        R, phy2log = placement.ranks, placement.phy2log[layer]
        if placement.num_redundant == 0:
            out.append(single_copy_loads(activity, phy2log, R, steps.count_steps)[0].max(axis=1))
        elif rule == "balanced":
            if active is None:
                active = (step_expert_counts(steps, layer) > 0).astype(np.float32)
            out.append(replica_optimum(active, phy2log, R))
        else:
            table = (static_dispatch_table(phy2log, placement.model.num_experts, R, placement.nodes)
                     if rule == "static" else None)
            out.append(layer_rank_loads(steps, layer, phy2log, R, rule, table, cost_model)[0].max(axis=1))
    return out


def _totals(distinct: np.ndarray, tokens: np.ndarray, optimum: np.ndarray, lower_bound: np.ndarray,
            cost_model: CostModel, extra_blocks: np.ndarray | int = 0) -> dict[str, Any]:
    """One layer's per-step loads (distinct, tokens, extra_blocks [S, R]; optimum, lower_bound [S]) summed
    over the steps, by the ``LayerSums`` field each is added to."""
    cost = cost_model.cost(distinct, tokens, extra_blocks)
    step_max = distinct.max(axis=1)
    return {"max_distinct": step_max.sum(), "mean_distinct": distinct.mean(axis=1).sum(),
            "lower_bound": lower_bound.sum(), "optimum": optimum.sum(), "max_cost": cost.max(axis=1).sum(),
            "mean_cost": cost.mean(axis=1).sum(), "rank_tokens": tokens.sum(axis=0),
            "rank_distinct": distinct.sum(axis=0), "step_max_hist": np.bincount(np.minimum(step_max, 64), minlength=65)}


def summarize(sums: LayerSums) -> dict[str, Any]:
    """Per-layer and overall metrics from running sums (means over steps)."""
    if sums.steps == 0:
        raise MoeplaceError("no steps to measure (empty trace or no steps of the chosen mode)")
    n = sums.steps
    per_layer_bal = balancedness(sums.rank_tokens)
    e_max = sums.max_distinct / n
    lower = sums.lower_bound / n
    optimum = sums.optimum / n
    out = {
        "steps": n,
        "e_max_distinct": float(e_max.mean()),
        "e_mean_distinct": float((sums.mean_distinct / n).mean()),
        "lower_bound": float(lower.mean()),
        "optimum": float(optimum.mean()),
        "token_balancedness": float(per_layer_bal.mean()),
        "balancedness_p50": float(np.percentile(per_layer_bal, 50)),
        "balancedness_p10": float(np.percentile(per_layer_bal, 10)),  # 9 in 10 layers are more balanced
        "balancedness_worst": float(per_layer_bal.min()),
        "moe_us_per_step": float((sums.max_cost / n).sum()),
        "moe_us_per_step_if_balanced": float((sums.mean_cost / n).sum()),
        "per_layer": {
            "e_max_distinct": e_max.tolist(),
            "lower_bound": lower.tolist(),
            "optimum": optimum.tolist(),
            "token_balancedness": per_layer_bal.tolist(),
            "moe_us": (sums.max_cost / n).tolist(),
        },
    }
    if sums.nodes > 1:
        out.update(cross_node_traffic(sums))
        out["per_layer"]["cross_node_share"] = (sums.cross_node_sends / np.maximum(sums.sends, 1)).tolist()
    return out


def cross_node_traffic(sums: LayerSums) -> dict[str, Any]:
    """The cross-node figures of ``sums`` (``moeplace.dispatch.traffic``): the share of (token, expert) sends
    received on another node than the step's source rank's, and such sends per step and MoE layer and per
    step (all MoE layers), means over the steps."""
    cross = float(sums.cross_node_sends.sum())
    return {"nodes": sums.nodes, "cross_node_share": cross / max(float(sums.sends.sum()), 1.0),
            "cross_node_sends_per_layer": cross / sums.steps / sums.num_layers,
            "cross_node_sends_per_step": cross / sums.steps,
            "source_ranks": "round robin" if sums.round_robin else "trace"}


def gap_closed(value: float, baseline: float, lower_bound: float) -> float:
    """Share of the baseline's gap to the lower bound that ``value`` closes (1.0 = reaches the bound)."""
    gap = baseline - lower_bound
    return float((baseline - value) / gap) if gap > 1e-12 else 0.0
