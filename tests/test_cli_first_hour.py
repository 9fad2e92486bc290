"""A user's first hour: each item through the real entry point, asserting the behaviour that the
earlier code got wrong (an input overwritten, a file left by a failure, a misleading baseline, in-sample
scores, silent guesses, progress garbling a log, SIGTERM leaving a temp file, ...). Bad inputs that only
need one clean line are swept in test_cli_bad_inputs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import moeplace.commands.common as common
from moeplace.commands.optimize import FIT_GAP, quality_warnings
from moeplace.errors import MoeplaceError
from moeplace.files.atomic import all_or_nothing, atomic_write_text
from moeplace.files.placement import save_placement
from moeplace.trace.store import write_trace
from test_cli_optimize import FAST, SAMPLE, run_main, topk_npz

REPO = Path(__file__).resolve().parents[1]
GPTOSS_EXPERT_GB = 24 * 3 * 2880 * 2880 * 2 / 1e9   # one spare slot a GPU: 24 layers of bf16 2880x2880 experts


def stderr_lines(err: str, prefix: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prefix)]


# ----------------------------------------------------------------------------- 1, 2: outputs

def test_optimize_refuses_to_overwrite_its_trace(tmp_path, capsys):
    trace = tmp_path / "t.mptrace"
    trace.write_bytes(SAMPLE.read_bytes())
    code, _, err = run_main(capsys, "optimize", trace, *FAST, "-o", trace)
    assert code == 2 and "is the TRACE" in err
    assert trace.read_bytes() == SAMPLE.read_bytes()


def test_a_failed_write_leaves_no_output(tmp_path, capsys, monkeypatch):
    """The placement, SGLang's file and the plots are written all or none: a failure writing the last one
    (here the placement) removes the others, and the plot folder made for them (before: SGLang's file and
    the plots stayed)."""
    import moeplace.commands.optimize as command

    def fail(path, placement):
        atomic_write_text(path, "half")   # a write under way when the disk fills up
        raise MoeplaceError(f"{path}: cannot write (No space left on device)")

    monkeypatch.setattr(command, "save_placement", fail)
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_main(capsys, "optimize", SAMPLE, *FAST, "-o", out / "p.json", "--sglang-out",
                            out / "sglang.json", "--plot-dir", out / "plots" / "run1")
    assert code == 2 and "No space left" in err
    assert os.listdir(out) == []


def test_all_or_nothing_nests_and_removes_the_folders_it_made(tmp_path):
    with pytest.raises(RuntimeError), all_or_nothing():
        atomic_write_text(tmp_path / "a" / "b" / "x.txt", "x")
        with all_or_nothing():   # an inner block defers to the outer one
            atomic_write_text(tmp_path / "a" / "y.txt", "y")
        assert not (tmp_path / "a" / "y.txt").exists()
        raise RuntimeError("late failure")
    assert os.listdir(tmp_path) == []
    with all_or_nothing():
        atomic_write_text(tmp_path / "a" / "x.txt", "x")
        atomic_write_text(tmp_path / "y.txt", "y")
    assert (tmp_path / "a" / "x.txt").read_text() == "x" and (tmp_path / "y.txt").read_text() == "y"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_plot_dir_is_refused_before_the_work(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run_main(capsys, "optimize", SAMPLE, *FAST, "-o", tmp_path / "p.json", "--plot-dir",
                                locked / "plots")
    finally:
        locked.chmod(0o700)
    assert code == 2 and "no permission to write" in err and "placing" not in err
    assert not (tmp_path / "p.json").exists()


def test_capture_checks_its_output_before_contacting_the_server(tmp_path, capsys):
    """An -o that cannot be written is refused before the server is asked for anything (before: after
    the whole --seconds of recording)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    contacted = []
    threading.Thread(target=lambda: contacted.append(server.accept()), daemon=True).start()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    try:
        code, _, err = run_main(capsys, "capture", "--url", f"http://127.0.0.1:{server.getsockname()[1]}",
                                "--seconds", "60", "-o", blocker / "t.mptrace")
        time.sleep(0.2)
    finally:
        server.close()
    assert code == 2 and "is a file, not a folder" in err
    assert contacted == []


def test_launch_refuses_to_overwrite_its_placement(tmp_path, capsys):
    from test_launch import DSV3_CONFIG, SPEC, round_robin

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(DSV3_CONFIG))
    placement = tmp_path / "p.json"
    save_placement(placement, round_robin(SPEC, ranks=4, redundant=4))
    before = placement.read_bytes()
    code, _, err = run_main(capsys, "launch", "--placement", placement, "--sglang-file", placement, "--dry-run", "--",
                            "--model-path", tmp_path / "m", "--tp", "4", "--ep", "4", "--ep-num-redundant-experts", "4")
    assert code == 2 and "is the --placement" in err
    assert placement.read_bytes() == before


# ----------------------------------------------------------------------------- 3: the first row with spares

def test_spares_under_sglangs_rule_are_compared_with_no_spares(tmp_path, capsys):
    """--replica-memory with --dispatch dynamic: the first row and baseline is DeepSeek EPLB without spare
    slots under SGLang's dynamic rule, so that spares that cost more than they save show as a loss (before:
    DeepSeek EPLB with the spares was the baseline, and stepaware showed -30% against it)."""
    code, out, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--replica-memory",
                              f"{1.5 * GPTOSS_EXPERT_GB:.3f}", *FAST, "-o", tmp_path / "p.json", "--json")
    assert code == 0, err
    data = json.loads(out)
    rows = {r["placement"]: r for r in data["rows"]}
    today = "deepseek, no spares, dynamic"
    assert data["baseline"] == today and data["rows"][0]["placement"] == today
    assert rows[today]["spare_slots"] == 0 and rows["deepseek"]["spare_slots"] == 8
    # under SGLang's dynamic rule, DeepSeek's replicas cost more than they save at verify batch
    assert rows["deepseek"]["vs_baseline_pct"] > 0 and rows[today]["vs_baseline_pct"] == 0


# ----------------------------------------------------------------------------- 4: held-out scores

def test_advise_scores_held_out_steps_and_says_so(tmp_path, capsys):
    code, out, err = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--effort", "1e6")
    assert code == 0, err
    assert "placements fitted on 2,000 of the first 2,105 verify steps; costs on 256 of the last 902, held out" in out
    assert "256 held-out steps" in out
    code, out, err = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--effort", "1e6",
                              "--holdout", "0", "--json")
    data = json.loads(out)
    assert code == 0 and data["evaluated_on"] == "fitted steps" and data["fit_steps"] == 2000


def test_compare_says_what_it_scores_and_takes_holdout(tmp_path, capsys):
    placement = tmp_path / "p.json"
    assert run_main(capsys, "optimize", SAMPLE, "--mode", "verify", *FAST, "-o", placement)[0] == 0
    code, out, _ = run_main(capsys, "compare", SAMPLE, placement, "--mode", "verify")
    assert code == 0
    assert out.startswith("scored on all 3,007 verify steps (no --holdout: a placement fitted on this trace is "
                          "scored on its fitted steps too)")
    assert f"note: {placement} was fitted on this trace" in out and "`moeplace compare --holdout 0.3` does" in out
    code, out, _ = run_main(capsys, "compare", SAMPLE, placement, "--mode", "verify", "--holdout", "0.3", "--json")
    data = json.loads(out)
    assert code == 0 and data["steps"] == 902 and data["trace_steps"] == 3007
    assert data["scored_on"] == "the last 902 of the trace's 3,007 verify steps (--holdout 0.3)"


# ----------------------------------------------------------------------------- 5: the fitted column

def test_optimize_table_has_a_fitted_column_beside_the_held_out_one(tmp_path, capsys):
    code, out, err = run_main(capsys, "optimize", SAMPLE, "--mode", "verify", *FAST, "-o", tmp_path / "p.json")
    assert code == 0, err
    head = next(line for line in out.splitlines() if line.startswith("placement "))
    assert head.split()[:4] == ["placement", "E[max", "distinct]", "fitted"]
    assert "fitted: E[max distinct] on 420 of the 420 fitted steps" in out
    code, out, _ = run_main(capsys, "optimize", SAMPLE, "--mode", "verify", *FAST, "--holdout", "0",
                            "-o", tmp_path / "q.json", "--json")
    assert code == 0 and all("fitted_e_max_distinct" not in r for r in json.loads(out)["rows"])


def test_a_placement_worse_than_a_baseline_is_warned_about(tmp_path, capsys):
    code, out, err = run_main(capsys, "optimize", SAMPLE, "--algorithm", "contiguous", *FAST,
                              "-o", tmp_path / "p.json", "--json")
    assert code == 0
    rows = {r["placement"]: r for r in json.loads(out)["rows"]}
    assert rows["contiguous"]["e_max_distinct"] > rows["deepseek"]["e_max_distinct"]
    warned = stderr_lines(err, "warning: ")
    assert len(warned) == 1 and "the written placement (contiguous) is worse than deepseek on the held-out" in warned[0]


def _row(name: str, held: float, fitted: float) -> dict:
    return {"placement": name, "e_max_distinct": held, "fitted_e_max_distinct": fitted}


@pytest.mark.parametrize("rows, expect", [
    ([_row("deepseek", 3.0, 3.0), _row("stepaware", 2.9, 2.85)], []),
    ([_row("deepseek", 3.0, 3.0), _row("stepaware", 3.1, 3.0)], ["is worse than deepseek"]),
    # generic over the rows: a row added later (a naive spares layout) is a baseline too
    ([_row("deepseek", 3.0, 3.0), _row("naive spares", 2.5, 2.5), _row("stepaware", 2.6, 2.55)],
     ["is worse than naive spares"]),
    ([_row("deepseek", 3.0, 3.0), _row("stepaware", 2.9, 2.9 / (1 + FIT_GAP) * 0.999)], ["more than 5% apart"]),
    ([_row("deepseek", 3.0, 3.0), _row("stepaware", 2.9, 2.9 / (1 + FIT_GAP) * 1.001)], []),
    ([_row("deepseek", 3.0, 3.0), _row("stepaware", 3.2, 2.5)], ["is worse than deepseek", "more than 5% apart"]),
])
def test_quality_warnings(rows, expect):
    lines = quality_warnings(rows, "stepaware", "held-out", 420, spares=False)
    assert len(lines) == len(expect) and all(e in line for e, line in zip(expect, lines)), lines


def test_a_short_fit_that_does_not_hold_is_warned_about(tmp_path, capsys):
    """Fitted on a few hundred steps of a 128-expert synthetic model, stepaware's held-out figure is far
    above its fitted one: the table's fitted column shows it and a warning says so."""
    trace = tmp_path / "q.mptrace"
    assert run_main(capsys, "trace", "synth", "--shape", "qwen3-30b-a3b", "--steps", "300", "-o", trace)[0] == 0
    code, out, err = run_main(capsys, "optimize", trace, "--effort", "2e7", "-o", tmp_path / "p.json", "--json")
    assert code == 0
    mine = next(r for r in json.loads(out)["rows"] if r["placement"] == "stepaware")
    assert mine["e_max_distinct"] > (1 + FIT_GAP) * mine["fitted_e_max_distinct"]
    assert any("more than 5% apart" in line and "210 fitted steps" in line for line in stderr_lines(err, "warning:"))


# ----------------------------------------------------------------------------- 6: what an .npz holds

def test_npz_without_expert_count_says_what_was_inferred(tmp_path, capsys):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (90, 2, 4)).astype(np.int16)
    ids[0, 0, 0] = 999
    np.savez(tmp_path / "t.npz", topk_ids=ids)
    code, out, err = run_main(capsys, "report", tmp_path / "t.npz", "--ranks", "8", "--cost-model",
                              REPO / "moeplace" / "cost" / "measured" / "cost_h200_bf16.json")
    assert code == 0, err
    assert "1000 experts" in out
    warned = stderr_lines(err, "warning: ")
    assert len(warned) == 1 and "does not say num_experts: 1000 taken from its largest expert id, 999" in warned[0]
    # a file that says its expert count is taken as it is, without a word
    code, _, err = run_main(capsys, "report", topk_npz(tmp_path / "u.npz", 16, 10, layers=2), "--ranks", "8",
                            "--cost-model", REPO / "moeplace" / "cost" / "measured" / "cost_h200_bf16.json")
    assert code == 0 and "warning" not in err


# ----------------------------------------------------------------------------- 12: launch

def test_launch_says_when_the_replicas_were_placed_for_another_rule(tmp_path, capsys, monkeypatch):
    from test_launch import DSV3_CONFIG, SPEC, round_robin

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(DSV3_CONFIG))
    p = round_robin(SPEC, ranks=4, redundant=4)
    p.metrics = {"dispatch": "dynamic"}
    save_placement(tmp_path / "p.json", p)
    args = ["launch", "--placement", tmp_path / "p.json", "--dry-run", "--", "--model-path", tmp_path / "m",
            "--tp", "4", "--ep-num-redundant-experts", "4"]
    code, out, err = run_main(capsys, *args, "--moe-a2a-backend", "deepep")
    assert code == 0, err
    warned = stderr_lines(err, "warning: ")
    assert len(warned) == 1 and "placed for SGLang's dynamic replica choice, but SGLang will use static" in warned[0]
    assert "--moe-a2a-backend deepep" in warned[0]
    code, _, err = run_main(capsys, *args, "--moe-a2a-backend", "deepep", "--ep-dispatch-algorithm", "dynamic")
    assert code == 0 and "warning" not in err
    code, _, err = run_main(capsys, *args, "--ep", "4")   # no all-to-all backend: SGLang's rule is dynamic
    assert code == 0 and "warning" not in err

    # --dry-run where SGLang is not installed says so beside the command
    fake = tmp_path / "python-without-sglang"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr("moeplace.sglang.launch.sys.executable", str(fake))
    code, out, err = run_main(capsys, *args, "--ep", "4")
    assert code == 0 and out.startswith(str(fake))
    assert any("SGLang is not installed" in line for line in stderr_lines(err, "warning: "))


# ----------------------------------------------------------------------------- 13: rough edges

@pytest.mark.parametrize("argv", [[], ["trace"]])
def test_bare_groups_print_their_help_and_exit_0(argv):
    proc = subprocess.run([sys.executable, "-m", "moeplace", *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith(f"Usage: moeplace {' '.join(argv)}".rstrip() + " [OPTIONS] COMMAND")
    if argv:
        assert "convert another format" in " ".join(proc.stdout.split("Options:")[0].split())   # the group's text


def test_out_is_the_option_everywhere_and_output_still_works(tmp_path, capsys):
    from click.testing import CliRunner

    from moeplace.cli import cli

    for command in (["optimize"], ["capture"], ["trace", "merge"], ["trace", "convert"], ["trace", "synth"]):
        text = CliRunner().invoke(cli, [*command, "--help"]).output
        assert "-o, --out FILE" in text and "--output" not in text, command
    code, _, err = run_main(capsys, "optimize", SAMPLE, *FAST, "--output", tmp_path / "p.json")
    assert code == 0 and (tmp_path / "p.json").is_file(), err


def test_effort_help_shows_its_default_and_range():
    from click.testing import CliRunner

    from moeplace.cli import cli

    text = " ".join(CliRunner().invoke(cli, ["advise", "--help"]).output.split())
    assert "[default: (2e8); 1<=x<=1e+15]" in text and "200000000.0" not in text


# ----------------------------------------------------------------------------- 14: logs, signals, servers, .pt

def test_report_progress_is_plain_lines_in_a_log(tmp_path, capsys, monkeypatch):
    """stderr that is not a terminal gets whole lines, never a carriage return (before: '\\r' rewrites)."""
    from moeplace.trace.load import open_trace

    trace = open_trace(SAMPLE)
    write_trace(tmp_path / "chunky.mptrace", trace.header, trace.load(), chunk_steps=100)   # 31 chunks
    real = common.Progress
    monkeypatch.setattr(common, "Progress", lambda *a, **k: real(*a, **{**k, "quiet_for": 0.0}))
    code, _, err = run_main(capsys, "report", tmp_path / "chunky.mptrace", "--ranks", "8")
    assert code == 0
    progress = stderr_lines(err, "reading: ")
    assert "\r" not in err and 5 <= len(progress) <= 11
    assert progress[-1].startswith("reading: 3,007 of 3,007 steps (100%")


def test_sigterm_leaves_no_partial_trace(tmp_path):
    """SIGTERM while trace synth writes: the .part file is removed, as on Ctrl-C, and the exit code says
    terminated (before: the default action killed the process and left NAME.mptrace.part)."""
    proc = subprocess.Popen([sys.executable, "-m", "moeplace", "trace", "synth", "--steps", "400000",
                             "-o", str(tmp_path / "big.mptrace")], cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "big.mptrace.part").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "big.mptrace.part").exists()
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_a_file_torch_refuses_is_never_met_with_its_advice(tmp_path, capsys):
    """torch's message for a .pt it will not load suggests weights_only=False, which would run the file's
    code: the one line moeplace prints says what the file holds instead."""
    torch = pytest.importorskip("torch")
    import fractions

    torch.save({"x": fractions.Fraction(1, 2)}, tmp_path / "obj.pt")
    (tmp_path / "junk.pt").write_bytes(b"\x80\x04junk")
    for name, said in (("obj.pt", "holds a fractions.Fraction object"), ("junk.pt", "not a readable torch file")):
        for argv in (["report", tmp_path / name], ["report", SAMPLE, "--placement", tmp_path / name]):
            code, _, err = run_main(capsys, *argv)
            assert code == 2 and said in err and "weights_only" not in err, err


# ----------------------------------------------------------------------------- 15: docs and plots

def test_the_distribution_plot_shows_the_lower_bound():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeplace.cost.model import CostModel
    from moeplace.files.placement import Placement
    from moeplace.analysis.report import distribution_figure, evaluate
    from moeplace.trace.load import open_trace

    trace = open_trace(SAMPLE)
    ev = evaluate({"contiguous": Placement(trace.model, 8, np.tile(np.arange(32), (24, 1)))},
                  [trace.load(max_steps=300)], CostModel())
    fig = distribution_figure(ev, "context")
    try:
        lines = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("lower bound")]
        assert len(lines) == 1
        assert lines[0].get_xdata()[0] == pytest.approx(ev[0].summary["lower_bound"])
        assert "lower bound" in [t.get_text().split(" (")[0] for t in fig.axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)


def test_the_walkthrough_says_model_needs_only_config_json():
    text = " ".join((REPO / "docs" / "walkthrough.md").read_text().split())
    assert "`--model` needs only the model's `config.json`" in text
