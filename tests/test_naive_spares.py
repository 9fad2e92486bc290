"""The naive spare-slot layout (the spare-slot baseline): DeepSeek EPLB on the first copies' slots (no spare slots
where the experts split over the ranks), then one more replica of each of the R hottest experts, on the ranks with
fewest extras, nearest first after the expert's own rank.

Checked against a plain re-statement of that definition (``naive_reference``), against DeepSeek EPLB for
the first copies, and by hypothesis for the invariants of any placement.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.baselines import hot_expert_spares
from moeplace.files.placement import Placement, check_placement
from test_algorithms import tiny_model, tiny_steps

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def naive_reference(base: list[int], weight: list[float], ranks: int, redundant: int) -> list[set[int]] | None:
    """Each rank's experts under the definition, written plainly; None where a hot expert finds no rank."""
    E = len(weight)
    spr = E // ranks
    experts = [set(base[r * spr:(r + 1) * spr]) for r in range(ranks)]
    home = {e: r for r in range(ranks) for e in experts[r]}
    extras = [0] * ranks
    for e in sorted(range(E), key=lambda e: (-weight[e], e))[:redundant]:
        after = [(home[e] + k) % ranks for k in range(1, ranks)]
        open_ranks = [r for r in after if extras[r] < redundant // ranks]
        if not open_ranks:
            return None
        fewest = min(extras[r] for r in open_ranks)
        r = next(r for r in open_ranks if extras[r] == fewest)
        experts[r].add(e)
        extras[r] += 1
    return experts


def rank_sets(phy2log: np.ndarray, ranks: int) -> list[set[int]]:
    spr = phy2log.shape[0] // ranks
    return [set(phy2log[r * spr:(r + 1) * spr].tolist()) for r in range(ranks)]


@pytest.mark.parametrize("E,ranks,redundant", [(8, 4, 4), (16, 8, 8), (32, 8, 16), (32, 8, 32), (64, 8, 8)])
def test_matches_the_definition(E, ranks, redundant):
    rng = np.random.default_rng(E + redundant)
    for _ in range(20):
        base = rng.permutation(E)
        weight = rng.integers(0, 50, E).astype(float)      # ties happen: the lower id is hotter
        want = naive_reference(base.tolist(), weight.tolist(), ranks, redundant)
        if want is None:
            continue
        got = hot_expert_spares(base, weight, ranks, redundant)
        assert rank_sets(got, ranks) == want
        assert np.all(np.diff(got.reshape(ranks, -1), axis=1) > 0)          # each rank's experts in id order


def test_nearest_rank_after_the_own_rank_first():
    # 8 experts on 4 ranks (2 a rank), 4 spare slots: the hottest, expert 5 on rank 2, goes to rank 3;
    # expert 7 (rank 3) to rank 0, wrapping around; expert 0 (rank 0) to rank 1; expert 2 (rank 1) to rank 2.
    base = np.array([0, 1, 2, 3, 5, 4, 7, 6])
    weight = np.array([6, 0, 5, 0, 0, 9, 0, 8], float)
    got = rank_sets(hot_expert_spares(base, weight, 4, 4), 4)
    assert got == [{0, 1, 7}, {2, 3, 0}, {5, 4, 2}, {7, 6, 5}]


def test_a_hot_expert_without_a_free_rank_is_passed_over():
    # 2 ranks, one spare slot each; the two hottest both live on rank 0, so only one fits on rank 1
    # and the next hottest (from rank 1) takes rank 0's slot.
    base = np.array([0, 1, 2, 3])
    weight = np.array([9, 8, 7, 1], float)
    got = rank_sets(hot_expert_spares(base, weight, 2, 2), 2)
    assert got == [{0, 1, 2}, {2, 3, 0}]


def test_first_copies_are_deepseek_eplb_and_spares_the_hottest():
    model = tiny_model(16, top_k=2)
    steps = tiny_steps(model, 200, 4, seed=3)
    plain = solve("deepseek", PlacementProblem(model, steps, 4))
    without = solve("naive-spares", PlacementProblem(model, steps, 4))
    assert all(rank_sets(a, 4) == rank_sets(b, 4) for a, b in zip(without, plain))
    phy2log = solve("naive-spares", PlacementProblem(model, steps, 4, redundant=4))
    weight = steps.expert_token_counts()
    for layer in range(model.num_moe_layers):
        copies = np.bincount(phy2log[layer], minlength=16)
        hottest = np.lexsort((np.arange(16), -weight[layer]))[:4]
        assert set(np.flatnonzero(copies == 2)) == set(hottest.tolist())
        for r, experts in enumerate(rank_sets(phy2log[layer], 4)):
            assert rank_sets(plain[layer], 4)[r] <= experts


@pytest.mark.parametrize("redundant", [2, 6])
def test_where_experts_do_not_split_the_first_copies_replicate_the_hottest(redundant):
    # 10 experts on 4 ranks: DeepSeek EPLB on 12 slots (the 2 hottest twice) evens out the ranks, then the
    # spare slots left go to the hottest by the definition
    model = tiny_model(10, top_k=2, num_moe_layers=1)
    steps = tiny_steps(model, 200, 4, 0)
    phy2log = solve("naive-spares", PlacementProblem(model, steps, 4, redundant=redundant))
    check_placement(Placement(model, 4, phy2log))
    first = solve("deepseek", PlacementProblem(model, steps, 4, redundant=2))[0]
    weight = steps.expert_token_counts()[0]
    assert rank_sets(phy2log[0], 4) == rank_sets(hot_expert_spares(first, weight, 4, redundant - 2), 4)
    assert set(np.flatnonzero(np.bincount(first, minlength=10) == 2)) == set(np.argsort(-weight, kind="stable")[:2])


@PROPERTY
@given(st.integers(1, 4).map(lambda k: 2 ** k), st.integers(1, 6), st.integers(0, 20), st.integers(0, 10_000))
def test_property_valid_and_every_slot_used(ranks, per_rank, spare_per_rank, seed):
    E = ranks * per_rank
    assume(per_rank + spare_per_rank <= E)
    rng = np.random.default_rng(seed)
    base = rng.permutation(E)
    weight = rng.integers(0, 5, E).astype(float)
    phy2log = hot_expert_spares(base, weight, ranks, spare_per_rank * ranks)
    model = tiny_model(E, top_k=1, num_moe_layers=1)
    check_placement(Placement(model, ranks, phy2log[None]))        # every expert, equal slots, no duplicates
    assert phy2log.shape == (E + spare_per_rank * ranks,)
    assert all(before <= after for before, after in zip(rank_sets(base, ranks), rank_sets(phy2log, ranks)))
