"""A sweep of bad and odd inputs across every command: each ends in exit code 2 and one line on stderr that
names the problem, with no traceback, no RuntimeWarning, no file left behind and every input unchanged.

Each case runs the real entry point in process (``moeplace.cli.main``) in a scratch folder holding the
inputs (``in/``) and an empty output folder (``out/``), which must still be empty afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.algorithms import PlacementProblem
from moeplace.algorithms.baselines import contiguous
from moeplace.cli import main
from moeplace.files.placement import Placement, save_placement
from moeplace.model.spec import ModelSpec
from moeplace.trace.load import open_trace
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps
from moeplace.trace.store import TraceHeader, write_trace
from test_trace_store import write_float_chunk

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"
# A DeepSeek-V3-shaped toy for launch: 4 layers (layer 0 dense), 16 routed experts, top-4.
TOY_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4,
              "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 16, "num_experts_per_tok": 4}
TOY = ModelSpec("toy", 4, (1, 2, 3), 16, 4)
TOY_LAUNCH = ["--", "--model-path", "{in}/toy", "--tp", "4", "--ep", "4"]
FAST = ["--max-steps", "300", "--effort", "1e6"]


def write_inputs(root: Path) -> None:
    """Every input the cases read, good and bad, under ``root``."""
    root.mkdir()
    (root / "t.mptrace").write_bytes(SAMPLE.read_bytes())
    (root / "shards").mkdir()
    (root / "shards" / "a.mptrace").write_bytes(SAMPLE.read_bytes())
    model = open_trace(SAMPLE).model
    save_placement(root / "p.json", Placement(model, 8, contiguous(PlacementProblem(model, RoutingSteps.empty(model), 8))))
    p = json.loads((root / "p.json").read_text())
    (root / "strings.json").write_text(json.dumps({**p, "physical_to_logical_map": [[str(x) for x in row]
                                                                                   for row in p["physical_to_logical_map"]]}))
    (root / "huge.json").write_text(json.dumps({**p, "physical_to_logical_map": [[1e30] + row[1:]
                                                                                for row in p["physical_to_logical_map"]]}))
    (root / "toy").mkdir()
    (root / "toy" / "config.json").write_text(json.dumps(TOY_CONFIG))
    save_placement(root / "toy.json", Placement(TOY, 4, np.tile(np.arange(16), (3, 1))))
    (root / "folder").mkdir()
    (root / "afile").write_text("not a folder\n")
    (root / "garbage.bin").write_bytes(b"\x00garbage\xff" * 10)
    (root / "bogus.pt").write_bytes(b"garbage that is no torch file")
    (root / "notjson.json").write_text("{not json")
    (root / "cost_huge.json").write_text(json.dumps({"a_us_per_expert": 1e308, "b_us_per_token": 1, "c_us": 1}))
    (root / "cost_ok.json").write_text(json.dumps({"a_us_per_expert": 20, "b_us_per_token": 1, "c_us": 70}))
    (root / "cost_nan.json").write_text('{"a_us_per_expert": NaN, "b_us_per_token": 1, "c_us": 1}')
    (root / "cost_blocks.json").write_text(json.dumps({"a_us_per_expert": 1, "b_us_per_token": 1, "c_us": 1,
                                                       "r_us_per_block": 2}))
    shipped_set = json.loads((SAMPLE.parents[1] / "moeplace" / "cost" / "measured" / "set_h100_gptoss20b.json").read_text())
    (root / "set_h100.json").write_text(json.dumps(shipped_set))
    (root / "set_v99.json").write_text(json.dumps({**shipped_set, "version": 99}))
    (root / "set_empty.json").write_text(json.dumps({**shipped_set, "lines": {}}))
    ids = np.full((90, 2, 4), -5, np.int16)
    np.savez(root / "negative.npz", topk_ids=ids, num_experts=np.int64(16))
    np.savez(root / "padding.npz", topk_ids=np.full((90, 2, 4), -1, np.int16))
    np.savez(root / "floats.npz", topk_ids=np.zeros((90, 2, 4), np.float32), num_experts=np.int64(16))
    write_float_chunk(root / "floats.mptrace", "topk_ids")
    # trace headers of every wrong shape and type (header-only shards: the header is read first)
    good = TraceHeader(TOY, "synthetic").to_json()
    bad_headers = {
        "h_list": [1, 2], "h_null": None, "h_string": "moeplace-trace",
        "h_huge": {**good, "model": {**good["model"], "num_experts": 10**12}},
        "h_float": {**good, "model": {**good["model"], "num_experts": 16.0}},
        "h_str_experts": {**good, "model": {**good["model"], "num_experts": "16"}},
        "h_str_ranks": {**good, "ranks": "0"}, "h_str_ep": {**good, "ep_size": "8"},
        "h_inf_nodes": {**good, "nodes": float("inf")},
    }
    for name, header in bad_headers.items():
        head = json.dumps(header).encode()
        (root / f"{name}.mptrace").write_bytes(b"MPTRACE\x01" + struct.pack("<II", len(head), zlib.crc32(head)) + head)
    (root / "badshards").mkdir()
    (root / "badshards" / "a.mptrace").write_bytes(SAMPLE.read_bytes())
    (root / "badshards" / "b.mptrace").write_bytes((root / "h_str_ranks.mptrace").read_bytes())
    none = RoutingSteps.from_topk(TOY, np.full((90, 3, 4), -1, np.int16), np.full(10, 9), M.TARGET_VERIFY)
    write_trace(root / "none.mptrace", TraceHeader(TOY, "synthetic"), none)
    np.savez(root / "bigids.npz", topk_ids=np.full((90, 2, 4), 2**40, np.int64))
    np.savez(root / "float_experts.npz", topk_ids=np.zeros((90, 2, 4), np.int16), num_experts=np.float64(16.5))
    np.savez(root / "short.npz", topk_ids=np.zeros((90, 2, 4), np.int16), num_experts=np.int64(16),
             example_offsets=np.array([0, 30, 90]))
    # placement files whose fields disagree or overflow
    for name, change in {"p_float_ranks": {"ranks": 8.0}, "p_inf_ranks": {"ranks": float("inf")},
                         "p_inf_nodes": {"nodes": float("inf")}, "p_nodes": {"nodes": 3},
                         "p_physical": {"num_physical_experts": 40}, "p_list": None,
                         "p_rule": {"metrics": {"dispatch": "bogus"}}}.items():
        (root / f"{name}.json").write_text(json.dumps([1, 2] if change is None else {**p, **change}))
    os.mkfifo(root / "fifo")
    os.link(root / "t.mptrace", root / "hardlink.mptrace")
    os.symlink(root / "t.mptrace", root / "symlink.mptrace")


# (argv with {in} and {out} for the two folders, a fragment the error line must hold)
CASES = [
    # calibrate: a model it cannot read or time, bad budgets; the GPU check (none here) comes after them
    (["calibrate", "--model", "kimi-k2", "-o", "{out}/s.json"], "served as fp8"),
    (["calibrate", "--model", "{in}/folder", "-o", "{out}/s.json"], "has no config.json"),
    (["calibrate", "--model", "gpt-oss-20b", "--budget", "0", "-o", "{out}/s.json"], "--budget"),
    (["calibrate", "--model", "gpt-oss-20b", "-o", "{out}/s.json"], "no CUDA GPU"),
    # --gpu and cost sets
    (["report", "{in}/t.mptrace", "--gpu", " "], "--gpu: empty"),
    (["report", "{in}/t.mptrace", "--cost-model", "{in}/set_h100.json", "--gpu", "H200"], "was measured on"),
    (["report", "{in}/t.mptrace", "--cost-model", "{in}/set_v99.json"], "version"),
    (["advise", "{in}/t.mptrace", "--cost-model", "{in}/set_empty.json"], "lines"),
    # the entry point
    (["--bogus"], "No such option"),
    (["nosuchcommand"], "No such command"),
    # optimize: outputs that are inputs, or each other, or unwritable
    (["optimize", "{in}/t.mptrace", "-o", "{in}/t.mptrace"], "is the TRACE"),
    (["optimize", "{in}/t.mptrace", "-o", "{in}/hardlink.mptrace"], "is the TRACE"),
    (["optimize", "{in}/t.mptrace", "-o", "{in}/symlink.mptrace"], "is the TRACE"),
    (["optimize", "{in}/shards", "-o", "{in}/shards/a.mptrace"], "inside the TRACE folder"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--sglang-out", "{out}/p.json"], "is also -o"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--cost-model", "{in}/cost_huge.json",
      "--sglang-out", "{in}/cost_huge.json"], "is the --cost-model"),
    (["optimize", "{in}/t.mptrace", "-o", "{in}/toy/config.json", "--model", "{in}/toy"], "is the --model"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--plot-dir", "{in}/afile"], "is a file"),
    (["optimize", "{in}/t.mptrace", "-o", "{in}/afile/p.json"], "afile is a file, not a folder"),
    (["optimize", "{in}/t.mptrace", "-o", "{in}/folder"], "is a directory"),
    # optimize: numbers
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--replica-memory", "nan"], "not a finite number"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--replica-memory", "inf"], "--replica-memory"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--replica-memory", "-1"], "--replica-memory"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--effort", "nan"], "not a finite number"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--effort", "inf"], "--effort"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--effort", "0"], "--effort"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--seed", "-1"], "--seed"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--holdout", "nan"], "not a finite number"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--holdout", "1"], "--holdout"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--balance-floor", "nan"], "not a finite number"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--ranks", "0"], "--ranks"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--ranks", "7"],
     "do not split evenly over 7 ranks; --redundant 3 would"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--redundant", "8", "--replica-memory", "3"],
     "--redundant or --replica-memory"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--max-steps", "0"], "--max-steps"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--mode", "bogus"], "--mode"),
    (["optimize", "{in}/t.mptrace"], "Missing option '-o' / '--out'"),
    # optimize: bad input files
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--cost-model", "{in}/cost_huge.json"], "at most 1e+06"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--cost-model", "{in}/cost_nan.json"], "finite"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--cost-model", "{in}/cost_blocks.json"], "no block_m"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--cost-model", "{in}/notjson.json"], "not valid JSON"),
    (["optimize", "{in}/nothere.mptrace", "-o", "{out}/p.json"], "does not exist"),
    (["optimize", "{in}/garbage.bin", "-o", "{out}/p.json"], "unknown trace format"),
    (["optimize", "{in}/negative.npz", "-o", "{out}/p.json"], "holds id -5"),
    (["optimize", "{in}/padding.npz", "-o", "{out}/p.json"], "holds no expert id"),
    (["optimize", "{in}/floats.npz", "-o", "{out}/p.json"], "integer expert ids"),
    (["optimize", "{in}/floats.mptrace", "-o", "{out}/p.json", "--ranks", "4", "--cost-model", "{in}/cost_ok.json"],
     "topk_ids must hold integers, not float32"),
    (["report", "{in}/floats.mptrace", "--ranks", "4", "--cost-model", "{in}/cost_ok.json"],
     "topk_ids must hold integers, not float32"),
    # advise
    (["advise", "{in}/t.mptrace", "--effort", "-5"], "--effort"),
    (["advise", "{in}/t.mptrace", "--effort", "0"], "--effort"),
    (["advise", "{in}/t.mptrace", "--effort", "nan"], "not a finite number"),
    (["advise", "{in}/t.mptrace", "--holdout", "1.5"], "--holdout"),
    (["advise", "{in}/t.mptrace", "--ranks", "5"], "do not split evenly over 5 ranks"),
    (["advise", "{in}/t.mptrace", "--cost-model", "{in}/cost_huge.json"], "at most 1e+06"),
    # report
    (["report", "{in}/t.mptrace", "--plot-dir", "{in}/afile"], "is a file"),
    (["report", "{in}/t.mptrace", "--ranks", "7"], "32 experts + 0 redundant slots do not split evenly over 7 ranks (see"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/p.json", "--ranks", "4"], "for 8 ranks, not 4"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/folder"], "--placement"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/strings.json"], "physical_to_logical_map[0][0] must be a whole number, got '0'"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/huge.json"], "must be a whole number, got 1e+30"),
    (["report", "{in}/bogus.pt"], "not a readable torch file"),
    (["report", "{in}/t.mptrace", "--window", "0"], "--window"),
    # compare
    (["compare", "{in}/t.mptrace", "{in}/p.json", "{in}/p.json"], "given twice"),
    (["compare", "{in}/t.mptrace", "{in}/p.json", "--holdout", "1"], "--holdout"),
    (["compare", "{in}/t.mptrace", "{in}/p.json", "--plot-dir", "{in}/afile"], "is a file"),
    (["compare", "{in}/t.mptrace", "{in}/toy.json"], "placement is for"),
    # trace synth
    (["trace", "synth", "--steps", "10", "--tokens-per-step", "100000000", "-o", "{out}/s"], "GiB of memory"),
    (["trace", "synth", "--steps", "10000000000000", "-o", "{out}/s"], "GB are free"),
    (["trace", "synth", "--steps", "10", "--skew", "nan", "-o", "{out}/s"], "not a finite number"),
    (["trace", "synth", "--steps", "10", "--skew", "inf", "-o", "{out}/s"], "--skew"),
    (["trace", "synth", "--steps", "10", "--coactivation", "nan", "-o", "{out}/s"], "not a finite number"),
    (["trace", "synth", "--steps", "10", "--coactivation", "1e308", "-o", "{out}/s"], "--coactivation"),
    (["trace", "synth", "--steps", "10", "--seed", "-1", "-o", "{out}/s"], "--seed"),
    (["trace", "synth", "--steps", "10", "--topics", "0", "-o", "{out}/s"], "--topics"),
    (["trace", "synth", "--steps", "0", "-o", "{out}/s"], "--steps"),
    (["trace", "synth", "--steps", "10", "-o", "{in}/afile/s"], "is a file, not a folder"),
    (["trace", "synth", "--steps", "10", "--shape", "kimi-k2", "--model", "{in}/toy", "-o", "{out}/s"],
     "--shape or --model"),
    # trace convert and merge
    (["trace", "convert", "{in}/t.mptrace", "-o", "{in}/t.mptrace"], "is the SOURCE"),
    (["trace", "convert", "{in}/t.mptrace", "-o", "{in}/hardlink"], "is the SOURCE"),
    (["trace", "convert", "{in}/shards", "-o", "{in}/shards/all.mptrace"], "inside the SOURCE folder"),
    (["trace", "convert", "{in}/bogus.pt", "-o", "{out}/x.mptrace"], "not a readable torch file"),
    (["trace", "merge", "{in}/t.mptrace", "-o", "{in}/t.mptrace"], "is the output of this merge"),
    (["trace", "merge", "{in}/t.mptrace", "{in}/hardlink.mptrace", "-o", "{out}/m.mptrace"], "hold the same steps"),
    (["trace", "merge", "{in}/t.mptrace", "-o", "{in}/afile/m.mptrace"], "is a file, not a folder"),
    # launch
    (["launch", "--placement", "{in}/toy.json", "--sglang-file", "{in}/toy.json", "--dry-run", *TOY_LAUNCH],
     "is the --placement"),
    (["launch", "--placement", "{in}/toy.json", "--sglang-file", "{in}/toy/config.json", "--dry-run", *TOY_LAUNCH],
     "is the --model"),
    (["launch", "--placement", "{in}/folder", "--dry-run", *TOY_LAUNCH], "is a folder, not a placement file"),
    (["launch", "--placement", "{in}/toy.json", "--dry-run", "--", "--model-path", "{in}/toy", "--enable-eplb"],
     "--enable-eplb needs 2 or more EP ranks"),
    (["launch", "--placement", "{in}/nothere.json", "--dry-run", *TOY_LAUNCH], "no such file"),
    # outputs that are not regular files or new paths: refused before any work
    (["optimize", "{in}/t.mptrace", "-o", "/dev/null"], "character device, not a regular file"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--sglang-out", "/dev/null"], "character device"),
    (["optimize", "{in}/t.mptrace", "-o", "{in}/fifo"], "FIFO, not a regular file"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/newdir/"], "names a folder"),
    (["optimize", "{in}/t.mptrace", "-o", "/proc/nothere/p.json"], "cannot write there"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--plot-dir", "/proc/nothere"], "cannot write there"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--plot-dir", "{in}/fifo"], "is a FIFO, not a folder"),
    (["report", "{in}/t.mptrace", "--plot-dir", "/dev/null"], "not a folder"),
    (["trace", "convert", "{in}/t.mptrace", "-o", "/dev/null"], "character device"),
    (["trace", "convert", "{in}/t.mptrace", "-o", "{in}/fifo"], "FIFO"),
    (["trace", "merge", "{in}/shards", "-o", "{in}/shards/merged.mptrace"], "inside the folder"),
    (["trace", "merge", "{in}/shards", "-o", "{in}/shards/merged"], "inside the folder"),
    (["trace", "merge", "{in}/shards", "-o", "{out}/m/"], "names a folder"),
    (["trace", "synth", "--steps", "10", "-o", "/dev/null"], "character device"),
    (["capture", "--url", "http://127.0.0.1:9", "-o", "{in}/fifo"], "FIFO"),
    (["launch", "--placement", "{in}/toy.json", "--sglang-out", "/dev/null", "--dry-run", *TOY_LAUNCH],
     "character device"),
    # trace headers: shape, type and range, before any array is sized from them
    (["report", "{in}/h_list.mptrace"], "trace header must be a JSON object"),
    (["optimize", "{in}/h_null.mptrace", "-o", "{out}/p.json"], "trace header must be a JSON object"),
    (["compare", "{in}/h_string.mptrace", "{in}/p.json"], "trace header must be a JSON object"),
    (["advise", "{in}/h_list.mptrace"], "trace header must be a JSON object"),
    (["trace", "convert", "{in}/h_null.mptrace", "-o", "{out}/x.mptrace"], "trace header must be a JSON object"),
    (["trace", "merge", "{in}/h_list.mptrace", "-o", "{out}/m.mptrace"], "trace header must be a JSON object"),
    (["report", "{in}/h_huge.mptrace"], "model.num_experts must be at most 32767"),
    (["report", "{in}/h_float.mptrace"], "model.num_experts must be a whole number, got 16.0"),
    (["report", "{in}/h_str_experts.mptrace"], "model.num_experts must be a whole number, got '16'"),
    (["report", "{in}/h_str_ranks.mptrace"], "ranks must be a list"),
    (["report", "{in}/h_str_ep.mptrace"], "ep_size must be a whole number"),
    (["report", "{in}/h_inf_nodes.mptrace"], "nodes must be a whole number"),
    (["trace", "merge", "{in}/badshards", "-o", "{out}/m.mptrace"], "ranks must be a list"),
    (["report", "{in}/none.mptrace", "--cost-model", "{in}/cost_ok.json"], "route no token to any expert"),
    (["optimize", "{in}/none.mptrace", "--ranks", "4", "--cost-model", "{in}/cost_ok.json", "-o", "{out}/p.json"],
     "route no token to any expert"),     # before the search: no progress line
    (["compare", "{in}/none.mptrace", "{in}/toy.json", "--ranks", "4", "--cost-model", "{in}/cost_ok.json"],
     "route no token to any expert"),
    (["report", "{in}/bigids.npz"], "32767"),
    (["report", "{in}/float_experts.npz"], "num_experts must be one whole number"),
    # placement files: types, ranges and agreement
    (["report", "{in}/t.mptrace", "--placement", "{in}/p_float_ranks.json"], "ranks must be a whole number, got 8.0"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/p_inf_ranks.json"], "ranks must be a whole number"),
    (["compare", "{in}/t.mptrace", "{in}/p_inf_nodes.json"], "nodes must be a whole number"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/p_nodes.json"], "nodes 3 does not divide ranks 8"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/p_physical.json"], "num_physical_experts 40 disagrees"),
    (["compare", "{in}/t.mptrace", "{in}/p_physical.json"], "num_physical_experts 40 disagrees"),
    (["compare", "{in}/t.mptrace", "{in}/p_rule.json"], "made for dispatch 'bogus'"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/p_rule.json"], "made for dispatch 'bogus'"),
    (["report", "{in}/t.mptrace", "--placement", "{in}/p_list.json"], "not a placement"),
    (["launch", "--placement", "{in}/p_inf_ranks.json", "--dry-run", *TOY_LAUNCH], "ranks must be a whole number"),
    (["launch", "--placement", "{in}/p_physical.json", "--dry-run", *TOY_LAUNCH], "num_physical_experts 40 disagrees"),
    (["launch", "--placement", "{in}/p_nodes.json", "--dry-run", *TOY_LAUNCH], "nodes 3 does not divide ranks 8"),
    # numbers past what the program can hold
    (["report", "{in}/t.mptrace", "--window", "100000000000000000000000000000"], "--window"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--window", "1e29"], "--window"),
    (["report", "{in}/short.npz", "--window", "100"], "--window 100: longer than the longest run"),
    (["trace", "convert", "{in}/short.npz", "--window", "61", "-o", "{out}/x.mptrace"], "(60 tokens), so no step is left"),
    (["advise", "{in}/t.mptrace", "--redundant", "100000000000000000000000000000"], "--redundant"),
    (["advise", "{in}/t.mptrace", "--redundant", "256"], "so at most 224 spare slots"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--redundant", "1000"], "--redundant"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--ranks", "100000"], "--ranks"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--effort", "1e300"], "--effort"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--replica-memory", "1e300"], "--replica-memory"),
    (["optimize", "{in}/t.mptrace", "-o", "{out}/p.json", "--max-steps", "1e29"], "--max-steps"),
    (["trace", "synth", "--steps", "10", "--seed", "100000000000000000000000000000", "-o", "{out}/s"], "--seed"),
    (["capture", "--url", "http://127.0.0.1:9", "--timeout", "1e29", "-o", "{out}/c.mptrace"], "--timeout"),
    (["capture", "--url", "http://127.0.0.1:9", "--seconds", "1e29", "-o", "{out}/c.mptrace"], "--seconds"),
    (["capture", "--url", "http://127.0.0.1:9", "--dump-timeout", "1e29", "-o", "{out}/c.mptrace"], "--dump-timeout"),
    # capture (no server needed: each is refused before it is contacted)
    (["capture", "--url", "localhost:30000", "-o", "{out}/c.mptrace"], "want http://HOST:PORT"),
    (["capture", "--url", "http://127.0.0.1:9", "--seconds", "nan", "-o", "{out}/c.mptrace"], "not a finite number"),
    (["capture", "--url", "http://127.0.0.1:9", "--seconds", "inf", "-o", "{out}/c.mptrace"], "--seconds"),
    (["capture", "--url", "http://127.0.0.1:9", "--timeout", "0", "-o", "{out}/c.mptrace"], "--timeout"),
    (["capture", "--url", "http://127.0.0.1:9", "-o", "{in}/afile/c.mptrace"], "is a file, not a folder"),
    (["capture", "--url", "http://127.0.0.1:9", "-o", "{in}/folder"], "is a directory"),
]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links as links) and a digest of its bytes."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "folder"
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "in"
    write_inputs(root)
    return root


def test_the_sweep_is_wide() -> None:
    assert len(CASES) >= 50
    assert {argv[0] for argv, _ in CASES} >= {"optimize", "advise", "report", "compare", "trace", "launch", "capture"}


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("argv, fragment", CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(inputs: Path, tmp_path: Path, argv: list[str], fragment: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(inputs)
    args = [a.replace("{in}", str(inputs)).replace("{out}", str(out)) for a in argv]
    runner = CliRunner()
    with runner.isolation() as (stdout, stderr, *_):
        with pytest.raises(SystemExit) as exit_info:
            main([*args[:1], *FAST, *args[1:]] if args[0] in ("optimize", "advise") else args)
    err = stderr.getvalue().decode()
    lines = err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert os.listdir(out) == [], "nothing may be written"
    assert snapshot(inputs) == before, "an input changed"
