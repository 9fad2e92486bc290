"""The tile-products benchmark's generated programs and its refusal without nvcc (no GPU needed)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_wgmma_patterns as bench  # noqa: E402


def test_the_kernel_split_reads_its_operands_twice():
    # naive count: QK 36 k steps, P.V 8 blocks x 4, each wgmma 64 x 16 of A (2 KB) and N x 16 of B
    def naive(rows):
        return 36 * (64 * 16 * 2 + rows * 16 * 2) + 32 * (64 * 16 * 2 + rows * 16 * 2)
    name, wgs = bench.PATTERNS[0]
    assert name.startswith("kernel") and bench.operand_bytes(wgs) == naive(40) + naive(32)
    # a split that reads every K and V block once reads less than the kernel's
    assert all(bench.operand_bytes(w) < bench.operand_bytes(wgs) for n, w in bench.PATTERNS if "72" in n)


@pytest.mark.parametrize("n", [24, 40, 72])
def test_a_specialisation_lists_one_accumulator_per_two_columns(n):
    text = bench.wgmma_specialisation(n)
    assert f"m64n{n}k16" in text and text.count('"+f"(d[') == n // 2 and f"float (&d)[{n // 2}]" in text


def test_every_warpgroup_gets_its_program():
    src = bench.program_source(0, [[bench.QK(40), bench.PV(40, 8)], [bench.QK(32)]])
    assert "phase<40, 1, 36, 0>" in src and "phase<40, 8, 4, 1>" in src and "phase<32, 1, 36, 0>" in src
    assert "__launch_bounds__(256, 1)" in src
    # every accumulator is read at the end, or ptxas drops its products (P.V would time 1 block of 8)
    assert all(f"a1[{b}][0]" in src for b in range(8))


def test_no_nvcc_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(bench.mla_verify_sm90, "find_nvcc", lambda: None)
    monkeypatch.setattr(sys, "argv", ["bench_wgmma_patterns.py"])
    assert bench.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no nvcc" in err[0]


def test_a_failed_run_is_told_apart_from_figures():
    count = len(bench.PROGRAMS) + len(bench.SCHEDULES)  # a figure per program and per schedule
    good = "\n".join(f"{1000 + k:.1f}" for k in range(count))
    assert bench.parse_cycles(good, 0) == [1000.0 + k for k in range(count)]
    assert bench.parse_cycles(good, 1) is None
    assert bench.parse_cycles("1000.0\nerror an illegal memory access was encountered", 0) is None
    assert bench.parse_cycles(good.replace("1000.0", "-1.0"), 0) is None
    assert bench.parse_cycles("1000.0", 0) is None


def test_every_table_row_has_five_cells():
    # pattern names hold '|' (40 | 32 rows): unescaped, the row would split into more cells
    figures = [3400.0 - k for k in range(len(bench.PROGRAMS) + len(bench.SCHEDULES))]
    rows = bench.table(figures)[:len(bench.PATTERNS) + 2]
    cells = [len(re.split(r"(?<!\\)\|", r.strip("|"))) for r in rows]
    assert cells == [5] * len(rows)
    assert rows[2].split(" | ")[3] == "1.00"


def test_the_chain_runs_between_the_products_issue_and_their_wait():
    src = bench.program_source(0, [[bench.QK(40), bench.FMA(200)]])
    issue, chain = src.index("phase<40, 1, 36, 0>"), src.index("i < 200")
    assert src.index("commit_group") < chain < src.index("wait_group") and issue < chain
    alone = bench.program_source(1, [[bench.FMA(800)]])
    assert "i < 800" in alone and "wgmma" not in alone and "x == 12345.f" in alone


def test_the_later_tables_name_every_program_in_order():
    rows = bench.table([float(1000 + k) for k in range(len(bench.PROGRAMS) + len(bench.SCHEDULES))])
    later = [r for r in rows[len(bench.PATTERNS) + 2:] if r.startswith("| ") and "---" not in r and "cycles" not in r]
    later = later[:len(bench.BESIDE) + len(bench.STRUCTURE)]
    names = [name for name, _ in bench.BESIDE + bench.STRUCTURE]
    first = len(bench.PATTERNS)
    assert later == [f"| {n} | {1000 + first + k} |" for k, n in enumerate(names)]


@pytest.mark.parametrize("wait, fence", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_the_block_loop_asks_for_what_it_names(wait, fence):
    src = bench.program_source(0, [[bench.QKB(40, wait, fence)], [bench.QKB(32, wait, fence)]])
    assert f"qk_blocks<40, {wait + 2 * fence}>" in src and f"qk_blocks<32, {wait + 2 * fence}>" in src
    assert "mbarrier.init" in src  # the barrier the waits read has completed its phase before the loop
    # the same products as 36 back to back: the table compares the issue, not the work
    assert bench.operand_bytes([[bench.QKB(40, wait, fence)]]) == bench.operand_bytes([[bench.QK(40)]])


def test_each_schedule_is_compared_with_the_kernels_at_its_own_stand_in():
    kinds = len(bench.SCHEDULE_KINDS)
    # the kernel's schedule 1000 + 100 c at every stand-in c, the others 10 and 20 cycles fewer
    timed = [1000.0 + 100 * c - 10 * (k % kinds) for k, (_, _, _, c) in enumerate(bench.SCHEDULES)]
    rows = bench.table([1.0] * len(bench.PROGRAMS) + timed)[-len(bench.SCHEDULES):]
    cells = [re.split(r"(?<!\\)\|", r.strip("|")) for r in rows]
    assert all(len(c) == 4 for c in cells)  # the names' '|' escaped
    for (name, _, _, c), row, cyc in zip(bench.SCHEDULES, cells, timed):
        kernel = 1000.0 + 100 * c
        assert int(row[1]) == c and float(row[2]) == round(cyc) and row[3].strip() == f"{cyc / kernel:.2f}"
    assert [r[3].strip() for r in cells[::kinds]] == ["1.00"] * (len(bench.SCHEDULES) // kinds)


def test_the_schedules_are_timed_per_tile():
    # the shared schedule covers two tiles a repetition (one per warpgroup); its P.V reads a warpgroup's own 4 blocks
    shared = [s for s in bench.SCHEDULES if s[1].startswith("sched_shared")]
    assert shared and all(tiles == 2 for _, _, tiles, _ in shared)
    assert all(tiles == 1 for _, kernel, tiles, _ in bench.SCHEDULES if kernel.startswith("sched_own"))
    assert "phase<72, 4, 4, 1>(o, base, 0, 0, 4 * wg," in bench.SCHEDULE_SOURCE
    assert "s / sms / reps / tiles" in bench.MAIN
