"""The live check's stale-placement check (``live_sglang_check.check_stale``) on the shipped trace, no server:
the same function the GPU run calls on its capture."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import live_sglang_check as live  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "gptoss20b-sample.mptrace"


def test_stale_check_reports_a_verdict_on_a_capture(tmp_path):
    check = live.check_stale(SAMPLE, tmp_path, max_steps=200)
    assert check.name == "stale" and check.ok, check.detail
    figures = check.figures
    assert figures["optimize_rc"] == 0 and figures["report_rc"] == 0
    assert check.detail == figures["verdict"] and live.STALE_VERDICT.match(check.detail)
    assert figures["fit_steps"] + figures["scored_steps"] == 200
    assert ("re-place" in check.detail) == (figures["to_gain"] >= 0.005)
    assert f"this placement {figures['current']:.3f}" in check.detail
    assert (tmp_path / "stale-placement.json").is_file()


def test_stale_check_fails_in_one_line_on_a_broken_capture(tmp_path):
    broken = tmp_path / "capture.mptrace"
    broken.write_bytes(b"not a trace")
    check = live.check_stale(broken, tmp_path)
    assert not check.ok and check.figures["optimize_rc"] == 2
    assert "optimize on the capture's first half failed (exit 2)" in check.detail and "Traceback" not in check.detail
