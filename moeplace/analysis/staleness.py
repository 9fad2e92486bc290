"""Has a placement gone stale? A placement in service, a placement fitted on today's capture, and the naive layout.

A placement was fitted on older traffic; ``staleness`` fits one on the first part of a newer capture
(``optimize``'s split, in time order) and scores all three on the capture's last part, which none of them
saw: the service's placement against what re-placing now would give, and against the naive layout (DeepSeek
EPLB of the capture, plus one replica of each of the hottest experts where there are spare slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms.fit import fit as fit_placement
from moeplace.algorithms.fit import naive as naive_layout
from moeplace.analysis.metrics import max_distinct_means
from moeplace.analysis.replace import MIN_GAIN
from moeplace.cost.model import CostModel
from moeplace.files.placement import Placement
from moeplace.trace.steps import RoutingSteps

HOLDOUT = 0.3      # share of the capture's last steps the three are scored on (optimize's default)
MIN_STEPS = 20     # fewer steps than this: no fit is attempted


@dataclass(frozen=True)
class Staleness:
    """E[max distinct] on the capture's held-out steps: ``current`` (the placement given), ``refit`` (fitted
    on the capture's first part now), ``naive``; fit_steps / scored_steps: how many steps each part has."""

    current: float
    refit: float
    naive: float
    fit_steps: int
    scored_steps: int

    @property
    def to_gain(self) -> float:
        """Share of the current figure a re-placement would remove (negative: re-placing would lose)."""
        return 1 - self.refit / self.current if self.current else 0.0

    @property
    def line(self) -> str:
        verdict = (f"re-place: {100 * self.to_gain:.0f}% to gain" if self.to_gain >= MIN_GAIN
                   else f"keep: re-placing gains under {100 * MIN_GAIN:.1f}%")
        vs_naive = 100 * (self.current / self.naive - 1) if self.naive else 0.0
        return (f"{verdict} (E[max distinct] on the last {self.scored_steps:,} steps: this placement "
                f"{self.current:.3f}, fitted now {self.refit:.3f}, naive layout {self.naive:.3f}, "
                f"{vs_naive:+.1f}% against it)")

    def to_json(self) -> dict:
        return {"current": self.current, "refit": self.refit, "naive": self.naive, "to_gain": self.to_gain,
                "fit_steps": self.fit_steps, "scored_steps": self.scored_steps, "line": self.line}


def staleness(steps: RoutingSteps, placement: Placement, dispatch: str, cost_model: CostModel,
              workers: int = 1) -> Staleness | None:
    """``placement`` against one fitted now on ``steps``' first part and the naive layout, on its last part
    (None where ``steps`` has fewer than MIN_STEPS steps). The fit has the placement's ranks and spare slots."""
    S = steps.num_steps
    if S < MIN_STEPS:
        return None
    cut = int(round(S * (1 - HOLDOUT)))
    fit, held = steps.slice(0, cut), steps.slice(cut, S)
    model, R = placement.model, placement.ranks
    spares = placement.num_redundant
    problem = PlacementProblem(model, fit, R, nodes=placement.nodes, redundant=spares, dispatch=dispatch,
                               cost_model=cost_model)
    refit, naive = fit_placement(problem).phy2log, naive_layout(problem)
    maps = [placement] + [Placement(model, R, phy2log, nodes=placement.nodes, algorithm=name)
                          for name, phy2log in (("refit", refit), ("naive", naive))]
    current, now, base = max_distinct_means(held, maps, [dispatch] * 3, [cost_model] * 3, workers)
    return Staleness(current, now, base, fit.num_steps, held.num_steps)
