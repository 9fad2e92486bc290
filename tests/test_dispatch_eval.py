"""Scoring the replica-dispatch rules on batches built from a trace's own steps."""

from __future__ import annotations

import numpy as np
import pytest

from moeplace.algorithms import PlacementProblem, solve
from moeplace.cost.model import CostModel
from moeplace.dispatch.balanced import step_expert_counts
from moeplace.dispatch.evaluation import RULES, Row, batch_costs, rule_loads, verify_batches
from moeplace.dispatch.loads import static_dispatch_table
from moeplace.trace.resample import resample_batches
from test_cost_dispatch import kimi_shaped


@pytest.fixture(scope="module")
def steps():
    return kimi_shaped(layers=1, steps=300)


def test_batches_are_whole_requests(steps):
    b = verify_batches(steps, 36, 5, seed=3)
    assert b.steps.num_steps == 5 and b.steps.topk_ids.shape[0] == 180
    np.testing.assert_array_equal(b.request.reshape(5, 36), np.repeat(np.arange(4), 9)[None, :].repeat(5, 0))
    np.testing.assert_array_equal(b.steps.topk_ids, resample_batches(steps, 36, 5, seed=3).topk_ids)


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_serves_every_pair(steps, rule):
    phy2log = solve("deepseek", PlacementProblem(steps.model, steps, 8, redundant=96))
    b = verify_batches(steps, 72, 6, seed=1)
    distinct, pairs = rule_loads(b, 0, phy2log[0], 8, rule, CostModel(19.0, 0.04, 50.0))
    np.testing.assert_allclose(pairs.sum(axis=1), step_expert_counts(b.steps, 0).sum(axis=1))
    assert np.all(distinct.sum(axis=1) >= (step_expert_counts(b.steps, 0) > 0).sum(axis=1) - 1e-9)


def test_static_sends_each_request_from_its_own_rank(steps):
    """One request alone: every pair leaves from rank 0 and goes to rank 0's fixed replica."""
    phy2log = solve("deepseek", PlacementProblem(steps.model, steps, 8, redundant=96))[0]
    b = verify_batches(steps, 9, 4, seed=2)
    distinct, pairs = rule_loads(b, 0, phy2log, 8, "static")
    table = static_dispatch_table(phy2log, 384, 8, 1)
    counts = step_expert_counts(b.steps, 0)
    for s in range(4):
        ranks = table[0, np.flatnonzero(counts[s])] // 60
        np.testing.assert_array_equal(pairs[s], np.bincount(ranks, weights=counts[s][counts[s] > 0], minlength=8))


def test_batch_costs_take_the_slowest_rank(steps):
    phy2log = solve("deepseek", PlacementProblem(steps.model, steps, 8))
    b = verify_batches(steps, 18, 3)
    model = CostModel(10.0, 1.0, 5.0)
    got = batch_costs(b, [Row("x", phy2log, "dynamic", lambda tokens: model)], 8, 18)["x"]
    distinct, pairs = rule_loads(b, 0, phy2log[0], 8, "dynamic")
    np.testing.assert_allclose(got, (10 * distinct + pairs + 5).max(axis=1))
