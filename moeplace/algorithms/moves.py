"""Moving from the map in force to a new one with as few expert weights copied as the new map allows.

Dimension letters: L MoE layers, P physical slots, R ranks, E experts.

Every placement algorithm scores a layer by which experts share a rank, never by which rank is which nor by
which slot of its rank an expert takes (under balanced dispatch and with one replica each, exactly; under
SGLang's dynamic and static rules up to which replica a token row or source rank reaches, which the decision
scores after alignment). So a new map can be relabelled for free: ``align`` gives each new rank the old rank
whose experts it shares most (an assignment problem, ``scipy.optimize.linear_sum_assignment``; over nodes,
nodes first, then ranks within each node, so the hierarchy stays), and within a rank keeps every expert it
already held in its old slot. What is left to copy is what the new map really changes.

A slot is moved when its expert changes (SGLang's ``expert_location_updater`` copies weights into it, from the
same GPU where the expert is there already, else from another rank).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment


def align(new: np.ndarray, old: np.ndarray, ranks: int, nodes: int = 1) -> np.ndarray:
    """``new [L, P]`` relabelled to copy the fewest slots from ``old [L, P]`` (module docstring); the same
    experts share a rank in both, every layer."""
    return np.stack([align_layer(n, o, ranks, nodes) for n, o in zip(new, old)])


def align_layer(new: np.ndarray, old: np.ndarray, ranks: int, nodes: int = 1) -> np.ndarray:
    """One layer of ``align``: new, old [P]."""
    P = new.shape[0]
    spr, per_node = P // ranks, ranks // nodes
    E = int(max(new.max(), old.max())) + 1
    held_new, held_old = _holdings(new, ranks, E), _holdings(old, ranks, E)   # [R, E] replicas on each rank
    overlap = np.minimum(held_new[:, None, :], held_old[None, :, :]).sum(axis=2)   # [R new, R old]
    node_overlap = overlap.reshape(nodes, per_node, nodes, per_node).sum(axis=(1, 3))
    node_rows, node_cols = linear_sum_assignment(-node_overlap)
    to_old = np.empty(ranks, np.int64)                     # new rank -> the old rank whose place it takes
    for a, b in zip(node_rows, node_cols):
        block = overlap[a * per_node:(a + 1) * per_node, b * per_node:(b + 1) * per_node]
        rows, cols = linear_sum_assignment(-block)
        to_old[a * per_node + rows] = b * per_node + cols
    out = np.empty_like(new)
    for r in range(ranks):
        out[to_old[r] * spr:(to_old[r] + 1) * spr] = _keep_slots(new[r * spr:(r + 1) * spr],
                                                                old[to_old[r] * spr:(to_old[r] + 1) * spr])
    return out


def _holdings(phy2log: np.ndarray, ranks: int, num_experts: int) -> np.ndarray:
    """[R, E] replicas of each expert on each rank of one layer."""
    rank = np.arange(phy2log.shape[0]) // (phy2log.shape[0] // ranks)
    held = np.zeros((ranks, num_experts), np.int64)
    np.add.at(held, (rank, phy2log), 1)
    return held


def _keep_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """One rank's slots: ``new``'s experts, each one ``old`` held kept in its old slot, the rest in the slots left
    (in ``new``'s order)."""
    out = np.full_like(new, -1)
    left = list(new)
    for slot, expert in enumerate(old):
        if expert in left:
            left.remove(expert)
            out[slot] = expert
    out[out < 0] = left
    return out


def moved_slots(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """[L] slots whose expert changes from ``old [L, P]`` to ``new [L, P]`` (replicas copied)."""
    return (old != new).sum(axis=1)


def received_per_rank(old: np.ndarray, new: np.ndarray, ranks: int) -> np.ndarray:
    """[L, R] moved slots on each rank: the replicas it receives (the copies run on the ranks in parallel, so the
    busiest rank's share sets how long a layer's move takes)."""
    L, P = old.shape
    return (old != new).reshape(L, ranks, P // ranks).sum(axis=2)
