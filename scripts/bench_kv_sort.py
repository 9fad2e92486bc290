#!/usr/bin/env python
"""How contiguous are a request's KV slots, with and without SGLang's free-list sort (``need_sort``)?

Question: How contiguous are a request's KV slots with and without SGLang's free-list sort?
Baseline: SGLang's real allocator without the sort, under the same seeded churn.
Output: a table on stdout; --json FILE writes the figures.

Runs SGLang 0.5.23's real ``TokenToKVPoolAllocator`` (page size 1, CPU tensors, no KV pool behind it:
the allocator only hands out slot ids) under a seeded serving churn, the way SGLang's scheduler calls it:

- an extend (prefill) batch takes ONE ``alloc(sum of prompt lengths)`` and splits it in request order;
- a decode step takes ONE ``alloc(batch size)``: slot i goes to running request i;
- with ``--draft D`` each decode step takes ``alloc(batch * D)`` (D draft slots per request), keeps an
  accepted prefix of 1..D and frees the rejected rest right away (EAGLE-style verify);
- finished requests free all their slots.

Every ``--sample-every`` steps, for each live request: the number of contiguous runs in its slot list
(prompt part alone, and whole sequence). Reported: mean runs per request and share of requests that
are one run, plus the wall time spent inside alloc/free.

    python scripts/bench_kv_sort.py                  # table to stdout
    python scripts/bench_kv_sort.py --json out.json  # also the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator


@dataclass
class Request:
    prompt: int
    output: int
    slots: list[np.ndarray] = field(default_factory=list)  # chunks in allocation order
    generated: int = 0

    def all_slots(self) -> np.ndarray:
        return np.concatenate(self.slots)


def count_runs(slots: np.ndarray) -> int:
    """Maximal runs of consecutive slot ids, in sequence order ([n] -> int)."""
    if slots.size == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(slots) != 1))


def sample_lengths(rng: np.random.Generator) -> tuple[int, int]:
    """Mixed traffic: 70% chat-sized prompts, 30% long documents; outputs 32..512."""
    if rng.random() < 0.7:
        prompt = int(rng.integers(32, 512))
    else:
        prompt = int(rng.integers(1024, 4096))
    return prompt, int(rng.integers(32, 512))


def run(need_sort: bool, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    allocator = TokenToKVPoolAllocator(args.pool, torch.bfloat16, "cpu", None, need_sort)
    running: list[Request] = []
    waiting: list[Request] = []
    prompt_runs, total_runs, alloc_seconds = [], [], 0.0
    D = args.draft

    for step in range(args.steps):
        for _ in range(rng.poisson(args.arrivals)):
            waiting.append(Request(*sample_lengths(rng)))

        # Extend batch: admit in arrival order while the pool keeps decode headroom.
        admitted: list[Request] = []
        budget = allocator.available_size() - args.headroom - (len(running) + 1) * D
        while waiting and len(running) + len(admitted) < args.max_running and waiting[0].prompt <= budget:
            budget -= waiting[0].prompt
            admitted.append(waiting.pop(0))
        if admitted:
            t = time.perf_counter()
            out = allocator.alloc(sum(r.prompt for r in admitted))
            alloc_seconds += time.perf_counter() - t
            assert out is not None
            offsets = np.cumsum([0] + [r.prompt for r in admitted])
            out = out.numpy()
            for r, lo, hi in zip(admitted, offsets[:-1], offsets[1:]):
                r.slots.append(out[lo:hi])
            running.extend(admitted)

        # Decode step: one allocation for the whole batch.
        if running:
            t = time.perf_counter()
            out = allocator.alloc(len(running) * D)
            alloc_seconds += time.perf_counter() - t
            if out is None:  # out of memory: retract the newest request, as SGLang would
                victim = running.pop()
                allocator.free(torch.from_numpy(victim.all_slots()))
                waiting.insert(0, Request(victim.prompt, victim.output))
                continue
            out = out.numpy().reshape(len(running), D)
            rejected = []
            for r, draft in zip(running, out):
                keep = int(rng.integers(1, D + 1)) if D > 1 else 1
                r.slots.append(draft[:keep])
                rejected.append(draft[keep:])
                r.generated += keep
            if D > 1:
                t = time.perf_counter()
                allocator.free(torch.from_numpy(np.concatenate(rejected)))
                alloc_seconds += time.perf_counter() - t

        # Finished requests free their slots.
        still = []
        for r in running:
            if r.generated >= r.output:
                t = time.perf_counter()
                allocator.free(torch.from_numpy(r.all_slots()))
                alloc_seconds += time.perf_counter() - t
            else:
                still.append(r)
        running = still

        if step >= args.warmup and step % args.sample_every == 0:
            for r in running:
                prompt_runs.append(count_runs(r.slots[0]))
                total_runs.append(count_runs(r.all_slots()))

    prompt_runs_a, total_runs_a = np.array(prompt_runs), np.array(total_runs)
    return {
        "need_sort": need_sort, "samples": int(prompt_runs_a.size),
        "prompt_runs_mean": float(prompt_runs_a.mean()), "prompt_one_run_share": float((prompt_runs_a == 1).mean()),
        "total_runs_mean": float(total_runs_a.mean()), "total_one_run_share": float((total_runs_a == 1).mean()),
        "alloc_free_seconds": alloc_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", type=int, default=65536, help="KV slots in the pool")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=1000, help="steps before sampling (pool fills up)")
    parser.add_argument("--sample-every", type=int, default=25)
    parser.add_argument("--arrivals", type=float, default=0.5, help="mean new requests per step")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--headroom", type=int, default=512, help="slots kept free for decode")
    parser.add_argument("--draft", type=int, nargs="+", default=[1, 4], help="draft slots per request per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    rows = []
    for draft in args.draft:
        for need_sort in (False, True):
            ns = argparse.Namespace(**{**vars(args), "draft": draft})
            rows.append({"draft": draft, **run(need_sort, ns)})

    print(f"pool {args.pool} slots, {args.steps} steps (sampled after {args.warmup}), seed {args.seed}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    header = ("draft", "need_sort", "samples", "prompt runs", "prompt 1-run", "seq runs", "seq 1-run", "alloc+free s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['draft']} | {'on' if r['need_sort'] else 'off'} | {r['samples']} | {r['prompt_runs_mean']:.2f} | "
              f"{r['prompt_one_run_share']:.1%} | {r['total_runs_mean']:.1f} | {r['total_one_run_share']:.1%} | "
              f"{r['alloc_free_seconds']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
