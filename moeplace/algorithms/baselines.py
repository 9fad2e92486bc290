"""Baselines: SGLang's trivial layout, DeepSeek EPLB (token-count balancing), and the naive spare-slot
layout that a balanced-dispatch placement must beat."""

from __future__ import annotations

import numpy as np

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms.deepseek import rebalance_experts
from moeplace.errors import MoeplaceError


def contiguous(problem: PlacementProblem) -> np.ndarray:
    """SGLang's ``trivial`` layout: slot p holds expert ``p % E`` in every layer."""
    L, P = problem.model.num_moe_layers, problem.num_physical
    return np.tile(np.arange(P) % problem.model.num_experts, (L, 1))


def _deepseek(problem: PlacementProblem, hierarchical: bool) -> np.ndarray:
    weight = problem.steps.expert_token_counts()
    # DeepSeek groups experts for node-limited routing; moeplace traces do not say the group count,
    # so each node gets one group (the finest grouping that still lets the hierarchy work).
    groups = problem.nodes if hierarchical else 1
    phy2log, _, _ = rebalance_experts(weight, problem.num_physical, groups, problem.nodes, problem.ranks,
                                      hierarchical)
    problem.progress(problem.model.num_moe_layers)
    return np.stack([separate_replicas(row, problem.ranks, w) for row, w in zip(phy2log, weight)])


def separate_replicas(phy2log: np.ndarray, ranks: int, weight: np.ndarray) -> np.ndarray:
    """Swap slots so that no rank holds two replicas of one expert (DeepSeek EPLB can do that).

    phy2log: [P] one layer; weight: [E] tokens. Each duplicate swaps with the slot on another rank
    whose per-replica load is closest, so token balance barely moves. SGLang would accept the
    duplicate, but it wastes a slot, and without an all-to-all backend both copies can be read.
    An expert with more replicas than ranks gives its extra ones to other experts.
    """
    out = phy2log.copy()
    spr = out.shape[0] // ranks
    copies = np.bincount(out, minlength=weight.shape[0])
    for slot in range(out.shape[0]) if (copies > ranks).any() else ():
        # EPLB does not cap replicas at the rank count, and more than ``ranks`` replicas cannot be
        # separated: an extra one on a rank that already holds its expert goes to the expert EPLB
        # would replicate next (highest load per replica) among those under the cap, preferably
        # one this rank lacks; the swaps below separate the rest.
        r, e = slot // spr, out[slot]
        mine = out[r * spr:(r + 1) * spr]
        if copies[e] > ranks and np.flatnonzero(mine == e)[0] != slot - r * spr:
            fits = copies < ranks
            if (fits & ~np.isin(np.arange(copies.shape[0]), mine)).any():
                fits &= ~np.isin(np.arange(copies.shape[0]), mine)
            f = int(np.argmax(np.where(fits, weight / copies, -np.inf)))
            out[slot], copies[e], copies[f] = f, copies[e] - 1, copies[f] + 1
    replica_load = weight / copies
    rank_of = np.arange(out.shape[0]) // spr
    # Only a slot whose expert its rank already holds in an earlier slot can need a swap, and a swap
    # never makes a new one (both ranks lacked what they receive), so the loop visits only those.
    repeated = np.ones(out.shape[0], bool)
    repeated[np.unique(rank_of * weight.shape[0] + out, return_index=True)[1]] = False
    for slot in np.flatnonzero(repeated):
        r, e = slot // spr, out[slot]
        mine = out[r * spr:(r + 1) * spr]
        if np.count_nonzero(mine == e) < 2 or np.flatnonzero(mine == e)[0] == slot - r * spr:
            continue
        # slots on other ranks whose expert this rank lacks, on a rank that lacks e
        lacks_e = ~(out.reshape(ranks, spr) == e).any(axis=1)
        candidates = np.flatnonzero((rank_of != r) & ~np.isin(out, mine) & lacks_e[rank_of])
        if not candidates.size:
            # Rare (many replicas per rank): the swaps have cornered themselves. Deal the replicas
            # round-robin over the ranks, hottest first; no expert has more than ``ranks`` of them now.
            order = np.lexsort((out, -replica_load[out]))
            return out[order].reshape(spr, ranks).T.ravel()
        best = candidates[np.argmin(np.abs(replica_load[out[candidates]] - replica_load[e]))]   # the first of ties
        out[slot], out[best] = out[best], out[slot]
    return out


def deepseek(problem: PlacementProblem) -> np.ndarray:
    """DeepSeek EPLB, global policy: replicate the heaviest experts, then pack ranks by token count
    (duplicate replicas on one rank are then swapped apart, see ``separate_replicas``)."""
    return _deepseek(problem, hierarchical=False)


def deepseek_hierarchical(problem: PlacementProblem) -> np.ndarray:
    """DeepSeek EPLB, hierarchical policy: pack expert groups onto nodes, then replicate and pack within."""
    return _deepseek(problem, hierarchical=True)


def naive_spares(problem: PlacementProblem) -> np.ndarray:
    """The naive spare-slot layout: DeepSeek EPLB on the first copies' slots (``PlacementProblem.first_slots``:
    one copy of each expert, and where the experts do not split over the ranks the hottest replicated until
    they do), then one more replica of each of the hottest experts of each layer for the spare slots left
    (``hot_expert_spares``). phy2log [L, P]."""
    weight = problem.steps.expert_token_counts()
    first, R = problem.first_slots, problem.ranks
    base = first_copies(weight, first, R)
    problem.progress(problem.model.num_moe_layers)
    return np.stack([hot_expert_spares(row, w, R, problem.num_physical - first) for row, w in zip(base, weight)])


def first_copies(weight: np.ndarray, slots: int, ranks: int) -> np.ndarray:
    """phy2log [L, slots]: DeepSeek EPLB's layout of ``weight [L, E]`` tokens on ``slots`` slots (the first copies,
    ``first_copy_slots``), no rank holding an expert twice (``separate_replicas``)."""
    phy2log, _, _ = rebalance_experts(weight, slots, 1, 1, ranks, False)
    return np.stack([separate_replicas(row, ranks, w) for row, w in zip(phy2log, weight)])


def hot_expert_spares(phy2log: np.ndarray, weight: np.ndarray, ranks: int, redundant: int) -> np.ndarray:
    """phy2log [F + redundant] of one layer: ``phy2log [F]`` (every expert at least once, F / ranks a rank)
    plus one replica of each of the ``redundant`` hottest experts (``weight [E]`` tokens; ties: lower id).

    Hottest first, each extra replica goes to a rank that holds the fewest extras so far among those
    with room and without a copy, the nearest after the expert's own rank (its first slot's: r + 1, r + 2,
    ... mod ranks).
    An expert with no such rank is passed over for the next; past ``redundant = E`` the hottest take
    further replicas in the same order.
    """
    E = weight.shape[0]
    rank_of = np.arange(phy2log.size) // (phy2log.size // ranks)
    home = np.full(E, ranks)
    np.minimum.at(home, phy2log, rank_of)                           # the rank of each expert's first slot
    holds = np.zeros((E, ranks), bool)
    holds[phy2log, rank_of] = True
    extras = np.zeros(ranks, np.int64)
    room = redundant // ranks
    hot = np.lexsort((np.arange(E), -weight))
    left = redundant
    while left:
        placed = left
        for e in hot:
            after = (home[e] + 1 + np.arange(ranks)) % ranks        # nearest first after its own rank
            free = after[~holds[e, after] & (extras[after] < room)]
            if not free.size:
                continue
            r = free[np.argmin(extras[free])]                        # argmin: the nearest of the fewest
            holds[e, r] = True
            extras[r] += 1
            left -= 1
            if not left:
                break
        if left == placed:
            raise MoeplaceError(f"{redundant} spare slots do not fit on {ranks} ranks without a rank "
                                f"holding an expert twice")
    _, expert = np.nonzero(holds.T)                                 # rank-major, experts ascending
    return expert
