"""Which cost model a command uses: ``--cost-model FILE``, else one derived for the model's experts.

The experts' shape comes from ``--model`` (a model folder, its config.json, or a Hugging Face id in
the local cache), else from the trace's model name when it is a known model, else a generic default
with a one-line warning. The same shape says what the experts weigh on a GPU (``slot_gb``) and when
they, spare slots included, outgrow it (``memory_warning``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click
import numpy as np

from moeplace.cost.cost_set import CostSet, load_cost_file
from moeplace.cost.derive import STEP_TOKENS, Calibration, derive_cost_model
from moeplace.cost.gpus import Gpu, model_token, resolve_gpu
from moeplace.cost.model import CostModel
from moeplace.errors import MoeplaceError
from moeplace.model.expert_shape import GENERIC, ExpertShape, known_expert_shape
from moeplace.model.spec import ModelSpec

if TYPE_CHECKING:
    from moeplace.analysis.layouts import Layout
    from moeplace.trace.load import Trace


@dataclass(frozen=True)
class Costing:
    """How a command costs a rank: a fixed model from a file, or one derived from ``shape`` on ``gpu``'s packaged
    measurements or on a cost set's (``calibration``).

    top_k: the model's experts per token (SGLang's launch grid follows the step's tokens x top-k).
    """

    shape: ExpertShape
    top_k: int
    fixed: CostModel | None = None
    gpu: Gpu = field(default_factory=lambda: resolve_gpu(None))
    calibration: Calibration | None = None

    @classmethod
    def from_set(cls, shape: ExpertShape, top_k: int, cost_set: CostSet) -> Costing:
        """Every rank derived from a cost set's lines, on its GPU and that GPU's memory."""
        return cls(shape, top_k, None, Gpu(cost_set.gpu, cost_set.gpu, cost_set.gpu_memory_gb),
                   cost_set.calibration)

    def derive(self, shape: ExpertShape, local_slots: int, step_tokens: int, config_tokens: int | None) -> CostModel:
        """A GPU holding ``local_slots`` slots of ``shape``, on this costing's GPU or cost set."""
        return derive_cost_model(shape, local_slots, self.top_k, self.gpu.measured, step_tokens, config_tokens,
                                 self.calibration)

    def ep(self, local_slots: int, step_tokens: int = STEP_TOKENS, config_tokens: int | None = None) -> CostModel:
        """A rank holding ``local_slots`` expert slots (EP), for steps of ``step_tokens`` tokens
        (``derive_cost_model`` says what ``config_tokens`` holds)."""
        if self.fixed is not None:
            return self.fixed
        return self.derive(self.shape, local_slots, step_tokens, config_tokens)

    def group(self, local_slots: int, moe_tp: int, step_tokens: int = STEP_TOKENS,
              config_tokens: int | None = None) -> CostModel:
        """One GPU of an EP group with MoE TP ``moe_tp`` inside (``moeplace.analysis.layouts``): ``local_slots``
        slots, each 1/moe_tp of an expert (a --cost-model file stands for whole experts only)."""
        if moe_tp == 1:
            return self.ep(local_slots, step_tokens, config_tokens)
        return self.tp(moe_tp, local_slots, step_tokens, config_tokens)

    def layout(self, layout: Layout, num_experts: int, step_tokens: int = STEP_TOKENS) -> CostModel:
        """One GPU of ``layout`` (``moeplace.analysis.layouts``) for steps of ``step_tokens`` tokens: SGLang's kernel
        config and launch grid for that step on that GPU's slots."""
        return self.group(layout.local_slots(num_experts), layout.moe_tp, step_tokens)

    def tp(self, ranks: int, experts: int, step_tokens: int = STEP_TOKENS,
           config_tokens: int | None = None) -> CostModel:
        """A rank holding 1/ranks of every one of ``experts`` experts (TP-MoE), for steps of ``step_tokens``."""
        return self.derive(self.shape.tp_slice(ranks), experts, step_tokens, config_tokens)


def trace_batch(src: Trace, mode: str) -> int:
    """The trace's tokens per step (the median over its steps of ``mode``; a verify step's 9 where it has
    none): the batch SGLang's kernel config is chosen for (``moeplace.cost.derive``). Reads no ids."""
    tokens = src.step_tokens(mode)
    return max(1, int(np.median(tokens))) if tokens.size else STEP_TOKENS


def expert_shape_from_model_ref(model_ref: str, model: ModelSpec) -> ExpertShape:
    """The expert shape in ``model_ref``'s config.json; refuse a config for another expert count."""
    from moeplace.model.hf_resolve import resolve_model_dir
    from moeplace.model.config import expert_shape_from_hf_config, model_spec_from_hf_config, read_hf_config

    folder = resolve_model_dir(model_ref)
    config = read_hf_config(folder)
    path = folder / "config.json"
    spec = model_spec_from_hf_config(config, path=path)
    if spec.num_experts != model.num_experts:
        raise MoeplaceError(f"--model {model_ref}: its config has {spec.num_experts} routed experts, the trace "
                            f"{model.num_experts}")
    return expert_shape_from_hf_config(config, f"--model {model_ref}", path)


def slot_gb(model: ModelSpec, costing: Costing, moe_tp: int = 1) -> float:
    """GB (1e9 bytes) of expert weights one slot per EP rank puts on each of its GPUs: one expert in every
    MoE layer, split over the ``moe_tp`` GPUs of the rank's group."""
    return model.num_moe_layers * costing.shape.bytes / moe_tp / 1e9


def experts_gb(model: ModelSpec, ranks: int, redundant: int, costing: Costing, moe_tp: int = 1) -> float:
    """GB of routed expert weights per GPU with ``redundant`` spare slots over ``ranks`` EP ranks (groups of
    ``moe_tp`` GPUs): the same for every EP x TP split of the same GPUs."""
    return (model.num_experts + redundant) / ranks * slot_gb(model, costing, moe_tp)


def spares_that_fit(model: ModelSpec, ranks: int, wanted: int, costing: Costing) -> int:
    """The most spare slots, a multiple of ``ranks`` and at most ``wanted``, that ``memory_warning`` lets the GPU
    load beside the experts (0 where none fits); ``wanted`` where the expert shape or the GPU is not known."""
    if costing.fixed is not None or costing.shape is GENERIC:
        return wanted
    room = costing.gpu.memory_gb / slot_gb(model, costing) * ranks - model.num_experts
    spares = max(0, min(wanted, int(room) // ranks * ranks))
    while spares and memory_warning(model, ranks, spares, costing):   # the same test, to the last bit
        spares -= ranks
    return spares


def memory_warning(model: ModelSpec, ranks: int, redundant: int, costing: Costing, moe_tp: int = 1,
                   fewer: str = "fewer (--replica-memory GB per GPU)") -> str | None:
    """A line where the routed experts alone, spare slots included, outgrow the memory of the GPU the
    cost model is for (so SGLang could not even load them); None where they fit, or where the expert
    shape or the GPU is not known (a generic shape, a --cost-model file). fewer: how to ask for fewer."""
    if costing.fixed is not None or costing.shape is GENERIC or not redundant:
        return None
    need, base = experts_gb(model, ranks, redundant, costing, moe_tp), experts_gb(model, ranks, 0, costing, moe_tp)
    have = costing.gpu.memory_gb
    if need <= have:
        return None
    return (f"the routed experts alone take {need:.1f} GB per GPU with the {redundant} spare slots ({base:.1f} GB "
            f"without), more than an {costing.gpu.name}'s {have:.1f} GB: SGLang could not load them; ask for {fewer} "
            f"or place over more GPUs")


def resolve_costing(model: ModelSpec, cost_model_path: str | None, model_ref: str | None,
                    derived_needed: bool | None = None, gpu_name: str | None = None) -> Costing:
    """The command's costing; warns once on stderr when a derived model has to use the generic shape, another
    GPU's measurements, or a cost set measured for another model's experts.

    derived_needed: whether the command derives any cost (default: when no --cost-model is given).
    gpu_name: ``--gpu`` (a cost set names its own GPU; a one-line error where the two differ).
    """
    loaded = load_cost_file(cost_model_path) if cost_model_path else None
    fixed = loaded if isinstance(loaded, CostModel) else None
    cost_set = loaded if isinstance(loaded, CostSet) else None
    derived_needed = fixed is None if derived_needed is None else derived_needed
    if model_ref:
        shape = expert_shape_from_model_ref(model_ref, model)
    else:
        shape = known_expert_shape(model) or (cost_set and set_shape(cost_set, model)) or GENERIC
        if shape is GENERIC and derived_needed:
            click.echo(f"warning: the expert shape of model {model.name!r} is unknown (pass --model with its "
                       f"config.json, or --cost-model FILE); MoE µs use a {GENERIC.describe()}", err=True)
    if cost_set is None:
        gpu = resolve_gpu(gpu_name)
        if gpu.warning and derived_needed:
            click.echo(gpu.warning, err=True)
        return Costing(shape, model.top_k, fixed, gpu)
    if gpu_name is not None and model_token(gpu_name) != model_token(cost_set.gpu):
        raise MoeplaceError(f"--gpu {gpu_name}: the cost set {cost_model_path} was measured on {cost_set.gpu}; "
                            f"give one of them")
    theirs = cost_set.model
    if (theirs["hidden"], theirs["intermediate"], theirs["weights"]) != \
            (shape.hidden, shape.intermediate, shape.weights):
        click.echo(f"warning: the cost set {cost_model_path} was measured for {theirs['name']}'s experts "
                   f"({theirs['hidden']}x{theirs['intermediate']} {theirs['weights']}), this model's are "
                   f"{shape.hidden}x{shape.intermediate} {shape.weights}: their cost is derived from its terms "
                   f"(calibrate with this model's --model for its own lines)", err=True)
    return Costing.from_set(shape, model.top_k, cost_set)


def set_shape(cost_set: CostSet, model: ModelSpec) -> ExpertShape | None:
    """The expert shape a cost set was measured for, where it is this model's (same routed experts and top-k)."""
    m = cost_set.model
    if (m["experts"], m["top_k"]) != (model.num_experts, model.top_k):
        return None
    return ExpertShape(m["hidden"], m["intermediate"], m["weights"], f"cost set {cost_set.path} ({m['name']})")


def cost_model_line(models: dict[str, CostModel]) -> str:
    """'cost model: ...' for a table; one line per distinct model when placements differ in slots."""
    groups: dict[str, list[str]] = {}
    for name, m in models.items():
        groups.setdefault(m.describe(), []).append(name)
    if len(groups) == 1:
        return f"cost model (MoE µs/step): {next(iter(groups))}"
    return "\n".join(f"cost model for {', '.join(names)}: {what}" for what, names in groups.items())
