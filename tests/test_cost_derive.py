"""The cost model derived from an expert's shape: calibration on the packaged H200 files, SGLang's
kernel-config rule, known models, and expert shapes read from config.json."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moeplace.cost_derive import (LARGE_M, SMALL_M, calibrate, derive_cost_model, formula_cost, gpu_calibration,
                                  packaged_measurements, sglang_default_config)
from moeplace.expert_shape import GENERIC, KNOWN_MODELS, MXFP4_NOTE, ExpertShape, known_expert_shape
from moeplace.model import ModelSpec
from moeplace.model_config import expert_shape_from_hf_config

FILES = {m.name: m for m in packaged_measurements()}


def test_every_packaged_file_names_its_rank_shape():
    assert len(FILES) == 6
    for m in FILES.values():
        for key in ("gpu", "dtype", "kernel", "date", "shape"):
            assert m.cost.provenance[key], (m.name, key)
        assert m.shape.hidden > 0 and m.shape.intermediate > 0 and m.local_slots > 0


@pytest.mark.parametrize("name", ["cost_h200_bf16.json", "cost_h200_bf16_tp8.json", "cost_h200_bf16_gptoss_tp8.json"])
def test_fixed_terms_predict_a_left_out_file(name):
    """Launch cost per padding program, fitted without one bf16 file, predicts that file's c within 3%;
    the per-byte read cost fitted without the bf16 Kimi file (so from fp8 and the TP shapes) predicts its a."""
    rest = [m for n, m in FILES.items() if n != name]
    a, _, c = formula_cost(calibrate(rest), FILES[name].shape, FILES[name].local_slots)
    assert c == pytest.approx(FILES[name].cost.c_us, rel=0.03)
    if name == "cost_h200_bf16.json":
        assert a == pytest.approx(FILES[name].cost.a_us_per_expert, rel=0.03)


def test_per_byte_cost_holds_across_bf16_and_fp8():
    cal = gpu_calibration()
    for name in ("cost_h200_bf16.json", "cost_h200_fp8.json"):
        m = FILES[name]
        assert cal.us_per_byte * m.shape.bytes == pytest.approx(m.cost.a_us_per_expert, rel=0.02)
    assert 1 / cal.us_per_byte / 1e6 == pytest.approx(4.6, rel=0.1)   # TB/s: near the H200's 4.8 peak


def test_measured_shapes_use_their_measurement():
    for m in FILES.values():
        cm = derive_cost_model(m.shape, m.local_slots)
        assert (cm.a_us_per_expert, cm.b_us_per_token, cm.c_us) == \
            (m.cost.a_us_per_expert, m.cost.b_us_per_token, m.cost.c_us)
        assert f"measured ({m.name})" in cm.describe()


def test_unmeasured_shapes_are_derived_and_ordered():
    qwen = ExpertShape(2048, 768, "bf16", "Qwen3-30B-A3B")
    small, large = derive_cost_model(qwen, 16), derive_cost_model(qwen, 32)
    assert "derived from expert bytes" in small.describe()
    assert 0 < small.a_us_per_expert == large.a_us_per_expert < FILES["cost_h200_bf16.json"].cost.a_us_per_expert
    assert small.c_us < large.c_us          # more local slots launch more padding programs
    kimi = FILES["cost_h200_bf16.json"]
    redundant = derive_cost_model(kimi.shape, kimi.local_slots + 4)   # Kimi with 32 redundant slots over 8 ranks
    assert redundant.a_us_per_expert == pytest.approx(kimi.cost.a_us_per_expert, rel=0.01)
    assert kimi.cost.c_us < redundant.c_us < kimi.cost.c_us * 1.1
    fp8 = derive_cost_model(dataclasses.replace(kimi.shape, weights="fp8"), 52)
    assert fp8.a_us_per_expert == pytest.approx(redundant.a_us_per_expert / 2, rel=0.01)


def test_few_local_experts_use_the_large_block_terms():
    gptoss = FILES["cost_h200_bf16_gptoss.json"]
    assert gptoss.config == LARGE_M and sglang_default_config(9, 16, "bf16") == SMALL_M
    five = derive_cost_model(gptoss.shape, 5)          # 8 redundant slots over 8 ranks: still 9 tokens > 5
    assert five.a_us_per_expert == pytest.approx(gptoss.cost.a_us_per_expert, rel=0.01)
    assert five.c_us == pytest.approx(gptoss.cost.c_us, rel=0.02)


@pytest.mark.sglang
@pytest.mark.parametrize("weights,quant,block", [("bf16", None, None), ("fp8", "fp8_w8a8", [128, 128]),
                                                 ("int4", "int4_w4a16", [0, 32])])
@pytest.mark.parametrize("tokens,local", [(9, 4), (9, 5), (9, 9), (9, 48), (1, 1), (64, 32), (9, 384)])
def test_kernel_config_rule_is_sglangs(tokens, local, weights, quant, block, tmp_path):
    from sglang.srt import runtime_context
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_default_config
    from sglang.srt.server_args import ServerArgs

    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
    state = runtime_context.snapshot_context()
    try:
        runtime_context.publish(ServerArgs(model_path=str(folder), skip_tokenizer_init=True, device="cpu"),
                                role="scheduler")
        config = get_default_config(tokens, local, 2048, 7168, 8, quant, False, block)
    finally:
        runtime_context.restore_context(state)
    assert sglang_default_config(tokens, local, weights) == \
        (config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"])


# ----------------------------------------------------------------------------- where the shape comes from

@pytest.mark.parametrize("name,experts,expected", [
    ("openai/gpt-oss-20b", 32, (2880, 2880, "bf16")),
    ("/models/gpt-oss-120b", 128, (2880, 2880, "bf16")),
    ("moonshotai/Kimi-K2-Instruct", 384, (7168, 2048, "fp8")),
    ("moonshotai/Kimi-K2-Thinking", 384, (7168, 2048, "int4")),
    ("SYNTHETIC kimi-k2-shaped", 384, (7168, 2048, "fp8")),
    ("deepseek-ai/DeepSeek-V3", 256, (7168, 2048, "fp8")),
    ("Qwen/Qwen3-30B-A3B", 128, (2048, 768, "bf16")),
    ("openai/gpt-oss-20b", 64, None),          # the name, but not its expert count
    ("my-moe", 32, None),
])
def test_known_models(name, experts, expected):
    shape = known_expert_shape(ModelSpec.all_moe(name, 4, experts, 4))
    assert (None if shape is None else (shape.hidden, shape.intermediate, shape.weights)) == expected
    if shape is not None and "gpt-oss" in name:
        assert shape.note == MXFP4_NOTE


def test_known_models_table_is_consistent():
    patterns = [k.pattern for k in KNOWN_MODELS]
    assert len(set(patterns)) == len(patterns) and GENERIC.weights == "bf16"
    for i, k in enumerate(KNOWN_MODELS):   # a specific pattern is never shadowed by a more general earlier one
        assert not any(p in k.pattern for p in patterns[:i]), k.pattern


# Fields copied from the published config.json files (the rest left out).
CONFIGS = {
    "gpt-oss-20b": ({"num_hidden_layers": 24, "num_local_experts": 32, "experts_per_token": 4, "hidden_size": 2880,
                     "intermediate_size": 2880, "quantization_config": {"quant_method": "mxfp4"}},
                    (2880, 2880, "bf16", MXFP4_NOTE)),
    "deepseek-v3": ({"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8, "hidden_size": 7168,
                     "intermediate_size": 18432, "moe_intermediate_size": 2048,
                     "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                    (7168, 2048, "fp8", "")),
    "kimi-k2-thinking": ({"num_hidden_layers": 61, "n_routed_experts": 384, "num_experts_per_tok": 8,
                          "hidden_size": 7168, "moe_intermediate_size": 2048, "quantization_config": {
                              "quant_method": "compressed-tensors", "config_groups": {"group_0": {
                                  "weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}},
                         (7168, 2048, "int4", "")),
    "qwen3-30b-a3b": ({"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048,
                       "intermediate_size": 6144, "moe_intermediate_size": 768, "torch_dtype": "bfloat16"},
                      (2048, 768, "bf16", "")),
    "mixtral-awq": ({"num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 4096,
                     "intermediate_size": 14336, "quantization_config": {"quant_method": "awq", "bits": 4}},
                    (4096, 14336, "int4", "")),
    "bnb": ({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
             "moe_intermediate_size": 32, "quantization_config": {"quant_method": "bitsandbytes"}},
            (64, 32, "bf16", "bitsandbytes quantisation is not measured: costed as bf16")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_expert_shape_from_config(name):
    config, expected = CONFIGS[name]
    shape = expert_shape_from_hf_config(config, name)
    assert (shape.hidden, shape.intermediate, shape.weights, shape.note) == expected


def test_config_without_expert_size_is_one_line():
    from moeplace.errors import FormatError
    with pytest.raises(FormatError, match="no expert size"):
        expert_shape_from_hf_config({"hidden_size": 64}, "x")
