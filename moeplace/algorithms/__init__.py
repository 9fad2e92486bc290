"""Placement algorithms, selectable by name (``--algorithm``); adding one is one module and one line.

Every algorithm takes a ``PlacementProblem`` and returns ``phy2log [L, P]``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moeplace.cost.model import CostModel
from moeplace.errors import MoeplaceError
from moeplace.model.spec import ModelSpec
from moeplace.trace.steps import RoutingSteps


DEFAULT_EFFORT = 2.4e9   # swap-search work over all layers (steps x slots x ranks per round)


@dataclass
class PlacementProblem:
    """What an algorithm is asked: place ``model``'s experts on ``ranks`` GPUs with ``redundant`` spare slots.

    steps: the steps to fit (training part of the trace)
    """

    model: ModelSpec
    steps: RoutingSteps
    ranks: int
    nodes: int = 1
    redundant: int = 0
    dispatch: str = "dynamic"
    cost_model: CostModel = field(default_factory=CostModel)
    seed: int = 0
    effort: float = DEFAULT_EFFORT
    balance_floor: float = 0.98  # stepaware keeps token balancedness >= this share of DeepSeek EPLB's
    pair_weight: float | None = None  # stepaware's weight of sum_r D^2 beside the step maxima (None: its tie-break)
    progress: Callable[[int], None] = lambda n: None  # called with the number of layers just finished

    @property
    def num_physical(self) -> int:
        return self.model.num_experts + self.redundant

    @property
    def first_slots(self) -> int:
        """Slots of the first copies under balanced dispatch with spare slots (``first_copy_slots``)."""
        return first_copy_slots(self.model.num_experts, self.ranks)

    @property
    def spares_left(self) -> int:
        """Spare slots beyond the first copies: what a spare-slot search places (a multiple of the ranks)."""
        return self.num_physical - self.first_slots

    def check(self) -> None:
        """Raise MoeplaceError if no placement can satisfy the problem."""
        E, P, R = self.model.num_experts, self.num_physical, self.ranks
        if R < 1 or self.nodes < 1 or R % self.nodes:
            raise MoeplaceError(f"--ranks ({R}) must be a positive multiple of --nodes ({self.nodes})")
        if self.redundant < 0:
            raise MoeplaceError(f"--redundant must be >= 0, got {self.redundant}")
        if P % R:
            raise MoeplaceError(f"{E} experts + {self.redundant} redundant = {P} slots do not split evenly "
                                f"over {R} ranks")
        if not 0.0 <= self.balance_floor <= 1.0:
            raise MoeplaceError(f"--balance-floor must be in [0, 1], got {self.balance_floor}")
        if P // R > E:
            raise MoeplaceError(f"{P // R} slots per rank exceed the {E} experts: some rank would hold two "
                                f"replicas of one expert")


def first_copy_slots(experts: int, ranks: int) -> int:
    """Slots a layout fills before its spare slots: one copy of each expert, and as many replicas more as it
    takes for every rank to hold the same number (``experts + (-experts) % ranks``; 384 experts on 144 ranks:
    432, three a rank). The spare slots beyond them then split evenly over the ranks too."""
    return experts + (-experts) % ranks


ALGORITHMS: dict[str, str] = {
    "stepaware": "moeplace.algorithms.stepaware:stepaware",
    "deepseek": "moeplace.algorithms.baselines:deepseek",
    "deepseek-hierarchical": "moeplace.algorithms.baselines:deepseek_hierarchical",
    "contiguous": "moeplace.algorithms.baselines:contiguous",
    "naive-spares": "moeplace.algorithms.baselines:naive_spares",
}
DEFAULT_ALGORITHM = "stepaware"


def get_algorithm(name: str) -> Callable[[PlacementProblem], np.ndarray]:
    if name not in ALGORITHMS:
        raise MoeplaceError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    module, attr = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def solve(name: str, problem: PlacementProblem) -> np.ndarray:
    """Run algorithm ``name`` on ``problem``; returns phy2log [L, P]."""
    problem.check()
    return get_algorithm(name)(problem)
