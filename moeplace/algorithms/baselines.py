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
    return phy2log


def deepseek(problem: PlacementProblem) -> np.ndarray:
    """DeepSeek EPLB, global policy: replicate the heaviest experts, then pack ranks by token count."""
    return _deepseek(problem, hierarchical=False)


def deepseek_hierarchical(problem: PlacementProblem) -> np.ndarray:
    """DeepSeek EPLB, hierarchical policy: pack expert groups onto nodes, then replicate and pack within."""
    return _deepseek(problem, hierarchical=True)
