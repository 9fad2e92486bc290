"""RoutingSteps' cheap accessors agree with the copying ones: ``slice`` with ``take`` (and shares the ids
instead of copying them), ``layer_pairs`` with a loop over the valid top-k entries."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_metrics import random_steps

from moeplace.analysis.optimize import split_steps
from moeplace.model.spec import ModelSpec

FIELDS = ("modes", "num_tokens", "ranks", "token_offsets", "topk_ids", "count_steps", "counts")
MIXED_STEPS = given(seed=st.integers(0, 2**32 - 1), n_steps=st.integers(1, 12),
                    count_share=st.sampled_from([0.0, 0.4, 1.0]), data=st.data())   # token rows, counts or both


@settings(max_examples=40, deadline=None, derandomize=True)
@MIXED_STEPS
def test_slice_is_take_of_a_range(seed, n_steps, count_share, data):
    steps = random_steps(np.random.default_rng(seed), ModelSpec.all_moe("m", 2, 6, 2), n_steps,
                         count_share=count_share)
    start = data.draw(st.integers(0, n_steps))
    stop = data.draw(st.integers(start, n_steps))
    part = steps.slice(start, stop)
    part.validate()
    expect = steps.take(np.arange(start, stop))
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(part, name), getattr(expect, name), err_msg=name)
    assert part.topk_ids.size == 0 or np.shares_memory(part.topk_ids, steps.topk_ids)


def test_split_steps_holds_the_trace_once():
    steps = random_steps(np.random.default_rng(3), ModelSpec.all_moe("m", 2, 6, 2), 40, count_share=0.0)
    fit, held = split_steps(steps, 0.3)
    assert fit.num_steps + held.num_steps == steps.num_steps
    assert np.shares_memory(fit.topk_ids, steps.topk_ids) and np.shares_memory(held.topk_ids, steps.topk_ids)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n_steps=st.integers(1, 10), padded=st.booleans())
def test_layer_pairs_are_the_valid_entries_in_row_order(seed, n_steps, padded):
    rng = np.random.default_rng(seed)
    steps = random_steps(rng, ModelSpec.all_moe("m", 2, 6, 2), n_steps)
    if not padded:
        steps.topk_ids = np.where(steps.topk_ids < 0, 0, steps.topk_ids).astype(np.int16)
    for layer in range(2):
        expect = [(s, r, int(e)) for s in range(steps.num_steps)
                  for r, row in enumerate(range(steps.token_offsets[s], steps.token_offsets[s + 1]))
                  for e in steps.topk_ids[row, layer] if e >= 0]
        step, row, expert = steps.layer_pairs(layer)
        assert expert.dtype == np.int64
        assert list(zip(step.tolist(), row.tolist(), expert.tolist())) == expect


@settings(max_examples=40, deadline=None, derandomize=True)
@MIXED_STEPS
def test_one_layer_is_that_layer_of_the_steps(seed, n_steps, count_share, data):
    steps = random_steps(np.random.default_rng(seed), ModelSpec.all_moe("m", 3, 6, 2), n_steps,
                         count_share=count_share)
    layer = data.draw(st.integers(0, steps.model.num_moe_layers - 1))
    one = steps.one_layer(layer)
    one.validate()
    assert one.model.num_moe_layers == 1 and one.model.num_experts == steps.model.num_experts
    np.testing.assert_array_equal(one.expert_token_counts()[0], steps.expert_token_counts()[layer])
    idx = np.arange(0, n_steps, 2)
    for a, b in zip(one.take(idx).layer(0), steps.take(idx).layer(layer)):
        np.testing.assert_array_equal(a, b)
