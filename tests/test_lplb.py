"""The LPLB emulation against SGLang 0.5.23's own pieces: its LPLBSolver's matrices, its prep kernel's
documented inputs, and its pure-torch reference of the barrier solver; the exact LP as the floor."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linprog

from moeplace.algorithms import PlacementProblem, solve
from moeplace.dispatch.balanced import step_expert_counts
from moeplace.dispatch.evaluation import verify_batches
from moeplace.dispatch.lplb import barrier_solve, expected_loads, lp_inputs, lp_problem, slot_probabilities
from moeplace.files.placement import replica_table
from test_cost_dispatch import kimi_shaped


@pytest.fixture(scope="module")
def case():
    """Kimi-shaped batches of 9 to 576 tokens and DeepSeek EPLB's placement with 96 spare slots."""
    steps = kimi_shaped(layers=1, steps=400)
    phy2log = solve("deepseek", PlacementProblem(steps.model, steps, 8, redundant=96))[0]
    counts = np.concatenate([step_expert_counts(verify_batches(steps, tokens, 3, seed=tokens).steps, 0)
                             for tokens in (9, 72, 576)])
    return phy2log, counts


@pytest.fixture(scope="module")
def sglang_solver(case):
    """SGLang's LPLBSolver for the placement, built on the CPU (its kernel warm-up needs CUDA; nothing else does)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    import sglang.kernels.ops.lplb.torch_solver as torch_solver
    from sglang.srt.eplb.lplb_solver import LPLBSolver

    phy2log, _ = case
    log2phy, nrep = replica_table(phy2log[None, :], 384)
    warmup = torch_solver.warmup
    torch_solver.warmup = lambda *args, **kwargs: None
    try:
        return LPLBSolver(torch.from_numpy(phy2log).long(), torch.from_numpy(log2phy[0]).long(), 8, None,
                          torch.from_numpy(nrep[0]))
    finally:
        torch_solver.warmup = warmup


def test_matrices_are_sglangs(case, sglang_solver):
    phy2log, counts = case
    lp = lp_problem(phy2log, 384, 8)
    s = sglang_solver
    np.testing.assert_array_equal(lp.A_base, s.A_base.numpy())
    np.testing.assert_array_equal(lp.objective, s.c_vec.numpy())
    np.testing.assert_array_equal(lp.single, s.log_single.numpy())
    np.testing.assert_array_equal(lp.single_slot, s.phy_single.numpy())
    np.testing.assert_array_equal(lp.replicated, s.log_replicated.numpy())
    np.testing.assert_array_equal(lp.replicated_slots, s.phy_replicated.numpy())
    np.testing.assert_array_equal(lp.rank_single, s.B1.numpy())
    # The prep kernel's inputs, from its documented torch equivalent.
    import torch
    A, b, t1 = lp_inputs(lp, counts)
    for k in range(counts.shape[0]):
        g = torch.from_numpy(counts[k]).double()
        norm = g / g.sum().clamp(min=1.0)
        t1_ref = norm[s.log_single]
        b_ref = torch.cat([norm[s.log_replicated], -(s.B1.double() @ t1_ref)])
        np.testing.assert_allclose(t1[k], t1_ref.numpy())
        np.testing.assert_allclose(b[k], b_ref.numpy(), atol=1e-15)
        np.testing.assert_allclose(A[k][:, -1], (b_ref - s.A_base.double().sum(dim=1)).numpy(), atol=1e-12)


def test_barrier_is_sglangs_reference(case, sglang_solver):
    import torch
    from sglang.test.kernels.lplb import solve_ipm_torch_reference

    phy2log, counts = case
    lp = lp_problem(phy2log, 384, 8)
    A, b, _ = lp_inputs(lp, counts)
    mine = barrier_solve(A, b, lp.objective)
    for k in range(counts.shape[0]):
        ref = solve_ipm_torch_reference(torch.from_numpy(A[k]), torch.from_numpy(b[k]),
                                        torch.from_numpy(lp.objective))
        np.testing.assert_allclose(mine[k], ref.numpy(), rtol=1e-6, atol=1e-9)


def test_barrier_lands_near_the_lp_optimum_and_loads_add_up(case):
    phy2log, counts = case
    lp = lp_problem(phy2log, 384, 8)
    A, b, _ = lp_inputs(lp, counts)
    x = barrier_solve(A, b, lp.objective)
    distinct, pairs = expected_loads(lp, counts)
    np.testing.assert_allclose(pairs.sum(axis=1), counts.sum(axis=1))
    prob = slot_probabilities(lp, counts)
    active = counts[:, phy2log] > 0
    for k in range(counts.shape[0]):
        best = linprog(lp.objective, A_eq=A[k], b_eq=b[k], bounds=(0, None), method="highs")
        assert best.status == 0
        assert x[k, -2] >= best.x[-2] - 1e-9           # the barrier's max share is never below the LP's
        assert x[k, -2] <= best.x[-2] * 1.2             # and, on these batches, converged close to it
        per_expert = np.bincount(phy2log[active[k]], weights=prob[k][active[k]], minlength=384)
        np.testing.assert_allclose(per_expert[counts[k] > 0], 1.0)
        # an active expert is read at least once in expectation, at most once per replica and pair
        copies = np.bincount(phy2log, minlength=384)
        assert (counts[k] > 0).sum() - 1e-9 <= distinct[k].sum() <= np.minimum(counts[k], copies).sum() + 1e-9


def test_without_replicas_loads_are_exact():
    phy2log = np.arange(16)
    lp = lp_problem(phy2log, 16, 4)
    counts = np.array([[3, 0, 1, 0, 2, 2, 0, 0, 0, 0, 0, 5, 1, 1, 1, 1]])
    distinct, pairs = expected_loads(lp, counts)
    np.testing.assert_allclose(distinct, [[2, 2, 1, 4]])
    np.testing.assert_allclose(pairs, [[4, 4, 5, 4]])
