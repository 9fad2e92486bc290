"""stepaware's search ends when it cannot gain: at one slot per rank it is skipped (and optimize says
so), and a swap round that does not lower the exact objective ends it, however much budget is left."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

import moeplace.algorithms.stepaware as stepaware
from moeplace.algorithms import PlacementProblem, solve
from moeplace.algorithms.stepaware import TIE_BREAK, _loads, _objective, move_changes, search_moot, swap_search
from moeplace.cli import cli
from moeplace.model.spec import ModelSpec
from moeplace.trace.store import write_trace
from moeplace.trace.synthetic import synthetic_steps


def problem(E: int, R: int, redundant: int = 0, dispatch: str = "dynamic", steps: int = 40) -> PlacementProblem:
    model = ModelSpec(f"test-{E}e", 2, (0, 1), E, min(2, E))
    _, routing = synthetic_steps(steps, 9, model, seed=E + R)
    routing.ranks = (np.arange(routing.num_steps) % R).astype(np.int16)
    return PlacementProblem(model, routing, R, redundant=redundant, dispatch=dispatch)


def refuse(*args, **kwargs):
    raise AssertionError("the search ran")


@pytest.mark.parametrize("E,R,redundant,dispatch", [
    (8, 8, 0, "dynamic"), (8, 8, 0, "static"), (4, 8, 4, "dynamic"), (8, 1, 0, "dynamic"),
    (8, 8, 8, "balanced"),   # the first copies under balanced dispatch: one per rank
])
def test_search_is_skipped_where_no_placement_scores_better(E, R, redundant, dispatch, monkeypatch):
    monkeypatch.setattr(stepaware, "greedy_place", refuse)
    monkeypatch.setattr(stepaware, "swap_search", refuse)
    p = problem(E, R, redundant, dispatch)
    phy2log = solve("stepaware", p)
    assert phy2log.shape == (2, E + redundant)
    assert all(np.array_equal(np.unique(row), np.arange(E)) for row in phy2log)
    if dispatch != "balanced":
        assert search_moot(p)


@pytest.mark.parametrize("E,R,redundant,dispatch", [
    (8, 4, 0, "dynamic"),     # two slots per rank: the pairing matters
    (4, 8, 4, "static"),      # a replica's rank decides which source ranks it serves
    (8, 4, 4, "balanced"),    # the spare slots' own search runs
])
def test_search_runs_where_the_placement_matters(E, R, redundant, dispatch):
    assert search_moot(problem(E, R, redundant, dispatch)) is None


def test_optimize_says_in_one_line_that_the_search_was_skipped(tmp_path):
    model = ModelSpec("test-8e", 2, (0, 1), 8, 2)
    header, steps = synthetic_steps(200, 9, model, seed=1)
    trace = write_trace(tmp_path / "t.mptrace", header, steps)
    result = CliRunner().invoke(cli, ["optimize", str(trace), "--ranks", "8", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stdout.splitlines() if "skipped its search" in line]
    assert len(said) == 1 and said[0].startswith("note: one expert slot per rank"), result.stdout
    two_per_rank = CliRunner().invoke(cli, ["optimize", str(trace), "--ranks", "4", "-o", str(tmp_path / "q.json")])
    assert two_per_rank.exit_code == 0 and "skipped its search" not in two_per_rank.stdout


@pytest.mark.parametrize("S,R", [(3000, 32), (2000, 16), (5000, 8)])
def test_swap_search_ends_when_rounding_is_all_that_looks_like_a_gain(S, R):
    """One slot per rank: every swap changes nothing, but float32 deltas over thousands of steps
    promise gains above the threshold; the search used to spend every round it was given on them."""
    rng = np.random.default_rng(S + R + 1)
    X = (rng.random((S, R)) < rng.uniform(0.05, 0.5, R)).astype(np.float32)
    rank = np.arange(R)
    out, rounds = swap_search(X, X.sum(axis=0).astype(float), np.arange(R), rank, R, 0.0, 40)
    assert rounds == 1
    assert np.array_equal(out, rank)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), S=st.integers(1, 400), R=st.integers(2, 8), spr=st.integers(1, 4))
def test_property_swap_search_never_ends_worse_than_it_started(seed, S, R, spr):
    rng = np.random.default_rng(seed)
    P = R * spr
    X = (rng.random((S, P)) < rng.uniform(0.05, 0.6)).astype(np.float32)
    rank = rng.permutation(np.repeat(np.arange(R), spr))
    out, rounds = swap_search(X, X.sum(axis=0).astype(float), np.arange(P), rank, R, 0.0, 1000)
    assert np.array_equal(np.bincount(out, minlength=R), np.full(R, spr))
    before, after = _objective(_loads(X, rank, R)), _objective(_loads(X, out, R))
    assert after <= before
    assert rounds < 1000                                   # it stopped by itself
    assert after < before - TIE_BREAK / 2 or rounds == 1   # every round but the last gained


@pytest.mark.parametrize("pairs", [TIE_BREAK, 2**-4])
@pytest.mark.parametrize("R", [1, 2, 3, 5, 8, 16])
def test_move_changes_is_the_objective_change_of_moving_one_slot(R, pairs):
    """h[s, a, b] against a direct recount: step s's max and sum of squares (weighted by ``pairs``) after rank a
    loses an active slot and rank b gains one (ties for the maximum included)."""
    rng = np.random.default_rng(R)
    D = rng.integers(0, 4, (60, R)).astype(np.float32)
    h = move_changes(D, pairs=pairs)
    for s, a, b in itertools.product(range(D.shape[0]), range(R), range(R)):
        if a == b:
            assert h[s, a, b] == 0
            continue
        moved = D[s].astype(np.float64)
        moved[a] -= 1
        moved[b] += 1
        expect = moved.max() - D[s].max() + pairs * ((moved ** 2).sum() - (D[s].astype(np.float64) ** 2).sum())
        assert h[s, a, b] == pytest.approx(expect, abs=1e-6), (s, a, b)


@pytest.mark.parametrize("R", [1, 2, 3, 5, 8])
def test_move_changes_of_given_pairs_are_the_full_grids(R):
    """move_changes(D, a, b) picks the pairs (a, b) out of every pair's grid, for any broadcast shape."""
    rng = np.random.default_rng(10 + R)
    D = rng.integers(0, 4, (30, R)).astype(np.float32)
    full = move_changes(D)
    a, b = rng.integers(0, R, 7), rng.integers(0, R, 7)
    np.testing.assert_array_equal(move_changes(D, a, b), full[:, a, b])
    np.testing.assert_array_equal(move_changes(D, a[:, None], b[None, :]), full[:, a[:, None], b[None, :]])


@pytest.mark.parametrize("E,R,redundant,dispatch", [(16, 4, 0, "dynamic"), (16, 4, 4, "static"),
                                                    (16, 4, 4, "balanced")])
def test_layers_placed_on_forked_workers_are_the_ones_placed_in_order(E, R, redundant, dispatch, monkeypatch):
    model = ModelSpec(f"test-{E}e", 4, (0, 1, 2, 3), E, 2)
    _, routing = synthetic_steps(60, 9, model, seed=5)
    routing.ranks = (np.arange(routing.num_steps) % R).astype(np.int16)
    in_order = solve("stepaware", PlacementProblem(model, routing, R, redundant=redundant, dispatch=dispatch))
    monkeypatch.setattr(stepaware, "layer_workers", lambda cells: 2)
    seen = []
    forked = solve("stepaware", PlacementProblem(model, routing, R, redundant=redundant, dispatch=dispatch,
                                                 progress=seen.append))
    np.testing.assert_array_equal(forked, in_order)
    assert seen == [1] * model.num_moe_layers
