"""Cross-node token traffic of a placement: the (token, expert) sends whose receiving replica is on
another node than the rank the token comes from.

Dimension letters: S steps, E logical experts, P physical slots, R ranks, N nodes.

A step's tokens come from one source rank: the rank that ran its requests' attention (with DP attention,
the step's rank, ``RoutingSteps.ranks``). Every (token, top-k expert) pair of a MoE layer is one send, to
the replica the dispatch rule picks; DeepEP's low-latency dispatch (decode) carries each as one message.
The R ranks are split evenly over the N nodes, contiguously (rank r on node ``r // (R / N)``), as SGLang
lays out its ranks and ``deepseek_hierarchical`` its nodes. Where the steps name fewer distinct source
ranks than R (a SYNTHETIC trace, a capture on one GPU), step i is taken to come from rank ``i % R``: DP
attention spreads requests over the ranks (``source_ranks``).

Under ``dynamic``, ``balanced`` and ``cost`` the receiving rank does not depend on the source, so a step's
cross-node sends follow from the sends each rank receives (``rank_cross_sends``); under SGLang's
``static`` rule a source rank keeps a fixed replica, its own node's where it has one
(``static_cross_sends``). With requests spread evenly over the ranks, rules of the first kind send about
1 - 1/N of the sends across nodes whatever the placement; under ``static`` a replica on more nodes keeps
more of them inside the node.
"""

from __future__ import annotations

import numpy as np

from moeplace.errors import MoeplaceError


def node_of_rank(ranks: int, nodes: int) -> np.ndarray:
    """[R] the node of each rank: ranks split evenly over ``nodes``, contiguously."""
    if nodes < 1 or ranks % nodes:
        raise MoeplaceError(f"{nodes} nodes do not split {ranks} ranks evenly")
    return np.arange(ranks) // (ranks // nodes)


def source_ranks(step_ranks: np.ndarray, ranks: int, first: int = 0) -> tuple[np.ndarray, bool]:
    """(source rank of each step [S], whether the steps were spread round robin).

    step_ranks: [S] the rank that recorded each step. With at least ``ranks`` distinct ranks among them,
    each step's own rank (mod ``ranks``); with fewer, step i comes from rank ``(first + i) % ranks``
    (``first``: steps before these ones in the same stream)."""
    step_ranks = np.asarray(step_ranks, np.int64)
    if np.unique(step_ranks).size >= ranks:
        return step_ranks % ranks, False
    return (first + np.arange(step_ranks.shape[0], dtype=np.int64)) % ranks, True


def rank_cross_sends(rank_sends: np.ndarray, source: np.ndarray, nodes: int) -> tuple[int, int]:
    """(cross-node sends, all sends) of one layer's steps where the receiving rank does not depend on the
    source: rank_sends [S, R] the (token, expert) sends each rank receives in each step; source [S] the
    step's source rank."""
    S, R = rank_sends.shape
    total = int(rank_sends.sum())
    if nodes == 1 or S == 0:
        return 0, total
    per_node = R // nodes
    first = np.arange(S) * R + node_of_rank(R, nodes)[np.asarray(source, np.int64)] * per_node   # [S] flat
    same = rank_sends.ravel()[(first[:, None] + np.arange(per_node)).ravel()].sum()        # on the source's node
    return total - int(same), total


def static_cross_sends(expert_sends: np.ndarray, phy2log: np.ndarray, ranks: int, nodes: int,
                       source: np.ndarray) -> tuple[int, int]:
    """(cross-node sends, all sends) of one layer's steps under SGLang's ``static`` rule, its table made
    with these nodes (``dispatch.loads.static_dispatch_table``).

    expert_sends: [S, E] sends to each logical expert in each step; phy2log: [P] the layer's map; source:
    [S] the step's source rank. The table sends a source rank to its own replica, else to one on its node
    where the expert has one there (where every replica is on its node the fair choice stays there too),
    else to any replica: a send crosses nodes exactly when its expert has no replica on the source's node,
    whatever the seed of the fair choice."""
    S, E = expert_sends.shape
    total = int(expert_sends.sum())
    if nodes == 1 or S == 0:
        return 0, total
    rank_of_slot = np.arange(phy2log.shape[0]) // (phy2log.shape[0] // ranks)
    held = np.zeros((nodes, E), bool)                                          # [N, E] a replica on node n
    held[node_of_rank(ranks, nodes)[rank_of_slot], phy2log] = True
    near = held[node_of_rank(ranks, nodes)[np.asarray(source, np.int64)]]     # [S, E] a replica on the source's node
    return int(np.where(near, 0, expert_sends).sum()), total
