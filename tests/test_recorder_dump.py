"""SGLang recorder dumps -> moeplace steps, with dumps written by SGLang's REAL recorder classes.

The dumps come from ``sglang.srt.eplb.expert_distribution._ExpertDistributionRecorderReal`` run on
CPU (SGLANG_USE_CPU_ENGINE=1, a one-process gloo group for the stat all-reduce) in a subprocess,
fed known top-k ids through ``with_forward_pass`` / ``with_current_layer`` / ``on_select_experts``
exactly as a model's forward does. The test then checks the converter returns those ids.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from moeplace.errors import FormatError

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

# Shape of the fake model: H hidden layers of which MOE are MoE, E logical experts, P slots, K top-k.
H, MOE, E, P, K, PASSES = 4, (1, 3), 8, 10, 4, 6

_GENERATOR = textwrap.dedent(r'''
    import json, os, sys
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    out = sys.argv[1]
    import numpy as np, torch, torch.distributed as dist
    from sglang.srt import runtime_context as rc
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    H, MOE, E, P, K, PASSES = 4, (1, 3), 8, 10, 4, 6
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    from sglang.srt.eplb import expert_distribution as ed
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, _compute_logical_to_all_physical_map
    # Two redundant slots (8 -> expert 0, 9 -> expert 1), 2 EP ranks of 5 slots.
    p2l = torch.cat([torch.arange(E), torch.tensor([0, 1])]).repeat(H, 1)
    g = torch.Generator().manual_seed(0)
    modes = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, None, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]
    sizes = [5, 2, 3, 2, 1, 3]
    fed = {}  # (pass, layer) -> physical ids [n, K]
    for p, n in enumerate(sizes):
        for layer in MOE:
            fed[(p, layer)] = torch.stack([torch.randperm(P, generator=g)[:K] for _ in range(n)]).int()

    def run(mode, rank, subdir):
        d = os.path.join(out, subdir)
        os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = d
        ov = rc._CONTEXT.override_server_args(expert_distribution_recorder_mode=mode, device="cpu",
                                              expert_distribution_recorder_buffer_size=4, chunked_prefill_size=16)
        ov.install()
        try:
            l2a = _compute_logical_to_all_physical_map(physical_to_logical_map=p2l, num_logical_experts=E,
                                                       ep_size=2, moe_ep_rank=0)
            meta = ExpertLocationMetadata._init_raw(ep_size=2, physical_to_logical_map=p2l,
                                                    logical_to_all_physical_map=l2a, moe_ep_rank=0)
            rec = ed._ExpertDistributionRecorderReal(meta, rank=rank)
            rec.start_record()
            for p, n in enumerate(sizes):
                m = modes[p] or ForwardMode.DECODE
                fb = ForwardBatch(forward_mode=m, batch_size=n, input_ids=torch.arange(n),
                                  req_pool_indices=torch.arange(n), seq_lens=torch.ones(n, dtype=torch.int64),
                                  out_cache_loc=torch.arange(n), seq_lens_sum=n, positions=torch.arange(n))
                with rec.with_forward_pass(p, fb):
                    if modes[p] is None:
                        continue  # a pass whose MoE layers never ran (draft/idle): all-zero record
                    for layer in MOE:
                        with rec.with_current_layer(layer):
                            rec.on_select_experts(fed[(p, layer)])
            rec.stop_record()
            rec.dump_record()
        finally:
            ov.restore()

    run("stat", 0, "stat")
    run("per_pass", 0, "per_pass")
    run("per_pass", 1, "per_pass")
    run("per_token", 0, "per_token")
    np.savez(os.path.join(out, "fed.npz"), **{f"{p}_{l}": v.numpy() for (p, l), v in fed.items()},
             p2l=p2l.numpy(), sizes=np.array(sizes), modes=np.array([int(m or 0) for m in modes]))
''')


def make_real_dumps(out: Path) -> Path:
    """Run SGLang's real recorder (stat, per_pass for ranks 0 and 1, per_token) into ``out``."""
    script = out / "gen_dumps.py"
    script.write_text(_GENERATOR)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    port = str(29500 + os.getpid() % 400)
    res = subprocess.run([sys.executable, str(script), str(out), port], capture_output=True, text=True,
                         env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def real_dumps(tmp_path_factory) -> Path:
    return make_real_dumps(tmp_path_factory.mktemp("sglang_dumps"))


def _fed(real_dumps: Path):
    z = np.load(real_dumps / "fed.npz")
    return z, z["p2l"]


def test_per_token_ids_equal_what_the_router_chose(real_dumps):
    from moeplace.trace.recorder_dump import read_recorder_dump

    header, steps = read_recorder_dump(real_dumps / "per_token")
    z, p2l = _fed(real_dumps)
    assert steps.model.moe_layers == MOE and steps.model.num_experts == E and steps.model.top_k == K
    live = [p for p, m in enumerate(z["modes"]) if m]  # the all-zero pass is dropped
    assert steps.num_steps == len(live)
    assert steps.modes.tolist() == [int(z["modes"][p]) for p in live]  # ForwardMode ints == moeplace codes
    assert steps.num_tokens.tolist() == [int(z["sizes"][p]) for p in live]
    for s, p in enumerate(live):
        rows = steps.topk_ids[steps.token_offsets[s]:steps.token_offsets[s + 1]]
        for j, layer in enumerate(MOE):
            want = p2l[layer][z[f"{p}_{layer}"]]
            np.testing.assert_array_equal(rows[:, j, :], want)
    assert header.physical_to_logical_map is not None and len(header.physical_to_logical_map) == len(MOE)


def test_per_pass_two_ranks_counts(real_dumps):
    from moeplace.trace.recorder_dump import read_recorder_dump

    header, steps = read_recorder_dump(real_dumps / "per_pass")
    z, p2l = _fed(real_dumps)
    live = [p for p, m in enumerate(z["modes"]) if m]
    assert header.ranks == [0, 1]
    assert steps.num_steps == 2 * len(live)  # each rank recorded every live pass
    assert steps.model.top_k == K  # inferred: gcd of per-pass totals n*K over passes of n = 5, 2, 3, 1
    for s in range(steps.num_steps):
        p = live[s // 2]
        for j, layer in enumerate(MOE):
            want = np.bincount(p2l[layer][z[f"{p}_{layer}"]].ravel(), minlength=E)
            np.testing.assert_array_equal(steps.counts[s, j], want)
    assert steps.ranks.tolist() == [0, 1] * len(live)


def test_stat_circular_buffer_keeps_last_passes(real_dumps):
    from moeplace.trace.recorder_dump import read_recorder_dump

    header, steps = read_recorder_dump(next((real_dumps / "stat").glob("*.pt")))
    z, p2l = _fed(real_dumps)
    assert header.aggregate_only and "summed over all ranks" in header.notes and "circular" in header.notes
    # Buffer of 4 rows, 6 passes: the last 4 passes survive (one of them all-zero, dropped), out of order.
    survivors = [p for p in range(PASSES - 4, PASSES) if z["modes"][p]]
    want = sorted(tuple(np.concatenate([np.bincount(p2l[l][z[f"{p}_{l}"]].ravel(), minlength=E) for l in MOE]))
                  for p in survivors)
    got = sorted(tuple(steps.counts[s].ravel().astype(int)) for s in range(steps.num_steps))
    assert got == want


def test_bad_files_give_one_line_errors(tmp_path, real_dumps):
    from moeplace.trace.recorder_dump import read_recorder_dump

    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(FormatError, match="junk.pt: not a readable torch file"):
        read_recorder_dump(junk)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    with pytest.raises(FormatError, match="not an SGLang expert distribution dump"):
        read_recorder_dump(other)
    cut = tmp_path / "cut.pt"
    data = next((real_dumps / "per_token").glob("*.pt")).read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="cut.pt"):
        read_recorder_dump(cut)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="folder holds no expert_distribution_recorder"):
        read_recorder_dump(tmp_path / "empty")
    with pytest.raises(FormatError, match="no such file"):
        read_recorder_dump(tmp_path / "missing.pt")


@pytest.mark.parametrize("mode", ["per_token", "per_pass"])
def test_a_recording_without_passes_is_one_line(tmp_path, real_dumps, mode):
    """Seen live: `capture` started recording after the traffic had ended; the dump held no record."""
    from moeplace.trace.recorder_dump import read_recorder_dump

    data = torch.load(next((real_dumps / mode).glob("*.pt")), weights_only=True)
    data["records"] = []
    empty = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save(data, empty)
    with pytest.raises(FormatError, match="recorded no forward pass"):
        read_recorder_dump(empty)


def test_roundtrip_through_trace_file(tmp_path, real_dumps):
    from moeplace.trace.recorder_dump import read_recorder_dump
    from moeplace.trace.store import TraceReader, write_trace

    header, steps = read_recorder_dump(real_dumps / "per_token")
    path = write_trace(tmp_path / "t.mptrace", header, steps)
    back = list(TraceReader(path))
    np.testing.assert_array_equal(back[0].topk_ids, steps.topk_ids)
