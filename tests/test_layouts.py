"""EP x TP layouts: which splits SGLang can run, their cost against brute force and the EP / TP-MoE costs
advise already had, where the fastest changes, and advise's layouts table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplace.trace.resample import resample_batches

from moeplace.algorithms import PlacementProblem, solve
from moeplace.analysis.advise import ep_layer_cost, tp_layer_cost
from moeplace.commands.costing import Costing
from moeplace.cost.derive import derive_cost_model
from moeplace.cost.model import CostModel
from moeplace.errors import MoeplaceError
from moeplace.model.expert_shape import ExpertShape
from moeplace.analysis.layouts import (Layout, LayoutCosts, candidate_layouts, check_split, fastest, layout_flips,
                              layer_counts, layout_step_costs)
from test_cli_optimize import SAMPLE, run_main
from test_cost_dispatch import kimi_shaped


def test_candidate_layouts():
    names = [layout.name for layout in candidate_layouts(8, 384, 2048, 96)]
    assert names == ["EP8", "EP8+96", "EP4xTP2", "EP4xTP2+96", "EP2xTP4", "EP2xTP4+96", "TP8"]
    assert [layout.moe_tp for layout in candidate_layouts(8, 384, 2048, 0)] == [1, 2, 4, 8]
    # an intermediate size SGLang cannot split over 8 drops TP8; 6 experts do not split over 4 groups
    assert [layout.name for layout in candidate_layouts(8, 384, 2052, 0)] == ["EP8", "EP4xTP2", "EP2xTP4"]
    assert "EP4" not in {layout.name for layout in candidate_layouts(4, 6, 64, 0)}
    # 384 experts split over 320 EP groups only with 256 spare slots: those layouts still run
    wide = {layout.name for layout in candidate_layouts(320, 384, 2048, 256)}
    assert {"EP320+256", "EP160xTP2+256", "EP40xTP8+256"} <= wide and not {"EP320", "EP160xTP2"} & wide


@pytest.mark.parametrize("gpus, ep, experts, inter, spares, fragment", [
    (8, 3, 384, 2048, 0, "must divide the 8 GPUs"),
    (8, 2, 384, 2046, 0, "does not split over MoE TP 4"),
    (8, 4, 384, 2048, 6, "do not split over 4 EP groups"),
])
def test_check_split_refuses(gpus, ep, experts, inter, spares, fragment):
    with pytest.raises(MoeplaceError, match=fragment):
        check_split(gpus, ep, experts, inter, spares)


def test_group_cost_model_is_the_sliced_experts():
    shape = ExpertShape(7168, 2048, "bf16", "k")
    costing = Costing(shape, 8)
    assert costing.group(96, 2, 36) == derive_cost_model(shape.tp_slice(2), 96, 8, step_tokens=36)
    assert costing.group(48, 1, 36) == costing.ep(48, 36)
    assert costing.group(384, 8, 9) == costing.tp(8, 384, 9)


@pytest.fixture(scope="module")
def steps():
    return resample_batches(kimi_shaped(layers=2, steps=200), 36, 12)


def test_ep_and_tp_layouts_cost_what_advise_costs(steps):
    model = steps.model
    phy2log = solve("deepseek", PlacementProblem(model, steps, 8))
    cost = CostModel(19.0, 0.04, 50.0)
    ep = layout_step_costs(layer_counts(steps), {"p": phy2log}, Layout(8, 8), cost)["p"]
    np.testing.assert_allclose(ep, sum(ep_layer_cost(steps, layer, phy2log[layer], 8, cost) for layer in range(2)))
    everything = np.broadcast_to(np.arange(384), (2, 384))
    tp = layout_step_costs(layer_counts(steps), {"all": everything}, Layout(8, 1), cost)["all"]
    np.testing.assert_allclose(tp, sum(tp_layer_cost(steps, layer, cost) for layer in range(2)))


def test_group_layout_against_brute_force(steps):
    """EP4xTP2: a layer costs its slowest group (4 groups of 96 slots), counted here from the token rows."""
    model = steps.model
    phy2log = solve("contiguous", PlacementProblem(model, steps, 4))
    cost = CostModel(10.0, 0.5, 20.0)
    got = layout_step_costs(layer_counts(steps), {"p": phy2log}, Layout(8, 4), cost)["p"]
    want = np.zeros(steps.num_steps)
    for s in range(steps.num_steps):
        rows = steps.topk_ids[steps.token_offsets[s]:steps.token_offsets[s + 1]]
        for layer in range(2):
            ids = rows[:, layer].ravel()
            group = (np.flatnonzero(phy2log[layer][None, :] == ids[:, None]) % 384) // 96
            want[s] += max(10.0 * np.unique(ids[group == g]).size + 0.5 * (group == g).sum() + 20.0 for g in range(4))
    np.testing.assert_allclose(got, want)


def test_fastest_and_flips():
    def costs(name_ep, values):
        return LayoutCosts(Layout(8, name_ep), values[0], dict(zip((1, 10, 100), values)), {})
    results = [costs(8, (30.0, 40.0, 50.0)), costs(4, (20.0, 40.0, 100.0)), costs(1, (10.0, 80.0, 400.0))]
    assert fastest(results).layout.name == "TP8" and fastest(results, 100).layout.name == "EP8"
    assert fastest(results, 10).layout.name == "EP8"             # a tie goes to the earlier layout
    (at, below, above), = layout_flips(results)
    assert (below, above) == ("TP8", "EP8")
    # TP8 / EP8 goes from 1/3 at 1 token to 2 at 10: log-linear, it is 1 at 10 ** (log 3 / log 6)
    assert at == pytest.approx(10 ** (np.log(3) / np.log(6)))


def test_advise_prints_the_layouts(capsys):
    code, out, err = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--effort", "1e6")
    assert code == 0, err
    head = next(line for line in out.splitlines() if line.startswith("tokens/step") and "EP4xTP2" in line)
    # every GPU shape of GPT-OSS's layouts has a measured line for each kernel config it runs (the config sweeps;
    # spare slots move a line by the launch grid) except EP8's whole experts at 1-5 tokens (16-row blocks)
    assert head.split()[1:] == ["EP8*", "EP8+8*", "EP4xTP2", "EP4xTP2+8", "EP2xTP4", "EP2xTP4+8", "TP8", "fastest"]
    assert "Layouts on 8 GPUs (SGLang --tp-size 8 --ep-size G" in out
    assert "At this trace's traffic (9 tokens per step) the fastest layout is" in out
    assert "*: at some batch sizes no measured cost file" in out
    code, out, err = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--effort", "1e6",
                              "--json")
    data = json.loads(out)
    names = [r["name"] for r in data["layouts"]]
    assert names == ["EP8", "EP8+8", "EP4xTP2", "EP4xTP2+8", "EP2xTP4", "EP2xTP4+8", "TP8"]
    by_name = {r["name"]: r for r in data["layouts"]}
    # the EP8 and TP8 layouts are advise's own EP (no spares, best placement) and TP-MoE figures
    assert by_name["TP8"]["at_trace_us"] == pytest.approx(data["at_trace"]["tp_us"])
    assert by_name["EP8"]["at_trace_us"] == pytest.approx(data["at_trace"]["ep_us"])
    assert data["fastest_layout_at_trace"] == min(by_name, key=lambda n: by_name[n]["at_trace_us"])


def test_optimize_places_for_the_ep_groups(tmp_path, capsys):
    from moeplace.files.placement import check_placement, load_placement
    from test_cli_optimize import FAST

    out = tmp_path / "p.json"
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", "--ep-size", "4", "--mode", "verify",
                                 "--dispatch", "balanced", "--redundant", "8", *FAST, "-o", out)
    assert code == 0, err
    assert "4 EP groups x MoE TP 2 on 8 GPUs (SGLang --tp-size 8 --ep-size 4), 8 redundant" in stdout
    assert "spare slots: 8 (2 per EP group) hold" in stdout and "1/2 of each expert: experts 2880x1440" in stdout
    placement = load_placement(out)
    check_placement(placement)
    assert placement.ranks == 4 and placement.num_redundant == 8
    assert placement.metrics["ep_split"] == {"gpus": 8, "ep_size": 4, "moe_tp": 2}


@pytest.mark.parametrize("args, fragment", [
    (["--ep-size", "3"], "--ep-size 3 must divide the 8 GPUs"),
    (["--ep-size", "4", "--redundant", "2"], "do not split evenly over 4 ranks"),
])
def test_optimize_refuses_a_split_sglang_cannot_run(tmp_path, capsys, args, fragment):
    code, stdout, err = run_main(capsys, "optimize", SAMPLE, "--ranks", "8", *args, "-o", tmp_path / "p.json")
    assert code == 2 and err.count("\n") == 1 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_near_ties_are_no_flip():
    def costs(ep, values):
        return LayoutCosts(Layout(8, ep), values[0], dict(zip((1, 10, 100), values)), {})
    # EP4xTP2 wins at 10 by 0.5% and EP8 at 100 by 0.4%: even at both, so no flip between them
    results = [costs(8, (30.0, 40.0, 50.0)), costs(4, (31.0, 39.8, 50.2)), costs(1, (10.0, 80.0, 400.0))]
    assert fastest(results, 10).layout.name == "EP4xTP2" and fastest(results, 100).layout.name == "EP8"
    assert [(lo, hi) for _, lo, hi in layout_flips(results)] == [("TP8", "EP4xTP2")]
    results[1] = costs(4, (31.0, 39.8, 60.0))                  # clearly slower at 100: a flip again
    assert [(lo, hi) for _, lo, hi in layout_flips(results)] == [("TP8", "EP4xTP2"), ("EP4xTP2", "EP8")]
