"""docs/walkthrough.md, run as far as a machine without GPUs allows: every ``sh`` block's SGLang flags go
through SGLang's own argument parser, the moeplace tracer (on CPU tensors, configured by the page's
environment variables) writes the shards of 8 ranks, and every ``moeplace`` command runs as written."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moeplace.cli import cli
from moeplace.errors import MoeplaceError

torch = pytest.importorskip("torch")

DOC = Path(__file__).parents[1] / "docs" / "walkthrough.md"
RANKS = 8
# Kimi K2's published config.json, the fields moeplace and SGLang's parser read.
KIMI_K2 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 61,
           "n_routed_experts": 384, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
           "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


def commands() -> list[tuple[dict[str, str], list[str]]]:
    """(environment, argv) of every command in the page's ``sh`` blocks, in order; exports carry on, and a
    command's own ``NAME=value`` prefix is in its environment alone."""
    env: dict[str, str] = {}
    out = []
    for block in re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["export"]:
                key, value = words[1].split("=", 1)
                env[key] = value
                continue
            own = {}
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                key, value = words.pop(0).split("=", 1)
                own[key] = value
            if words:
                out.append(({**env, **own}, words))
    return out


def localise(words: list[str], root: Path) -> list[str]:
    """The page's absolute paths (/data, /models) moved under ``root``."""
    return [re.sub(r"^/(data|models)/", lambda m: f"{root}/{m.group(1)}/", w) for w in words]


@pytest.fixture(scope="module")
def page():
    cmds = commands()
    assert [w[0] for _, w in cmds] == ["python", "python"] + ["moeplace"] * 11
    return cmds


def test_server_flags_are_sglangs(page):
    import argparse

    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    server = [w for _, w in page if w[:3] == ["python", "-m", "sglang.launch_server"]]
    launched = [w[w.index("--") + 1:] for _, w in page if w[:2] == ["moeplace", "launch"]]
    assert len(server) == 2 and len(launched) == 2
    for argv in [w[3:] for w in server] + launched:
        args, unknown = parser.parse_known_args(argv)
        assert not unknown, unknown
        assert args.tp_size == 8 and args.ep_size == 8
    assert parser.parse_known_args(server[1][3:])[0].expert_distribution_recorder_mode == "per_token"


def write_rank_shards(env: dict[str, str], model_path: str, passes: int = 120) -> Path:
    """What the 8 ranks' tracers write while serving: the same verify passes on every rank (TP attention),
    plus decode and prefill passes, with the page's environment."""
    from moeplace.sglang.plugin import enabled_features
    from moeplace.sglang.tracer import Layout, RoutingTracer, TracerConfig

    from moeplace.sglang.tracer import LAUNCHER_ENV

    old = {k: os.environ.get(k) for k in [*env, "MOEPLACE_TRACE_PREFIX", LAUNCHER_ENV]}
    os.environ.update(env)
    try:
        assert enabled_features() == ["trace"]
        config = TracerConfig.from_env()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    rng = np.random.default_rng(0)
    moe_layers = range(1, 61)
    log_weights = np.log(rng.zipf(1.6, (60, 1, 384)))
    kinds = [(5, 9)] * passes + [(2, 1)] * 10 + [(1, 300)]     # TARGET_VERIFY, DECODE, EXTEND
    # Skewed top-8 without replacement per token: the 8 largest of log weight + Gumbel noise.
    routed = [torch.from_numpy(np.argsort(-(log_weights + rng.gumbel(size=(60, n, 384))), axis=2)[:, :, :8]).int()
              for _, n in kinds]
    for rank in range(RANKS):
        tracer = RoutingTracer(config, lambda r=rank: Layout(model_path, 61, 384, 384, None, RANKS, RANKS, 1, r))
        for (mode, n), ids in zip(kinds, routed):
            for layer, layer_ids in zip(moe_layers, ids):
                tracer.on_router(layer, layer_ids)
            tracer.end_pass(mode, n)
        tracer.close()
        assert tracer.dropped_steps == 0
    return config.out_dir


def test_walkthrough_runs(page, tmp_path, monkeypatch):
    model = tmp_path / "models" / "Kimi-K2-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(KIMI_K2))
    monkeypatch.chdir(tmp_path)
    env, _ = page[0]
    shard_dir = write_rank_shards({k: localise([v], tmp_path)[0] for k, v in env.items()}, str(model))
    assert shard_dir == tmp_path / "data" / "moeplace-traces"
    assert len(list(shard_dir.glob("trace-*-r00?-00000.mptrace"))) == RANKS

    for command_env, words in page:
        if words[0] != "moeplace":
            continue
        argv = [x for w in localise(words[1:], tmp_path) for x in (sorted(glob.glob(w)) if "*" in w else [w])]
        if "run2.mptrace" in argv:   # the newer capture of the last step: the same routing here
            shutil.copyfile(tmp_path / "run1.mptrace", tmp_path / "run2.mptrace")
        if words[1] == "launch" and "--dry-run" not in argv:   # here SGLang is not started: the check and the command
            argv.insert(argv.index("--"), "--dry-run")
        own = {k: localise([v], tmp_path)[0] for k, v in command_env.items() if k.startswith("MOEPLACE_ONLINE")}
        if words[1:3] == ["online", "request"]:   # a running server answers these; without one: one line, exit 2
            if "--placement" in argv and not Path(argv[argv.index("--placement") + 1]).exists():
                continue   # `online decide` kept the placement: there is nothing to move to
            Path(argv[2]).mkdir(parents=True, exist_ok=True)
            result = CliRunner().invoke(cli, argv + ["--wait", "1"])   # main() makes the error one line, exit 2
            assert isinstance(result.exception, MoeplaceError) and "no status" in str(result.exception), result.output
            continue
        result = CliRunner().invoke(cli, argv, env=own)
        assert result.exit_code == 0, (words, result.output)
        if words[1:3] == ["trace", "merge"]:
            assert result.stdout.startswith("wrote run1.mptrace: 131 steps from 1 shard(s), ranks [0]")
            assert "dropped rank(s) [1, 2, 3, 4, 5, 6, 7]: they routed the same tokens" in result.stdout
        if words[1] in ("report", "optimize", "advise"):
            assert "is unknown" not in result.stderr   # the experts' shape came from --model
            assert "experts 7168x2048 fp8" in result.stdout
        if words[1] == "optimize":
            assert "fitted on the first 84 verify steps; table on the last 36, held out" in result.stdout
        if "--placement" in words and words[1] == "report":
            assert re.search(r"^(keep|re-place): ", result.stdout, re.M), result.stdout
        if words[1] == "launch":
            assert (tmp_path / "placement.sglang.json").is_file()
            assert result.stdout.split()[-2:] == ["--init-expert-location", str(tmp_path / "placement.sglang.json")]
            assert ("--enable-eplb" in result.stdout.split()) == ("MOEPLACE_ONLINE" in own)
        if words[1:3] == ["online", "decide"]:
            assert re.match(r"(keep|re-place \d+ layers)", result.stdout), result.stdout
    for made in ("run1.mptrace", "placement.json", "plots/step_max_by_layer.png"):
        assert (tmp_path / made).is_file(), made
