"""``moeplace optimize`` and ``moeplace compare`` end to end: files written, tables, JSON, and bad input
reported as one line with exit code 2 and nothing half-written."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.cli import cli, main
from moeplace.files.placement import check_placement, load_placement

SAMPLE = Path(__file__).resolve().parent.parent / "traces" / "gptoss20b-sample.mptrace"
FAST = ["--max-steps", "600", "--effort", "2e7"]
ROWS = ["contiguous", "deepseek", "stepaware"]


def invoke(*args: str):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """``moeplace ARGS`` through the real entry point (its error handling included), in process."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
        sys.exit(0)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> None:
    """One error line (click's usage preamble aside), naming the problem, and no traceback."""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], err


def assert_nothing_written(out_dir: Path) -> None:
    """After a failure: no placement, no temp file, nothing at all in the output folder."""
    assert not (out_dir / "p.json").exists()
    assert sorted(os.listdir(out_dir)) == []


def topk_npz(path: Path, num_experts: int, steps: int, layers: int = 24, top_k: int = 4, seed: int = 0) -> Path:
    """A tiny per-token trace (``topk_ids [T, L, K]``) read as verify windows of 9 tokens."""
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(layers)])
                    for _ in range(steps * 9)]).astype(np.int16)
    np.savez(path, topk_ids=ids, num_experts=np.int64(num_experts), model_name=np.str_("tiny"))
    return path


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """One optimize run on the shipped GPT-OSS-20B sample, shared by the tests that read its output."""
    out = tmp_path_factory.mktemp("optimize")
    result = invoke("optimize", SAMPLE, "--ranks", 8, *FAST, "-o", out / "p.json",
                    "--sglang-out", out / "sglang.json")
    assert result.exit_code == 0, result.output
    return out, result


# ----------------------------------------------------------------------------- optimize

def test_optimize_writes_a_valid_placement(optimized):
    out, _ = optimized
    p = load_placement(out / "p.json")
    check_placement(p)
    assert (p.ranks, p.phy2log.shape, p.algorithm) == (8, (24, 32), "stepaware")
    assert p.metrics["evaluated_on"] == "held-out steps" and p.metrics["eval_steps"] > 0
    # the mode a plain open() gives (regression: mkstemp's private 0600 was kept, unreadable to a server
    # running as another user)
    assert stat.S_IMODE(os.stat(out / "p.json").st_mode) == 0o666 & ~_umask()
    assert stat.S_IMODE(os.stat(out / "sglang.json").st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_optimize_sglang_out_has_only_the_map(optimized):
    out, _ = optimized
    data = json.loads((out / "sglang.json").read_text())
    assert list(data) == ["physical_to_logical_map"]        # SGLang splats the dict: no other key
    phy2log = np.array(data["physical_to_logical_map"])
    assert phy2log.shape == (24, 32)
    assert np.array_equal(phy2log, load_placement(out / "p.json").phy2log)   # every layer is MoE


def test_optimize_prints_the_three_rows(optimized):
    _, result = optimized
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fitted on the first ") and "steps (all modes); table on the last " in lines[0]
    assert ", held out; 8 ranks, 0 redundant" in lines[0] and " all steps" not in lines[0]
    table = [line.split()[0] for line in lines if line.split() and line.split()[0] in ROWS]
    assert table == ROWS
    assert lines[-1].startswith("wrote ")
    assert any(line.startswith("placement ") and "vs baseline" in line for line in lines)
    assert any(line.startswith("baseline: deepseek ") for line in lines)
    assert any(line.startswith("cost model (MoE µs/step): NVIDIA H200, known model gpt-oss-20b") for line in lines)


def test_optimize_json(tmp_path):
    result = invoke("optimize", SAMPLE, "--ranks", 8, *FAST, "--redundant", 8, "--dispatch", "static",
                    "--algorithm", "deepseek", "-o", tmp_path / "p.json", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # spares asked for: the first row and baseline is SGLang's layout today, under its own rule for DeepEP
    assert [r["placement"] for r in data["rows"]] == ["deepseek, no spares, static", "contiguous", "deepseek"]
    assert data["baseline"] == "deepseek, no spares, static" and data["rows"][0]["spare_slots"] == 0
    assert data["placement"] == str(tmp_path / "p.json") and data["sglang_out"] is None
    used = data["fit_steps"] + data["eval_steps"]
    assert used > 0 and data["note"].startswith(f"used {used} of the trace's 3,007 steps (all modes), evenly spaced")
    for row in data["rows"]:
        assert row["e_max_distinct"] >= row["lower_bound"] > 0
    p = load_placement(tmp_path / "p.json")
    assert p.phy2log.shape == (24, 40) and p.algorithm == "deepseek"


def test_optimize_same_seed_same_file(tmp_path):
    for name in ("a.json", "b.json"):
        assert invoke("optimize", SAMPLE, "--ranks", 4, *FAST, "--seed", 3, "-o", tmp_path / name).exit_code == 0
    a, b = (load_placement(tmp_path / n) for n in ("a.json", "b.json"))
    assert np.array_equal(a.phy2log, b.phy2log)


def test_optimize_aggregate_only_source(tmp_path):
    """A logical_count JSON has no steps: they are sampled from its counts, and the output says so.
    8 experts with the default top-k 8 (regression: top_k == num_experts crashed the sampler)."""
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 100, (3, 8)).tolist()
    src = tmp_path / "counts.json"
    src.write_text(json.dumps({"logical_count": counts}))
    result = invoke("optimize", src, "--ranks", 4, "--max-steps", 50, "--effort", 1e6, "-o", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    assert "note: aggregate-only trace" in result.stdout
    p = load_placement(tmp_path / "p.json")
    assert p.phy2log.shape == (3, 8) and p.metrics["note"].startswith("aggregate-only trace")
    result = invoke("optimize", src, "--ranks", 4, "--top-k", 2, "--effort", 1e6, "-o", tmp_path / "q.json")
    assert result.exit_code == 0, result.output


# ----------------------------------------------------------------------------- compare

def test_compare_moeplace_and_sglang_files(optimized, tmp_path):
    out, _ = optimized
    contiguous = tmp_path / "contiguous.json"
    assert invoke("optimize", SAMPLE, "--ranks", 8, *FAST, "--algorithm", "contiguous", "-o",
                  contiguous).exit_code == 0
    result = invoke("compare", SAMPLE, contiguous, out / "p.json", out / "sglang.json", "--ranks", 8,
                    "--max-steps", 600)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("scored on the first 600 steps (all modes) of 3,007 (no --holdout")
    assert lines[0].endswith(f"; 8 ranks, dispatch dynamic (the rule each placement was made for; the default for "
                             f"{out / 'sglang.json'}, which records none)")
    assert "vs baseline" in next(line for line in lines if line.startswith("placement "))
    head = next(i for i, line in enumerate(lines) if line.startswith("placement "))
    names = [line.split()[0] for line in lines[head + 2:head + 5]]
    assert names == [str(contiguous), str(out / "p.json"), str(out / "sglang.json")]
    assert lines[head + 5].startswith(f"baseline: {contiguous} ")
    assert lines[head + 6].startswith("cost model (MoE µs/step): ")
    result = invoke("compare", SAMPLE, contiguous, out / "p.json", out / "sglang.json", "--ranks", 8,
                    "--max-steps", 600, "--json")
    rows = json.loads(result.stdout)["rows"]
    assert rows[0]["vs_baseline_pct"] == 0.0
    # the SGLang file holds the same map as the moeplace file: the same numbers
    assert {k: v for k, v in rows[1].items() if k != "placement"} == \
        {k: v for k, v in rows[2].items() if k != "placement"}


def test_compare_placement_for_other_expert_count(optimized, tmp_path, capsys):
    out, _ = optimized
    trace = topk_npz(tmp_path / "tiny16.npz", 16, 6)
    code, _, err = run_main(capsys, "compare", trace, out / "p.json", "--ranks", 8)
    assert code == 2
    assert_one_line_error(err, "32 experts", "16 experts")
    code, _, err = run_main(capsys, "compare", trace, out / "sglang.json", "--ranks", 8)
    assert code == 2
    assert_one_line_error(err, "sglang.json")


def test_compare_placement_for_other_rank_count(optimized, capsys):
    out, _ = optimized
    code, _, err = run_main(capsys, "compare", SAMPLE, out / "p.json", "--ranks", 4)
    assert code == 2
    assert_one_line_error(err, "placement is for 8 ranks, not 4")


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("args,fragments", [
    (["--ranks", "7"], ["--ranks", "32 experts", "7 ranks"]),
    (["--ranks", "8", "--redundant", "3"], ["--ranks", "3 redundant", "8 ranks"]),
    (["--ranks", "8", "--nodes", "3"], ["--ranks (8)", "--nodes (3)"]),
    (["--ranks", "2", "--redundant", "34"], ["slots per rank exceed the 32 experts"]),
    (["--holdout", "1"], ["--holdout"]),
    (["--algorithm", "nope"], ["--algorithm"]),
    (["--balance-floor", "1.5"], ["--balance-floor"]),
])
def test_optimize_bad_options(tmp_path, capsys, args, fragments):
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, *FAST, *args, "-o", out / "p.json")
    assert code == 2, err
    assert_one_line_error(err, *fragments)
    assert_nothing_written(out)


def test_optimize_holdout_too_large_for_a_tiny_trace(tmp_path, capsys):
    trace = topk_npz(tmp_path / "tiny.npz", 32, 5)
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_main(capsys, "optimize", trace, "--holdout", "0.99", "-o", out / "p.json")
    assert code == 2
    assert_one_line_error(err, "5 steps are too few", "--holdout")
    assert_nothing_written(out)


@pytest.mark.parametrize("name,content", [
    ("garbage.mptrace", b"\x00\x01not a trace at all" * 10),
    ("truncated.mptrace", b"MPTRACE"),
    ("garbage.json", b"{not json"),
    ("nocounts.json", b'{"something": 1}'),
    ("garbage.npz", b"PK\x03\x04 broken zip"),
    ("garbage.txt", b"hello"),
])
def test_optimize_garbage_trace(tmp_path, capsys, name, content):
    trace = tmp_path / name
    trace.write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_main(capsys, "optimize", trace, "-o", out / "p.json")
    assert code == 2, err
    assert_one_line_error(err, name)
    assert_nothing_written(out)


def test_optimize_missing_trace(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_main(capsys, "optimize", tmp_path / "nope.mptrace", "-o", out / "p.json")
    assert code == 2
    assert_one_line_error(err, "nope.mptrace")
    assert_nothing_written(out)


def test_optimize_unwritable_outputs_leave_nothing(tmp_path, capsys):
    """An output under a regular file cannot be written: one line, and no placement left behind
    (regression: a traceback, after the placement had already been written)."""
    out = tmp_path / "out"
    out.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run_main(capsys, "optimize", SAMPLE, *FAST, "-o", out / "p.json",
                            "--sglang-out", blocker / "sglang.json")
    assert code == 2
    assert_one_line_error(err, "sglang.json")
    assert_nothing_written(out)
    code, _, err = run_main(capsys, "optimize", SAMPLE, *FAST, "-o", blocker / "p.json")
    assert code == 2
    assert_one_line_error(err, "p.json")


def test_optimize_failure_keeps_an_existing_placement(optimized, tmp_path, capsys):
    """A failed run does not touch an older placement at the -o path."""
    out, _ = optimized
    target = tmp_path / "p.json"
    target.write_bytes((out / "p.json").read_bytes())
    code, _, _ = run_main(capsys, "optimize", SAMPLE, *FAST, "--ranks", "7", "-o", target)
    assert code == 2
    assert target.read_bytes() == (out / "p.json").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["p.json"]


def test_entry_point_subprocess_one_line_exit_2(tmp_path):
    """The installed entry point, in a fresh interpreter: exit 2, one stderr line, no traceback."""
    bad = tmp_path / "bad.mptrace"
    bad.write_bytes(b"MPTRACE\x00garbage")
    proc = subprocess.run([sys.executable, "-c", "import sys; from moeplace.cli import main; main(sys.argv[1:])",
                           "optimize", str(bad), "-o", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.mptrace" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args", [["--ranks", "7"], ["--redundant", "3"], ["--holdout", "2"]])
def test_bad_option_is_one_line_through_main(tmp_path, capsys, args):
    """Click's own option errors also come out as one line (no usage block) with exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", str(SAMPLE), "-o", str(tmp_path / "p.json"), *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "optimize --help" in lines[0], lines
    assert not (tmp_path / "p.json").exists()


def test_help_has_examples():
    for command in ("optimize", "compare"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "Example:" in result.stdout and f"moeplace {command}" in result.stdout


@pytest.mark.parametrize("redundant, warns", [(0, False), (16, False), (48, False), (96, True), (384, True)])
def test_spare_slots_that_outgrow_the_gpu_are_warned_about(redundant, warns):
    """Kimi K2's fp8 experts take 126.9 GB of an H200's 150.8 GB at 8 ranks; each spare slot a GPU adds
    2.64 GB, so 96 spares (12 a GPU, 158.6 GB) cannot load and 48 (142.7 GB) can. The line gives both."""
    from moeplace.commands.costing import Costing, memory_warning, slot_gb
    from moeplace.model.expert_shape import known_expert_shape
    from moeplace.trace.synthetic import KIMI_K2

    costing = Costing(known_expert_shape(KIMI_K2), KIMI_K2.top_k)
    line = memory_warning(KIMI_K2, 8, redundant, costing)
    assert (line is not None) is warns
    need = (384 + redundant) / 8 * slot_gb(KIMI_K2, costing)
    assert (need > 150.76) is warns
    if warns:
        assert f"{need:.1f} GB per GPU" in line and "126.9 GB without" in line and "--replica-memory" in line


def test_no_memory_warning_without_a_known_shape_or_gpu():
    """A generic expert shape, or a --cost-model file (its GPU unknown), gives no memory line."""
    from moeplace.commands.costing import Costing, memory_warning
    from moeplace.cost.model import CostModel
    from moeplace.model.expert_shape import GENERIC, known_expert_shape
    from moeplace.trace.synthetic import KIMI_K2

    assert memory_warning(KIMI_K2, 8, 384, Costing(GENERIC, 8)) is None
    assert memory_warning(KIMI_K2, 8, 384, Costing(known_expert_shape(KIMI_K2), 8, CostModel())) is None


def test_advise_names_its_own_option_in_the_memory_line():
    """advise has --redundant, not --replica-memory: the same check says so (every EP x TP split holds the
    same bytes per GPU, so the line is given once for all layouts with spare slots)."""
    from moeplace.commands.costing import Costing, memory_warning
    from moeplace.model.expert_shape import known_expert_shape
    from moeplace.trace.synthetic import KIMI_K2

    costing = Costing(known_expert_shape(KIMI_K2), KIMI_K2.top_k)
    line = memory_warning(KIMI_K2, 8, 96, costing, fewer="fewer (--redundant)")
    assert "ask for fewer (--redundant)" in line and "--replica-memory" not in line
    split = memory_warning(KIMI_K2, 4, 96, costing, moe_tp=2)   # EP4 x TP2: 120 half experts a GPU
    assert split is not None and "158.6 GB per GPU" in split
