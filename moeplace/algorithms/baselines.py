"""Baselines: SGLang's trivial layout and DeepSeek EPLB (token-count balancing)."""

from __future__ import annotations

import numpy as np

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms.deepseek import rebalance_experts


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
    for slot in range(out.shape[0]):
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
    for slot in range(out.shape[0]):
        r, e = slot // spr, out[slot]
        mine = out[r * spr:(r + 1) * spr]
        if np.count_nonzero(mine == e) < 2 or np.flatnonzero(mine == e)[0] == slot - r * spr:
            continue
        candidates = [s for s in range(out.shape[0]) if s // spr != r
                      and out[s] not in mine and e not in out[(s // spr) * spr:(s // spr + 1) * spr]]
        if not candidates:
            # Rare (many replicas per rank): the swaps have cornered themselves. Deal the replicas
            # round-robin over the ranks, hottest first; no expert has more than ``ranks`` of them now.
            order = np.lexsort((out, -replica_load[out]))
            return out[order].reshape(spr, ranks).T.ravel()
        best = min(candidates, key=lambda s: abs(replica_load[out[s]] - replica_load[e]))
        out[slot], out[best] = out[best], out[slot]
    return out


def deepseek(problem: PlacementProblem) -> np.ndarray:
    """DeepSeek EPLB, global policy: replicate the heaviest experts, then pack ranks by token count
    (duplicate replicas on one rank are then swapped apart, see ``separate_replicas``)."""
    return _deepseek(problem, hierarchical=False)


def deepseek_hierarchical(problem: PlacementProblem) -> np.ndarray:
    """DeepSeek EPLB, hierarchical policy: pack expert groups onto nodes, then replicate and pack within."""
    return _deepseek(problem, hierarchical=True)
