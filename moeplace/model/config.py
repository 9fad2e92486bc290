"""Read a Hugging Face model folder's ``config.json`` into a :class:`ModelSpec`, without torch or SGLang.

The MoE layout is derived the way SGLang's model classes derive it, for the families moeplace targets:

- DeepSeek V2/V3, Kimi K2 (``n_routed_experts``): layer i is MoE when ``i >= first_k_dense_replace``
  and ``i % moe_layer_freq == 0``.
- Qwen2/Qwen3-MoE (``num_experts``): layer i is MoE unless it is in ``mlp_only_layers``, and only
  when ``(i + 1) % decoder_sparse_step == 0``.
- Mixtral, GPT-OSS (``num_local_experts``): every layer is MoE.

Multimodal wrappers keep the language model in ``text_config``; that is read when the top level
has no layer count.

The same file gives one expert's shape and weight format for the cost model
(``expert_shape_from_hf_config``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moeplace.errors import FormatError
from moeplace.model.expert_shape import ExpertShape, served_weights
from moeplace.model.spec import ModelSpec

# Keys naming the routed-expert count, in the order SGLang's model families use them.
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
# One routed expert's intermediate size: MoE-specific key first (DeepSeek, Qwen-MoE keep the dense MLP's
# size in intermediate_size), then the shared key (Mixtral, GPT-OSS).
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
INT4_METHODS = ("awq", "gptq", "awq_marlin", "gptq_marlin", "moe_wna16", "compressed-tensors")


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``folder/config.json`` as a dict; raise FormatError if it is missing, unreadable or not an object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FormatError(path, "no such file (--model / --model-path must be a local model folder)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(path, f"not valid JSON ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise FormatError(path, "not a JSON object")
    return config


def model_spec_from_folder(folder: str | os.PathLike) -> ModelSpec:
    """Read ``folder/config.json``; raise FormatError if it is missing, unreadable or not an MoE model."""
    path = Path(folder) / "config.json"
    return model_spec_from_hf_config(read_hf_config(folder), name=Path(folder).resolve().name, path=path)


def model_spec_from_hf_config(config: dict[str, Any], name: str = "model",
                              path: str | os.PathLike = "config.json") -> ModelSpec:
    """A Hugging Face config dict -> ModelSpec (layer layout, routed experts, top-k)."""
    config = _language_model(config)
    num_layers = _positive_int(config, "num_hidden_layers", path)
    expert_key, num_experts = _first_set(config, EXPERT_COUNT_KEYS, "not an MoE model", path)
    _, top_k = _first_set(config, TOP_K_KEYS, "no top-k", path)

    if expert_key == "n_routed_experts":
        first_dense = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        moe_layers = [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
    elif expert_key == "num_experts":
        step = int(config.get("decoder_sparse_step") or 1)
        dense_only = set(config.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0]
    else:
        moe_layers = list(range(num_layers))
    if not moe_layers:
        raise FormatError(path, "the config describes no MoE layer")
    return ModelSpec(name, num_layers, tuple(moe_layers), num_experts, top_k)


def expert_shape_from_hf_config(config: dict[str, Any], source: str,
                               path: str | os.PathLike = "config.json") -> ExpertShape:
    """One routed expert's hidden and intermediate sizes and the format SGLang's MoE kernel reads it in."""
    checkpoint, unmeasured = checkpoint_weights(config.get("quantization_config"))
    weights, upcast = served_weights(checkpoint)
    config = _language_model(config)
    hidden = _positive_int(config, "hidden_size", path)
    _, intermediate = _first_set(config, INTERMEDIATE_KEYS, "no expert size", path)
    return ExpertShape(hidden, intermediate, weights, source, unmeasured or upcast)


def checkpoint_weights(quant: Any) -> tuple[str, str]:
    """(weight format, note) of a checkpoint's experts from its ``quantization_config``.

    None: bf16. ``fp8``, ``mxfp4``; 4-bit ``awq``/``gptq``/``compressed-tensors``: int4. Anything
    else is costed as bf16, and the note says so.
    """
    if not isinstance(quant, dict):
        return "bf16", ""
    method = str(quant.get("quant_method", "")).lower()
    if method in ("fp8", "mxfp4"):
        return method, ""
    bits = quant.get("bits")
    if method == "compressed-tensors":
        groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
        if any(w.get("num_bits") == 8 and w.get("type") == "float" for w in groups):
            return "fp8", ""
        bits = next((w.get("num_bits") for w in groups), None)
    if bits == 4 and method in INT4_METHODS:
        return "int4", ""
    return "bf16", f"{method or 'unknown'} quantisation is not measured: costed as bf16"


def _language_model(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers keep the language model in ``text_config``; read it when the top level has
    no layer count."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def _first_set(config: dict[str, Any], keys: tuple[str, ...], missing: str,
               path: str | os.PathLike) -> tuple[str, int]:
    """(key, value) of the first of ``keys`` the config sets, a positive integer; else FormatError."""
    key = next((k for k in keys if config.get(k)), None)
    if key is None:
        raise FormatError(path, f"{missing}: none of {', '.join(keys)} is set")
    return key, _positive_int(config, key, path)


def _positive_int(config: dict[str, Any], key: str, path: str | os.PathLike) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FormatError(path, f"{key} must be a positive integer, got {value!r}")
    return value
