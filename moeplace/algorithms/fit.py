"""The one way to fit a placement to steps: what ``optimize`` writes, ``report``'s staleness check refits, the
benchmarks compare and the server's re-placement worker fits, so that all four judge the same placement.

* ``fit``: the algorithm asked for; for ``stepaware`` under balanced dispatch (or the rule by cost, whose spare
  slots are placed alike) with spare slots past the first copies, the spare layout that does best out of fold
  (``robust.robust_spares``), which may be the naive one.
* ``naive``: the layout a placement must beat: DeepSeek EPLB, and with spare slots the naive spare layout
  (``baselines.naive_spares``: DeepSeek EPLB plus one replica of each of the hottest experts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.robust import Choice, robust_spares
from moeplace.dispatch.by_cost import PLACED_AS


@dataclass(frozen=True)
class Fitted:
    """phy2log [L, P], and under balanced dispatch with spare slots which spare layout was chosen (else None)."""

    phy2log: np.ndarray
    choice: Choice | None = None


def placed_as(problem: PlacementProblem) -> PlacementProblem:
    """``problem`` with its dispatch rule as placements are made for it (the rule by cost places as balanced)."""
    rule = PLACED_AS.get(problem.dispatch, problem.dispatch)
    return problem if rule == problem.dispatch else replace(problem, dispatch=rule)


def fit(problem: PlacementProblem, algorithm: str = "stepaware",
        choice_progress: Callable[[int, int], None] = lambda done, total: None) -> Fitted:
    """``algorithm``'s placement for ``problem`` (module docstring); MoeplaceError if the problem has none.
    choice_progress: (jobs done, jobs) of the spare layout's choice, where it runs."""
    problem = placed_as(problem)
    problem.check()
    if algorithm == "stepaware" and problem.dispatch == "balanced" and problem.spares_left:
        phy2log, choice = robust_spares(problem, choice_progress)
        return Fitted(phy2log, choice)
    return Fitted(solve(algorithm, problem))


def naive(problem: PlacementProblem) -> np.ndarray:
    """phy2log [L, P] of the naive layout for ``problem`` (module docstring)."""
    return solve("naive-spares" if problem.redundant else "deepseek", placed_as(problem))
