"""How the derived cost model predicts the GPU replay: MoE ms per verify step, placement by placement.

Question: How closely does the derived cost model predict the GPU replay's measured MoE time per step?
Baseline: the packaged file measured on the same rank shape (``file``), computed in the same run.
Output: a table on stdout.

Rebuilds the held-out steps and placements of ``scripts/replay_placement.py`` (same sizes and seeds),
then predicts each EP placement's and TP-MoE's ms per step with four cost models:

* ``file``: the packaged file measured on that exact rank shape, as measured: the emulation's first
  block layout, whose launch grid over-counts SGLang's when a rank has more slots than the step has
  pairs (within 3.4% of the replay's measured times, which used the same layout; BENCHMARKS.md#model-against-the-replay);
* ``derived``: what the commands use (``moeplace.cost.derive.derive_cost_model``; a measured rank
  shape uses its file's line moved to SGLang's launch grid);
* ``terms``: the derived terms alone, as an unmeasured shape would get them (``formula_cost``);
* ``terms, own file left out``: the same, calibrated without the file of the shape predicted (for
  redundant slots: without the file of the same experts with no redundancy);
* ``early default``: ``CostModel()``, the fixed EP model the commands used before (n/a for TP).

Ratios are against ``file`` in the same run (``derived`` where no file was measured on the shape).

    python scripts/check_derived_cost.py        # 2-core CPU: about 1 minute
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay_placement import ALGORITHMS, GPTOSS, RANKS, TRACES, load_trace  # noqa: E402

from moeplace.algorithms import PlacementProblem, solve  # noqa: E402
from moeplace.analysis.advise import ep_layer_cost, tp_layer_cost  # noqa: E402
from moeplace.cost.derive import calibrate, derive_cost_model, formula_cost, gpu_calibration  # noqa: E402
from moeplace.cost.model import CostModel  # noqa: E402
from moeplace.model.expert_shape import ExpertShape  # noqa: E402

SHAPES = {"gptoss": ExpertShape(2880, 2880, "bf16", "GPT-OSS-20B"), "kimi": ExpertShape(7168, 2048, "bf16", "Kimi K2")}


def models(shape: ExpertShape, slots: int, top_k: int, own: str, tp: bool = False) -> dict[str, CostModel | None]:
    """The candidate models for one rank shape; ``own``: the packaged file of these experts."""
    cal = gpu_calibration()
    left_out = calibrate([m for m in cal.files if m.name != own])
    measured = next((m for m in cal.files if m.name == own and m.local_slots == slots), None)
    return {"file": measured.cost if measured else None,
            "derived": derive_cost_model(shape, slots, top_k),
            "terms": CostModel(*formula_cost(cal, shape, slots, top_k)),
            "terms, own file left out": CostModel(*formula_cost(left_out, shape, slots, top_k)),
            "early default": None if tp else CostModel()}


def main() -> None:
    own = {("gptoss", "ep"): "cost_h200_bf16_gptoss.json", ("gptoss", "tp"): "cost_h200_bf16_gptoss_tp8.json",
           ("kimi", "ep"): "cost_h200_bf16.json", ("kimi", "tp"): "cost_h200_bf16_tp8.json"}
    for name, cfg in TRACES.items():
        train, test, label = load_trace(name, GPTOSS)
        L, E, K, scale = test.model.num_moe_layers, test.model.num_experts, test.model.top_k, cfg.get("layer_scale", 1)
        print(f"\n{label}: {test.num_steps} held-out steps; ms per step")
        print(f"{'placement':<24}" + "".join(f"{k:>27}" for k in ("file", "derived", "terms",
                                                                   "terms, own file left out", "early default")))
        rows = []
        for red in (0, cfg["redundant"]):
            for alg in ALGORITHMS:
                phy2log = solve(alg, PlacementProblem(train.model, train, RANKS, redundant=red, effort=2e8))
                slots = phy2log.shape[1] // RANKS
                ms = {k: None if m is None else scale * sum(ep_layer_cost(test, layer, phy2log[layer], RANKS, m)
                                                            for layer in range(L)).mean() / 1e3
                      for k, m in models(SHAPES[name], slots, K, own[(name, "ep")]).items()}
                rows.append((f"{alg}" + (f" +{red} redundant" if red else ""), ms))
        tp_models = models(SHAPES[name].tp_slice(RANKS), E, K, own[(name, "tp")], tp=True)
        rows.append(("TP-MoE", {k: None if m is None else
                                scale * sum(tp_layer_cost(test, layer, m) for layer in range(L)).mean() / 1e3
                                for k, m in tp_models.items()}))
        file_of = {r: ms["file"] or ms["derived"] for r, ms in rows}
        for row, ms in rows:
            cells = [("n/a" if v is None else f"{v:.2f} ({v / file_of[row]:.2f}x)") for v in ms.values()]
            print(f"{row:<24}" + "".join(f"{c:>27}" for c in cells))
    cal = gpu_calibration()
    print(f"\ncalibration ({cal.gpu}): {cal.us_per_byte * 1e6:.4f} µs/MB ({1e-6 / cal.us_per_byte:.2f} TB/s), "
          f"launch {cal.launch_us:.1f} µs + {cal.us_per_program * 1e3:.2f} ns per program of the grid, "
          f"large blocks: {cal.read_share:.2f} of the reads + {cal.us_per_k_step:.3f} µs per K step, "
          f"extra {', '.join(f'{k} {v:.1f} µs' for k, v in cal.extra_us.items())}")


if __name__ == "__main__":
    main()
