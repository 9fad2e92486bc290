"""Imbalance metrics: per-step, per-rank expert loads under a placement and a dispatch rule.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts, P physical
slots, R ranks. A rank's load in a step is the number of distinct physical experts it must read
(``distinct``) and the tokens it runs (``tokens``); the step waits for its slowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeplace.algorithms.hall import step_optimum, subset_counts, subset_sizes
from moeplace.balanced import MAX_AUGMENT, ActivePairs, active_pairs, fast_rule, replica_layout, step_expert_counts
from moeplace.cost_dispatch import layer_dispatch, pair_slots
from moeplace.costmodel import CostModel
from moeplace.errors import MoeplaceError
from moeplace.parallel import map_layers
from moeplace.placement import Placement, replica_table
from moeplace.trace.steps import RoutingSteps

DISPATCH_RULES = ("dynamic", "static", "balanced", "cost")


def static_dispatch_table(phy2log: np.ndarray, num_experts: int, ranks: int, nodes: int,
                          seed: int = 0) -> np.ndarray:
    """[R, E] physical slot each source rank sends an expert's tokens to (SGLang's ``static`` rule).

    Same GPU first, then same node when that narrows the choice, then a seeded fair choice among
    all replicas: the remaining ranks spread evenly over them (SGLang 0.5.23's
    ``_find_nearest_expert`` and ``_fair_choices``). phy2log: [P] one layer.
    """
    P = phy2log.shape[0]
    slots_per_rank, ranks_per_node = P // ranks, ranks // nodes
    rank_of = np.arange(P) // slots_per_rank
    rng = np.random.default_rng(seed)
    table = np.zeros((ranks, num_experts), np.int64)
    for e in range(num_experts):
        replicas = np.flatnonzero(phy2log == e)
        remaining = []
        for r in range(ranks):
            local = replicas[rank_of[replicas] == r]
            same_node = replicas[rank_of[replicas] // ranks_per_node == r // ranks_per_node]
            if local.size:
                table[r, e] = local[0]
            elif 0 < same_node.size < replicas.size:
                table[r, e] = same_node[0]
            else:
                remaining.append(r)
        if remaining:
            whole, rest = divmod(len(remaining), replicas.size)
            choices = np.concatenate([np.tile(replicas, whole), rng.choice(replicas, rest, replace=False)])
            table[remaining, e] = rng.permutation(choices)
    return table


def token_slots(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, dispatch: str = "dynamic",
                static_table: np.ndarray | None = None,
                cost_model: CostModel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The physical slot SGLang sends each (token row, top-k) pair of one layer to.

    phy2log: [P] this layer's map; static_table: [R, E] for ``static`` (SGLang's table when None).
    Returns (step [N], slot [N]) for the N valid pairs of the token-row steps. ``dynamic``: token row r
    picks replica ``r % num_replicas`` (by physical id); ``static``: the step's source rank picks its
    fixed replica; ``balanced``: moeplace's per-step rule (``moeplace.balanced``); ``cost``: its rule by
    ``cost_model`` (``moeplace.cost_dispatch``).
    """
    if dispatch == "cost":
        return pair_slots(steps, layer, phy2log, ranks, _needs_cost(cost_model))
    E = steps.model.num_experts
    step_of_row, row_in_step, ids = steps.layer(layer)
    valid = ids >= 0
    e = np.where(valid, ids, 0).astype(np.int64)
    if dispatch == "balanced":
        pick = balanced_loads(steps, layer, phy2log, ranks)[0].pick
        slots = replica_layout(phy2log, E, ranks).slots
        phys = slots[e, np.maximum(pick[step_of_row[:, None], e], 0)]
    elif dispatch == "dynamic":
        log2phy, nrep = (t[0] for t in replica_table(phy2log[None, :], E))
        phys = log2phy[e, row_in_step[:, None] % nrep[e]]
    else:
        if static_table is None:
            static_table = static_dispatch_table(phy2log, E, ranks, 1)
        src_rank = steps.ranks.astype(np.int64)[step_of_row] % ranks
        phys = static_table[src_rank[:, None], e]
    return np.broadcast_to(step_of_row[:, None], ids.shape)[valid], phys[valid]


def layer_rank_loads(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int,
                     dispatch: str = "dynamic", static_table: np.ndarray | None = None,
                     cost_model: CostModel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Distinct experts and tokens per rank per step at one MoE layer.

    phy2log: [P] this layer's map. Returns (distinct [S, R], tokens [S, R]).
    ``dynamic``: a token row picks replica ``row % num_replicas`` (SGLang with --moe-a2a-backend none).
    ``static``: each source rank (the step's rank) has a fixed replica (SGLang with DeepEP).
    ``balanced``: all of a step's tokens for an expert go to the replica moeplace's rule picks.
    ``cost``: moeplace's rule by ``cost_model``, which may split an expert's tokens.
    """
    if dispatch not in DISPATCH_RULES:
        raise MoeplaceError(f"unknown dispatch rule {dispatch!r}; choose from {', '.join(DISPATCH_RULES)}")
    if dispatch == "cost":
        chosen = layer_dispatch(steps, layer, phy2log, ranks, _needs_cost(cost_model))
        return chosen.distinct, chosen.tokens
    if dispatch == "balanced":
        chosen = balanced_loads(steps, layer, phy2log, ranks)[0]
        return chosen.distinct, chosen.tokens
    E = steps.model.num_experts
    P = phy2log.shape[0]
    S = steps.num_steps
    spr = P // ranks
    log2phy, nrep = replica_table(phy2log[None, :], E)
    log2phy, nrep = log2phy[0], nrep[0]
    if dispatch == "static" and static_table is None:
        static_table = static_dispatch_table(phy2log, E, ranks, 1)
    src_rank = steps.ranks.astype(np.int64) % ranks

    distinct = np.zeros((S, ranks), np.int64)
    tokens = np.zeros((S, ranks), np.int64)

    # Steps with token rows.
    if steps.topk_ids.size:
        step_k, phys = token_slots(steps, layer, phy2log, ranks, dispatch, static_table)
        tokens += np.bincount(step_k * ranks + phys // spr, minlength=S * ranks).reshape(S, ranks)
        hit = np.zeros(S * P, bool)
        hit[step_k * P + phys] = True
        distinct += hit.reshape(S, ranks, spr).sum(axis=2)

    # Steps known only as counts: rows are unknown, so the dynamic rule is taken as spreading
    # c tokens round-robin over the replicas from the first (rows 0..c-1).
    if steps.count_steps.size:
        counts = steps.counts[:, layer, :]  # [S_c, E]
        X = log2phy.shape[1]
        j = np.arange(X)
        if dispatch == "dynamic":
            n = nrep[None, :, None]
            c = counts[:, :, None]
            per_replica = np.where(j < n, np.floor(c / n) + (j < np.mod(c, n)), 0)  # [S_c, E, X]
            slot = np.broadcast_to(log2phy[None], per_replica.shape)
        else:
            per_replica = counts[:, :, None].copy()
            slot = static_table[src_rank[steps.count_steps]][:, :, None]
        rank_of_slot = np.where(slot >= 0, slot // spr, 0)
        for k, s in enumerate(steps.count_steps):
            w = per_replica[k].ravel()
            r = np.broadcast_to(rank_of_slot[k], per_replica[k].shape).ravel()
            tokens[s] += np.bincount(r, weights=w, minlength=ranks).astype(np.int64)
            distinct[s] += np.bincount(r, weights=(w > 0), minlength=ranks).astype(np.int64)
    return distinct, tokens


def _needs_cost(cost_model: CostModel | None) -> CostModel:
    if cost_model is None:
        raise MoeplaceError("the cost dispatch rule needs a cost model")
    return cost_model


def token_slot_pairs(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, dispatch: str = "dynamic",
                     static_table: np.ndarray | None = None, cost_model: CostModel | None = None) -> np.ndarray:
    """[S, P] pairs each physical slot runs in each step at one layer under ``token_slots``' rules (the token-row
    steps; 0 for count steps)."""
    S, P = steps.num_steps, phy2log.shape[0]
    step, phys = token_slots(steps, layer, phy2log, ranks, dispatch, static_table, cost_model)
    return np.bincount(step * P + phys, minlength=S * P).reshape(S, P)


def max_step_tokens(steps: RoutingSteps) -> int:
    """The most tokens any step of ``steps`` routes (token rows, or a count step's largest expert count)."""
    rows = int(np.diff(steps.token_offsets).max(initial=0))
    counts = int(np.ceil(steps.counts.max(initial=0))) if steps.count_steps.size else 0
    return max(rows, counts)


def rank_extra_blocks(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, dispatch: str,
                      cost_model: CostModel, static_table: np.ndarray | None = None) -> np.ndarray:
    """[S, R] row blocks beyond each expert's first on each rank at one layer (``CostModel.extra_blocks``).

    Token-row steps as ``token_slots`` dispatches them; a count step's expert count spread evenly over its
    replicas (its rows are unknown; exact for an expert with one replica)."""
    S, P, E = steps.num_steps, phy2log.shape[0], steps.model.num_experts
    slot = token_slot_pairs(steps, layer, phy2log, ranks, dispatch, static_table, cost_model).astype(np.float64)
    if steps.count_steps.size:
        replicas = np.bincount(phy2log, minlength=E)
        slot[steps.count_steps] += np.ceil(steps.counts[:, layer, :])[:, phy2log] / replicas[phy2log]
    return cost_model.extra_blocks(slot.reshape(S, ranks, P // ranks))


def balanced_loads(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int,
                   counts: np.ndarray | None = None, pairs: ActivePairs | None = None):
    """(the fast rule's dispatch as the GPU runs it, the optimum [S]) of balanced dispatch at one layer.

    The rule without its cap on augmenting paths is the exact optimum (``moeplace.balanced``); the
    capped rule differs only on the steps that needed more paths, which are recomputed.
    counts: the layer's ``step_expert_counts``, and pairs their ``active_pairs``, where the caller has them.
    """
    layout = replica_layout(phy2log, steps.model.num_experts, ranks)
    counts = step_expert_counts(steps, layer) if counts is None else counts
    chosen = fast_rule(counts, layout.masks, ranks, max_augment=None, pairs=pairs)
    optimum = chosen.distinct.max(axis=1)
    over = np.flatnonzero(chosen.augments > MAX_AUGMENT)
    if over.size:
        capped = fast_rule(counts[over], layout.masks, ranks)
        for name in ("pick", "distinct", "tokens", "augments"):
            getattr(chosen, name)[over] = getattr(capped, name)
    return chosen, optimum


def replica_optimum(active: np.ndarray, phy2log: np.ndarray, ranks: int) -> np.ndarray:
    """[S] the best max distinct experts per rank that the replicas of ``phy2log`` allow in each step
    (``active [S, E]``: the steps' active experts, bool or 0/1 float32): Hall's formula
    (``algorithms.hall``), exact, without running a rule."""
    masks = replica_layout(phy2log, active.shape[1], ranks).masks
    return step_optimum(subset_counts(active, masks, ranks), subset_sizes(ranks))


def layer_distinct_total(steps: RoutingSteps, layer: int) -> np.ndarray:
    """[S] distinct logical experts activated per step at one layer."""
    S, E = steps.num_steps, steps.model.num_experts
    out = np.zeros(S, np.int64)
    step_of_row, _, ids = steps.layer(layer)
    if ids.size:
        step_k = np.broadcast_to(step_of_row[:, None], ids.shape)[ids >= 0]
        hit = np.zeros(S * E, bool)
        hit[step_k * E + ids[ids >= 0]] = True
        out += hit.reshape(S, E).sum(axis=1)
    if steps.count_steps.size:
        out[steps.count_steps] += (steps.counts[:, layer, :] > 0).sum(axis=1)
    return out


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

    def __post_init__(self) -> None:
        L, R = self.num_layers, self.ranks
        for name in ("max_distinct", "mean_distinct", "lower_bound", "optimum", "max_cost", "mean_cost"):
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

    def layer_totals(layer: int) -> list[dict[str, Any]]:
        activity = layer_activity(steps, layer)
        distinct_total = activity.distinct_total()
        counts = pairs = None   # [S, E] and its active pairs, made once for the placements with spare slots
        out = []
        for placement, cost_model, tables, rule in zip(placements, cost_models, static_tables, rules):
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
        return out

    step_tokens = max_step_tokens(steps)

    for layer, totals in map_layers(layer_totals, steps.model.num_moe_layers, workers):
        for layer_sums, placement_totals in zip(sums, totals):
            for name, value in placement_totals.items():
                getattr(layer_sums, name)[layer] += value
    tokens = steps.expert_token_counts()
    for layer_sums in sums:
        layer_sums.steps += steps.num_steps
        layer_sums.expert_tokens = tokens if layer_sums.expert_tokens is None else layer_sums.expert_tokens + tokens


def max_distinct_means(steps: RoutingSteps, placements: list[Placement], rules: list[str],
                       cost_models: list[CostModel], workers: int = 1) -> list[float]:
    """E[max distinct] of each placement under its dispatch rule on ``steps``, and nothing else
    (optimize's fitted column).

    Under balanced dispatch a placement with spare slots is given its per-step optimum
    (``replica_optimum``), the figure the fast rule reaches wherever its cap on augmenting paths does
    not bind (on every step measured: the held-out table shows both), at a fraction of the rule's cost.
    """
    def layer_means(layer: int) -> list[float]:
        activity = layer_activity(steps, layer)
        active = None   # [S, E] 0/1 float32, made once for the placements with spare slots
        out = []
        for placement, rule, cost_model in zip(placements, rules, cost_models):
            R, phy2log = placement.ranks, placement.phy2log[layer]
            if placement.num_redundant == 0:
                step_max = single_copy_loads(activity, phy2log, R, steps.count_steps)[0].max(axis=1)
            elif rule == "balanced":
                if active is None:
                    active = (step_expert_counts(steps, layer) > 0).astype(np.float32)
                step_max = replica_optimum(active, phy2log, R)
            else:
                table = (static_dispatch_table(phy2log, placement.model.num_experts, R, placement.nodes)
                         if rule == "static" else None)
                step_max = layer_rank_loads(steps, layer, phy2log, R, rule, table, cost_model)[0].max(axis=1)
            out.append(float(step_max.mean()))
        return out

    per_layer = np.zeros((steps.model.num_moe_layers, len(placements)))
    for layer, means in map_layers(layer_means, steps.model.num_moe_layers, workers):
        per_layer[layer] = means
    return per_layer.mean(axis=0).tolist()


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


def balancedness(rank_load: np.ndarray) -> np.ndarray:
    """SGLang's balancedness per row: (mean + 1e-5) / (max + 1e-5). rank_load: [L, R] -> [L]."""
    return (rank_load.mean(axis=-1) + 1e-5) / (rank_load.max(axis=-1) + 1e-5)


def summarize(sums: LayerSums) -> dict[str, Any]:
    """Per-layer and overall metrics from running sums (means over steps)."""
    if sums.steps == 0:
        raise MoeplaceError("no steps to measure (empty trace or no steps of the chosen mode)")
    n = sums.steps
    per_layer_bal = balancedness(sums.rank_tokens)
    e_max = sums.max_distinct / n
    lower = sums.lower_bound / n
    optimum = sums.optimum / n
    return {
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


def gap_closed(value: float, baseline: float, lower_bound: float) -> float:
    """Share of the baseline's gap to the lower bound that ``value`` closes (1.0 = reaches the bound)."""
    gap = baseline - lower_bound
    return float((baseline - value) / gap) if gap > 1e-12 else 0.0
