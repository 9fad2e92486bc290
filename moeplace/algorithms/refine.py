"""A placement near the map in force: the moves of the fitted search that pay, started from where experts are.

Dimension letters: S steps, P physical slots, R ranks, E experts, L MoE layers.

A placement fitted from scratch ends in another local optimum than the map in force, so even aligned to it
(``moves.align``) it copies most of a layer's experts when the traffic has only moved a little. ``refine``
runs the fitted search's own local moves from the map in force instead, on the new steps, until none gains:

* with one replica each, or under SGLang's dynamic and static rules: ``stepaware``'s best-improvement swaps of
  two slots between ranks (two replicas copied per swap), under its token-balance floor (DeepSeek EPLB's on the
  steps times ``balance_floor``, or the map's own balance where that is lower, so a start below the floor is
  not forced into repairs);
* under balanced dispatch with spare slots: ``replica_exchange``'s exchanges of two experts' replica sets (an
  expert that turned hot takes the replicas of one that cooled), on up to ``sample_size`` of the steps.

Above ``balanced_replicas.MAX_SEARCH_RANKS`` with spare slots (the exchanges enumerate rank sets), each expert keeps
its first copy where it is and the spare replicas are placed again by ``wide_spares`` on the steps: only spare slots
move. How many experts hold how many replicas never changes here (a swap keeps every expert's count, an
exchange trades two experts' counts): a refit changes them.
"""

from __future__ import annotations

import numpy as np

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms import wide_spares
from moeplace.algorithms.balanced_replicas import MAX_SEARCH_RANKS, WIDE_SEARCH_STEPS, masks_to_phy2log, sample_size
from moeplace.algorithms.deepseek import rebalance_experts
from moeplace.algorithms.fit import placed_as
from moeplace.algorithms.moves import align_layer
from moeplace.algorithms.replica_exchange import MIN_GAIN, exchange_masks
from moeplace.algorithms.stepaware import (SWAP_GAIN, item_activity, pair_weight, round_cost, search_rows,
                                           swap_search, token_floor)
from moeplace.dispatch.balanced import MASK_RANKS, pack_bits, replica_layout, step_expert_counts
from moeplace.dispatch.loads import balancedness
from moeplace.parallel import layer_workers, map_layers

REFINE_EFFORT = 0.25   # share of a fit's swap budget the swaps from the map in force may spend: they start near it
EXCHANGE_STEPS = 500   # steps a layer's exchanges are scored on, at most (a sample: each pass reads them all)
EXCHANGE_PASSES = 3    # passes over every exchange a layer's search may make


def refine(problem: PlacementProblem, current: np.ndarray, min_step_gain: float = 0.0) -> np.ndarray:
    """phy2log [L, P]: ``current [L, P]`` after the local moves that lower E[max distinct] on ``problem.steps``
    (module docstring) by more than ``min_step_gain`` per step each (what copying a move's replicas costs, in
    expert reads per step), aligned to it so that only what the moves change is copied."""
    problem = placed_as(problem)
    L, R = problem.model.num_moe_layers, problem.ranks
    rng = np.random.default_rng([problem.seed, 71])
    seeds = rng.integers(2**31, size=L)
    weight = problem.steps.expert_token_counts()
    reference = rebalance_experts(weight, problem.num_physical, 1, 1, R, False)[0]

    def layer_job(layer: int) -> np.ndarray:
        layer_rng = np.random.default_rng(seeds[layer])
        if problem.dispatch == "balanced" and problem.redundant:
            moved = (respare_layer(problem, layer, current[layer]) if R > MAX_SEARCH_RANKS else
                     exchange_layer(problem, layer, current[layer], layer_rng, min_step_gain))
        else:
            moved = swap_layer(problem, layer, current[layer], reference[layer], layer_rng, min_step_gain)
        return align_layer(moved, current[layer], R, problem.nodes)

    out = np.array(current, copy=True)
    for layer, phy2log in map_layers(layer_job, L, layer_workers(problem.steps.num_steps * problem.num_physical * L)):
        out[layer] = phy2log
        problem.progress(1)
    return out


def swap_layer(problem: PlacementProblem, layer: int, current: np.ndarray, reference: np.ndarray,
               rng: np.random.Generator, min_step_gain: float) -> np.ndarray:
    """One layer's ``current [P]`` after stepaware's slot swaps; ``reference [P]``: DeepSeek EPLB's map of the
    steps (its token balance sets the floor, as stepaware's)."""
    R, E, P = problem.ranks, problem.model.num_experts, problem.num_physical
    spr = P // R
    order = np.argsort(current, kind="stable")              # items: replicas in expert order, by slot (rank) order
    item_expert = current[order]
    replicas = np.bincount(current, minlength=E)
    active, item_tokens = item_activity(problem.steps, layer, replicas, problem.dispatch)
    rank = order // spr
    floor = min(token_floor(problem.balance_floor, reference, item_expert, item_tokens, R),
                float(balancedness(np.bincount(rank, weights=item_tokens, minlength=R)[None])[0]))
    rows = search_rows(problem.steps.num_steps, P, rng, R)
    budget = REFINE_EFFORT * problem.effort / problem.model.num_moe_layers
    rounds = max(1, int(budget // round_cost(rows.size, P, R)))
    rank, _ = swap_search(active[rows], item_tokens, item_expert, rank, R, floor, rounds,
                          min_swap=max(SWAP_GAIN, min_step_gain * rows.size), pairs=pair_weight(problem))
    out = np.empty(P, np.int64)
    by_rank = np.lexsort((item_expert, rank))               # each rank's slots, experts in id order
    out[:] = item_expert[by_rank]
    return out


def exchange_layer(problem: PlacementProblem, layer: int, current: np.ndarray,
                   rng: np.random.Generator, min_step_gain: float) -> np.ndarray:
    """One layer's ``current [P]`` after exchanges of two experts' replica sets (balanced dispatch)."""
    R, E = problem.ranks, problem.model.num_experts
    active = step_expert_counts(problem.steps, layer) > 0
    sample = min(sample_size(problem), EXCHANGE_STEPS)
    if active.shape[0] > sample:
        active = active[np.sort(rng.choice(active.shape[0], sample, replace=False))]
    masks = replica_layout(current, E, R).masks
    passes = EXCHANGE_PASSES * active.shape[0] * (len(np.unique(masks)) * (len(np.unique(masks)) + E) + E * E)
    masks = exchange_masks(active, np.ones(active.shape[0]), masks, R, passes,
                           min_gain=max(MIN_GAIN, min_step_gain * active.shape[0]))
    return masks_to_phy2log(masks, R, problem.num_physical // R)


def respare_layer(problem: PlacementProblem, layer: int, current: np.ndarray) -> np.ndarray:
    """One wide layer's ``current [P]`` with its first copies kept (each expert's replica in its lowest slot) and its
    spare replicas placed again by ``wide_spares`` on the steps: only spare slots move."""
    R, E, P = problem.ranks, problem.model.num_experts, problem.num_physical
    counts = step_expert_counts(problem.steps, layer)
    first = np.unique(current, return_index=True)[1]          # each expert's lowest slot
    on = np.zeros((E, R), bool)
    on[current[first], first // (P // R)] = True
    masks = pack_bits(on) if R <= MASK_RANKS else on
    room = P // R - on.sum(axis=0)
    sample = counts[:WIDE_SEARCH_STEPS] > 0 if counts.shape[0] <= WIDE_SEARCH_STEPS else \
        counts[np.unique(np.linspace(0, counts.shape[0] - 1, WIDE_SEARCH_STEPS).astype(np.int64))] > 0
    masks = wide_spares.add_replicas(sample, masks, R, room, counts.sum(axis=0))
    return masks_to_phy2log(masks, R, P // R)
