"""The evaluation's shared per-layer path: loads of placements without spare slots counted from the
layer's (step, expert) pairs equal the per-token oracle and ``layer_rank_loads`` under every rule, and
measuring several placements in one pass gives each the sums it gets alone."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_metrics import naive_loads, random_placement, random_steps

from moeplace.analysis.metrics import LayerSums, accumulate, accumulate_all, layer_activity, single_copy_loads
from moeplace.cost.model import CostModel
from moeplace.dispatch.loads import DISPATCH_RULES, layer_distinct_total, layer_rank_loads, static_dispatch_table
from moeplace.files.placement import Placement
from moeplace.model.spec import ModelSpec


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), E=st.integers(1, 12), K=st.integers(1, 4), R=st.integers(1, 6),
       layers=st.integers(1, 3), n_steps=st.integers(1, 10), count_share=st.sampled_from([0.0, 0.3, 1.0]))
def test_single_copy_loads_match_the_oracle_and_every_rule(seed, E, K, R, layers, n_steps, count_share):
    E = E - E % R or R        # every rank holds E / R experts
    K = min(K, E)
    rng = np.random.default_rng(seed)
    model = ModelSpec.all_moe("m", layers, E, K)
    steps = random_steps(rng, model, n_steps, count_share=count_share, src_ranks=R)
    for layer in range(layers):
        phy2log = random_placement(rng, E, R, 0)
        activity = layer_activity(steps, layer)
        distinct, tokens = single_copy_loads(activity, phy2log, R, steps.count_steps)
        table = static_dispatch_table(phy2log, E, R, 1)
        expect = naive_loads(steps, layer, phy2log, R, "dynamic")
        np.testing.assert_array_equal(distinct, expect[0])
        np.testing.assert_array_equal(tokens, expect[1])
        for rule in DISPATCH_RULES:
            same = layer_rank_loads(steps, layer, phy2log, R, rule, table if rule == "static" else None,
                                    CostModel(10.0, 1.0, 0.0))   # the cost rule's model; the others ignore it
            np.testing.assert_array_equal(distinct, same[0])
            np.testing.assert_array_equal(tokens, same[1])
        np.testing.assert_array_equal(activity.distinct_total(), layer_distinct_total(steps, layer))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), dispatch=st.sampled_from(DISPATCH_RULES))
def test_placements_measured_together_get_what_each_gets_alone(seed, dispatch):
    rng = np.random.default_rng(seed)
    E, R, L = 8, 4, 2
    model = ModelSpec.all_moe("m", L, E, 2)
    steps = random_steps(rng, model, 12, src_ranks=R)
    placements = [Placement(model, R, np.stack([random_placement(rng, E, R, redundant) for _ in range(L)]))
                  for redundant in (0, 4, 0)]
    cost = CostModel(a_us_per_expert=2.0, b_us_per_token=0.5, c_us=3.0)
    together = [LayerSums(L, R) for _ in placements]
    accumulate_all(together, steps, placements, [cost] * 3, dispatch)
    for sums, placement in zip(together, placements):
        alone = LayerSums(L, R)
        accumulate(alone, steps, placement, cost, dispatch)
        for name in ("max_distinct", "mean_distinct", "lower_bound", "optimum", "max_cost", "mean_cost",
                     "rank_tokens", "rank_distinct", "step_max_hist", "expert_tokens"):
            np.testing.assert_array_equal(getattr(sums, name), getattr(alone, name), err_msg=name)
        assert sums.steps == alone.steps == steps.num_steps


def test_layers_measured_on_forked_workers_sum_to_the_same():
    rng = np.random.default_rng(9)
    E, R, L = 8, 4, 3
    model = ModelSpec.all_moe("m", L, E, 2)
    steps = random_steps(rng, model, 20, src_ranks=R)
    placements = [Placement(model, R, np.stack([random_placement(rng, E, R, redundant) for _ in range(L)]))
                  for redundant in (0, 4)]
    cost = CostModel(a_us_per_expert=2.0, b_us_per_token=0.5, c_us=3.0)
    for dispatch in DISPATCH_RULES:
        in_order, forked = [LayerSums(L, R) for _ in placements], [LayerSums(L, R) for _ in placements]
        accumulate_all(in_order, steps, placements, [cost] * 2, dispatch)
        accumulate_all(forked, steps, placements, [cost] * 2, dispatch, workers=2)
        for a, b in zip(in_order, forked):
            for name in ("max_distinct", "optimum", "max_cost", "rank_tokens", "step_max_hist", "expert_tokens"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{dispatch} {name}")
