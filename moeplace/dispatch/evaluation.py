"""Predicted MoE time of each replica-dispatch rule at every batch size, on batches built from a trace.

Dimension letters: S batches (steps), L MoE layers, E logical experts, P physical slots, R ranks.

A batch of B tokens is the verify windows of several requests, drawn from the trace's own steps
(``trace.resample.resample_requests``). Each rule gives every rank its distinct experts and (token, expert)
pairs per layer, and the row blocks beyond an expert's first where a batch has more tokens than a block
holds; a layer costs its slowest rank (``moeplace.cost.model``, derived for the rank's slots and the batch:
SGLang's kernel config and launch grid follow B), a batch the sum over layers.

Rules (``RULES``):

* ``dynamic``: SGLang with ``--moe-a2a-backend none``: token row % replicas (``dispatch.loads.layer_rank_loads``);
* ``static``: SGLang with DeepEP: a fixed replica per source rank; request j of a batch is served by
  rank j % R (DP attention spreads requests over the ranks);
* ``lplb``: SGLang's ``--ep-dispatch-algorithm lp`` on the batch's token counts, scored on its expected
  loads (``moeplace.dispatch.lplb``; SGLang runs it only for DeepSeek-family models);
* ``balanced``: moeplace's balanced rule as the GPU runs it (``moeplace.dispatch.balanced``);
* ``cost``: the rule by cost (``moeplace.dispatch.by_cost``), with the cost model of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import fast_rule, replica_layout, step_expert_counts
from moeplace.dispatch.by_cost import cost_rule, rule_weights
from moeplace.dispatch.loads import layer_rank_loads, static_dispatch_table, token_slot_pairs
from moeplace.dispatch.lplb import expected_loads, lp_problem, slot_probabilities
from moeplace.trace.resample import resample_requests
from moeplace.trace.steps import RoutingSteps

RULES = ("dynamic", "static", "lplb", "balanced", "cost")
SGLANG_RULES = ("dynamic", "static", "lplb")
VERIFY_TOKENS = 9                               # a request verifying 8 drafts
BATCH_REQUESTS = (1, 4, 8, 16, 32, 64)          # 9 to 576 tokens per step


@dataclass(frozen=True)
class Batches:
    """Batches of verify windows: steps [S batches], and request [T] the request of each token row
    within its batch (0, 1, ...)."""

    steps: RoutingSteps
    request: np.ndarray


def verify_batches(steps: RoutingSteps, tokens: int, num: int, seed: int = 0) -> Batches:
    """``num`` batches of ``tokens`` token rows each, whole steps of ``steps`` (requests) concatenated."""
    return Batches(*resample_requests(steps, tokens, num, seed))


def rule_loads(batches: Batches, layer: int, phy2log: np.ndarray, ranks: int, rule: str,
               cost: CostModel | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(distinct [S, R], pairs [S, R]) per rank at one layer under ``rule`` (expected values for lplb).

    phy2log: [P] this layer's map; cost: the cost model the ``cost`` rule balances.
    """
    steps = batches.steps
    E = steps.model.num_experts
    if rule == "dynamic":
        return layer_rank_loads(steps, layer, phy2log, ranks, "dynamic")
    if rule == "static":
        return _static_loads(batches, layer, phy2log, ranks)
    counts = step_expert_counts(steps, layer)
    if rule == "lplb":
        return expected_loads(lp_problem(phy2log, E, ranks), counts)
    masks = replica_layout(phy2log, E, ranks).masks
    if rule == "balanced":
        chosen = fast_rule(counts, masks, ranks)
    elif rule == "cost":
        if cost is None:
            raise ValueError("the cost rule needs a cost model")
        chosen = cost_rule(counts, masks, ranks, rule_weights(cost))
    else:
        raise ValueError(f"unknown rule {rule!r}; one of {', '.join(RULES)}")
    return chosen.distinct, chosen.tokens


def rule_extra_blocks(batches: Batches, layer: int, phy2log: np.ndarray, ranks: int, rule: str,
                      cost: CostModel) -> np.ndarray:
    """[S, R] row blocks beyond each expert's first on each rank under ``rule`` (``CostModel.extra_blocks``;
    lplb: of its expected pairs per slot), for the row-block term of ``cost``."""
    steps = batches.steps
    S, P = steps.num_steps, phy2log.shape[0]
    if rule == "lplb":
        counts = step_expert_counts(steps, layer)
        slot = slot_probabilities(lp_problem(phy2log, steps.model.num_experts, ranks), counts) * counts[:, phy2log]
    elif rule == "static":
        slot = _static_slot_pairs(batches, layer, phy2log, ranks)
    else:
        slot = token_slot_pairs(steps, layer, phy2log, ranks, rule, cost_model=cost)
    return cost.extra_blocks(slot.reshape(S, ranks, P // ranks))


def _static_slot_pairs(batches: Batches, layer: int, phy2log: np.ndarray, ranks: int) -> np.ndarray:
    """[S, P] pairs per slot under SGLang's static rule with request j of each batch on source rank j % R."""
    steps = batches.steps
    S, P = steps.num_steps, phy2log.shape[0]
    table = static_dispatch_table(phy2log, steps.model.num_experts, ranks, 1)       # [R, E]
    step_of_row, _, ids = steps.layer(layer)
    valid = ids >= 0
    source = (batches.request % ranks)[:, None]
    phys = table[np.broadcast_to(source, ids.shape)[valid], ids[valid]]
    step = np.broadcast_to(step_of_row[:, None], ids.shape)[valid]
    return np.bincount(step * P + phys, minlength=S * P).reshape(S, P)


def _static_loads(batches: Batches, layer: int, phy2log: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's static rule with request j of each batch on source rank j % R."""
    slot_tokens = _static_slot_pairs(batches, layer, phy2log, ranks).reshape(batches.steps.num_steps, ranks, -1)
    return (slot_tokens > 0).sum(axis=2), slot_tokens.sum(axis=2)


@dataclass(frozen=True)
class Row:
    """One (placement, rule) of the comparison: phy2log [L, P]; cost(batch tokens) the rank's cost model."""

    name: str
    phy2log: np.ndarray
    rule: str
    cost: Callable[[int], CostModel]


def batch_costs(batches: Batches, rows: list[Row], ranks: int, tokens: int,
                layers: range | None = None) -> dict[str, np.ndarray]:
    """[S] predicted MoE µs per batch (summed over ``layers``, default all) for every row."""
    steps = batches.steps
    layers = layers if layers is not None else range(steps.model.num_moe_layers)
    out = {row.name: np.zeros(steps.num_steps) for row in rows}
    for row in rows:
        model = row.cost(tokens)
        for layer in layers:
            distinct, pairs = rule_loads(batches, layer, row.phy2log[layer], ranks, row.rule, model)
            extra = (rule_extra_blocks(batches, layer, row.phy2log[layer], ranks, row.rule, model)
                     if model.needs_blocks(tokens) else 0)
            out[row.name] += model.cost(distinct, pairs, extra).max(axis=1)
    return out
