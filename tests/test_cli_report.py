"""The CLI: ``moeplace report`` on the shipped sample, one-line errors with exit code 2, light imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.cli import cli
from moeplace.files.placement import Placement, save_placement, save_sglang
from moeplace.model.spec import ModelSpec
from moeplace.trace.load import open_trace

REPO = Path(__file__).parents[1]
SAMPLE = REPO / "traces" / "gptoss20b-sample.mptrace"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GPTOSS = open_trace(SAMPLE).model  # 24 MoE layers, 32 experts, top-4


def moeplace(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real entry point in a fresh interpreter, as the console script would."""
    return subprocess.run([sys.executable, "-c", "from moeplace.cli import main; main()", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def _strict_json(text: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=reject)


def _shuffled_placement(model: ModelSpec, ranks: int, seed: int = 0) -> Placement:
    rng = np.random.default_rng(seed)
    phy2log = np.stack([rng.permutation(model.num_experts) for _ in range(model.num_moe_layers)])
    return Placement(model, ranks, phy2log, algorithm="shuffled")


# ----------------------------------------------------------------------------- report on the sample

def test_report_table_and_plots(tmp_path):
    plots = tmp_path / "plots"
    result = CliRunner().invoke(cli, ["report", str(SAMPLE), "--ranks", "8", "--plot-dir", str(plots)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "openai/gpt-oss-20b: 24 MoE layers, 32 experts, top-4" in out
    assert "placement contiguous on 8 ranks, dispatch dynamic" in out
    assert "E[max distinct]" in out and "lower bound" in out and "hottest experts" in out
    row = next(line for line in out.splitlines() if line.startswith("contiguous "))
    e_max, lower = (float(x) for x in row.split()[1:3])
    assert lower <= e_max <= 4  # 4 slots per rank
    pngs = sorted(plots.glob("*.png"))
    assert [p.name for p in pngs] == ["step_max_by_layer.png", "step_max_distribution.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000
    assert not [p for p in plots.iterdir() if p.suffix != ".png"]  # no temp files left


@pytest.mark.parametrize("command", [["optimize", SAMPLE, "--ranks", "8", "--max-steps", "200", "-o", "p.json"],
                                     ["report", SAMPLE, "--ranks", "8"],
                                     ["compare", SAMPLE, REPO / "tests" / "data" / "golden" / "a.json", "--ranks", "8"]])
def test_plot_dir_without_matplotlib_is_one_line_before_any_work(tmp_path, command):
    """matplotlib missing (it is an install requirement, but environments drift): --plot-dir says so at once,
    exit 2, one line, nothing written, rather than a traceback after the whole computation."""
    code = ("import sys; sys.modules['matplotlib'] = None; from moeplace.cli import main; "
            "main(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", code, *map(str, command), "--plot-dir", "plots"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --plot-dir needs matplotlib") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_report_json_and_placement(tmp_path):
    placement = tmp_path / "p.json"
    save_placement(placement, _shuffled_placement(GPTOSS, 8))
    runner = CliRunner()
    result = runner.invoke(cli, ["report", str(SAMPLE), "--ranks", "8", "--json", "--mode", "verify"])
    assert result.exit_code == 0, result.output
    data = _strict_json(result.output)
    m = data["metrics"]
    assert data["model"]["num_experts"] == 32 and data["ranks"] == 8 and data["placement"] == "contiguous"
    assert m["steps"] > 1000 and m["lower_bound"] <= m["e_max_distinct"]
    assert len(m["per_layer"]["e_max_distinct"]) == 24 and len(data["hottest_experts"]) == 5
    assert data["aggregate_only"] is False

    result = runner.invoke(cli, ["report", str(SAMPLE), "--ranks", "8", "--json", "--placement", str(placement),
                                 "--dispatch", "static"])
    assert result.exit_code == 0, result.output
    shuffled = _strict_json(result.output)
    assert shuffled["placement"] == "shuffled" and shuffled["dispatch"] == "static"
    # Placements move load between ranks, never the tokens themselves, so the lower bound is the same.
    assert shuffled["metrics"]["lower_bound"] == pytest.approx(m["lower_bound"])

    sglang = tmp_path / "init.json"
    save_sglang(sglang, _shuffled_placement(GPTOSS, 8))
    result = runner.invoke(cli, ["report", str(SAMPLE), "--ranks", "8", "--placement", str(sglang)])
    assert result.exit_code == 0, result.output
    assert "placement sglang-file on 8 ranks" in result.output


def test_report_aggregate_only_json(tmp_path):
    counts = np.zeros((4, 16))
    counts[1:] = np.arange(1, 17)
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"logical_count": counts.tolist()}))
    result = CliRunner().invoke(cli, ["report", str(path), "--ranks", "4", "--top-k", "2"])
    assert result.exit_code == 0, result.output
    assert "aggregate counts only" in result.output
    result = CliRunner().invoke(cli, ["report", str(path), "--ranks", "4", "--json"])
    assert _strict_json(result.stdout)["aggregate_only"] is True


def test_help_lists_commands():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in ("report", "optimize", "compare", "trace", "capture", "launch"):
        assert f"  {name}" in result.output
    result = CliRunner().invoke(cli, ["report", "--help"])
    assert result.exit_code == 0 and "Example:" in result.output and "--plot-dir" in result.output


def _all_helps() -> dict[str, str]:
    """``moeplace CMD [SUB] --help`` of every command (the subcommands of a group, not the group)."""
    import click

    from moeplace.cli import COMMANDS

    helps = {}
    for name in COMMANDS:
        command = cli.get_command(None, name)
        paths = [[name, sub] for sub in command.commands] if isinstance(command, click.Group) else [[name]]
        for path in paths:
            result = CliRunner().invoke(cli, [*path, "--help"])
            assert result.exit_code == 0, result.output
            helps[" ".join(path)] = result.output
    return helps


def test_help_texts_print_what_they_mean():
    helps = _all_helps()
    for name, text in helps.items():
        assert "%%" not in text, name                  # click does not %-format help any more
        assert "Example:" in text, name
    for name in ("report", "optimize", "compare"):
        assert "token row % replicas" in " ".join(helps[name].split()), name
    assert "--dispatch" not in helps["advise"]   # advise compares layouts under their own rules


def test_help_examples_name_shipped_inputs():
    """Every trace an Example reads by a relative path is in the repository or written earlier in the
    example; absolute paths name the user's own files (a server's dump folder)."""
    for name, text in _all_helps().items():
        words = text.split("Example:", 1)[1].split("Options:")[0].split()
        written = {w for prev, w in zip(words, words[1:]) if prev in ("-o", "--out", "--output")}
        for word in words:
            if word.endswith((".mptrace", ".npz", ".pt")) and word not in written and not word.startswith(("/", "~")):
                assert (REPO / word).exists(), f"moeplace {name} --help names {word}, which is not shipped"


def test_report_balancedness_percentiles_are_named_honestly():
    result = CliRunner().invoke(cli, ["report", str(SAMPLE), "--ranks", "8"])
    line = next(x for x in result.output.splitlines() if x.startswith("token balancedness across layers"))
    assert "p90" not in line and "10th percentile" in line
    median = float(line.split("median ")[1].split(",")[0])
    p10 = float(line.split("10th percentile ")[1].split()[0])
    assert p10 <= median


def test_no_deprecation_warnings_from_click(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(cli, ["optimize", str(SAMPLE), "--max-steps", "300", "--effort", "1e6",
                                          "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert not [w for w in caught if "click" in str(w.filename) or "click" in str(w.message)]


def test_ranks_that_do_not_divide_the_experts():
    result = CliRunner().invoke(cli, ["report", str(SAMPLE), "--ranks", "7"])
    assert result.exit_code == 2
    assert "--ranks" in result.output and "32 experts" in result.output and "7 ranks" in result.output


# ----------------------------------------------------------------------------- errors through main()

def _assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert res.stdout == ""


def test_placement_for_another_model_or_rank_count(tmp_path):
    other = tmp_path / "other_model.json"
    save_placement(other, _shuffled_placement(ModelSpec.all_moe("kimi-ish", 24, 64, 8), 8))
    res = moeplace("report", SAMPLE, "--ranks", "8", "--placement", other)
    _assert_one_line_error(res, "other_model.json", "64 experts", "32 experts")

    four = tmp_path / "four_ranks.json"
    save_placement(four, _shuffled_placement(GPTOSS, 4))
    res = moeplace("report", SAMPLE, "--ranks", "8", "--placement", four)
    _assert_one_line_error(res, "four_ranks.json", "4 ranks, not 8")

    sglang = tmp_path / "sglang_rows.json"  # SGLang file whose slots do not split over the ranks
    sglang.write_text(json.dumps({"physical_to_logical_map": [list(range(32)) + [0, 1, 2, 3]] * 24}))
    res = moeplace("report", SAMPLE, "--ranks", "8", "--placement", sglang)
    _assert_one_line_error(res, "sglang_rows.json", "36 slots per layer do not split evenly over 8 ranks")


def _bad_traces(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    data = SAMPLE.read_bytes()
    files = {
        "garbage.mptrace": (b"\x00garbage\xff" * 50, "bad magic"),
        "header_cut.mptrace": (data[:100], "shard header"),
        "chunk_cut.mptrace": (data[:len(data) // 2], "cut inside a chunk"),  # the sample is one chunk
        "garbage.npz": (b"PK\x03\x04garbage" * 20, "not a top-k ids .npz"),
        "garbage.json": (b"{\"logical_count\": [[1, 2]", "not valid JSON"),
        "garbage.dat": (b"\x01\x02\x03", "unknown trace format"),
    }
    out = {}
    for name, (content, needle) in files.items():
        (tmp_path / name).write_bytes(content)
        out[name] = (tmp_path / name, needle)
    return out


def test_bad_traces_are_one_line_errors(tmp_path):
    for name, (path, needle) in _bad_traces(tmp_path).items():
        res = moeplace("report", path, "--ranks", "8")
        _assert_one_line_error(res, name, needle)


def test_damaged_shard_warns_once(tmp_path):
    folder = tmp_path / "trace"
    folder.mkdir()
    data = SAMPLE.read_bytes()
    (folder / "a.mptrace").write_bytes(data)
    (folder / "b.mptrace").write_bytes(data[:-10])
    res = moeplace("report", folder, "--ranks", "8", "--mode", "verify")
    assert res.returncode == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "b.mptrace" in warnings[0] and "cut" in warnings[0]
    assert "Traceback" not in res.stderr and "contiguous" in res.stdout


def test_bad_option_values_exit_2_without_traceback(tmp_path):
    res = moeplace("report", SAMPLE, "--ranks", "7")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "Invalid value for '--ranks'" in res.stderr or "Invalid value for --ranks" in res.stderr
    res = moeplace("report", tmp_path / "missing.mptrace")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "does not exist" in res.stderr
    bad_cost = tmp_path / "cost.json"
    bad_cost.write_text("{}")
    res = moeplace("report", SAMPLE, "--cost-model", bad_cost)
    _assert_one_line_error(res, "cost.json")


# ----------------------------------------------------------------------------- light imports

def test_help_does_not_import_torch_or_sglang():
    script = (
        "import sys, io, contextlib\n"
        "import moeplace, moeplace.cli\n"
        "from moeplace.cli import main\n"
        "for argv in (['--help'], ['report', '--help'], ['optimize', '--help']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert not e.code, (argv, e.code)\n"
        "    assert 'Usage' in out.getvalue(), argv\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang'))\n"
        "print(','.join(heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"--help imported: {res.stdout.strip()[:200]}"


# ----------------------------------------------------------------------------- report module

def test_evaluate_compare_and_format():
    from moeplace.cost.model import CostModel
    from moeplace.analysis.report import comparison_rows, evaluate, format_table, hottest_experts
    from moeplace.trace import modes as M
    from moeplace.trace.steps import RoutingSteps

    model = ModelSpec("two", 1, (0,), 4, 1)
    # Each step reads experts 0 and 1: contiguous puts both on rank 0, "split" puts them on different ranks.
    steps = RoutingSteps.from_topk(model, np.array([[[0]], [[1]]] * 3), [2, 2, 2], M.TARGET_VERIFY)
    placements = {"contiguous": Placement(model, 2, np.array([[0, 1, 2, 3]])),
                  "split": Placement(model, 2, np.array([[0, 2, 1, 3]]))}
    cost = CostModel(1.0, 0.0, 0.0)
    chunks = iter([steps.take([0]), steps.take([1, 2])])  # one pass over a stream of chunks
    evals = evaluate(placements, chunks, cost)
    assert [e.name for e in evals] == ["contiguous", "split"]
    assert [e.summary["e_max_distinct"] for e in evals] == [2.0, 1.0]
    assert all(e.summary["lower_bound"] == 1.0 and e.summary["steps"] == 3 for e in evals)
    rows = comparison_rows(evals, baseline="contiguous")
    assert rows[1]["vs_baseline_pct"] == pytest.approx(-50.0) and rows[1]["gap_closed_pct"] == pytest.approx(100.0)
    assert rows[0]["gap_closed_pct"] == 0.0
    table = format_table(rows, "contiguous").splitlines()
    assert len(table) == 5 and table[0].startswith("placement") and set(table[1]) <= {"-", " "}
    assert "vs baseline" in table[0] and table[4].startswith("baseline: contiguous ")
    assert table[3].split()[:3] == ["split", "1.000", "1.000"] and "-50.0%" in table[3] and "100%" in table[3]
    single = format_table(rows[:1], None).splitlines()   # one placement: nothing to compare against
    assert len(single) == 3 and "vs baseline" not in single[0] and "gap closed" not in single[0]

    hot = hottest_experts(np.array([[1.0, 3, 0, 0], [5, 5, 5, 5]]), (3, 7), n=3)
    assert [(h["layer"], h["expert"]) for h in hot[:1]] == [(3, 1)]
    assert hot[0]["share"] == pytest.approx(0.75) and hot[0]["uniform_share"] == 0.25
    assert [h["share"] for h in hot[1:]] == pytest.approx([0.25, 0.25])


def test_write_plots_side_by_side(tmp_path, monkeypatch):
    """Both plots show per-step maxima with integer ticks, carry the trace/mode/steps/ranks line in
    their titles, and the legend sits beside the bars, not on them."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from moeplace.cost.model import CostModel
    from moeplace.analysis.report import evaluate, plot_context, write_plots

    seen = []
    save = Figure.savefig

    def record(fig, *args, **kwargs):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        titles = [t.get_text() for t in fig.texts] + [ax.get_title() for ax in fig.axes]
        overlaps = []
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                box = legend.get_window_extent(renderer)
                overlaps += [box.overlaps(bar.get_window_extent(renderer)) for bar in ax.patches if bar.get_height()]
        ticks = [t for ax in fig.axes if ax.get_images() or ax.patches for t in ax.get_xticks()
                 if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        seen.append((titles, overlaps, ticks))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    trace = open_trace(SAMPLE)
    steps = trace.load(max_steps=200)
    placements = {"contiguous": Placement(GPTOSS, 8, np.tile(np.arange(32), (24, 1))),
                  "shuffled": _shuffled_placement(GPTOSS, 8)}
    evals = evaluate(placements, [steps], CostModel())
    context = plot_context(str(SAMPLE), "verify", 200, "held-out", 8)
    assert context == "gptoss20b-sample.mptrace: 200 held-out verify steps, 8 ranks"
    files = write_plots(evals, str(tmp_path / "plots"), context)
    assert [Path(f).name for f in files] == ["step_max_distribution.png", "step_max_by_layer.png"]
    for f in files:
        assert Path(f).read_bytes()[:8] == PNG_MAGIC
    assert len(seen) == 2
    for titles, overlaps, ticks in seen:
        assert any(context in t for t in titles), titles
        assert overlaps and not any(overlaps) or not overlaps
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert seen[0][1] and not any(seen[0][1])        # the histogram has a legend, and it covers no bar
