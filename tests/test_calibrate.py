"""``moeplace calibrate``: its plan covers every GPU shape the commands cost, its fit reproduces the shipped lines
from their raw H200 times, a cost set is what every command costs with, SGLang's kernel runs as the calibration
launches it (Triton's CPU interpreter), and what it refuses is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moeplace.analysis.advise import BATCH_GRID
from moeplace.analysis.layouts import candidate_layouts
from moeplace.cli import main
from moeplace.commands.calibrate import CalibratedModel, planned_sweeps
from moeplace.commands.costing import resolve_costing
from moeplace.cost.cost_set import KIND, load_cost_file
from moeplace.cost.derive import derive_cost_model, packaged_measurements, sglang_default_config
from moeplace.cost.gpus import resolve_gpu
from moeplace.cost.model import load_cost_model
from moeplace.cost.sweeps import filling_experts, sweep_line, workloads
from moeplace.model.expert_shape import ExpertShape
from moeplace.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
RAW = json.loads((ROOT / "tests" / "data" / "calib_h200_config_sweeps.json").read_text())
SAMPLE = str(ROOT / "traces" / "gptoss20b-sample.mptrace")
GPTOSS = CalibratedModel("gpt-oss-20b", ExpertShape(2880, 2880, "bf16", "t"), 32, 4)
KIMI = CalibratedModel("kimi-shaped", ExpertShape(7168, 2048, "bf16", "t"), 384, 8)


def run_main(capsys, *args: str) -> tuple[int, str]:
    """``moeplace ARGS`` through the real entry point (MoeplaceError: one line, exit 2): exit code, stdout + stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
        sys.exit(0)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out + captured.err


def shipped(label: str):
    return load_cost_model(ROOT / "moeplace" / "cost" / "measured" / f"cost_h200_bf16_{label.replace('-', '_')}.json")


@pytest.mark.parametrize("label", sorted(RAW["sweeps"]))
def test_fit_reproduces_the_shipped_line_from_its_raw_times(label):
    """The line calibrate fits, on the H200 points the shipped config-sweep files were fitted on, is that file's."""
    sweep = RAW["sweeps"][label]
    line = sweep_line(sweep["shape"], sweep["points"], sweep["step_tokens"], RAW["gpu"], 132, {})
    ref = shipped(label)
    for key in ("a_us_per_expert", "r_us_per_block", "b_us_per_token", "c_us"):
        assert line[key] == pytest.approx(getattr(ref, key), rel=5e-3, abs=5e-3), key
    assert line["block_m"] == ref.block_m
    assert line["provenance"]["kernel_config"] == ref.provenance["kernel_config"]


def raw_cost_set(tmp_path: Path, labels: list[str] | None = None) -> Path:
    """A cost set made of the recorded H200 sweeps, as calibrate writes one."""
    lines = {label: sweep_line(sw["shape"], sw["points"], sw["step_tokens"], RAW["gpu"], 132, {"date": RAW["date"]})
             for label, sw in RAW["sweeps"].items() if labels is None or label in labels}
    doc = {"kind": KIND, "version": 1, "gpu": RAW["gpu"], "gpu_memory_gb": 150.75, "sglang": RAW["sglang"],
           "date": RAW["date"], "model": GPTOSS.to_json(), "ranks": 8, "lines": lines}
    path = tmp_path / "set.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("label", sorted(RAW["sweeps"]))
def test_a_cost_set_predicts_its_own_measurements(tmp_path, label):
    """Costed from a cost set alone (not the shipped files), every recorded point whose experts fill the GPU is
    within 15%, their mean within 6%, with the kernel config each point ran."""
    cost_set = load_cost_file(raw_cost_set(tmp_path))
    cal = cost_set.calibration
    sweep = RAW["sweeps"][label]
    s = sweep["shape"]
    ran = sweep["points"][0]["config"]
    err = []
    for p in sweep["points"]:
        if p["distinct"] < filling_experts(s["inter"], ran["BLOCK_SIZE_N"]):
            continue
        model = derive_cost_model(ExpertShape(s["hidden"], s["inter"], "bf16", label), s["n_local"], s["top_k"],
                                  step_tokens=p["config_m"], calibration=cal)
        assert model.provenance["derived_from"] == label
        assert model.block_m == ran["BLOCK_SIZE_M"]
        err.append(model.cost(p["distinct"], p["tokens"], p["row_blocks"] - p["distinct"]) / p["us"] - 1)
    err = np.abs(err)
    assert err.max() < 0.15 and err.mean() < 0.06, (label, err)


@pytest.mark.parametrize("model", [GPTOSS, KIMI], ids=["gptoss", "kimi"])
@pytest.mark.parametrize("ranks", [2, 8])
def test_plan_covers_every_layout_at_every_batch(model, ranks):
    """For every layout advise costs and every batch it reports, a sweep ran that GPU shape at the kernel config
    SGLang picks there; each sweep's steps run that config, and each workload fits its step."""
    sweeps, spares = planned_sweeps(model, ranks, None, 1e4)
    for layout in candidate_layouts(ranks, model.experts, model.shape.intermediate, spares):
        inter, slots = model.shape.tp_slice(layout.moe_tp).intermediate, layout.local_slots(model.experts)
        for batch in BATCH_GRID:
            config = sglang_default_config(batch, slots, "bf16")
            assert any((s.inter, s.local_slots) == (inter, slots) and sglang_default_config(s.step_tokens, slots,
                                                                                            "bf16") == config
                       for s in sweeps), (layout, batch)
    for s in sweeps:
        config = sglang_default_config(s.step_tokens, s.local_slots, "bf16")
        assert sglang_default_config(s.big_step, s.local_slots, "bf16") == config
        for tokens, counts in workloads(s, config[0], config[1], 132):
            assert 0 < len(counts) <= s.local_slots and min(counts) > 0 and sum(counts) <= tokens * s.top_k


def test_spares_follow_the_gpus_memory():
    """Without --redundant, the spare slots are a quarter of the experts where they fit, fewer where not."""
    assert planned_sweeps(GPTOSS, 8, None, 1e4)[1] == 8
    assert planned_sweeps(KIMI, 8, 0, 1e4)[1] == 0
    real = CalibratedModel("kimi", ExpertShape(7168, 2048, "bf16", "t"), 384, 8)
    assert planned_sweeps(real, 8, None, 1.0)[1] == 0


def test_commands_cost_with_a_cost_set(tmp_path, capsys):
    """report takes a cost set as --cost-model: the cost line names its GPU and line; a set's GPU and a --gpu that
    differs are one line, exit 2."""
    path = raw_cost_set(tmp_path)
    code, out = run_main(capsys, "report", SAMPLE, "--ranks", "8", "--cost-model", path)
    assert code == 0, out
    assert "cost model (MoE µs/step): NVIDIA H200" in out and "gptoss-i2880-bm64" in out
    code, out = run_main(capsys, "report", SAMPLE, "--ranks", "8", "--cost-model", path, "--gpu", "H100")
    assert code == 2 and "measured on NVIDIA H200" in out and "Traceback" not in out


def test_optimize_and_advise_take_a_cost_set_unchanged(tmp_path, capsys):
    """The file calibrate writes is optimize's and advise's --cost-model as it is: the placement records the set's
    line, advise's printed commands carry the file on."""
    path = raw_cost_set(tmp_path)
    out = tmp_path / "p.json"
    code, text = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--cost-model", path, "--max-steps", "600",
                          "-o", out)
    assert code == 0, text
    recorded = json.loads(out.read_text())["metrics"]["cost_model"]
    assert recorded["provenance"]["derived_from"] == "gptoss-i2880-bm64"
    code, text = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--cost-model", path,
                          "--max-steps", "600")
    assert code == 0, text
    assert f"--cost-model {path}" in text
    # the set holds the recorded sweeps: EP8 (2880 x 2880 at 16-row blocks) and TP8 (2880 x 360 at 16-row blocks)
    # were never among them, so only those columns are marked as derived
    header = next(line for line in text.splitlines() if line.lstrip().startswith("tokens/step") or "EP4xTP2" in line)
    assert {name for name in header.split() if name.endswith("*")} == {"EP8*", "EP8+8*", "TP8*"}, header


def test_costing_with_a_set_uses_its_gpu_and_memory(tmp_path):
    costing = resolve_costing(ModelSpec.all_moe("openai/gpt-oss-20b", 24, 32, 4), str(raw_cost_set(tmp_path)), None)
    assert costing.gpu.memory_gb == 150.75 and costing.calibration is not None
    tp = costing.tp(8, 32, 36)
    assert tp.provenance["derived_from"] == "gptoss-i360-bm64"


def test_a_shipped_cost_set_is_read_as_its_gpus_measurements(tmp_path):
    """A cost set dropped into the measured folder as set_*.json ships that GPU's lines: each line a measurement
    of the set's GPU, from which the GPU's terms calibrate."""
    from moeplace.cost.derive import calibrate, packaged_measurements
    doc = json.loads(raw_cost_set(tmp_path).read_text())
    doc["gpu"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "measured").mkdir()
    (tmp_path / "measured" / "set_h100_gptoss.json").write_text(json.dumps(doc))
    lines = packaged_measurements(tmp_path / "measured")
    assert sorted(m.name for m in lines) == sorted(f"set_h100_gptoss.json:{label}" for label in RAW["sweeps"])
    assert {m.cost.provenance["gpu"] for m in lines} == {"NVIDIA H100 80GB HBM3"}
    assert calibrate(lines).gpu == "NVIDIA H100 80GB HBM3"


SHIPPED_SETS = [m for m in packaged_measurements() if m.name.startswith("set_")]


@pytest.mark.parametrize("line", SHIPPED_SETS, ids=[m.name for m in SHIPPED_SETS])
def test_shipped_set_lines_give_their_c_at_every_measured_step(line):
    """A shipped cost set's line (``moeplace calibrate``: c measured at each batch its config runs) gives that c
    on its own GPU shape at each of those steps."""
    gpu = line.cost.provenance["gpu"]
    for tokens, c in line.c_at_steps:
        model = derive_cost_model(line.shape, line.local_slots, line.top_k, gpu, step_tokens=tokens)
        assert model.provenance["derived_from"] == line.name
        assert model.c_us == pytest.approx(c, abs=0.01)


def test_each_gpu_gets_its_own_models_or_the_nearest_with_a_warning():
    """H200 and H100 ship their own measurements; an H800 (an H100 by another name) gets the H100's with a warning
    naming them; a GPU not in the table the H200's, with its memory said to be unknown."""
    own = resolve_gpu("h200")
    assert own.measured == "NVIDIA H200" and own.warning is None
    h100 = resolve_gpu("H100")
    assert h100.measured == "NVIDIA H100 80GB HBM3" and h100.warning is None
    assert h100.memory_gb == pytest.approx(81_559 * 2**20 / 1e9)
    h800 = resolve_gpu("NVIDIA H800")
    assert h800.measured == "NVIDIA H100 80GB HBM3" and "no cost model ships for NVIDIA H800" in h800.warning
    other = resolve_gpu("MI300X")
    assert other.measured == "NVIDIA H200" and "memory is not known" in other.warning
    assert other.memory_gb == resolve_gpu(None).memory_gb


def test_gpu_flag_sizes_spares_by_its_memory():
    """Spare slots sized for the named GPU: Kimi K2 (fp8) holds some beside its experts on an H200, none on an
    H100 (it does not fit 8 of them at all)."""
    from moeplace.commands.costing import Costing, spares_that_fit
    spec = ModelSpec.all_moe("moonshotai/Kimi-K2-Instruct", 60, 384, 8)
    shape = ExpertShape(7168, 2048, "fp8", "t")
    on = {g: spares_that_fit(spec, 8, 96, Costing(shape, 8, gpu=resolve_gpu(g))) for g in ("H200", "H100")}
    assert on["H100"] == 0 < on["H200"]


@pytest.mark.parametrize("args,message", [
    (["--model", "kimi-k2"], "served as fp8"),
    (["--model", "/nonexistent/model"], "no such folder"),
    (["--model", "gpt-oss-20b"], "no CUDA GPU"),
])
def test_calibrate_refusals_are_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "set.json"
    code, text = run_main(capsys, "calibrate", *args, "-o", out)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], text
    assert "Traceback" not in text and not out.exists()


def test_a_bad_cost_set_is_one_line(tmp_path, capsys):
    path = raw_cost_set(tmp_path, ["kimi-i256-bm64"])   # one large-block line: no calibration from it
    code, out = run_main(capsys, "report", SAMPLE, "--cost-model", path)
    assert code == 2 and "cannot be read as measurements" in out, out
    doc = json.loads(path.read_text())
    doc["lines"] = {}
    path.write_text(json.dumps(doc))
    code, out = run_main(capsys, "report", SAMPLE, "--cost-model", path)
    assert code == 2 and "lines" in out and len(out.strip().splitlines()) == 1, out


INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from moeplace.sglang import fused_moe_timing as fmt
sgl = fmt.load_fused_moe("cpu")
sgl[1].get_device_name = lambda device_id=0: "CPU"
rank = fmt.RankMoe(sgl, 128, 64, 6, 2, device="cpu", act_dtype=torch.float16)
counts = [3, 0, 5, 1, 0, 2]
print(rank.check(counts))
step = rank.step(9)
step.load(counts)
step.c2.fill_(float("nan"))
step.run(1)
print(fmt.reference_error(step.xs[0], step.topk_w, step.c2, rank.w13[0], rank.w2[0], counts))
"""


@pytest.mark.sglang
def test_sglangs_kernel_runs_as_calibrate_launches_it():
    """SGLang's own fused MoE kernel, in Triton's CPU interpreter (float16: the interpreter has no bfloat16),
    launched as calibrate times it (a closure per workload, and the captured step's buffers loaded in place):
    the pairs of the GPU's experts match an fp32 reference, other GPUs' rows come out zero."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    errors = [float(x) for x in run.stdout.split()[-2:]]
    assert max(errors) < 2e-3, errors
