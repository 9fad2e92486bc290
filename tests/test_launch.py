"""`moeplace launch`: config.json reading, SGLang flag parsing, and one-line refusals before SGLang starts.

No torch or SGLang needed: the oracle test against SGLang's own parser is in test_launch_sglang_parser.py.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.cli import main
from moeplace.errors import FormatError
from moeplace.files.placement import Placement, save_placement, save_sglang
from moeplace.model.config import model_spec_from_folder, model_spec_from_hf_config
from moeplace.model.spec import ModelSpec
from moeplace.sglang.launch import parse_sglang_args

# A DeepSeek-V3-shaped toy: 4 layers, layer 0 dense, 16 routed experts, top-4.
DSV3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "n_group": 4, "topk_group": 2,
}
SPEC = ModelSpec("dsv3", 4, (1, 2, 3), 16, 4)


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """Run moeplace's real entry point (so MoeplaceError -> exit 2), capture exit code, stdout, stderr."""
    runner = CliRunner()
    with runner.isolation() as (out, err, *_):
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue().decode(), err.getvalue().decode()


def round_robin(spec: ModelSpec, ranks: int, redundant: int) -> Placement:
    """A valid placement: slot s holds expert s % E (replicas land on different ranks when P/R <= E)."""
    P = spec.num_experts + redundant
    phy2log = np.tile(np.arange(P) % spec.num_experts, (spec.num_moe_layers, 1))
    return Placement(spec, ranks, phy2log)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "dsv3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DSV3_CONFIG))
    return folder


@pytest.fixture
def placement_file(tmp_path: Path) -> Path:
    path = tmp_path / "placement.json"
    save_placement(path, round_robin(SPEC, ranks=4, redundant=4))
    return path


# ----------------------------------------------------------------------------- config.json

def test_deepseek_layout(model_dir: Path) -> None:
    spec = model_spec_from_folder(model_dir)
    assert (spec.num_hidden_layers, spec.moe_layers, spec.num_experts, spec.top_k) == (4, (1, 2, 3), 16, 4)


@pytest.mark.parametrize("config, moe_layers, experts, top_k", [
    ({"num_hidden_layers": 6, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
      "moe_layer_freq": 2}, (2, 4), 8, 2),
    ({"num_hidden_layers": 4, "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
      "mlp_only_layers": [0]}, (1, 2, 3), 60, 4),
    ({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2}, (1, 3), 8, 2),
    ({"num_hidden_layers": 3, "num_local_experts": 32, "experts_per_token": 4}, (0, 1, 2), 32, 4),
    ({"text_config": {"num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2}}, (0, 1), 8, 2),
])
def test_families(config: dict, moe_layers: tuple, experts: int, top_k: int) -> None:
    spec = model_spec_from_hf_config(config)
    assert (spec.moe_layers, spec.num_experts, spec.top_k) == (moe_layers, experts, top_k)


@pytest.mark.parametrize("config", [
    {"num_hidden_layers": 4, "intermediate_size": 128},  # dense
    {"num_hidden_layers": 4, "n_routed_experts": 8},  # no top-k
    {"num_hidden_layers": "4", "n_routed_experts": 8, "num_experts_per_tok": 2},
])
def test_bad_configs(config: dict) -> None:
    with pytest.raises(FormatError):
        model_spec_from_hf_config(config)


# ----------------------------------------------------------------------------- SGLang flags

def test_parse_both_forms_last_wins() -> None:
    layout = parse_sglang_args(shlex.split(
        "--model-path /m --tp=8 --ep 4 --ep-num-redundant-experts=32 --nnodes 2 --ep-size=8 --enable-eplb"))
    assert (layout.model_path, layout.tp_size, layout.ep_size, layout.ep_num_redundant_experts,
            layout.nnodes, layout.enable_eplb) == ("/m", 8, 8, 32, 2, True)
    assert layout.effective_ep_size == 8


def test_ep_defaults() -> None:
    assert parse_sglang_args(["--tp", "8"]).effective_ep_size == 1  # SGLang's default
    # An EP-spanning all-to-all backend makes SGLang use tp_size, whatever --ep says.
    assert parse_sglang_args(["--tp", "8", "--ep", "2", "--moe-a2a-backend", "deepep"]).effective_ep_size == 8


def test_init_location_abbreviation_detected() -> None:
    assert parse_sglang_args(["--init-expert=x.json"]).init_expert_location == "x.json"


# ----------------------------------------------------------------------------- the command

def sglang_args(model_dir: Path, extra: str = "--tp 4 --ep 4 --ep-num-redundant-experts 4") -> list[str]:
    return ["--model-path", str(model_dir), *shlex.split(extra)]


def test_dry_run_writes_sglang_file(tmp_path: Path, model_dir: Path, placement_file: Path) -> None:
    out = tmp_path / "out.json"
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--sglang-file", str(out),
                                    "--dry-run", "--", *sglang_args(model_dir)])
    assert code == 0, stderr
    command = shlex.split(stdout.strip())
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert command[-2:] == ["--init-expert-location", str(out)]
    data = json.loads(out.read_text())
    assert list(data) == ["physical_to_logical_map"]
    phy2log = np.array(data["physical_to_logical_map"])
    assert phy2log.shape == (4, 20)  # every hidden layer, 16 experts + 4 redundant


def test_sglang_file_as_placement(tmp_path: Path, model_dir: Path) -> None:
    """An SGLang map (no model, no ranks inside) is accepted and re-checked against the flags."""
    src = tmp_path / "theirs.json"
    save_sglang(src, round_robin(SPEC, ranks=4, redundant=4))
    code, _, stderr = run_cli(["launch", "--placement", str(src), "--dry-run", "--", *sglang_args(model_dir)])
    assert code == 0, stderr
    assert (tmp_path / "theirs.sglang.json").is_file()


def test_model_option_overrides_model_path(tmp_path: Path, model_dir: Path, placement_file: Path) -> None:
    code, _, stderr = run_cli(["launch", "--placement", str(placement_file), "--model", str(model_dir),
                               "--dry-run", "--", "--model-path", "org/remote-id", "--tp", "4", "--ep", "4",
                               "--ep-num-redundant-experts", "4"])
    assert code == 0, stderr


@pytest.mark.parametrize("case, extra, expect", [
    ("wrong ep size", "--tp 8 --ep 8 --ep-num-redundant-experts 4", "ep_size 8"),
    ("ep absent", "--tp 4 --ep-num-redundant-experts 4", "SGLang's default is 1"),
    ("a2a forces ep", "--tp 8 --ep 4 --moe-a2a-backend deepep --ep-num-redundant-experts 4", "deepep"),
    ("redundant mismatch", "--tp 4 --ep 4", "--ep-num-redundant-experts 4"),
    ("ep does not divide tp", "--tp 6 --ep 4 --ep-num-redundant-experts 4", "must divide --tp-size 6"),
    ("nodes", "--tp 4 --ep 4 --ep-num-redundant-experts 4 --nnodes 2", "--nnodes 2"),
    ("already has init", "--tp 4 --ep 4 --ep-num-redundant-experts 4 --init-expert-location=trivial",
     "already set --init-expert-location"),
    ("bad int", "--tp four", "needs an integer"),
])
def test_refusals(tmp_path: Path, model_dir: Path, placement_file: Path, case: str, extra: str,
                  expect: str) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir, extra)])
    assert_refused(tmp_path, code, stdout, stderr, expect)


def test_wrong_expert_count(tmp_path: Path, model_dir: Path, placement_file: Path) -> None:
    (model_dir / "config.json").write_text(json.dumps({**DSV3_CONFIG, "n_routed_experts": 32}))
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir)])
    assert_refused(tmp_path, code, stdout, stderr, "32 routed experts")


def test_wrong_layer_layout(tmp_path: Path, model_dir: Path, placement_file: Path) -> None:
    (model_dir / "config.json").write_text(json.dumps({**DSV3_CONFIG, "first_k_dense_replace": 2}))
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir)])
    assert_refused(tmp_path, code, stdout, stderr, "MoE layers")


def test_missing_config_json(tmp_path: Path, placement_file: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    "--model-path", str(empty), "--tp", "4", "--ep", "4"])
    assert_refused(tmp_path, code, stdout, stderr, "config.json")


def test_no_model_at_all(tmp_path: Path, placement_file: Path) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--", "--tp", "4"])
    assert_refused(tmp_path, code, stdout, stderr, "no model: give --model")


def test_missing_placement(tmp_path: Path, model_dir: Path) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(tmp_path / "nope.json"), "--dry-run", "--",
                                    *sglang_args(model_dir)])
    assert_refused(tmp_path, code, stdout, stderr, "no such file")


def test_sglang_file_must_be_json(tmp_path: Path, model_dir: Path, placement_file: Path) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--sglang-file",
                                    str(tmp_path / "map.txt"), "--dry-run", "--", *sglang_args(model_dir)])
    assert_refused(tmp_path, code, stdout, stderr, "must end in .json")


def assert_refused(tmp_path: Path, code: int, stdout: str, stderr: str, expect: str) -> None:
    assert code == 2, (stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expect in lines[0], lines[0]
    assert stdout == ""
    assert not list(tmp_path.rglob("*.sglang.json")), "nothing may be written on a refusal"


def test_launch_imports_neither_torch_nor_sglang() -> None:
    import subprocess
    import sys

    code = ("import sys, moeplace.commands.launch, moeplace.sglang.launch; "
            "assert not {'torch', 'sglang'} & set(sys.modules), 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- Hugging Face ids

def cache_model_id(cache: Path, repo_id: str, config: dict, commit: str = "c" * 40, ref: str | None = "main") -> Path:
    """``repo_id`` in a Hugging Face cache laid out as huggingface_hub writes it (refs/main -> snapshot)."""
    from test_hf_resolve import cache_model

    return cache_model(cache, repo_id, commit, {"config.json": json.dumps(config)}, ref=ref)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.mark.parametrize("where", ["--model-path", "--model"])
def test_hugging_face_id_from_the_cache(tmp_path: Path, hf_cache: Path, placement_file: Path, where: str) -> None:
    cache_model_id(hf_cache, "deepseek-ai/toy-v3", DSV3_CONFIG)
    args = ["launch", "--placement", str(placement_file), "--dry-run"]
    flags = ["--tp", "4", "--ep", "4", "--ep-num-redundant-experts", "4"]
    if where == "--model":
        args += ["--model", "deepseek-ai/toy-v3", "--", "--model-path", "/elsewhere/on/the/server", *flags]
    else:
        args += ["--", "--model-path", "deepseek-ai/toy-v3", *flags]
    code, stdout, stderr = run_cli(args)
    assert code == 0, stderr
    assert "deepseek-ai/toy-v3" in stdout or where == "--model"   # SGLang gets the id as given


def test_hugging_face_id_revision(tmp_path: Path, hf_cache: Path, placement_file: Path) -> None:
    """--revision picks the snapshot SGLang will load: here one with 32 experts, which the placement misses."""
    cache_model_id(hf_cache, "org/m", DSV3_CONFIG)
    cache_model_id(hf_cache, "org/m", {**DSV3_CONFIG, "n_routed_experts": 32}, commit="d" * 40, ref=None)
    base = ["launch", "--placement", str(placement_file), "--dry-run", "--", "--model-path", "org/m",
            "--tp", "4", "--ep", "4", "--ep-num-redundant-experts", "4"]
    assert run_cli(base)[0] == 0
    (tmp_path / "placement.sglang.json").unlink()   # the dry run wrote it
    code, stdout, stderr = run_cli(base + ["--revision", "d" * 40])
    assert_refused(tmp_path, code, stdout, stderr, "'org/m' has 32 routed experts")


def test_hugging_face_id_not_cached(tmp_path: Path, hf_cache: Path, placement_file: Path) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    "--model-path", "openai/gpt-oss-20b", "--tp", "4", "--ep", "4"])
    assert_refused(tmp_path, code, stdout, stderr, "not in the Hugging Face cache")
    assert "huggingface-cli download openai/gpt-oss-20b config.json" in stderr


# ----------------------------------------------------------------------------- balanced dispatch

@pytest.fixture
def balanced_file(tmp_path: Path) -> Path:
    """A placement whose spare slots were placed for balanced dispatch (what `optimize --dispatch balanced` writes)."""
    p = round_robin(SPEC, ranks=4, redundant=4)
    p.metrics = {"dispatch": "balanced"}
    path = tmp_path / "balanced.json"
    save_placement(path, p)
    return path


def test_balanced_placement_turns_the_plugins_rule_on(model_dir: Path, balanced_file: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEPLACE_DISPATCH", raising=False)
    code, stdout, stderr = run_cli(["launch", "--placement", str(balanced_file), "--dry-run", "--",
                                    *sglang_args(model_dir)])
    assert code == 0, stderr
    assert stdout.startswith("MOEPLACE_DISPATCH=balanced ")
    assert shlex.split(stdout)[2:4] == ["-m", "sglang.launch_server"]


def _cost_placement(tmp_path: Path, cost_model: dict | None) -> Path:
    p = round_robin(SPEC, ranks=4, redundant=4)
    p.metrics = {"dispatch": "cost", **({"cost_model": cost_model} if cost_model is not None else {})}
    save_placement(tmp_path / "cost.json", p)
    return tmp_path / "cost.json"


def test_cost_rule_placement_runs_the_cost_kernel_with_its_q(tmp_path: Path, model_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """q = round(a / b) of the placement's cost model (19 / 0.0415 = 458), in the plugin's environment."""
    monkeypatch.delenv("MOEPLACE_DISPATCH", raising=False)
    monkeypatch.delenv("MOEPLACE_DISPATCH_Q", raising=False)
    path = _cost_placement(tmp_path, {"a_us_per_expert": 19.0, "b_us_per_token": 0.0415, "c_us": 50.0})
    code, stdout, stderr = run_cli(["launch", "--placement", str(path), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4")])
    assert code == 0, stderr
    assert stdout.startswith("MOEPLACE_DISPATCH=cost MOEPLACE_DISPATCH_Q=458 ")
    assert "warning" not in stderr
    monkeypatch.setenv("MOEPLACE_DISPATCH_Q", "300")                     # the user's own q is kept
    code, stdout, stderr = run_cli(["launch", "--placement", str(path), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4")])
    assert code == 0 and stdout.startswith("MOEPLACE_DISPATCH=cost MOEPLACE_DISPATCH_Q=300 "), stderr


def test_cost_rule_placement_with_row_blocks_runs_the_weighted_rule(tmp_path: Path, model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A cost model with the row-block term: MOEPLACE_DISPATCH_WEIGHTS = rule_weights (458, 1, 241, 16); with
    tokens free, reads and blocks only (4096, 0, 2156, 16)."""
    monkeypatch.delenv("MOEPLACE_DISPATCH", raising=False)
    monkeypatch.delenv("MOEPLACE_DISPATCH_Q", raising=False)
    monkeypatch.delenv("MOEPLACE_DISPATCH_WEIGHTS", raising=False)
    for b, want in ((0.0415, "458,1,241,16"), (0.0, "4096,0,2156,16")):
        path = _cost_placement(tmp_path, {"a_us_per_expert": 19.0, "b_us_per_token": b, "c_us": 50.0,
                                          "r_us_per_block": 10.0, "block_m": 16})
        code, stdout, stderr = run_cli(["launch", "--placement", str(path), "--dry-run", "--",
                                        *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4")])
        assert code == 0, stderr
        assert stdout.startswith(f"MOEPLACE_DISPATCH=cost MOEPLACE_DISPATCH_WEIGHTS={want} "), stdout
        assert "warning" not in stderr
    path = _cost_placement(tmp_path, {"a_us_per_expert": 19.0, "b_us_per_token": 0.0, "c_us": 50.0,
                                      "r_us_per_block": 10.0})
    code, stdout, stderr = run_cli(["launch", "--placement", str(path), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4")])
    assert code == 2 and not stdout and len(stderr.strip().splitlines()) == 1 and "block_m" in stderr, stderr


def test_cost_rule_placement_without_a_token_term_runs_the_balanced_rule(tmp_path: Path, model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEPLACE_DISPATCH", raising=False)
    path = _cost_placement(tmp_path, {"a_us_per_expert": 19.0, "b_us_per_token": 0.0, "c_us": 50.0})
    code, stdout, stderr = run_cli(["launch", "--placement", str(path), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4")])
    assert code == 0, stderr
    assert stdout.startswith("MOEPLACE_DISPATCH=balanced ") and "MOEPLACE_DISPATCH_Q" not in stdout
    assert "no token or row-block term; the SGLang plugin runs the balanced rule" in stderr


@pytest.mark.parametrize("cost_model, env, expect", [
    (None, None, "records no cost model"),
    ({"a_us_per_expert": "x", "b_us_per_token": 1.0}, None, "records no cost model"),
    ({"a_us_per_expert": 19.0, "b_us_per_token": 0.04}, "balanced", "MOEPLACE_DISPATCH='balanced'; unset it or set it to cost"),
])
def test_cost_rule_placement_refusals(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                      cost_model, env, expect) -> None:
    if env is None:
        monkeypatch.delenv("MOEPLACE_DISPATCH", raising=False)
    else:
        monkeypatch.setenv("MOEPLACE_DISPATCH", env)
    path = _cost_placement(tmp_path, cost_model)
    code, stdout, stderr = run_cli(["launch", "--placement", str(path), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4")])
    assert_refused(tmp_path, code, stdout, stderr, expect)


@pytest.mark.parametrize("extra, env, expect", [
    ("--enable-dp-attention", None, "drop --enable-dp-attention"),
    ("", "dynamic", "MOEPLACE_DISPATCH='dynamic'"),
])
def test_balanced_placement_refusals(tmp_path: Path, model_dir: Path, balanced_file: Path,
                                     monkeypatch: pytest.MonkeyPatch, extra: str, env: str | None, expect: str) -> None:
    if env is None:
        monkeypatch.delenv("MOEPLACE_DISPATCH", raising=False)
    else:
        monkeypatch.setenv("MOEPLACE_DISPATCH", env)
    code, stdout, stderr = run_cli(["launch", "--placement", str(balanced_file), "--dry-run", "--",
                                    *sglang_args(model_dir, f"--tp 4 --ep 4 --ep-num-redundant-experts 4 {extra}")])
    assert_refused(tmp_path, code, stdout, stderr, expect)


def test_placement_for_sglangs_rule_adds_no_environment(model_dir: Path, placement_file: Path) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir)])
    assert code == 0, stderr
    assert "MOEPLACE_DISPATCH" not in stdout


# ----------------------------------------------------------------------------- EP x TP splits

@pytest.fixture
def split_file(tmp_path: Path) -> Path:
    """A placement for 4 EP groups x MoE TP 2 on 8 GPUs (what `optimize --ranks 8 --ep-size 4` writes)."""
    p = round_robin(SPEC, ranks=4, redundant=0)
    p.metrics = {"ep_split": {"gpus": 8, "ep_size": 4, "moe_tp": 2}}
    path = tmp_path / "split.json"
    save_placement(path, p)
    return path


def sglang_parse(argv: list[str]):
    """SGLang 0.5.23's own parser over a launch_server argument list."""
    import argparse

    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    args, unknown = parser.parse_known_args(argv)
    assert not unknown, unknown
    return args


@pytest.mark.parametrize("given, added", [
    ("", ["--ep-size", "4", "--tp-size", "8"]),
    ("--tp 8", ["--ep-size", "4"]),
    ("--tp-size 8 --ep 4", []),
])
def test_launch_passes_the_placements_split(model_dir: Path, split_file: Path, given: str, added: list[str]) -> None:
    code, stdout, stderr = run_cli(["launch", "--placement", str(split_file), "--dry-run", "--",
                                    *sglang_args(model_dir, given)])
    assert code == 0, stderr
    argv = shlex.split(stdout)[3:]
    assert argv[:-2] == [*sglang_args(model_dir, given), *added]
    args = sglang_parse(argv)
    assert (args.tp_size, args.ep_size) == (8, 4)
    assert "warning" not in stderr


def test_launch_split_refusals_and_warnings(tmp_path: Path, model_dir: Path, split_file: Path) -> None:
    # another EP size than the placement's groups: refused, one line
    code, stdout, stderr = run_cli(["launch", "--placement", str(split_file), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 8 --ep 8")])
    assert_refused(tmp_path, code, stdout, stderr, "placement is for 4 ranks but SGLang will run with ep_size 8")
    # the same groups with another MoE TP: runs, and says the costs were for the other split
    code, stdout, stderr = run_cli(["launch", "--placement", str(split_file), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4")])
    assert code == 0, stderr
    assert sglang_parse(shlex.split(stdout)[3:]).ep_size == 4
    assert ("warning: the placement was made for 4 EP groups x MoE TP 2 on 8 GPUs; --tp-size 4 runs MoE TP 1"
            in stderr)


def test_enable_eplb_makes_moeplace_the_rebalancer(model_dir: Path, placement_file: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEPLACE_ONLINE", raising=False)
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir, "--tp 4 --ep 4 --ep-num-redundant-experts 4 --enable-eplb")])
    assert code == 0, stderr
    assert stdout.startswith("MOEPLACE_ONLINE=1 ") and "--enable-eplb" in shlex.split(stdout)


def test_online_at_ep_2_or_more_adds_enable_eplb(model_dir: Path, placement_file: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEPLACE_ONLINE", "1")
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir)])
    assert code == 0, stderr
    assert shlex.split(stdout).count("--enable-eplb") == 1


def test_online_at_ep_1_runs_without_enable_eplb(tmp_path: Path, model_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEPLACE_ONLINE", "1")
    save_placement(tmp_path / "one.json", round_robin(SPEC, ranks=1, redundant=0))
    code, stdout, stderr = run_cli(["launch", "--placement", str(tmp_path / "one.json"), "--dry-run", "--",
                                    "--model-path", str(model_dir)])
    assert code == 0, stderr
    assert "--enable-eplb" not in shlex.split(stdout)


@pytest.mark.parametrize("env, extra, expect", [
    ({"MOEPLACE_ONLINE": "0"}, "--tp 4 --ep 4 --ep-num-redundant-experts 4 --enable-eplb", "MOEPLACE_ONLINE=0"),
    ({}, "--ep-num-redundant-experts 4 --enable-eplb", "2 or more EP ranks"),
    ({"MOEPLACE_ONLINE": "1", "MOEPLACE_ONLINE_WINDOW": "lots"}, "--tp 4 --ep 4 --ep-num-redundant-experts 4",
     "MOEPLACE_ONLINE_WINDOW"),
])
def test_online_refusals(tmp_path: Path, model_dir: Path, placement_file: Path, monkeypatch: pytest.MonkeyPatch,
                         env: dict, extra: str, expect: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, stdout, stderr = run_cli(["launch", "--placement", str(placement_file), "--dry-run", "--",
                                    *sglang_args(model_dir, extra)])
    assert_refused(tmp_path, code, stdout, stderr, expect)
