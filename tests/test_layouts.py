"""EP x TP layouts: which splits SGLang can run, their cost against brute force and the EP / TP-MoE costs
advise already had, where the fastest changes, and advise's layouts table."""

from __future__ import annotations

import json
import shlex

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
from moeplace.analysis.layouts import (Layout, LayoutCosts, candidate_layouts, check_split, fastest, fastest_column,
                                       layer_counts, layout_flips, layout_step_costs)
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
    # TP8 / EP8 goes from 1/3 at 1 token to 2 at 10: log-linear, EP8 is 1% faster (TP8 / EP8 = 1.01) at
    # 10 ** (log 3.03 / log 6)
    assert at == pytest.approx(10 ** (np.log(3 * 1.01) / np.log(6)))


def test_flips_are_the_changes_of_the_fastest_column():
    """A layout the column keeps within 1% of the fastest stays until another is more than 1% faster, however many
    batches that takes: the flips are where the column changes (comparing neighbouring batches only, the
    change from EP4xTP2 to EP8 between 100 and 1,000 tokens was lost: even at 10 and 100, the same at 1,000)."""
    def costs(ep, values):
        return LayoutCosts(Layout(8, ep), values[0], dict(zip((1, 10, 100, 1000), values)), {})
    results = [costs(8, (20.0, 20.0, 29.8, 36.0)), costs(4, (10.0, 19.9, 30.0, 40.0)), costs(1, (5.0, 50, 500, 5e3))]
    column = fastest_column(results)
    assert [column[b].layout.name for b in (1, 10, 100, 1000)] == ["TP8", "EP4xTP2", "EP4xTP2", "EP8"]
    flips = layout_flips(results)
    assert [(lo, hi) for _, lo, hi in flips] == [("TP8", "EP4xTP2"), ("EP4xTP2", "EP8")]
    assert 1 < flips[0][0] < 10 and 100 <= flips[1][0] < 1000


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
    # the flips are the changes of the table's fastest column
    column = list(data["fastest_by_batch"].values())
    changes = [(lo, hi) for lo, hi in zip(column, column[1:]) if lo != hi]
    assert [(f["below"], f["above"]) for f in data["layout_flips"]] == changes


def test_advise_prints_the_commands_that_run_its_pick(tmp_path, capsys):
    """The pick's optimize command fits a placement for it, and launch takes that placement with the printed
    SGLang flags (a GPT-OSS-20B config.json in a folder stands for the model)."""
    from test_cli_optimize import FAST

    code, out, err = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--effort", "1e6",
                              "--json")
    pick = json.loads(out)["pick"]
    assert pick["layout"] == "EP2xTP4+8" and pick["dispatch"] == "balanced"   # verify batch: the cost rule is balanced
    fit, launch = pick["commands"]
    assert fit == ["moeplace", "optimize", str(SAMPLE), "--ranks", "8", "--ep-size", "2", "--mode", "verify",
                   "--redundant", "8", "--dispatch", "balanced", "-o", "placement.json"]
    assert launch == ["moeplace", "launch", "--placement", "placement.json", "--", "--model-path", "openai/gpt-oss-20b",
                      "--tp-size", "8", "--ep-size", "2", "--ep-num-redundant-experts", "8"]
    placement = tmp_path / "placement.json"
    code, _, err = run_main(capsys, *fit[1:-2], *FAST, "-o", placement)
    assert code == 0, err
    model = tmp_path / "gpt-oss-20b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(GPT_OSS_20B))
    server = launch[launch.index("--"):]
    server[server.index("--model-path") + 1] = str(model)
    code, out, err = run_main(capsys, "launch", "--placement", placement, "--dry-run", *server)
    assert code == 0, err
    assert out.startswith("MOEPLACE_DISPATCH=balanced ") and "--ep-size 2 --ep-num-redundant-experts 8" in out
    code, out, _ = run_main(capsys, "advise", SAMPLE, "--ranks", "8", "--mode", "verify", "--effort", "1e6")
    assert "\n  " + shlex.join(fit) + "\n  " + shlex.join(launch) + "\n" in out


# GPT-OSS-20B's published config.json, the fields moeplace reads
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 24,
               "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "hidden_size": 2880,
               "intermediate_size": 2880, "quantization_config": {"quant_method": "mxfp4"}, "torch_dtype": "bfloat16"}


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


def test_advise_places_fewer_spare_slots_where_the_default_cannot_load():
    """Kimi K2's fp8 experts on 8 H200s: the default, a quarter of the experts (96 spare slots), takes 158.6 GB per
    GPU of 150.8; advise compares the most that load (72: 150.7 GB; 80 would take 153.3) and says so. A --redundant
    that cannot load is kept, and marked so (the pick and the fastest column leave those layouts out)."""
    from moeplace.commands.advise import SpareSlots
    from moeplace.commands.costing import memory_warning, spares_that_fit
    from moeplace.model.expert_shape import GENERIC, known_expert_shape
    from moeplace.trace.synthetic import KIMI_K2

    costing = Costing(known_expert_shape(KIMI_K2), KIMI_K2.top_k)
    assert spares_that_fit(KIMI_K2, 8, 384, costing) == 72
    assert memory_warning(KIMI_K2, 8, 72, costing) is None and memory_warning(KIMI_K2, 8, 80, costing) is not None
    lowered = SpareSlots.choose(KIMI_K2, 8, 0, costing)
    assert (lowered.count, lowered.load, lowered.memory) == (72, True, None)
    assert "72, the most that fit an NVIDIA H200" in lowered.note and "(96), would take 158.6 GB" in lowered.note
    asked = SpareSlots.choose(KIMI_K2, 8, 96, costing)
    assert (asked.count, asked.load, asked.note) == (96, False, None) and "158.6 GB per GPU" in asked.memory
    assert SpareSlots.choose(KIMI_K2, 8, 0, Costing(GENERIC, 8)) == SpareSlots(96)   # no GPU to check against
    assert SpareSlots.choose(KIMI_K2, 8, 48, costing) == SpareSlots(48)
