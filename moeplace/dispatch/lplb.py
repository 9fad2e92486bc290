"""SGLang's LPLB dispatch (``--ep-dispatch-algorithm lp``) emulated in numpy, scored on expected loads.

Dimension letters: S steps, E logical experts, P physical slots, G ranks (GPUs), N replicated slots.

What SGLang 0.5.23 does per MoE layer and batch (``srt/eplb/lplb_solver.py``, kernels in
``sglang/kernels/jit/csrc/lplb/``): count the batch's tokens per logical expert, all-reduce them over
the EP group, normalise by their total, and solve one linear program for the token share of every
replica of the replicated experts:

    minimise   M + 1000 * z
    subject to sum of e's replica shares                       = e's share         (each replicated e)
               rank g's replica shares + slack_g - M           = -(g's single-replica experts' share)
               all variables >= 0

(``z``, the last column, is a Big-M start variable: ``x = 1`` satisfies every row.) It is solved by 5
barrier (affine-scaling) iterations from ``x = 1``; if they do not converge, every share is 0.5. Each
(token, expert) pair then samples a replica with probability proportional to its share.

``lp_problem`` builds the same matrices, ``barrier_solve`` runs the same iteration (SGLang's docstring
of ``solve_ipm_torch_reference`` states it; ``tests/test_lplb.py`` checks both against SGLang's own
``LPLBSolver`` and that reference), and ``expected_loads`` scores the result without sampling noise:
a slot with share p of an expert's n pairs runs ``n p`` of them and is read with probability
``1 - (1 - p)^n``. LPLB balances tokens, never distinct experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeplace.errors import MoeplaceError

BIG_M_WEIGHT = 1000.0    # the objective's weight on the start variable z
BARRIER_ITERS = 5
STEP = 0.999             # share of the step to the boundary


@dataclass(frozen=True)
class LpProblem:
    """SGLang's LP for one layer's placement.

    phy2log: [P]; single, replicated: logical ids with one / several replicas (ascending);
    single_slot: [len(single)] their slot; replicated_slots: [N] slots of replicated experts
    (ascending); A_base: [len(replicated) + G, N + G + 1] the constraint matrix without the z column;
    rank_single: [G, len(single)] 1 where a single-replica expert lives on rank g.
    """

    phy2log: np.ndarray
    ranks: int
    single: np.ndarray
    single_slot: np.ndarray
    replicated: np.ndarray
    replicated_slots: np.ndarray
    A_base: np.ndarray
    rank_single: np.ndarray

    @property
    def objective(self) -> np.ndarray:
        """[N + G + 2]: 1 on M, BIG_M_WEIGHT on z."""
        c = np.zeros(self.A_base.shape[1] + 1)
        c[-2], c[-1] = 1.0, BIG_M_WEIGHT
        return c


def lp_problem(phy2log: np.ndarray, num_experts: int, ranks: int) -> LpProblem:
    """The LP's fixed matrices for one layer's map ``phy2log [P]`` (rank g owns slots [g*P/G, (g+1)*P/G))."""
    P = phy2log.shape[0]
    if P % ranks:
        raise MoeplaceError(f"{P} slots do not split evenly over {ranks} ranks")
    copies = np.bincount(phy2log, minlength=num_experts)
    single = np.flatnonzero(copies == 1)
    replicated = np.flatnonzero(copies > 1)
    slot_of_single = np.full(num_experts, -1, np.int64)
    slot_of_single[phy2log[copies[phy2log] == 1]] = np.flatnonzero(copies[phy2log] == 1)
    rep_slots = np.flatnonzero(copies[phy2log] > 1)
    rank_of = np.arange(P) // (P // ranks)
    N, G = rep_slots.size, ranks
    on_rank = (rank_of[None, :] == np.arange(G)[:, None]).astype(np.float64)     # [G, P]
    C = (phy2log[rep_slots][None, :] == replicated[:, None]).astype(np.float64)  # [len(rep), N]
    top = np.hstack([C, np.zeros((replicated.size, G + 1))])
    bottom = np.hstack([on_rank[:, rep_slots], np.eye(G), -np.ones((G, 1))])
    return LpProblem(phy2log, ranks, single, slot_of_single[single], replicated, rep_slots,
                     np.vstack([top, bottom]), on_rank[:, slot_of_single[single]])


def lp_inputs(lp: LpProblem, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A [S, NC, NV], b [S, NC], t1 [S, len(single)]) for the batches' ``counts [S, E]``, as SGLang's
    prep kernel builds them: shares of the total, the z column making ``x = 1`` feasible."""
    counts = np.asarray(counts, np.float64)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    t1 = share[:, lp.single]
    b = np.concatenate([share[:, lp.replicated], -(t1 @ lp.rank_single.T)], axis=1)
    S = counts.shape[0]
    z = b - lp.A_base.sum(axis=1)[None, :]
    A = np.concatenate([np.broadcast_to(lp.A_base, (S, *lp.A_base.shape)), z[:, :, None]], axis=2)
    return A, b, t1


def barrier_solve(A: np.ndarray, b: np.ndarray, c: np.ndarray, iters: int = BARRIER_ITERS) -> np.ndarray:
    """x [S, NV]: ``iters`` affine-scaling steps from ``x = 1`` for ``min c x, A x = b, x >= 0`` (one LP
    per row of ``A [S, NC, NV]``), 0.5 everywhere for a row that did not converge, as SGLang's solver."""
    S, NC, NV = A.shape
    x = np.ones((S, NV))
    d_max = np.zeros(S)
    jitter = 1e-12 * np.eye(NC)
    for _ in range(iters):
        ax2 = A * (x * x)[:, None, :]
        kkt = ax2 @ np.swapaxes(A, 1, 2) + jitter
        delta = np.linalg.solve(kkt, (ax2 @ c)[:, :, None])[:, :, 0]
        d = x * (c[None, :] - (np.swapaxes(A, 1, 2) @ delta[:, :, None])[:, :, 0])
        d_max = d.max(axis=1)
        alpha = np.where(d_max > 1e-9, STEP / np.where(d_max > 1e-9, d_max, 1.0), 1.0)
        x = x * (1.0 - alpha[:, None] * d)
    residual = np.abs((A @ x[:, :, None])[:, :, 0] - b).max(axis=1)
    converged = (d_max < 0.1) & (x[:, -1] >= 0) & (x[:, -1] < 1e-4) & (residual < 0.05)
    return np.where(converged[:, None], x, 0.5)


def slot_probabilities(lp: LpProblem, counts: np.ndarray) -> np.ndarray:
    """[S, P] probability that a pair of a slot's expert goes to that slot (0 for an expert without tokens)."""
    counts = np.asarray(counts, np.float64)
    A, b, t1 = lp_inputs(lp, counts)
    x = barrier_solve(A, b, lp.objective)
    S, P = counts.shape[0], lp.phy2log.shape[0]
    weight = np.zeros((S, P))
    weight[:, lp.single_slot] = t1
    weight[:, lp.replicated_slots] = np.maximum(x[:, :lp.replicated_slots.size], 0.0)
    expert = lp.phy2log
    row_sum = np.zeros((S, counts.shape[1]))
    np.add.at(row_sum.T, expert, weight.T)
    uniform = 1.0 / np.bincount(expert, minlength=counts.shape[1])[expert]      # SGLang's zero-sum fallback
    prob = np.where(row_sum[:, expert] > 0, weight / np.where(row_sum[:, expert] > 0, row_sum[:, expert], 1.0),
                    uniform[None, :])
    return np.where(counts[:, expert] > 0, prob, 0.0)


def expected_loads(lp: LpProblem, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(expected distinct experts [S, G], expected pairs [S, G]) per rank under LPLB for ``counts [S, E]``."""
    counts = np.asarray(counts, np.float64)
    prob = slot_probabilities(lp, counts)
    n = counts[:, lp.phy2log]
    S, P, G = counts.shape[0], lp.phy2log.shape[0], lp.ranks
    reads = (1.0 - (1.0 - prob) ** n).reshape(S, G, P // G).sum(axis=2)
    return reads, (prob * n).reshape(S, G, P // G).sum(axis=2)
