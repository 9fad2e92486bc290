"""Which cost model the commands use for "MoE µs/step": derived for the trace's model, from --model,
or a --cost-model file; said in the output and the JSON; a one-line warning when nothing tells the shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.cli import cli
from moeplace.cost.derive import derive_cost_model
from moeplace.model.expert_shape import ExpertShape

REPO = Path(__file__).parents[1]
SAMPLE = REPO / "traces" / "gptoss20b-sample.mptrace"
FAST = ["--max-steps", "300", "--effort", "1e6"]
QWEN_LIKE = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 24, "num_experts": 32,
             "num_experts_per_tok": 4, "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "torch_dtype": "bfloat16"}


def invoke(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def tiny_npz(path: Path, experts: int = 32, layers: int = 24, name: str = "my-moe") -> Path:
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(experts, 4, replace=False) for _ in range(layers)])
                    for _ in range(9 * 40)]).astype(np.int16)
    np.savez(path, topk_ids=ids, num_experts=np.int64(experts), model_name=np.str_(name))
    return path


def test_report_uses_the_model_in_the_trace_header():
    code, out, err = invoke("report", SAMPLE, "--ranks", 8, "--json")
    assert code == 0, err
    cost = json.loads(out)["cost_model"]
    gptoss = derive_cost_model(ExpertShape(2880, 2880, "bf16", "x"), 4, 4)   # 4 slots a rank, top-4
    assert (cost["a_us_per_expert"], cost["c_us"]) == (gptoss.a_us_per_expert, gptoss.c_us)
    assert gptoss.a_us_per_expert == 6.598 and gptoss.c_us == pytest.approx(73.68, abs=0.5)   # the measured line
    assert "gpt-oss-20b" in cost["source"] and not err
    code, out, _ = invoke("report", SAMPLE, "--ranks", 8)
    assert "cost model (MoE µs/step): NVIDIA H200, known model gpt-oss-20b: experts 2880x2880 bf16" in out


@pytest.mark.parametrize("command", ["report", "optimize", "compare"])
def test_moe_us_column_follows_the_model(tmp_path, command):
    """The same routing costs differently with Kimi-sized and GPT-OSS-sized experts; the column says so."""
    trace = tiny_npz(tmp_path / "t.npz")
    placement = tmp_path / "p.json"
    assert invoke("optimize", trace, "--ranks", 8, *FAST, "--algorithm", "contiguous", "-o", placement)[0] == 0
    args = {"report": ["report", trace], "optimize": ["optimize", trace, *FAST, "-o", tmp_path / "q.json"],
            "compare": ["compare", trace, placement]}[command]
    us = {}
    for label, extra in (("generic", []), ("config", ["--model", _config(tmp_path, QWEN_LIKE)])):
        code, out, err = invoke(*args, "--ranks", 8, "--json", *extra)
        assert code == 0, err
        data = json.loads(out)
        cost = data.get("cost_model") or next(iter(data["cost_models"].values()))
        rows = data.get("rows") or [data["metrics"]]
        us[label] = rows[0]["moe_us_per_step"]
        # optimize may also warn that its placement does not hold on this tiny trace: not counted here
        warning = [line for line in err.splitlines() if line.startswith("warning:") and "expert shape" in line]
        if label == "generic":
            assert len(warning) == 1 and "'my-moe'" in warning[0] and "--model" in warning[0]
            assert "generic default" in cost["source"]
        else:
            assert not warning and "--model" in cost["source"]
            assert "2048x768 bf16" in cost["source"]
    assert us["config"] < 0.5 * us["generic"]      # 2048x768 experts read far fewer bytes than 7168x2048


def test_cost_model_file_overrides_and_silences_the_warning(tmp_path):
    trace = tiny_npz(tmp_path / "t.npz")
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"a_us_per_expert": 1.0, "b_us_per_token": 0.0, "c_us": 0.0}))
    code, out, err = invoke("report", trace, "--ranks", 8, "--cost-model", cost, "--json")
    assert code == 0 and not err
    data = json.loads(out)
    assert data["metrics"]["moe_us_per_step"] == pytest.approx(24 * data["metrics"]["e_max_distinct"])
    assert data["cost_model"]["source"] == f"file {cost}"


def test_model_as_hugging_face_id_from_the_local_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--moe-32" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN_LIKE))
    (tmp_path / "hub" / "models--acme--moe-32" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--moe-32" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = invoke("report", tiny_npz(tmp_path / "t.npz"), "--ranks", 8, "--model", "acme/moe-32")
    assert code == 0, err
    assert "--model acme/moe-32: experts 2048x768 bf16, 4 per rank" in out and "warning" not in err


@pytest.mark.parametrize("command,change,fragment", [
    ("report", {"num_experts": 64}, "64 routed experts, the trace 32"),
    ("advise", {"num_experts": 64}, "64 routed experts, the trace 32"),
    ("optimize", {"moe_intermediate_size": None, "intermediate_size": None}, "no expert size"),
])
def test_model_that_does_not_fit_is_one_line(tmp_path, capsys, command, change, fragment):
    from moeplace.cli import main

    config = _config(tmp_path, {**QWEN_LIKE, **change})
    with pytest.raises(SystemExit) as e:
        main([command, str(tiny_npz(tmp_path / "t.npz")), "--ranks", "8", "--model", str(config),
              *(["-o", str(tmp_path / "p.json")] if command == "optimize" else [])])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_advise_prints_both_cost_models(tmp_path):
    code, out, err = invoke("advise", tiny_npz(tmp_path / "t.npz"), "--ranks", 8, "--effort", 1e6,
                            "--model", _config(tmp_path, QWEN_LIKE))
    assert code == 0, err
    assert "EP cost model at 9 tokens per step: NVIDIA H200, --model" in out
    assert "TP cost model at 9 tokens per step: NVIDIA H200, --model" in out
    assert "experts 2048x768 bf16, 4 per rank" in out and "experts 2048x96 bf16, 32 per rank" in out
    assert "SGLang's launch grid for 9 tokens x top-4" in out


def _config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "cfg" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def test_advise_where_tp_moe_cannot_run_compares_the_ep_splits(tmp_path):
    # 8 GPUs, intermediate 100: TP8 would split it in 12.5 columns (SGLang refuses), EP4xTP2 and EP8 run
    config = _config(tmp_path, {**QWEN_LIKE, "moe_intermediate_size": 100})
    code, out, err = invoke("advise", tiny_npz(tmp_path / "t.npz"), "--ranks", 8, "--effort", 1e6, "--model", config)
    assert code == 0, err
    assert "TP-MoE cannot run on 8 GPUs (the experts' intermediate size 100 does not split over MoE TP 8" in out
    head = next(line for line in out.splitlines() if line.startswith("tokens/step"))
    assert "TP cost model" not in out and "EP4xTP2" in head and "TP8" not in head.split()
    code, out, err = invoke("advise", tiny_npz(tmp_path / "t.npz"), "--ranks", 8, "--effort", 1e6, "--model", config,
                            "--json")
    data = json.loads(out)
    assert data["at_trace"] is None and data["grid"] == [] and data["tp_cost_model"] is None
    assert "does not split over MoE TP 8" in data["tp_moe_refused"]
    assert [r["name"] for r in data["layouts"]][:2] == ["EP8", "EP8+8"]


def test_advise_runs_the_splits_that_only_the_spare_slots_make(tmp_path):
    # 32 experts split over no EP size of 12 GPUs whose MoE TP divides the intermediate size 100 (EP 4 needs TP 3);
    # 32 + 4 spare slots split over EP 12, 6 and 3 (MoE TP 1, 2, 4): those layouts are what SGLang can run
    config = _config(tmp_path, {**QWEN_LIKE, "moe_intermediate_size": 100})
    code, out, err = invoke("advise", tiny_npz(tmp_path / "t.npz"), "--ranks", 12, "--redundant", 4, "--effort", 1e6,
                            "--model", config, "--json")
    assert code == 0, err
    assert [r["name"] for r in json.loads(out)["layouts"]] == ["EP12+4", "EP6xTP2+4", "EP3xTP4+4"]
