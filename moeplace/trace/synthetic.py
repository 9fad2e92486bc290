"""SYNTHETIC Kimi-K2-shaped routing for tests and benchmarks: not real model data.

61 layers with the first dense, 384 experts, top-8 by default. Skew: expert popularity follows a
Zipf law per layer. Co-activation: experts belong to latent topics; each step draws one topic
mixture, so the tokens of one step (a verify window of one sequence) share experts, as real
decode traces do.
"""

from __future__ import annotations

import numpy as np

from moeplace.model import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.store import TraceHeader

KIMI_K2 = ModelSpec("SYNTHETIC kimi-k2-shaped", 61, tuple(range(1, 61)), 384, 8)


def synthetic_steps(num_steps: int, tokens_per_step: int = 9, model: ModelSpec = KIMI_K2,
                    skew: float = 1.0, coactivation: float = 0.7, num_topics: int = 16,
                    mode: int = M.TARGET_VERIFY, seed: int = 0) -> tuple[TraceHeader, RoutingSteps]:
    """Steps of ``tokens_per_step`` tokens each, ids [S * tokens, L, K].

    skew: Zipf exponent of expert popularity (0 = uniform).
    coactivation: weight of the step's topic in each token's routing (0 = independent tokens).
    """
    rng = np.random.default_rng(seed)
    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    T = num_steps * tokens_per_step
    ids = np.empty((T, L, K), np.int16)
    for layer in range(L):
        popularity = 1.0 / np.arange(1, E + 1) ** skew
        popularity = np.log(popularity[rng.permutation(E)] / popularity.sum())
        topics = rng.normal(0, 2.0, (num_topics, E))
        step_topic = rng.integers(num_topics, size=num_steps)
        base = (popularity[None] + coactivation * topics[step_topic]).astype(np.float32)
        gumbel = -np.log(-np.log(rng.random((T, E), dtype=np.float32) + np.float32(1e-12)))
        logits = base.repeat(tokens_per_step, axis=0) + gumbel
        ids[:, layer, :] = np.argpartition(-logits, K - 1, axis=1)[:, :K]
    steps = RoutingSteps.from_topk(model, ids, np.full(num_steps, tokens_per_step), mode)
    header = TraceHeader(model=model, source="synthetic",
                         notes=f"SYNTHETIC: skew={skew} coactivation={coactivation} topics={num_topics} seed={seed}")
    return header, steps


def steps_from_counts(model: ModelSpec, counts: np.ndarray, num_steps: int, tokens_per_step: int = 9,
                      seed: int = 0) -> RoutingSteps:
    """Steps sampled from aggregate counts [L, E]: each token draws top-k distinct experts in
    proportion to their counts, independently. For traces that have no per-step information; it
    loses all co-activation, so a step-aware placement made from it is only load-aware."""
    rng = np.random.default_rng(seed)
    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    T = num_steps * tokens_per_step
    ids = np.empty((T, L, K), np.int16)
    for layer in range(L):
        logp = np.log(np.maximum(counts[layer], 1e-12) / max(counts[layer].sum(), 1e-12)).astype(np.float32)
        gumbel = -np.log(-np.log(rng.random((T, E), dtype=np.float32) + np.float32(1e-12)))
        ids[:, layer, :] = np.argpartition(-(logp + gumbel), K - 1, axis=1)[:, :K]
    return RoutingSteps.from_topk(model, ids, np.full(num_steps, tokens_per_step), M.UNKNOWN)
