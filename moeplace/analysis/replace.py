"""Should a server re-place its experts now, and where to? The decision online re-placement makes every period
on the server's window of recent routing, and ``moeplace online decide`` makes on a capture: the same code.

Dimension letters: L MoE layers, P physical slots, R ranks, S steps.

1. Candidates, out of fold. The window's steps in ``folds`` contiguous blocks (a request's steps are close in
   time, so a block holds mostly other requests than the rest: ``robust.fold_blocks``). For each block, three
   candidates made on the other blocks: ``refined``, the map in force after the local moves that pay
   (``refine``: few copies); ``fitted``, what ``fit`` makes from scratch; ``naive``, the naive layout
   (``fit.naive``); the last two aligned to the map in force (``moves.align``). They and the map in force are
   scored step by step on the block under the dispatch rule the server runs: every step of the window is scored
   by placements that did not see it.
2. Per layer, what pays. Each candidate's layer gains its out-of-fold figure's drop from the map in force, over
   ``horizon`` passes (E[max distinct] x the cost model's µs per expert read), and costs the stall of copying
   its moved replicas (made on the whole window, aligned), set by the rank that receives the most of them (the
   ranks copy in parallel) at ``move_gbps``. A layer moves to the candidate whose gain beats its stall by the
   most, among those not worse than the naive layout out of fold (so no layer moves to what the out-of-fold
   figures say is worse than the naive layout) whose gain stands ``z`` standard errors above that layer's noise
   (the best of three per layer would otherwise often be luck), or stays; where another candidate that pays copies
   fewer replicas and its gain is within the noise of that one's, it takes that candidate (``fewest_copies``: a
   larger gain the window cannot tell from a smaller one is not worth more copies).
3. Go or keep. Re-place when the moved layers gain at least ``min_gain`` of the map's out-of-fold figure and the
   gain stands out of the noise: its mean over the window's steps more than ``z`` standard errors above zero,
   the error taken over batches of consecutive steps (a request's steps are alike, so single steps would
   understate it). A short window (a few requests) thus keeps a map that is as good as the naive layout unless a
   candidate is clearly better; but a map that does worse than the naive layout out of fold (by ``min_gain``)
   is always left: every layer moves to its best candidate that gains, whatever it copies, since none of them is
   worse than the naive layout out of fold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms.fit import fit, naive
from moeplace.algorithms.moves import align, moved_slots, received_per_rank
from moeplace.algorithms.refine import refine
from moeplace.algorithms.robust import fold_blocks
from moeplace.analysis.metrics import step_max_distinct
from moeplace.cost.model import CostModel
from moeplace.errors import MoeplaceError
from moeplace.files.placement import Placement
from moeplace.trace.steps import RoutingSteps

MIN_GAIN = 0.005   # re-placing must gain at least this share of E[max distinct] (report's staleness line too)
MIN_STEPS = 20     # a window of fewer steps is too short to fit and score: the map is kept
NOISE_BATCHES = 30  # the standard error of the gain is over this many batches of consecutive steps at most


@dataclass(frozen=True)
class ReplaceConfig:
    """How the decision weighs a re-placement (module docstring).

    min_gain: share of the map's E[max distinct] the re-placed layers must gain out of fold.
    horizon: passes a new map is expected to serve (its gain per pass counts this many times against its stall).
    move_gbps: GB/s one rank copies expert weights at while moving (the slowest link a move may take).
    replica_bytes: bytes of one expert's weights in one layer (0: moves cost nothing, only ``min_gain`` holds).
    z: standard errors the gain must stand above zero.
    balance_floor: the fit's floor on token balancedness, as a share of DeepSeek EPLB's (``PlacementProblem``);
        lower than ``optimize``'s default because the window holds the decode and verify passes, where the
        busiest rank's reads set the time (``optimize --balance-floor``'s advice for such traffic).
    pair_weight: the fits' weight of sum_r D^2 (the pairs of co-active experts that share a rank) beside the step
        maxima (``PlacementProblem.pair_weight``), more than ``optimize``'s tie-break: the map chosen serves traffic
        that goes on drifting, and the pairs, an average over every step, hold better on steps a window did not
        see than the maxima's few busiest steps (docs/online.md, "What was tried and dropped"; 1/8 and 1/32 within
        0.3% of 1/16, 1 worse). A power of two keeps the search's float32 sums exact.
    """

    min_gain: float = MIN_GAIN
    folds: int = 3
    horizon: int = 10_000
    move_gbps: float = 50.0
    replica_bytes: float = 0.0
    z: float = 2.0
    balance_floor: float = 0.9
    pair_weight: float = 2**-4
    seed: int = 0

    def swap_gain(self, ranks: int, cost_model: CostModel) -> float:
        """E[max distinct] per step a swap of two slots must gain to pay for its copies over the horizon: two
        replicas copied, on two of the ``ranks`` ranks (the busiest rank's copies set the stall, so a swap adds
        about 2 / ranks of a copy to it)."""
        stall_us = 2 / ranks * self.replica_bytes / (self.move_gbps * 1e3)
        return stall_us / (cost_model.a_us_per_expert * self.horizon)

    def check(self) -> None:
        """MoeplaceError naming the first value out of range."""
        for name, value, ok in (("min_gain", self.min_gain, 0 <= self.min_gain < 1),
                                ("folds", self.folds, self.folds >= 2),
                                ("horizon", self.horizon, self.horizon >= 1),
                                ("move_gbps", self.move_gbps, 0 < self.move_gbps < float("inf")),
                                ("replica_bytes", self.replica_bytes, 0 <= self.replica_bytes < float("inf")),
                                ("z", self.z, 0 <= self.z < float("inf")),
                                ("balance_floor", self.balance_floor, 0 <= self.balance_floor <= 1),
                                ("pair_weight", self.pair_weight, 0 <= self.pair_weight < float("inf"))):
            if not ok:
                raise MoeplaceError(f"re-placement setting {name} = {value!r} is out of range")


@dataclass
class Decision:
    """What the decision found. E[max distinct] out of fold (every step scored by placements fitted without it):
    ``current`` the map in force, ``fitted`` the fit on every layer, ``naive`` the naive layout, ``chosen`` the
    map to move to (the re-placed layers' targets, the other layers as they are). target: phy2log [L, P] to move
    to, None to keep; layers: the MoE layers (indices into the model's MoE layers) it re-places."""

    current: float
    fitted: float
    naive: float
    chosen: float
    target: np.ndarray | None = None
    layers: list[int] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)   # re-placed layers by candidate (``CANDIDATES``)
    moved_replicas: int = 0
    moved_bytes: float = 0.0
    stall_ms: float = 0.0      # estimated: the busiest rank's copies at ``move_gbps``, summed over the layers
    steps: int = 0
    reason: str = ""
    seconds: float = 0.0

    @property
    def gain(self) -> float:
        """Share of the map's E[max distinct] the move removes out of fold (0 when kept)."""
        return 1 - self.chosen / self.current if self.current and self.target is not None else 0.0

    @property
    def line(self) -> str:
        how = ", ".join(f"{n} {kind}" for kind, n in self.kinds.items())
        head = (f"re-place {len(self.layers)} layers ({how}): {100 * self.gain:.1f}% to gain"
                if self.target is not None else f"keep: {self.reason}")
        moved = (f"; moves {self.moved_replicas:,} expert replicas ({self.moved_bytes / 1e9:.2f} GB, about "
                 f"{self.stall_ms:.1f} ms of copies)" if self.target is not None else "")
        return (f"{head} (E[max distinct] out of fold on {self.steps:,} steps: in force {self.current:.3f}, "
                f"fitted {self.fitted:.3f}, naive layout {self.naive:.3f}, after the move {self.chosen:.3f})"
                f"{moved}; decided in {self.seconds:.1f} s")

    def to_json(self) -> dict:
        return {"replace": self.target is not None, "gain": self.gain, "current": self.current,
                "fitted": self.fitted, "naive": self.naive, "chosen": self.chosen, "layers": self.layers,
                "kinds": self.kinds,
                "moved_replicas": self.moved_replicas, "moved_bytes": self.moved_bytes, "stall_ms": self.stall_ms,
                "steps": self.steps, "reason": self.reason, "seconds": self.seconds, "line": self.line}


CANDIDATES = ("refined", "fitted", "naive")   # the per-layer targets, in the order ties go


def decide(steps: RoutingSteps, current: Placement, dispatch: str, cost_model: CostModel,
           config: ReplaceConfig = ReplaceConfig(), progress: Callable[[int], None] = lambda n: None) -> Decision:
    """Whether to move ``current`` (the map in force) and where to, from ``steps`` (the window, in time order)
    under ``dispatch`` (the rule the server runs); ``progress`` is called with each fit finished (folds + 1)."""
    config.check()
    start = time.perf_counter()
    S = steps.num_steps
    if S < MIN_STEPS:
        return Decision(0.0, 0.0, 0.0, 0.0, steps=S, reason=f"{S} steps are too few to fit and score (at least "
                                                            f"{MIN_STEPS})", seconds=time.perf_counter() - start)
    model, R, nodes = current.model, current.ranks, current.nodes

    def candidates(part: RoutingSteps) -> list[np.ndarray]:
        """[refined, fitted, naive] fitted on ``part``, each aligned to the map in force."""
        problem = PlacementProblem(model, part, R, nodes=nodes, redundant=current.num_redundant, dispatch=dispatch,
                                   cost_model=cost_model, seed=config.seed, balance_floor=config.balance_floor,
                                   pair_weight=config.pair_weight)
        refined = refine(problem, current.phy2log, config.swap_gain(R, cost_model))
        return [refined] + [align(phy2log, current.phy2log, R, nodes) for phy2log in (fit(problem).phy2log,
                                                                                       naive(problem))]

    scores = np.zeros((1 + len(CANDIDATES), model.num_moe_layers, S))   # [in force, *CANDIDATES], out of fold
    for block in fold_blocks(S, config.folds):
        maps = [current] + [Placement(model, R, phy2log, nodes=nodes)
                            for phy2log in candidates(steps.take(np.setdiff1d(np.arange(S), block)))]
        scores[:, :, block] = step_max_distinct(steps.take(block), maps, [dispatch] * len(maps),
                                                [cost_model] * len(maps))
        progress(1)
    finals = candidates(steps)
    progress(1)
    decision = choose(scores, current.phy2log, finals, R, cost_model, config)
    decision.seconds = time.perf_counter() - start
    return decision


def choose(scores: np.ndarray, current: np.ndarray, finals: list[np.ndarray], ranks: int, cost_model: CostModel,
           config: ReplaceConfig) -> Decision:
    """Phases 2 and 3 of the module docstring. scores: [1 + C, L, S] out-of-fold maxima of the map in force and of
    each of the C ``CANDIDATES``; current: [L, P]; finals: the C candidates on the whole window, aligned."""
    means = scores.mean(axis=2)                                      # [1 + C, L]
    now, oof = means[0], means[1:]
    naive_at = CANDIDATES.index("naive")
    gain = now[None] - oof                                           # [C, L] distinct per step, out of fold
    # a layer's candidate must be no worse than the naive layout, and its gain stand out of that layer's noise:
    # picked per layer among three, a gain within the noise would often be luck
    error = np.array([[standard_error(scores[0, l] - scores[1 + c, l]) for l in range(now.shape[0])]
                      for c in range(len(CANDIDATES))])
    allowed = oof <= oof[naive_at][None] + 1e-12
    significant = gain > config.z * error
    stall_us = np.stack([received_per_rank(current, final, ranks).max(axis=1) for final in finals]) \
        * config.replica_bytes / (config.move_gbps * 1e3)            # [C, L]
    net = np.where(allowed & significant, gain * cost_model.a_us_per_expert * config.horizon - stall_us, -np.inf)
    pick = fewest_copies(np.argmax(net, axis=0), net, gain, scores, current, finals, config.z)
    layers = np.take_along_axis(net, pick[None], 0)[0] > 0
    L = now.shape[0]
    behind = now.sum() > oof[naive_at].sum() * (1 + config.min_gain)   # the map in force lost to the naive layout
    if behind:   # every layer that gains moves to its best candidate, whatever it copies
        pick = np.argmax(np.where(allowed, gain, -np.inf), axis=0)
        layers = np.take_along_axis(gain, pick[None], 0)[0] > 0
    chosen_gain = np.take_along_axis(gain, pick[None], 0)[0]
    chosen = (now.sum() - chosen_gain[layers].sum()) / L
    decision = Decision(float(now.mean()), float(oof[CANDIDATES.index("fitted")].mean()),
                        float(oof[naive_at].mean()), float(chosen), steps=scores.shape[2])
    if not layers.any():
        decision.reason = ("no layer gains enough to pay for the weights it would move" if significant.any()
                           else "no layer's gain stands out of its noise")
        return decision
    share = 1 - chosen / decision.current
    if share < config.min_gain:
        decision.reason = f"re-placing gains {100 * share:.2f}%, under {100 * config.min_gain:.1f}%"
        return decision
    target_scores = np.take_along_axis(scores[1:], pick[None, :, None], 0)[0]     # [L, S]
    per_step = (scores[0, layers] - target_scores[layers]).sum(axis=0) / L       # [S] the gain, step by step
    error = standard_error(per_step)
    if per_step.mean() <= config.z * error and not behind:
        decision.reason = (f"the {100 * share:.1f}% to gain is within the noise of {per_step.size:,} steps "
                           f"({per_step.mean():.4f} against {config.z:g} x {error:.4f})")
        return decision
    target = np.stack(finals)[pick, np.arange(L)]                    # [L, P] each layer's pick
    moved = np.where(layers[:, None], target, current)
    count = int(moved_slots(current, moved).sum())
    decision.target = moved
    decision.layers = np.flatnonzero(layers).tolist()
    decision.kinds = {name: int((layers & (pick == i)).sum()) for i, name in enumerate(CANDIDATES)
                      if (layers & (pick == i)).any()}
    decision.moved_replicas = count
    decision.moved_bytes = count * config.replica_bytes
    decision.stall_ms = float(np.take_along_axis(stall_us, pick[None], 0)[0][layers].sum() / 1e3)
    return decision


def fewest_copies(pick: np.ndarray, net: np.ndarray, gain: np.ndarray, scores: np.ndarray, current: np.ndarray,
                  finals: list[np.ndarray], z: float) -> np.ndarray:
    """[L] each layer's pick, moved to the candidate that copies fewest replicas among those that pay (``net``
    [C, L] above zero) and whose gain is within ``z`` standard errors of the pick's (their per-step difference):
    a larger gain that the window cannot tell from a smaller one is not worth more copies."""
    moved = np.stack([moved_slots(current, final) for final in finals])          # [C, L]
    out = pick.copy()
    for layer, best in enumerate(pick):
        for c in np.argsort(moved[:, layer], kind="stable"):
            if moved[c, layer] >= moved[best, layer] or not net[c, layer] > 0:
                continue
            noise = z * standard_error(scores[1 + c, layer] - scores[1 + best, layer])
            if gain[best, layer] - gain[c, layer] <= noise:
                out[layer] = c
                break
    return out


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of ``values [S]`` (in time order) over up to NOISE_BATCHES batches of
    consecutive values; infinite where there are fewer than two batches."""
    batches = [b.mean() for b in np.array_split(values, min(NOISE_BATCHES, values.size)) if b.size]
    if len(batches) < 2:
        return float("inf")
    return float(np.std(batches, ddof=1) / np.sqrt(len(batches)))
