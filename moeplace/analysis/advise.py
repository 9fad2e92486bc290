"""EP with a placement or TP-MoE? Per-rank work lists, TP-MoE cost, and the batch size where the answer flips.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E logical experts, P physical slots,
R ranks, B tokens per step.

EP: rank r runs the distinct experts of its slots that the step activates; the step waits for the
slowest rank, so a layer costs ``max_r cost(distinct[r], tokens[r])`` (``moeplace.cost.model``).
TP-MoE: every rank holds 1/R of every expert, so every rank runs every expert the step activates, on
all of the step's (token, expert) pairs: perfectly balanced, but each activated expert is read by
every rank. A layer costs ``tp.cost(distinct_total, pairs_total)`` with a cost model for experts of
intermediate size / R (``moeplace.cost.derive``). Communication (EP dispatch and combine, TP
all-reduce) is not in either cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import step_expert_counts
from moeplace.dispatch.by_cost import counts_dispatch
from moeplace.dispatch.loads import (layer_distinct_total, layer_rank_loads, max_step_tokens, needs_cost,
                                     token_slot_pairs)
from moeplace.errors import MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace.steps import RoutingSteps

BATCH_GRID = (1, 2, 4, 8, 9, 16, 32, 64, 128, 256, 512, 1024)


def slot_token_counts(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int,
                      dispatch: str = "dynamic", cost: CostModel | None = None) -> np.ndarray:
    """[S, P] tokens each physical slot runs in each step at one layer, as SGLang dispatches them.

    phy2log: [P] this layer's map. Same rules as ``dispatch.loads.layer_rank_loads`` (dynamic: token row
    ``row % replicas``; static: a fixed replica per source rank; balanced and cost: moeplace's per-step
    rules, the latter by ``cost``); token-row steps only.
    """
    if steps.count_steps.size:
        raise MoeplaceError("per-slot work needs token rows; this trace has count-only steps")
    return token_slot_pairs(steps, layer, phy2log, ranks, dispatch, cost_model=cost)


def rank_work(slot_counts: np.ndarray, ranks: int) -> np.ndarray:
    """[S, R, P/R] tokens per local slot of each rank (rank r owns slots r*P/R ... (r+1)*P/R - 1)."""
    S, P = slot_counts.shape
    return slot_counts.reshape(S, ranks, P // ranks)


def work_key(counts: np.ndarray) -> tuple[int, ...]:
    """A rank's work as the multiset of its nonzero per-slot token counts (which slots does not matter)."""
    c = np.asarray(counts)
    return tuple(sorted((int(x) for x in c[c > 0]), reverse=True))


def ep_layer_cost(steps: RoutingSteps, layer: int, phy2log: np.ndarray, ranks: int, cost: CostModel,
                  dispatch: str = "dynamic") -> np.ndarray:
    """[S] µs of one layer under EP: the slowest rank's predicted cost (with the row blocks of experts
    that get more pairs than a block holds, where the model has that term and the steps are that large)."""
    if cost.needs_blocks(max_step_tokens(steps)):
        work = rank_work(slot_token_counts(steps, layer, phy2log, ranks, dispatch, cost), ranks)
        return cost.cost((work > 0).sum(axis=2), work.sum(axis=2), cost.extra_blocks(work)).max(axis=1)
    distinct, tokens = layer_rank_loads(steps, layer, phy2log, ranks, dispatch, cost_model=cost)
    return cost.cost(distinct, tokens).max(axis=1)


def counts_work(counts: np.ndarray, phy2log: np.ndarray, ranks: int, dispatch: str = "dynamic",
                cost: CostModel | None = None) -> np.ndarray:
    """[S, R, X] tokens each rank runs of each expert it runs at one layer, from that layer's ``counts [S, E]``
    (``step_expert_counts``): ``rank_work(slot_token_counts(...))`` up to the order and the zeros of the last
    axis (X: the rank's slots, or every expert), so ``work_cost`` reads the same from it, without token rows.

    phy2log: [P]. Exact where every expert has one slot (every rule sends all its tokens there) and under
    the ``cost`` rule, which reads the counts only; the other rules split a replicated expert's tokens by
    token row, which the counts do not hold.
    """
    S, E = counts.shape
    if dispatch == "cost":
        return counts_dispatch(counts, phy2log, ranks, needs_cost(cost)).full_alloc(counts).transpose(0, 2, 1)
    if phy2log.shape[0] != E or np.bincount(phy2log, minlength=E).max() != 1:
        raise MoeplaceError(f"the {dispatch} rule splits a replicated expert's tokens by token row: its work "
                            "needs the rows (slot_token_counts)")
    return counts[:, phy2log].reshape(S, ranks, E // ranks)


def work_cost(work: np.ndarray, cost: CostModel) -> np.ndarray:
    """[S] µs of one layer: the slowest rank's predicted cost of ``work [S, R, X]`` (``counts_work``), row blocks
    included (none where a step's tokens fit one block, so this is ``ep_layer_cost`` exactly)."""
    return cost.cost((work > 0).sum(axis=2), work.sum(axis=2), cost.extra_blocks(work)).max(axis=1)


def tp_layer_cost(steps: RoutingSteps, layer: int, tp_cost: CostModel) -> np.ndarray:
    """[S] µs of one layer under TP-MoE: every rank runs all activated experts on all pairs."""
    distinct = layer_distinct_total(steps, layer)
    step_of_row, _, ids = steps.layer(layer)
    pairs = np.bincount(step_of_row, weights=(ids >= 0).sum(axis=1), minlength=steps.num_steps)
    extra = tp_cost.extra_blocks(step_expert_counts(steps, layer)) if tp_cost.needs_blocks(max_step_tokens(steps)) else 0
    return tp_cost.cost(distinct, pairs, extra)


def step_costs(steps: RoutingSteps, placements: dict[str, np.ndarray], ranks: int, ep_cost: CostModel,
               tp_cost: CostModel, dispatch: str = "dynamic") -> dict[str, np.ndarray]:
    """[S] µs per step (all layers) for each EP placement (phy2log [L, P]) and for ``"tp"``."""
    out = {name: np.zeros(steps.num_steps) for name in [*placements, "tp"]}
    for layer in range(steps.model.num_moe_layers):
        for name, phy2log in placements.items():
            out[name] += ep_layer_cost(steps, layer, phy2log[layer], ranks, ep_cost, dispatch)
        out["tp"] += tp_layer_cost(steps, layer, tp_cost)
    return out


@dataclass(frozen=True)
class BatchVerdict:
    """EP vs TP-MoE at one batch size. Costs are µs per step (all MoE layers), means over steps."""

    batch: int
    ep_us: float
    tp_us: float
    ep_placement: str

    @property
    def winner(self) -> str:
        return "ep" if self.ep_us <= self.tp_us else "tp"

    @property
    def speedup(self) -> float:
        """How many times faster the winner is than the loser."""
        return max(self.ep_us, self.tp_us) / min(self.ep_us, self.tp_us)


def verdict(costs: dict[str, np.ndarray], batch: int) -> BatchVerdict:
    """The best EP placement against TP-MoE, from ``step_costs`` output."""
    ep = {k: float(v.mean()) for k, v in costs.items() if k != "tp"}
    best = min(ep, key=ep.get)
    return BatchVerdict(batch, ep[best], float(costs["tp"].mean()), best)


def flip_batch(verdicts: list[BatchVerdict]) -> float | None:
    """Batch size where the winner changes (log-linear interpolation of the cost ratio), or None.

    verdicts: sorted by batch. The first change is reported.
    """
    for lo, hi in zip(verdicts, verdicts[1:]):
        if lo.winner != hi.winner:
            return crossing(lo.batch, hi.batch, lo.ep_us / lo.tp_us, hi.ep_us / hi.tp_us)
    return None


def flip_batches(verdicts: list[BatchVerdict]) -> list[tuple[float, str, str]]:
    """Every change of winner over ``verdicts`` (sorted by batch): (batch where it flips, interpolated as in
    ``flip_batch``; the winner below; the winner above)."""
    return [(crossing(lo.batch, hi.batch, lo.ep_us / lo.tp_us, hi.ep_us / hi.tp_us), lo.winner, hi.winner)
            for lo, hi in zip(verdicts, verdicts[1:]) if lo.winner != hi.winner]


def crossing(lo_batch: int, hi_batch: int, lo_ratio: float, hi_ratio: float) -> float:
    """Batch size where a cost ratio that is ``lo_ratio`` at ``lo_batch`` and ``hi_ratio`` at ``hi_batch``
    (on opposite sides of 1) reaches 1, interpolating its log linearly in log batch."""
    r0, r1 = np.log(lo_ratio), np.log(hi_ratio)
    t = r0 / (r0 - r1)
    return float(np.exp(np.log(lo_batch) + t * (np.log(hi_batch) - np.log(lo_batch))))


def model_check(model: ModelSpec, ranks: int, redundant: int) -> None:
    if (model.num_experts + redundant) % ranks:
        raise MoeplaceError(f"{model.num_experts} experts + {redundant} redundant slots do not split evenly "
                            f"over {ranks} ranks")
