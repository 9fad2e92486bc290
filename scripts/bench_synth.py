"""Synthetic trace generation: the streamed alias-table sampler against the previous generator.

Question: How fast and how lean is the synthetic trace generator?
Baseline: the previous generator, kept in this file as it was, run in the same process on the same routing law.
Output: a table on stdout; --json FILE writes the figures.

    python scripts/bench_synth.py [--steps 3000] [--json out.json]

Both make Kimi-K2-shaped steps (60 MoE layers, 384 experts, top-8, 9 tokens a step) with the same
routing law: per layer a Zipf popularity and topic logits, each token the top-8 of Gumbel-perturbed
logits. The previous generator (kept below as the baseline, as it was) draws E Gumbel numbers per
token and layer for the whole trace at once and partitions them; the current one
(``moeplace.trace.synthetic``) draws without replacement from alias tables a chunk at a time. Times
and peak traced memory (tracemalloc, numpy's arrays included) are measured in this process, as is
the mean number of distinct experts a step activates per layer, which the two must share.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from moeplace.trace.steps import RoutingSteps, concat_steps
from moeplace.trace.store import write_chunks
from moeplace.trace.synthetic import KIMI_K2, SyntheticRouting, synthetic_chunks


def previous_generator(num_steps: int, tokens_per_step: int = 9, seed: int = 0) -> np.ndarray:
    """The generator before the streamed one: ids [S * tokens, L, K], all in memory."""
    rng = np.random.default_rng(seed)
    L, E, K = KIMI_K2.num_moe_layers, KIMI_K2.num_experts, KIMI_K2.top_k
    T = num_steps * tokens_per_step
    ids = np.empty((T, L, K), np.int16)
    for layer in range(L):
        popularity = 1.0 / np.arange(1, E + 1) ** 1.0
        popularity = np.log(popularity[rng.permutation(E)] / popularity.sum())
        topics = rng.normal(0, 2.0, (16, E))
        step_topic = rng.integers(16, size=num_steps)
        base = (popularity[None] + 0.7 * topics[step_topic]).astype(np.float32)
        gumbel = -np.log(-np.log(rng.random((T, E), dtype=np.float32) + np.float32(1e-12)))
        logits = base.repeat(tokens_per_step, axis=0) + gumbel
        ids[:, layer, :] = np.argpartition(-logits, K - 1, axis=1)[:, :K]
    return ids


def current_generator(num_steps: int, out: Path | None = None) -> np.ndarray | None:
    """The streamed generator: to ``out`` (chunks written on a second thread), or into memory."""
    routing = SyntheticRouting(KIMI_K2)
    if out is not None:
        write_chunks(out, routing.header(), synthetic_chunks(routing, num_steps))
        return None
    return concat_steps(list(synthetic_chunks(routing, num_steps))).topk_ids


def distinct_per_step(ids: np.ndarray, tokens_per_step: int = 9) -> float:
    """Mean distinct experts a step activates in one layer. ids: [S * tokens, L, K]."""
    T, L, K = ids.shape
    per_step = ids.reshape(T // tokens_per_step, tokens_per_step * 1, L, K).transpose(0, 2, 1, 3)
    flat = np.sort(per_step.reshape(per_step.shape[0], L, -1), axis=2)
    return float(((np.diff(flat, axis=2) != 0).sum(axis=2) + 1).mean())


def measure(fn, *args) -> tuple[float, float, object]:
    """(seconds, peak traced MB, result) of fn(*args): timed without tracing, then traced once more."""
    start = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    fn(*args)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return seconds, peak, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    S = args.steps
    rows = {}
    t, peak, old_ids = measure(previous_generator, S)
    rows["previous (whole trace, Gumbel + partition)"] = (t, peak, distinct_per_step(old_ids))
    del old_ids
    t, peak, new_ids = measure(current_generator, S)
    rows["current, in memory"] = (t, peak, distinct_per_step(new_ids))
    del new_ids
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (S, 10 * S):   # streamed: memory does not grow with the trace
            t, peak, _ = measure(current_generator, n, Path(tmp) / "t.mptrace")
            rows[f"current, {n} steps streamed to disk"] = (t, peak, float("nan"))
            sizes[f"current, {n} steps streamed to disk"] = n
    base_t, base_peak = rows["previous (whole trace, Gumbel + partition)"][:2]
    print(f"Kimi-K2-shaped steps, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{'generator':45} {'steps':>7} {'s':>7} {'steps/s':>8} {'x rate':>7} {'peak MB':>8} {'E[distinct]/layer':>18}")
    out = {}
    for name, (t, peak, distinct) in rows.items():
        n = sizes.get(name, S)
        print(f"{name:45} {n:7} {t:7.2f} {n / t:8.0f} {n / t / (S / base_t):7.2f} {peak:8.0f} {distinct:18.3f}")
        out[name] = {"steps": n, "seconds": t, "peak_mb": peak, "distinct": distinct}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
