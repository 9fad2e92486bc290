"""``--dispatch cost`` through the commands: optimize places its spare slots as balanced dispatch's, and
at the trace's verify batch the rule scores what balanced dispatch scores, in optimize and in compare."""

from __future__ import annotations

import json

from moeplace.files.placement import load_placement
from test_cli_optimize import FAST, SAMPLE, run_main


def test_optimize_and_compare_with_the_cost_rule(tmp_path, capsys):
    rows = {}
    for rule in ("balanced", "cost"):
        out = tmp_path / f"{rule}.json"
        code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--mode", "verify", "--dispatch",
                                     rule, "--redundant", "8", *FAST, "-o", out, "--json")
        assert code == 0, err
        rows[rule] = {r["placement"]: r for r in json.loads(stdout)["rows"]}
        assert load_placement(out).metrics["dispatch"] == rule
    assert rows["cost"] == rows["balanced"]
    assert (load_placement(tmp_path / "cost.json").phy2log == load_placement(tmp_path / "balanced.json").phy2log).all()
    scored = {}
    for rule in ("balanced", "cost", "dynamic"):
        code, stdout, err = run_main(capsys, "compare", SAMPLE, tmp_path / "cost.json", "--ranks", "8", "--mode",
                                     "verify", "--dispatch", rule, "--holdout", "0.3", "--json")
        assert code == 0, err
        scored[rule] = json.loads(stdout)["rows"][0]
    assert scored["cost"]["moe_us_per_step"] == scored["balanced"]["moe_us_per_step"]
    assert scored["cost"]["moe_us_per_step"] < scored["dynamic"]["moe_us_per_step"]


def test_help_names_the_rule(capsys):
    code, stdout, _ = run_main(capsys, "compare", "--help")
    assert code == 0 and "cost (moeplace's rule by the cost model" in " ".join(stdout.split())
