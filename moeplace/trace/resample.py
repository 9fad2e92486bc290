"""Batches of other sizes built from a trace's steps: whole verify windows of random requests, so the tokens
of one request keep the experts they share (``advise`` and the dispatch evaluation cost every batch size
from the held-out steps this way)."""

from __future__ import annotations

import numpy as np

from moeplace.errors import MoeplaceError
from moeplace.trace.steps import RoutingSteps


def resample_batches(steps: RoutingSteps, batch: int, num_steps: int, seed: int = 0) -> RoutingSteps:
    """``num_steps`` steps of ``batch`` tokens each, built from whole steps of ``steps``.

    A batch of B tokens is the concatenation of random steps (verify windows of different requests),
    cut to B rows, so tokens of one request keep their shared experts. Needs token-row steps.
    """
    return resample_requests(steps, batch, num_steps, seed)[0]


def resample_requests(steps: RoutingSteps, batch: int, num_steps: int,
                      seed: int = 0) -> tuple[RoutingSteps, np.ndarray]:
    """``resample_batches`` and, for each of its token rows, the request (the drawn step, 0, 1, ...
    within its batch) it comes from: [num_steps * batch]."""
    lengths = np.diff(steps.token_offsets)
    usable = np.flatnonzero(lengths > 0)
    if usable.size == 0:
        raise MoeplaceError("the trace has no token-row steps to build batches from")
    rng = np.random.default_rng(seed)
    rows, requests = [], []
    for _ in range(num_steps):
        picked: list[np.ndarray] = []
        have = 0
        while have < batch:
            s = usable[rng.integers(usable.size)]
            picked.append(np.arange(steps.token_offsets[s], steps.token_offsets[s + 1]))
            have += picked[-1].size
        rows.append(np.concatenate(picked)[:batch])
        requests.append(np.repeat(np.arange(len(picked)), [r.size for r in picked])[:batch])
    ids = steps.topk_ids[np.concatenate(rows)]
    batches = RoutingSteps.from_topk(steps.model, ids, np.full(num_steps, batch), steps.modes[usable[0]])
    return batches, np.concatenate(requests)
