"""``--dispatch balanced`` through the commands: optimize with spare slots by count or by memory, the
reference row of what SGLang runs today, the per-step optimum column, and bad input as one line."""

from __future__ import annotations

import json

import pytest

from moeplace.analysis.optimize import TODAY
from moeplace.files.placement import check_placement, load_placement
from test_cli_optimize import FAST, SAMPLE, assert_nothing_written, assert_one_line_error, run_main, topk_npz

GPTOSS_EXPERT_GB = 24 * 3 * 2880 * 2880 * 2 / 1e9   # one spare slot a GPU: 24 layers of bf16 2880x2880 experts


def test_optimize_balanced_with_spare_slots(tmp_path, capsys):
    out = tmp_path / "p.json"
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--dispatch",
                                 "balanced", "--redundant", "8", *FAST, "-o", out, "--json")
    assert code == 0, err
    data = json.loads(stdout)
    rows = {r["placement"]: r for r in data["rows"]}
    assert data["baseline"] == TODAY and list(rows)[0] == TODAY
    assert rows[TODAY]["spare_slots"] == 0 and rows["stepaware"]["spare_slots"] == 8
    # balanced dispatch with spare slots beats what SGLang runs today and the naive spare layout (a row
    # of its own), and never beats the optimum
    assert rows["stepaware"]["e_max_distinct"] < rows[TODAY]["e_max_distinct"]
    assert rows["naive-spares"]["spare_slots"] == 8
    assert rows["stepaware"]["e_max_distinct"] <= rows["naive-spares"]["e_max_distinct"]
    for r in rows.values():
        assert r["lower_bound"] - 1e-9 <= r["optimum"] <= r["e_max_distinct"] + 1e-9
    assert data["replica_gb_per_gpu"] == pytest.approx(GPTOSS_EXPERT_GB)
    placement = load_placement(out)
    check_placement(placement)
    assert placement.num_redundant == 8 and placement.metrics["dispatch"] == "balanced"


def test_table_names_the_memory_and_the_optimum(tmp_path, capsys):
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--dispatch",
                                 "balanced", "--replica-memory", f"{2.5 * GPTOSS_EXPERT_GB:.3f}", *FAST,
                                 "-o", tmp_path / "p.json")
    assert code == 0, err
    assert "16 redundant" in stdout and "spare slots: 16 (2 per GPU) hold" in stdout
    assert f"{2 * GPTOSS_EXPERT_GB:.2f} GB of extra expert weights per GPU" in stdout
    assert "per-step opt." in stdout and f"baseline: {TODAY}" in stdout
    assert load_placement(tmp_path / "p.json").num_redundant == 16


def test_no_spare_slots_keeps_the_plain_table(tmp_path, capsys):
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--dispatch", "balanced", *FAST,
                                 "-o", tmp_path / "p.json")
    assert code == 0, err
    assert TODAY not in stdout and "per-step opt." not in stdout and "baseline: deepseek" in stdout
    assert "naive-spares" not in stdout


@pytest.mark.parametrize("args, fragments", [
    (["--redundant", "8", "--replica-memory", "3"], ["--redundant or --replica-memory"]),
    (["--replica-memory", "0.5"], ["--replica-memory", "holds no spare slot", "1.19 GB"]),
])
def test_bad_spare_slot_requests(tmp_path, capsys, args, fragments):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--dispatch", "balanced", *args,
                            "-o", out_dir / "p.json")
    assert code == 2
    assert_one_line_error(err, *fragments)
    assert_nothing_written(out_dir)


@pytest.mark.parametrize("redundant", [4, 12])
def test_balanced_where_experts_do_not_split_over_ranks(tmp_path, capsys, redundant):
    # 12 experts on 8 ranks: the first copies take 16 slots (4 replicas make them even), the rest are spare
    # slots the search places (none with 4, one a rank with 12)
    trace = topk_npz(tmp_path / "t.npz", num_experts=12, steps=60, layers=2)
    out = tmp_path / "p.json"
    code, stdout, err = run_main(capsys, "optimize", trace, "--ranks", "8", "--dispatch", "balanced", "--redundant",
                                 str(redundant), "-o", out)
    assert code == 0, err
    placement = load_placement(out)
    check_placement(placement)
    assert placement.phy2log.shape == (2, 12 + redundant)
    assert ("ways tried on the fitted steps" in stdout + err) == (redundant > 4)   # the out-of-fold choice, where slots are left


def test_report_and_compare_under_balanced_dispatch(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--dispatch", "balanced", "--redundant", "8",
                    *FAST, "-o", out)[0] == 0
    code, stdout, err = run_main(capsys, "report", SAMPLE, "--placement", out, "--ranks", "8", "--dispatch",
                                 "balanced", "--json")
    assert code == 0, err
    balanced = json.loads(stdout)
    assert balanced["dispatch"] == "balanced"
    e_max = balanced["metrics"]["e_max_distinct"]
    code, stdout, err = run_main(capsys, "compare", SAMPLE, out, "--ranks", "8", "--dispatch", "dynamic", "--json")
    assert code == 0, err
    dynamic = json.loads(stdout)["rows"][0]
    # the same placement under SGLang's own rule reads more experts on the busiest rank; the per-step
    # optimum of the placement does not depend on the rule, and balanced dispatch reaches it
    assert e_max < dynamic["e_max_distinct"]
    assert dynamic["optimum"] == pytest.approx(balanced["metrics"]["optimum"])
    assert e_max == pytest.approx(balanced["metrics"]["optimum"])


def test_report_and_compare_score_a_placement_under_the_rule_it_was_made_for(tmp_path, capsys):
    """No --dispatch: the rule recorded in the file, as if it had been given; --dispatch overrides it; compare
    scores each placement under its own rule."""
    balanced, plain = tmp_path / "b.json", tmp_path / "d.json"
    for out, rule in ((balanced, "balanced"), (plain, "dynamic")):
        assert run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--dispatch", rule,
                        "--redundant", "8", *FAST, "-o", out)[0] == 0
    report = ["report", SAMPLE, "--placement", balanced, "--mode", "verify", "--max-steps", "300"]
    runs = {}
    for given in ((), ("--dispatch", "balanced"), ("--dispatch", "dynamic")):
        code, stdout, err = run_main(capsys, *report, *given, "--json")
        assert code == 0, err
        runs[given] = json.loads(stdout)
    read, given_same, given_other = runs.values()
    assert (read["dispatch"], read["dispatch_from"]) == ("balanced", "placement")
    assert given_same["dispatch_from"] == "--dispatch" == given_other["dispatch_from"]
    assert read["metrics"] == given_same["metrics"] and read["staleness"] == given_same["staleness"]
    assert read["metrics"]["e_max_distinct"] < given_other["metrics"]["e_max_distinct"]
    code, stdout, _ = run_main(capsys, *report)
    assert code == 0 and f"dispatch balanced (the rule {balanced} was made for)" in stdout
    code, stdout, _ = run_main(capsys, *report, "--dispatch", "dynamic")
    assert code == 0 and f"dispatch dynamic (--dispatch; {balanced} was made for balanced)" in stdout

    compare = ["compare", SAMPLE, plain, balanced, "--mode", "verify", "--max-steps", "300"]
    code, stdout, _ = run_main(capsys, *compare)
    assert code == 0
    assert stdout.splitlines()[0].endswith(f"each placement under the rule it was made for: {plain} dynamic, "
                                           f"{balanced} balanced")
    rows = json.loads(run_main(capsys, *compare, "--json")[1])["rows"]
    for row, (path, rule) in zip(rows, ((plain, "dynamic"), (balanced, "balanced"))):
        alone = json.loads(run_main(capsys, "compare", SAMPLE, path, "--mode", "verify", "--max-steps", "300",
                                    "--dispatch", rule, "--json")[1])["rows"][0]
        assert row["e_max_distinct"] == alone["e_max_distinct"] and row["moe_us_per_step"] == alone["moe_us_per_step"]


def test_a_placement_recording_an_unknown_rule_is_one_line_unless_dispatch_is_given(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert run_main(capsys, "optimize", SAMPLE, "--ranks", "8", *FAST, "-o", out)[0] == 0
    data = json.loads(out.read_text())
    data["metrics"]["dispatch"] = "round-robin"
    out.write_text(json.dumps(data))
    code, _, err = run_main(capsys, "report", SAMPLE, "--placement", out, "--max-steps", "50")
    assert code == 2
    assert_one_line_error(err, "made for dispatch 'round-robin'", "give --dispatch")
    code, stdout, err = run_main(capsys, "report", SAMPLE, "--placement", out, "--max-steps", "50",
                                 "--dispatch", "static")
    assert code == 0 and "dispatch static (--dispatch)" in stdout, err


def test_balanced_table_is_on_a_sample_of_held_out_steps_and_says_so(tmp_path, capsys, monkeypatch):
    from moeplace.analysis import optimize as optimize_module

    monkeypatch.setattr(optimize_module, "BALANCED_EVAL_STEPS", 20)
    out = tmp_path / "p.json"
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--dispatch", "balanced", "--redundant",
                                 "8", *FAST, "-o", out)
    assert code == 0, err
    assert "balanced dispatch on 8 ranks: the table is on 20 of the" in stdout + err
    assert json.loads(out.read_text())["metrics"]["eval_steps"] == 20
