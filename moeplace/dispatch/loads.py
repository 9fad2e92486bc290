"""A rank's load in one step under each dispatch rule: distinct experts read and tokens run per rank.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts, P physical
slots, R ranks. ``dynamic`` and ``static`` are SGLang's rules among replicas, ``balanced`` and ``cost``
moeplace's; every placement's metrics and every placement algorithm measure a step through these.
"""

from __future__ import annotations

import numpy as np

from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import MAX_AUGMENT, ActivePairs, fast_rule, replica_layout, step_expert_counts
from moeplace.dispatch.by_cost import layer_dispatch, pair_slots
from moeplace.dispatch.flow import optimum as exact_optimum
from moeplace.errors import MoeplaceError
from moeplace.files.placement import replica_table
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
    slot = np.arange(P)
    rank_of = slot // slots_per_rank
    node_of = rank_of // ranks_per_node
    # the lowest slot of each expert on each rank and on each node (P where it has none), and its copies per node
    local = np.full((ranks, num_experts), P, np.int64)
    np.minimum.at(local, (rank_of, phy2log), slot)
    near = np.full((nodes, num_experts), P, np.int64)
    np.minimum.at(near, (node_of, phy2log), slot)
    in_node = np.zeros((nodes, num_experts), np.int64)
    np.add.at(in_node, (node_of, phy2log), 1)
    rank_node = np.arange(ranks) // ranks_per_node
    narrows = (in_node[rank_node] > 0) & (in_node[rank_node] < np.bincount(phy2log, minlength=num_experts))
    table = np.where(local < P, local, np.where(narrows, near[rank_node], -1))         # [R, E], -1: a fair choice
    # The seeded fair choice: an expert's remaining ranks, in random order, take its replicas in a random
    # order round robin (each replica (remaining ranks) // replicas times, a random few once more), all
    # experts at once where SGLang draws expert by expert.
    rng = np.random.default_rng(seed)
    expert, rank = np.nonzero(table.T < 0)                                   # by expert
    order = np.lexsort((rng.random(expert.size), expert))
    expert, rank = expert[order], rank[order]
    turn = np.arange(expert.size) - np.searchsorted(expert, expert)          # place among its expert's ranks
    shuffled = np.lexsort((rng.random(P), phy2log))                          # slots by expert, random within
    copies = np.bincount(phy2log, minlength=num_experts)
    first = np.cumsum(copies) - copies
    table[rank, expert] = shuffled[first[expert] + turn % copies[expert]]
    return table


def token_slots(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, dispatch: str = "dynamic",
                static_table: np.ndarray | None = None,
                cost_model: CostModel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The physical slot SGLang sends each (token row, top-k) pair of one layer to.

    phy2log: [P] this layer's map; static_table: [R, E] for ``static`` (SGLang's table when None).
    Returns (step [N], slot [N]) for the N valid pairs of the token-row steps. ``dynamic``: token row r
    picks replica ``r % num_replicas`` (by physical id); ``static``: the step's source rank picks its
    fixed replica; ``balanced``: moeplace's per-step rule (``moeplace.dispatch.balanced``); ``cost``: its rule by
    ``cost_model`` (``moeplace.dispatch.by_cost``).
    """
    if dispatch == "cost":
        return pair_slots(steps, layer, phy2log, ranks, needs_cost(cost_model))
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
        chosen = layer_dispatch(steps, layer, phy2log, ranks, needs_cost(cost_model))
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
        cell = np.flatnonzero(hit)                       # (step, slot) cells read, slot = cell % P
        distinct += np.bincount(cell // P * ranks + cell % P // spr, minlength=S * ranks).reshape(S, ranks)

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


def needs_cost(cost_model: CostModel | None) -> CostModel:
    """``cost_model``, which the ``cost`` rule needs (MoeplaceError where it is None)."""
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

    The rule without its cap on augmenting paths is the exact optimum (``moeplace.dispatch.balanced``); the
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
    (``active [S, E]``: the steps' active experts, bool or 0/1 float32): exact (``moeplace.dispatch.flow``:
    Hall's formula on few ranks, the uncapped rule on many)."""
    masks = replica_layout(phy2log, active.shape[1], ranks).masks
    return exact_optimum(active, masks, ranks)


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


def balancedness(rank_load: np.ndarray) -> np.ndarray:
    """SGLang's balancedness per row: (mean + 1e-5) / (max + 1e-5). rank_load: [L, R] -> [L]."""
    return (rank_load.mean(axis=-1) + 1e-5) / (rank_load.max(axis=-1) + 1e-5)
