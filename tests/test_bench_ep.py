"""scripts/bench_ep.py: the pure parts (pair slots, SGLang's block layout, rank weights) and the CPU path.

The per-rank MoE of every placement, summed over ranks as the all-reduce does, must equal a dense MoE
of the same weights; ``cpu-check`` runs the same code on 2 gloo processes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplace.algorithms import PlacementProblem, solve
from moeplace.cost.derive import sglang_row_blocks, sglang_sorted_rows
from moeplace.model.spec import ModelSpec
from moeplace.trace.synthetic import synthetic_steps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("bench_ep", ROOT / "scripts" / "bench_ep.py")
bench_ep = importlib.util.module_from_spec(spec)
sys.modules["bench_ep"] = bench_ep   # its dataclasses look their module up
spec.loader.exec_module(bench_ep)
import replay_placement  # noqa: E402  (scripts/ is on sys.path)

MODEL = ModelSpec("SYNTHETIC test", 3, (1, 2), 16, 4)


@pytest.fixture(scope="module")
def steps():
    _, s = synthetic_steps(24, tokens_per_step=9, model=MODEL, seed=5)
    return s


def placements(steps, ranks: int) -> dict[str, tuple[np.ndarray, str]]:
    out = {}
    for tag, alg, red, dispatch in [("contiguous", "contiguous", 0, "dynamic"),
                                    ("deepseek+r4", "deepseek", 4, "dynamic"),
                                    ("balanced+r4", "stepaware", 4, "balanced")]:
        problem = PlacementProblem(MODEL, steps, ranks, redundant=red, dispatch=dispatch, effort=1e5)
        out[tag] = (solve(alg, problem), dispatch)
    return out


def align_oracle(ids: np.ndarray, num_local: int, bm: int) -> tuple[list[list[int]], list[int]]:
    """Buckets in order (-1 first), each the pairs of that id in pair order, padded to whole blocks."""
    flat = ids.reshape(-1)
    blocks, experts = [], []
    for e in range(-1, num_local):
        pairs = [int(p) for p in np.flatnonzero(flat == e)]
        for b in range(0, len(pairs), bm):
            blocks.append(pairs[b:b + bm])
            experts.append(e)
    return blocks, experts


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 8), st.integers(1, 40), st.sampled_from([1, 4, 16, 64]), st.integers(0, 10**6))
def test_align_layout_is_sglangs_bucket_layout(tokens, top_k, num_local, bm, seed) -> None:
    """The layout bench_ep and the emulation share (calibrate_cost.align_layout); its buffer size
    is checked against SGLang's own code in tests/test_cost_derive.py."""
    ids = np.random.default_rng(seed).integers(-1, num_local, size=(tokens, top_k))
    sorted_ids, expert_ids, padded = bench_ep.align_layout(ids, num_local, bm)
    numel = ids.size
    assert sorted_ids.size == sglang_sorted_rows(numel, num_local, bm)
    assert expert_ids.size == sglang_row_blocks(numel, num_local, bm)
    blocks, experts = align_oracle(ids, num_local, bm)
    assert padded == len(blocks) * bm <= sorted_ids.size
    for b, (pairs, e) in enumerate(zip(blocks, experts)):
        got = sorted_ids[b * bm:(b + 1) * bm]
        assert list(got[:len(pairs)]) == pairs and (got[len(pairs):] == numel).all()
        assert expert_ids[b] == e
    assert (sorted_ids[padded:] == numel).all() and (expert_ids[len(blocks):] == -1).all()


def test_pair_slots_follow_the_rule_and_local_ids_split_pairs(steps) -> None:
    ranks = 2
    for tag, (phy2log, dispatch) in placements(steps, ranks).items():
        spr = phy2log.shape[1] // ranks
        for layer in range(MODEL.num_moe_layers):
            step_of_row, _, ids = steps.layer(layer)
            slots = bench_ep.pair_slots(steps, layer, phy2log[layer], ranks, dispatch)
            assert (phy2log[layer][slots] == ids).all()          # each pair goes to a replica of its expert
            owners = np.stack([bench_ep.local_ids(slots, r, spr) >= 0 for r in range(ranks)])
            assert (owners.sum(axis=0) == 1).all()                # exactly one rank runs each pair
            if dispatch == "balanced":                            # one replica per expert and step
                key = step_of_row[:, None] * MODEL.num_experts + ids
                for k in np.unique(key):
                    assert np.unique(slots[key == k]).size == 1


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_sum_to_the_dense_moe(steps, ranks) -> None:
    """Each rank's MoE (torch kernel stand-in over SGLang's layout), summed as the all-reduce does."""
    import torch
    hidden, inter, layer = 12, 8, 1
    w13, w2 = bench_ep.logical_weights(MODEL.num_experts, hidden, inter, seed=1)
    rows = slice(int(steps.token_offsets[3]), int(steps.token_offsets[4]))
    topk_w = np.random.default_rng(2).random((rows.stop - rows.start, MODEL.top_k)).astype(np.float32)
    experts = bench_ep.TorchExperts()
    for tag, (phy2log, dispatch) in [*placements(steps, ranks).items(), ("tp", (None, "dynamic"))]:
        p = None if phy2log is None else phy2log[layer]
        slots = bench_ep.pair_slots(steps, layer, p, ranks, dispatch)[rows]
        total, x = 0, None
        for r in range(ranks):
            lw13, lw2 = bench_ep.rank_weights(w13, w2, p, r, ranks)
            spr = lw13.shape[0]
            rl = bench_ep.RankLayers(experts, [torch.from_numpy(lw13)], [torch.from_numpy(np.ascontiguousarray(lw2))],
                                     slots.shape[0], MODEL.top_k, hidden, lw2.shape[2], torch.float32, "cpu")
            inp = bench_ep.layer_inputs(experts, bench_ep.rank_ids(slots, r, spr, p is None), topk_w, spr,
                                        lw2.shape[2], hidden, "cpu")
            total = total + rl.step([inp], all_reduce=False).numpy().astype(np.float64)
            x = rl.x.numpy()
        logical = slots if p is None else p[slots]
        ref = bench_ep.dense_moe(x, logical, topk_w, w13, w2)
        assert np.linalg.norm(total - ref) <= 1e-5 * np.linalg.norm(ref), tag


def test_tp_slices_cover_every_expert_once() -> None:
    w13, w2 = bench_ep.logical_weights(3, 4, 6, seed=0)
    parts = [bench_ep.rank_weights(w13, w2, None, r, 3) for r in range(3)]
    gate = np.concatenate([p[0][:, :2] for p in parts], axis=1)
    up = np.concatenate([p[0][:, 2:] for p in parts], axis=1)
    assert (gate == w13[:, :6]).all() and (up == w13[:, 6:]).all()
    assert (np.concatenate([p[1] for p in parts], axis=2) == w2).all()


def test_emulation_order_is_step_major_and_complete(steps) -> None:
    index = replay_placement.WorkIndex()
    placed = placements(steps, 2)
    arrays = replay_placement.index_workloads(index, "t", steps, placed, 2, 8, 8)
    tags = [*placed, "tp"]
    order = bench_ep.emulation_order(arrays, tags, index.jobs, layers=1)
    for job in index.jobs:
        mine = [t for t in tags if str(arrays[f"job/{t}"]) == job]
        needed = set().union(*(set(arrays[f"idx/{t}"][:, :1].ravel()) for t in mine))
        assert set(order[job]) == needed and len(order[job]) == len(needed)
        first_step = set().union(*(set(arrays[f"idx/{t}"][0, :1].ravel()) for t in mine))
        assert set(order[job][:len(first_step)]) == first_step     # step 0's workloads come first
    # a cut after k workloads keeps whole leading steps: timed_steps counts them
    job = str(arrays["job/contiguous"])
    assert replay_placement.timed_steps(len(index.jobs[job]["keys"]), arrays["idx/contiguous"]) == steps.num_steps
    assert replay_placement.timed_steps(0, arrays["idx/contiguous"]) == 0


def test_job_deadlines_share_the_budget_by_size() -> None:
    assert replay_placement.job_deadlines([1, 3], 100.0, 8.0) == [102.0, 108.0]
    assert bench_ep.step_summary(np.array([1.0, np.nan, 3.0]))["median"] == 2.0


def test_cpu_check_two_gloo_processes() -> None:
    """The same per-rank code on 2 processes (gloo all-reduce), every placement against the dense MoE."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ep.py"), "cpu-check"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "worst rel err vs dense MoE" in run.stdout and "| balanced | EP, 8 redundant, balanced |" in run.stdout


@pytest.mark.parametrize("argv", [["report", "--work", "no-such-folder", "--times", "x.json"],
                                  ["run", "--work", "no-such-folder", "--out", "x.json"]])
def test_bad_input_is_one_line_and_exit_2(argv, tmp_path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ep.py"), *argv], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("bench_ep: ")
