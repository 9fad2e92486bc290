"""``moeplace online decide`` on the shipped sample: the placement to move to written, or nothing when it keeps;
its refusals; ``online request`` without a server."""

from __future__ import annotations

import json

import numpy as np

from moeplace.files.placement import Placement, load_placement, save_placement
from moeplace.trace.load import open_trace
from test_cli_optimize import SAMPLE, assert_one_line_error, run_main

ARGS = ["--ranks", "8", "--mode", "verify", "--last", "600"]


def hottest_together(path) -> None:
    """A bad placement in force: each rank holds experts of neighbouring hotness (rank 0 the four hottest)."""
    steps = open_trace(SAMPLE).load("verify")
    save_placement(path, Placement(steps.model, 8, np.argsort(-steps.expert_token_counts(), axis=1, kind="stable")))


def test_decide_writes_where_to_move_and_what_it_gains(tmp_path, capsys):
    hottest_together(tmp_path / "now.json")
    code, out, err = run_main(capsys, "online", "decide", SAMPLE, "--placement", tmp_path / "now.json", *ARGS,
                              "-o", tmp_path / "next.json", "--sglang-out", tmp_path / "next.sglang.json")
    assert code == 0, err
    assert out.startswith("re-place") and "% to gain" in out and "expert replicas" in out
    moved = load_placement(tmp_path / "next.json")
    assert moved.algorithm == "online" and moved.metrics["dispatch"] == "dynamic"
    assert moved.metrics["online_decision"]["moved_replicas"] == int(
        (moved.phy2log != load_placement(tmp_path / "now.json").phy2log).sum())
    assert json.loads((tmp_path / "next.sglang.json").read_text())["physical_to_logical_map"]
    assert "deciding: 4 of 4 fits" in err


def test_decide_that_keeps_writes_nothing(tmp_path, capsys):
    code, _, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--balance-floor", "0.9",
                            "-o", tmp_path / "now.json")
    assert code == 0, err
    code, out, err = run_main(capsys, "online", "decide", SAMPLE, "--placement", tmp_path / "now.json", *ARGS,
                              "--min-gain", "0.5", "-o", tmp_path / "next.json", "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert not answer["replace"] and answer["placement"] is None, answer["decision"]["line"]
    assert answer["decision"]["line"].startswith("keep")
    assert not (tmp_path / "next.json").exists()


def test_decide_refuses_to_overwrite_the_placement_in_force(tmp_path, capsys):
    hottest_together(tmp_path / "now.json")
    before = (tmp_path / "now.json").read_bytes()
    code, _, err = run_main(capsys, "online", "decide", SAMPLE, "--placement", tmp_path / "now.json", *ARGS,
                            "-o", tmp_path / "now.json")
    assert code == 2
    assert_one_line_error(err, "--placement")
    assert (tmp_path / "now.json").read_bytes() == before


def test_decide_refuses_a_bad_share(tmp_path, capsys):
    hottest_together(tmp_path / "now.json")
    code, _, err = run_main(capsys, "online", "decide", SAMPLE, "--placement", tmp_path / "now.json", *ARGS,
                            "--min-gain", "1.5", "-o", tmp_path / "next.json")
    assert code == 2
    assert_one_line_error(err, "--min-gain")


def test_request_without_a_server_says_so(tmp_path, capsys):
    code, _, err = run_main(capsys, "online", "request", tmp_path, "--dry-run", "--wait", "1")
    assert code == 2
    assert_one_line_error(err, "no status")
    assert list(tmp_path.iterdir()) == []


def test_decide_refuses_a_placement_made_for_a_rule_it_does_not_know(tmp_path, capsys):
    hottest_together(tmp_path / "now.json")
    data = json.loads((tmp_path / "now.json").read_text())
    data["metrics"] = {"dispatch": "round-robin"}
    (tmp_path / "now.json").write_text(json.dumps(data))
    code, _, err = run_main(capsys, "online", "decide", SAMPLE, "--placement", tmp_path / "now.json", *ARGS,
                            "-o", tmp_path / "next.json")
    assert code == 2
    assert_one_line_error(err, "round-robin")
    assert not (tmp_path / "next.json").exists()
