"""Our --init-expert-location file, read by SGLang 0.5.23's own start-up code on CPU.

The oracle is SGLang itself: ``compute_initial_expert_location_metadata`` with a real ``ServerArgs``
published into SGLang's runtime context and a real ``ModelConfig`` of a tiny DeepSeek-V3 config.json.
Its derived logical->physical maps must equal ``moeplace.files.placement.replica_table``.

Dimension letters: L MoE layers, H hidden layers, E logical experts, P physical slots, R ranks, X max replicas.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from moeplace.files.placement import Placement, load_placement, replica_table, save_sglang, sglang_physical_to_logical
from moeplace.model.config import model_spec_from_folder
from moeplace.model.spec import ModelSpec
from moeplace.sglang.launch import _VALUE_OPTIONS, parse_sglang_args

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.eplb.expert_location")
pytestmark = pytest.mark.sglang

# Smallest DeepSeek-V3 that SGLang's ModelConfig and model registry accept: 4 layers (layer 0 dense),
# 16 routed experts in 4 groups, top-4.
TINY_DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}
SHAPES = [(2, 0), (2, 2), (4, 0), (4, 4), (4, 12), (8, 0), (8, 8),   # (ranks, redundant)
          (16, 16), (64, 48), (128, 112), (128, 240),                   # wide EP: 1 or 2 slots per rank
          (12, 8), (144, 128)]                                          # the experts do not split over the ranks


def random_placement(spec: ModelSpec, ranks: int, redundant: int, seed: int) -> Placement:
    """A valid, deliberately scrambled placement: replicas of the first ``redundant`` experts of a
    per-layer permutation, then slots shuffled within each rank (rank membership unchanged)."""
    rng = np.random.default_rng(seed)
    E, P = spec.num_experts, spec.num_experts + redundant
    rows = []
    for _ in range(spec.num_moe_layers):
        perm = rng.permutation(E)
        row = perm[np.arange(P) % E].reshape(ranks, -1)  # slot j and j+E lie on different ranks here
        rows.append(rng.permuted(row, axis=1).reshape(-1))
    return Placement(spec, ranks, np.array(rows))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-dsv3")
    (folder / "config.json").write_text(json.dumps(TINY_DSV3))
    return folder


@pytest.fixture(scope="module")
def sglang_context():
    """Restore SGLang's process-wide context after this module publishes into it."""
    from sglang.srt import runtime_context

    state = runtime_context.snapshot_context()
    yield runtime_context
    runtime_context.restore_context(state)


@pytest.fixture(scope="module")
def model_config(tiny_model: Path, sglang_context):
    from sglang.srt.configs.model_config import ModelConfig

    # SGLang's model registry silently drops a model class whose imports fail (it needs openai and
    # partial-json-parser beyond the notes' list); then no expert location is computed at all.
    pytest.importorskip("sglang.srt.models.deepseek_v2", reason="SGLang's DeepSeek model class does not import")
    publish(tiny_model, sglang_context, ranks=1, redundant=0, init="trivial")
    return ModelConfig.from_server_args(sglang_context.get_server_args())


def publish(model: Path, rc, ranks: int, redundant: int, init: str) -> None:
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(model), tp_size=ranks, ep_size=ranks, ep_num_redundant_experts=redundant,
                             init_expert_location=init, skip_tokenizer_init=True,
                             device="cpu")
    rc.publish(server_args, role="scheduler")


@pytest.mark.parametrize("ranks, redundant", SHAPES)
def test_sglang_start_up_reads_our_file(tmp_path: Path, tiny_model: Path, sglang_context, model_config,
                                        ranks: int, redundant: int) -> None:
    from sglang.srt.eplb.expert_location import compute_initial_expert_location_metadata

    spec = model_spec_from_folder(tiny_model)
    p = random_placement(spec, ranks, redundant, seed=ranks * 100 + redundant)
    path = tmp_path / "map.json"
    save_sglang(path, p)
    publish(tiny_model, sglang_context, ranks, redundant, init=str(path))

    meta = compute_initial_expert_location_metadata(model_config, moe_ep_rank=0)

    full = sglang_physical_to_logical(p)  # [H, P]
    assert meta.ep_size == ranks and meta.num_physical_experts == spec.num_experts + redundant
    assert np.array_equal(meta.physical_to_logical_map_cpu.numpy(), full)
    log2phy, num_replicas = replica_table(p.phy2log, spec.num_experts)  # [L, E, X], [L, E]
    ours_moe = meta.logical_to_all_physical_map_cpu.numpy()[list(spec.moe_layers)]  # [L, E, P] padded -1
    X = log2phy.shape[-1]
    assert np.array_equal(ours_moe[..., :X], log2phy)
    assert (ours_moe[..., X:] == -1).all()
    assert np.array_equal(meta.logical_to_all_physical_map_num_valid.numpy()[list(spec.moe_layers)], num_replicas)


@pytest.mark.parametrize("ranks, redundant", [(4, 4), (8, 8)])
def test_static_dispatch_prefers_own_rank(tmp_path: Path, tiny_model: Path, sglang_context, model_config,
                                          ranks: int, redundant: int) -> None:
    """With static dispatch SGLang picks, per source rank, one replica; it must be a real replica,
    and the one on that rank when there is one.

    Static dispatch is only valid with an all-to-all backend; DeepEP's ServerArgs checks need its GPU
    package, so the resolved config is overridden through SGLang's own RuntimeContext.override."""
    from sglang.srt.eplb.expert_location import compute_initial_expert_location_metadata

    spec = model_spec_from_folder(tiny_model)
    p = random_placement(spec, ranks, redundant, seed=7)
    path = tmp_path / "map.json"
    save_sglang(path, p)
    publish(tiny_model, sglang_context, ranks, redundant, init=str(path))
    sglang_context.get_context().override("moeplace-test", moe_a2a_backend="deepep", ep_dispatch_algorithm="static")
    log2phy, _ = replica_table(p.phy2log, spec.num_experts)
    slots_per_rank = p.num_physical // ranks
    for rank in (0, ranks - 1):
        meta = compute_initial_expert_location_metadata(model_config, moe_ep_rank=rank)
        chosen = meta.logical_to_rank_dispatch_physical_map.numpy()[list(spec.moe_layers)]  # [L, E]
        for layer in range(spec.num_moe_layers):
            for expert in range(spec.num_experts):
                replicas = [s for s in log2phy[layer, expert] if s >= 0]
                assert chosen[layer, expert] in replicas
                local = [s for s in replicas if s // slots_per_rank == rank]
                if local:
                    assert chosen[layer, expert] == local[0]


@pytest.mark.parametrize("ranks, redundant", SHAPES)
def test_round_trip_through_sglang_inverse(tmp_path: Path, ranks: int, redundant: int) -> None:
    """save_sglang -> json -> SGLang's _compute_logical_to_all_physical_map == replica_table; and the
    file loads back into the same placement."""
    from sglang.srt.eplb.expert_location import _compute_logical_to_all_physical_map

    spec = ModelSpec("dsv3", 4, (1, 2, 3), 16, 4)
    p = random_placement(spec, ranks, redundant, seed=ranks + 31 * redundant)
    path = tmp_path / "map.json"
    save_sglang(path, p)
    data = json.loads(path.read_text())
    assert list(data) == ["physical_to_logical_map"]  # SGLang splats the dict: no other key allowed
    full = torch.tensor(data["physical_to_logical_map"])
    # moe_ep_rank=None: the plain inverse, no per-rank nearest-replica collapse (needs no context).
    l2p = _compute_logical_to_all_physical_map(full, num_logical_experts=16, ep_size=ranks, moe_ep_rank=None)
    log2phy, _ = replica_table(p.phy2log, 16)
    assert np.array_equal(l2p.numpy()[list(spec.moe_layers)], log2phy)
    back = load_placement(path, model=spec, ranks=ranks)
    assert np.array_equal(back.phy2log, p.phy2log)


# ----------------------------------------------------------------------------- flag parsing vs SGLang's parser

@pytest.fixture(scope="module")
def sglang_parser():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_our_option_names_are_sglangs(sglang_parser) -> None:
    actions = sglang_parser._option_string_actions
    for name, dest in _VALUE_OPTIONS.items():
        if name == "--tp":  # an argparse abbreviation, checked by parsing below
            continue
        assert actions[name].dest == dest, name


@pytest.mark.parametrize("args", [
    "--model-path /m --tp 8 --ep 8 --ep-num-redundant-experts 32",
    "--model=/m --tp=4 --expert-parallel-size=2 --nnodes=2 --enable-eplb",
    "--model-path /m --tensor-parallel-size 8 --ep-size 4 --ep 8 --init-expert-location=/x.json",
    "--model-path /m --tp 8 --moe-a2a-backend deepep --ep-num-redundant-experts=0 --init-expert trivial",
    "--model-path /m --trust-remote-code --tp 2",
])
def test_parse_matches_sglang(sglang_parser, args: str) -> None:
    theirs = sglang_parser.parse_args(shlex.split(args))
    ours = parse_sglang_args(shlex.split(args))
    assert ours.model_path == theirs.model_path
    assert ours.tp_size == theirs.tp_size
    assert (ours.ep_size or 1) == theirs.ep_size
    assert ours.ep_num_redundant_experts == theirs.ep_num_redundant_experts
    assert ours.nnodes == theirs.nnodes
    assert ours.moe_a2a_backend == theirs.moe_a2a_backend
    assert (ours.init_expert_location or "trivial") == theirs.init_expert_location
    assert ours.enable_eplb == theirs.enable_eplb
