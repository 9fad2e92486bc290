"""The replay's layout rows, prepared and reported on the CPU (the timing itself needs the H200): batches
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
    assert meta["traces"]["kimi-b36"]["groups"] == {"cost+r96": 8, "ep4xtp2": 4, "deepseek-ep4xtp2": 4,
                                                    "ep4xtp2+r96": 4, "ep2xtp4": 2, "deepseek-ep2xtp4": 2,
                                                    "ep2xtp4+r96": 2}
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
    # the layout questions from the same run: the rules table and advise's choice against the fastest layout
    assert "rules (measured MoE ms per step)" in text and "advise's choice measured vs fastest" in text
    assert "| EP8 | EP8+96 | EP4xTP2 | EP4xTP2+96 | EP2xTP4 | EP2xTP4+96 | TP8 |" in text


sys.path.insert(0, str(ROOT / "scripts"))
import replay_placement  # noqa: E402  (scripts/ is on sys.path)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WORK = st.lists(st.integers(1, 200), max_size=12).map(lambda c: tuple(sorted(c, reverse=True)))


@settings(max_examples=200, deadline=None)
@given(st.lists(WORK, min_size=1, max_size=8), st.tuples(*[st.floats(0, 50)] * 4))
def test_dominated_ranks_are_never_the_slowest(keys, coef):
    """Under any cost that grows with experts, pairs and 16- and 64-row blocks, the slowest rank of a layer is
    among the ranks ``dominated`` keeps; ranks with equal work keep one."""
    def cost(k):
        return (coef[0] * len(k) + coef[1] * sum(k) + coef[2] * sum(-(-c // 16) for c in k)
                + coef[3] * sum(-(-c // 64) for c in k))
    skip = replay_placement.dominated(keys)
    assert not skip.all()
    assert max(cost(k) for k, s in zip(keys, skip) if not s) == max(cost(k) for k in keys)
    assert len({k for k, s in zip(keys, skip) if not s}) == sum(not s for s in skip)


def test_share_deadline_passes_saved_time_on():
    """Each job gets its share of the time left: a first job that overran (compiles) leaves the rest their
    shares of what remains, never a deadline already past."""
    assert replay_placement.share_deadline(0.0, 100.0, 1.0, 4.0) == 25.0
    assert replay_placement.share_deadline(90.0, 100.0, 1.0, 2.0) == 100.0     # the floor, up to the budget
    assert replay_placement.share_deadline(0.0, 100.0, 1.0, 40.0) == 10.0      # a small first job: the floor
    assert replay_placement.share_deadline(99.0, 100.0, 1.0, 2.0) == 100.0
    assert replay_placement.share_deadline(101.0, 100.0, 1.0, 2.0) == 101.0


def test_layout_members_are_advises_layouts():
    tags = ["contiguous", "deepseek", "stepaware", "deepseek+r96", "balanced+r96", "cost+r96", "ep4xtp2",
            "deepseek-ep4xtp2", "ep4xtp2+r96", "tp"]
    groups = {"cost+r96": 8, "ep4xtp2": 4, "deepseek-ep4xtp2": 4, "ep4xtp2+r96": 4}
    assert replay_placement.layout_members(tags, 384, 8, groups) == {
        "EP8": ["deepseek", "stepaware"], "EP8+96": ["cost+r96"], "EP4xTP2": ["ep4xtp2", "deepseek-ep4xtp2"],
        "EP4xTP2+96": ["ep4xtp2+r96"], "TP8": ["tp"]}
