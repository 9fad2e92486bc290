"""The replay's issue-22 rows, prepared and reported on the CPU (the timing itself needs the H200): batches
of several sizes, the cost rule, EP groups with MoE TP inside; fake workload times stand in for the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "replay_placement.py"


def run(*args: str) -> str:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_prepare_and_report_batches_cost_rule_and_layouts(tmp_path):
    work = tmp_path / "rp"
    run("prepare", "--out", str(work), "--only", "kimi", "--batch-tokens", "9,36", "--cost-rule", "--layouts",
        "--effort", "1e7")
    meta = json.loads((work / "work.json").read_text())
    assert set(meta["traces"]) == {"kimi", "kimi-b36"}
    assert meta["traces"]["kimi-b36"]["groups"] == {"cost+r96": 8, "ep4xtp2": 4, "ep4xtp2+r96": 4,
                                                    "ep2xtp4": 2, "ep2xtp4+r96": 2}
    jobs = meta["jobs"]
    assert jobs["kimi-b36-ep-96-tp2"]["shape"]["inter"] == 1024 and jobs["kimi-b36-ep-96-tp2"]["step_tokens"] == 36
    assert "step_tokens" not in jobs["kimi-ep-60"]      # 9-token jobs keep measure's --step-tokens
    nine = np.load(work / "kimi.npz")
    # at 9 tokens the cost rule is balanced dispatch: the same placement, the same workloads
    assert (nine["idx/cost+r96"] == nine["idx/balanced+r96"]).all()
    times = {j: {"us": [50.0 + 19 * len(k) + 0.04 * sum(k) for k in v["keys"]], "complete": True}
             for j, v in jobs.items()}
    (tmp_path / "t.json").write_text(json.dumps({"gpu": "fake", "jobs": times}))
    text = run("report", "--work", str(work), "--times", str(tmp_path / "t.json"))
    assert "batches of 36 tokens" in text
    assert "| ep4xtp2 | EP4 x MoE TP 2, 96 redundant, cost |" in text and "| cost | EP, 96 redundant, cost |" in text
