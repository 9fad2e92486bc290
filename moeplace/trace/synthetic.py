"""SYNTHETIC routing for tests, benchmarks and ``moeplace trace synth``: not real model data.

Dimension letters: S steps, T token rows, L MoE layers, K top-k, E experts, C topics.

The model of routing: in each MoE layer, expert popularity follows a Zipf law (``skew``) over a
random order of the experts. Co-activation: every step draws one of C latent topics per layer, and
its tokens route by ``popularity + coactivation * topic`` logits, so the tokens of one step (a
verify window of one sequence) share experts, as real decode traces do. Each token takes K distinct
experts by sampling without replacement in proportion to ``softmax(logits)``: the distribution of
the top-K of Gumbel-perturbed logits, drawn here as the first K distinct of independent draws
(equal in law, and a table lookup per draw instead of a sort of E noisy logits per token).

Steps are made a chunk at a time (``synthetic_chunks``), so 200,000 Kimi-K2-shaped steps stream to
disk in bounded memory; the same seed and number of steps give the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import CHUNK_BYTES, MAX_CHUNK_STEPS, TraceHeader

KIMI_K2 = ModelSpec("SYNTHETIC kimi-k2-shaped", 61, tuple(range(1, 61)), 384, 8)

# Shapes `moeplace trace synth --shape` knows: the routed-expert layout of each model's config.json.
SHAPES: dict[str, tuple[str, ModelSpec]] = {
    "kimi-k2": ("moonshotai/Kimi-K2-Instruct", KIMI_K2),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", ModelSpec("SYNTHETIC deepseek-v3-shaped", 61, tuple(range(3, 61)), 256, 8)),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", ModelSpec.all_moe("SYNTHETIC qwen3-235b-a22b-shaped", 94, 128, 8)),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", ModelSpec.all_moe("SYNTHETIC qwen3-30b-a3b-shaped", 48, 128, 8)),
    "gpt-oss-120b": ("openai/gpt-oss-120b", ModelSpec.all_moe("SYNTHETIC gpt-oss-120b-shaped", 36, 128, 4)),
    "gpt-oss-20b": ("openai/gpt-oss-20b", ModelSpec.all_moe("SYNTHETIC gpt-oss-20b-shaped", 24, 32, 4)),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", ModelSpec.all_moe("SYNTHETIC mixtral-8x7b-shaped", 32, 8, 2)),
}


@dataclass(frozen=True)
class SyntheticRouting:
    """How synthetic steps are drawn (the header's notes repeat it).

    skew: Zipf exponent of expert popularity (0 = uniform).
    coactivation: weight of the step's topic in each token's logits (0 = independent tokens).
    """

    model: ModelSpec = KIMI_K2
    tokens_per_step: int = 9
    skew: float = 1.0
    coactivation: float = 0.7
    num_topics: int = 16
    mode: int = M.TARGET_VERIFY
    seed: int = 0

    def header(self, notes: str = "") -> TraceHeader:
        return TraceHeader(model=self.model, source="synthetic",
                           notes=f"SYNTHETIC: skew={self.skew} coactivation={self.coactivation} "
                                 f"topics={self.num_topics} tokens/step={self.tokens_per_step} seed={self.seed}"
                                 + (f"; {notes}" if notes else ""))


def synthetic_chunks(routing: SyntheticRouting, num_steps: int) -> Iterator[RoutingSteps]:
    """``num_steps`` steps of ``routing.tokens_per_step`` tokens each, a trace chunk at a time.

    Each chunk: topk_ids [S_c * tokens_per_step, L, K], about CHUNK_BYTES, drawn from its own
    generator (seed, chunk index).
    """
    model, B, C = routing.model, routing.tokens_per_step, routing.num_topics
    L, E, K = model.num_moe_layers, model.num_experts, model.top_k
    chunk_steps = steps_per_chunk(routing)
    rng = np.random.default_rng(routing.seed)
    popularity = 1.0 / np.arange(1, E + 1) ** routing.skew
    log_pop = np.log(popularity / popularity.sum())
    # [L, C, E] logits per layer and topic: a random popularity order per layer, topics ~ N(0, 2).
    logits = np.stack([log_pop[rng.permutation(E)] for _ in range(L)])[:, None, :] \
        + routing.coactivation * rng.normal(0, 2.0, (L, C, E))
    probs = softmax(logits)
    tables = [alias_tables(p) for p in probs]
    for c, start in enumerate(range(0, num_steps, chunk_steps)):
        S = min(chunk_steps, num_steps - start)
        chunk_rng = np.random.default_rng([routing.seed, c])
        topic = chunk_rng.integers(C, size=(L, S))
        ids = np.empty((S * B, L, K), np.int16)
        for layer in range(L):
            ids[:, layer, :] = sample_topk(chunk_rng, probs[layer], np.repeat(topic[layer], B), K,
                                           tables=tables[layer])
        yield RoutingSteps.from_topk(model, ids, np.full(S, B), routing.mode)


def steps_per_chunk(routing: SyntheticRouting) -> int:
    """Steps in each chunk ``synthetic_chunks`` makes: about CHUNK_BYTES of int16 ids, at least one."""
    m = routing.model
    return max(1, min(MAX_CHUNK_STEPS, CHUNK_BYTES // (routing.tokens_per_step * m.num_moe_layers * m.top_k * 2)))


def working_bytes(routing: SyntheticRouting) -> int:
    """About the most memory ``synthetic_chunks`` and the trace writer hold at once: the [L, C, E]
    logits, probabilities and alias tables, one chunk's int16 ids three times over (the chunk being
    made, the one being written, its packed form) and one layer's draws (2K draws a row, each in six
    8-byte arrays and temporaries). Measured peaks at 0.2M and 1M tokens per step stay below it."""
    m = routing.model
    L, E, K = m.num_moe_layers, m.num_experts, m.top_k
    rows = steps_per_chunk(routing) * routing.tokens_per_step
    return L * routing.num_topics * E * 8 * 4 + rows * (3 * L * K * 2 + 2 * K * 8 * 6)


def synthetic_steps(num_steps: int, tokens_per_step: int = 9, model: ModelSpec = KIMI_K2,
                    skew: float = 1.0, coactivation: float = 0.7, num_topics: int = 16,
                    mode: int = M.TARGET_VERIFY, seed: int = 0) -> tuple[TraceHeader, RoutingSteps]:
    """All of ``synthetic_chunks`` in memory: ids [num_steps * tokens_per_step, L, K]."""
    routing = SyntheticRouting(model, tokens_per_step, skew, coactivation, num_topics, mode, seed)
    parts = list(synthetic_chunks(routing, num_steps))
    return routing.header(), concat_steps(parts) if parts else RoutingSteps.empty(model)


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
        # an expert with no tokens gets a share of 1e-12: drawn only when fewer than K have tokens
        probs = np.maximum(counts[layer], 1e-12)[None]
        ids[:, layer, :] = sample_topk(rng, probs / probs.sum(), np.zeros(T, np.int64), K)
    return RoutingSteps.from_topk(model, ids, np.full(num_steps, tokens_per_step), M.UNKNOWN)


def softmax(logits: np.ndarray) -> np.ndarray:
    """[D, E] logits -> [D, E] probabilities per row."""
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def alias_tables(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias tables of D distributions ([D, E] rows summing to 1), Vose's construction.

    Returns (keep [D, E] float64, alias [D, E] int64): a draw picks a column j uniformly, then keeps j
    with probability keep[d, j], else takes alias[d, j]. One lookup per draw, whatever E is.
    """
    D, E = probs.shape
    keep = np.ones((D, E))
    alias = np.tile(np.arange(E), (D, 1))
    for d in range(D):
        scaled = (probs[d] * (E / probs[d].sum())).tolist()
        small = [j for j in range(E) if scaled[j] < 1.0]
        large = [j for j in range(E) if scaled[j] >= 1.0]
        while small and large:
            s, g = small.pop(), large[-1]
            keep[d, s], alias[d, s] = scaled[s], g
            scaled[g] += scaled[s] - 1.0
            if scaled[g] < 1.0:
                small.append(large.pop())
        # what is left has scaled mass 1 up to rounding: keep = 1, as initialised
    return keep, alias


def sample_topk(rng: np.random.Generator, probs: np.ndarray, dist: np.ndarray, k: int,
                rounds: int = 4, tables: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[N, k] distinct experts per row, row n drawn without replacement from ``probs[dist[n]]``
    ([D, E], rows summing to 1), in draw order.

    The first k distinct values of independent draws are a draw without replacement: each new
    expert comes in proportion to its probability among those not yet drawn. Rows draw 2k at a time
    (alias tables: one lookup a draw) until they have k distinct; a row's draws are extended, never
    restarted, so no row is biased toward experts that come up fast. Rows still short after
    ``rounds`` (most of their mass already drawn) take the rest one by one among the experts not
    yet drawn, which is the same law. tables: ``alias_tables(probs)`` if the caller keeps them.
    """
    D, E = probs.shape
    keep, alias = tables if tables is not None else alias_tables(probs)
    keep, alias = keep.ravel(), alias.ravel()
    dist = np.asarray(dist, np.int64)
    out = np.empty((dist.shape[0], k), np.int16)
    pending = np.arange(dist.shape[0])
    draws = np.empty((pending.size, 0), np.int16)
    for _ in range(rounds):
        if not pending.size:
            return out
        x = rng.random((pending.size, 2 * k)) * E      # column: integer part; keep test: fraction
        column = np.minimum(x.astype(np.int64), E - 1)
        slot = dist[pending, None] * E + column
        new = np.where(x - column < keep[slot], column, alias[slot])
        draws = np.concatenate([draws, new.astype(np.int16)], axis=1)
        first = _first_occurrences(draws)
        done = first.sum(axis=1) >= k
        chosen = first[done] & (np.cumsum(first[done], axis=1) <= k)
        out[pending[done]] = draws[done][chosen].reshape(-1, k)
        pending, draws, first = pending[~done], draws[~done], first[~done]
    for row, seq, is_first in zip(pending, draws, first):
        out[row] = _finish_without_replacement(rng, probs[dist[row]], list(seq[is_first]), k)
    return out


def sample_topk_gumbel(rng: np.random.Generator, probs: np.ndarray, dist: np.ndarray, k: int) -> np.ndarray:
    """The slow exact rule ``sample_topk`` is tested against: [N, k] the k largest of ``log probs[dist[n]]``
    plus Gumbel noise (a sort of E noisy logits per row; how this module drew tokens before)."""
    logits = np.log(np.maximum(probs[np.asarray(dist, np.int64)], 1e-300))
    gumbel = -np.log(-np.log(rng.random(logits.shape) + 1e-300))
    return np.argsort(-(logits + gumbel), axis=1)[:, :k].astype(np.int16)


def _first_occurrences(draws: np.ndarray) -> np.ndarray:
    """[N, D] bool: draws[n, j] differs from every draws[n, :j]."""
    first = np.ones(draws.shape, bool)
    for j in range(1, draws.shape[1]):
        first[:, j] = (draws[:, :j] != draws[:, j:j + 1]).all(axis=1)
    return first


def _finish_without_replacement(rng: np.random.Generator, p: np.ndarray, picked: list[int], k: int) -> list[int]:
    """Extend ``picked`` to k distinct experts, each next one in proportion to ``p`` [E] among the rest
    (uniformly if the rest have no mass)."""
    unpicked = np.ones(p.size, bool)
    unpicked[picked] = False
    while len(picked) < k:
        weights = np.where(unpicked, p, 0.0)
        if weights.sum() <= 0:
            weights = unpicked.astype(np.float64)
        choice = int(rng.choice(p.size, p=weights / weights.sum()))
        picked.append(choice)
        unpicked[choice] = False
    return picked
