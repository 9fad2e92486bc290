"""Start SGLang with a moeplace placement: check it against the model and the SGLang flags, write
SGLang's ``--init-expert-location`` file, then exec ``python -m sglang.launch_server``.

Every mismatch is found here, before SGLang starts, and reported as one MoeplaceError line; SGLang
itself would only fail minutes later with an assert or a shape error deep in model loading.

What SGLang 0.5.23 does with the flags we read (``srt/arg_groups/fields/parallel.py``,
``fields/exec_.py``, ``arg_groups/overrides.py``):

- ``ep_size`` defaults to 1 when ``--ep-size`` is absent; an all-to-all backend that spans the EP
  group (deepep, mooncake, flashinfer, ...) overrides it with ``tp_size`` whatever was given.
- slots per layer P = routed experts + ``--ep-num-redundant-experts``; rank r owns slots
  ``[r*P/ep, (r+1)*P/ep)``; MoE tensor parallelism is ``tp_size // ep_size``.
- a placement made by ``optimize --ep-size`` records its split; launch adds ``--ep-size`` and
  ``--tp-size`` from it where the arguments leave them out.
- ``--init-expert-location`` is read as a file only when it ends in ``.json`` or ``.pt``; any other
  string is parsed as inline JSON.
- argparse accepts unique prefixes of long options (``--tp`` for ``--tp-size``).

No torch or SGLang import here: the check runs, and ``--dry-run`` works, without them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from moeplace.errors import MoeplaceError, PlacementError
from moeplace.files.outputs import check_outputs
from moeplace.files.placement import Placement, check_placement, load_placement, save_sglang
from moeplace.model.config import model_spec_from_folder
from moeplace.model.hf_resolve import model_name, resolve_model_dir
from moeplace.model.spec import ModelSpec

if TYPE_CHECKING:
    from moeplace.dispatch.by_cost import RuleWeights

# srt/arg_groups/overrides.py _A2A_EP_SPANNING_BACKENDS: these force ep_size = tp_size.
EP_SPANNING_A2A_BACKENDS = frozenset({
    "megamoe", "deepep", "deepep_v2", "mooncake", "nixl", "ascend_fuseep", "flashinfer",
    "flashinfer_megamoe", "mori", "pplx",
})

# SGLang option spellings (name and aliases, checked against SGLang's own parser in the tests).
_VALUE_OPTIONS: dict[str, str] = {
    "--model-path": "model_path", "--model": "model_path",
    "--tp-size": "tp_size", "--tensor-parallel-size": "tp_size", "--tp": "tp_size",
    "--ep-size": "ep_size", "--expert-parallel-size": "ep_size", "--ep": "ep_size",
    "--ep-num-redundant-experts": "ep_num_redundant_experts",
    "--nnodes": "nnodes",
    "--moe-a2a-backend": "moe_a2a_backend",
    "--init-expert-location": "init_expert_location",
    "--ep-dispatch-algorithm": "ep_dispatch_algorithm",
    "--revision": "revision",
}
_INT_FIELDS = {"tp_size", "ep_size", "ep_num_redundant_experts", "nnodes"}
# Shortest prefix argparse would still resolve to --init-expert-location (no other option starts so).
_INIT_LOCATION_MIN_PREFIX = "--init-exp"


@dataclass(frozen=True)
class SglangLayout:
    """The parts of an SGLang argument list that decide where experts live."""

    model_path: str | None = None
    tp_size: int = 1
    ep_size: int | None = None  # None: not given on the command line
    ep_num_redundant_experts: int = 0
    nnodes: int = 1
    moe_a2a_backend: str = "none"
    init_expert_location: str | None = None
    ep_dispatch_algorithm: str | None = None
    enable_eplb: bool = False
    revision: str | None = None
    given: frozenset[str] = frozenset()   # the fields the arguments set

    @property
    def effective_ep_size(self) -> int:
        """The ep_size SGLang will run with."""
        if self.moe_a2a_backend in EP_SPANNING_A2A_BACKENDS:
            return self.tp_size
        return self.ep_size if self.ep_size is not None else 1

    @property
    def dispatch_rule(self) -> str:
        """How SGLang picks among an expert's replicas with an initial placement: the flag's choice, else
        dynamic without an all-to-all backend and static with one (``parallel_hook.handle_eplb_and_dispatch``)."""
        if self.ep_dispatch_algorithm:
            return self.ep_dispatch_algorithm
        return "dynamic" if self.moe_a2a_backend == "none" else "static"

    def ep_size_reason(self) -> str:
        """Where effective_ep_size comes from, for error messages."""
        if self.moe_a2a_backend in EP_SPANNING_A2A_BACKENDS:
            return f"--moe-a2a-backend {self.moe_a2a_backend} sets ep_size to --tp-size {self.tp_size}"
        if self.ep_size is None:
            return "no --ep-size given: SGLang's default is 1"
        return f"--ep-size {self.ep_size}"


def parse_sglang_args(args: Sequence[str]) -> SglangLayout:
    """Read the placement-relevant flags from SGLang arguments (``--x v`` and ``--x=v``; last one wins)."""
    found: dict[str, object] = {}
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline = token.partition("=")
        if name == "--enable-eplb":
            found["enable_eplb"] = True
            i += 1
            continue
        field_name = _VALUE_OPTIONS.get(name)
        if field_name is None and len(name) >= len(_INIT_LOCATION_MIN_PREFIX) \
                and "--init-expert-location".startswith(name):
            field_name = "init_expert_location"
        if field_name is None:
            i += 1
            continue
        if eq:
            value, i = inline, i + 1
        elif i + 1 < len(args):
            value, i = args[i + 1], i + 2
        else:
            raise MoeplaceError(f"SGLang argument {name} needs a value")
        if field_name in _INT_FIELDS:
            try:
                found[field_name] = int(value)
            except ValueError:
                raise MoeplaceError(f"SGLang argument {name} needs an integer, got {value!r}") from None
            if found[field_name] < (0 if field_name == "ep_num_redundant_experts" else 1):
                raise MoeplaceError(f"SGLang argument {name} must be positive, got {value}")
        else:
            found[field_name] = value
    return SglangLayout(**found, given=frozenset(found))  # type: ignore[arg-type]


def fit_placement(p: Placement, spec: ModelSpec, layout: SglangLayout) -> Placement:
    """Check ``p`` against the model and SGLang's layout; return it re-homed on ``spec``.

    Raises PlacementError with one line naming the flag or file to fix.
    """
    ep = layout.effective_ep_size
    P = p.num_physical
    if layout.tp_size % ep:
        raise PlacementError(f"ep_size {ep} ({layout.ep_size_reason()}) must divide --tp-size {layout.tp_size}")
    if p.model.num_experts != spec.num_experts:
        raise PlacementError(f"placement has {p.model.num_experts} experts per layer, the model "
                             f"{spec.name!r} has {spec.num_experts} routed experts")
    if (p.model.num_hidden_layers, p.model.moe_layers) != (spec.num_hidden_layers, spec.moe_layers):
        raise PlacementError(f"placement covers {p.model.num_moe_layers} MoE layers of {p.model.num_hidden_layers}, "
                             f"the model {spec.name!r} has {spec.num_moe_layers} MoE layers of "
                             f"{spec.num_hidden_layers} (first MoE layer {spec.moe_layers[0]})")
    if p.ranks != ep:
        raise PlacementError(f"placement is for {p.ranks} ranks but SGLang will run with ep_size {ep} "
                             f"({layout.ep_size_reason()}); pass --ep-size {p.ranks} or re-optimize")
    expected = spec.num_experts + layout.ep_num_redundant_experts
    if P != expected:
        raise PlacementError(f"placement has {P} slots per layer, SGLang will allocate {spec.num_experts} experts + "
                             f"{layout.ep_num_redundant_experts} redundant = {expected}; pass "
                             f"--ep-num-redundant-experts {P - spec.num_experts}")
    if P % ep:
        raise PlacementError(f"{P} slots per layer do not split evenly over ep_size {ep}")
    if ep % layout.nnodes:
        raise PlacementError(f"ep_size {ep} is not a multiple of --nnodes {layout.nnodes}")
    if p.nodes != layout.nnodes:
        raise PlacementError(f"placement was optimized for {p.nodes} node(s), SGLang runs on --nnodes "
                             f"{layout.nnodes}; re-optimize with --nodes {layout.nnodes}")
    fitted = Placement(spec, p.ranks, p.phy2log, nodes=p.nodes, algorithm=p.algorithm, trace=p.trace,
                       metrics=p.metrics)
    check_placement(fitted)
    return fitted


def read_placement(path: str | os.PathLike, spec: ModelSpec, layout: SglangLayout) -> Placement:
    """Read a moeplace placement file or an SGLang map (.json/.pt); the latter borrows spec and ep size."""
    try:
        return load_placement(path)  # a moeplace file carries its own model and rank count
    except PlacementError:
        # An SGLang file carries neither; a bad moeplace file fails again below with the same problem.
        return load_placement(path, model=spec, ranks=layout.effective_ep_size, nodes=layout.nnodes)


@dataclass(frozen=True)
class LaunchPlan:
    """What ``moeplace launch`` will run: the checked placement, the file to write, the command, the
    environment it adds (``MOEPLACE_DISPATCH=balanced`` for a placement made for balanced dispatch),
    and what the user should know before it starts (one line each)."""

    placement: Placement
    sglang_file: Path
    command: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def shell(self) -> str:
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.command)])


def default_sglang_file(placement_path: str | os.PathLike) -> Path:
    """``dir/name.json`` -> ``dir/name.sglang.json`` (absolute)."""
    path = Path(placement_path).resolve()
    stem = path.name.removesuffix(path.suffix).removesuffix(".sglang")
    return path.with_name(stem + ".sglang.json")


def plan_launch(placement_path: str | os.PathLike, sglang_args: Sequence[str], model: str | None = None,
                sglang_file: str | os.PathLike | None = None, python: str | None = None) -> LaunchPlan:
    """Check everything and build the command; writes nothing."""
    layout = parse_sglang_args(sglang_args)
    if layout.init_expert_location is not None:
        raise MoeplaceError("the SGLang arguments already set --init-expert-location "
                            f"({layout.init_expert_location}); moeplace launch sets it from --placement")
    ref = model or layout.model_path
    if ref is None:
        raise MoeplaceError("no model: give --model (a folder or Hugging Face id) or --model-path in the SGLang "
                            "arguments")
    folder = resolve_model_dir(ref, revision=layout.revision or "main")
    spec = dataclasses.replace(model_spec_from_folder(folder), name=model_name(folder))
    target = Path(sglang_file).resolve() if sglang_file is not None else default_sglang_file(placement_path)
    if target.suffix != ".json":
        # SGLang reads a file only for .json/.pt names; anything else it parses as inline JSON.
        raise MoeplaceError(f"{target}: the SGLang placement file name must end in .json")
    check_outputs({"--sglang-out": target}, inputs={"--placement": placement_path, "--model": folder / "config.json"})
    read = read_placement(placement_path, spec, layout)
    added = split_flags(read, layout)
    layout_after = parse_sglang_args([*sglang_args, *added]) if added else layout
    online, eplb_flag = online_settings(layout_after)
    added += eplb_flag
    if added:
        sglang_args = [*sglang_args, *added]
        layout = parse_sglang_args(sglang_args)
    placement = fit_placement(read, spec, layout)
    command = [python or sys.executable, "-m", "sglang.launch_server", *sglang_args,
               "--init-expert-location", str(target)]
    warnings = [line for line in [dispatch_mismatch(placement, layout), cost_rule_note(placement),
                                  split_mismatch(placement, layout)] if line]
    env = {**dispatch_env(placement, sglang_args), **online}
    check_plugin_settings(env)
    return LaunchPlan(placement, target, command, env, warnings)


def online_settings(layout: SglangLayout) -> tuple[dict[str, str], list[str]]:
    """(environment, SGLang flags) for online re-placement: ``--enable-eplb`` makes moeplace SGLang's rebalancer
    (``moeplace.sglang.online``: its trigger and algorithm, SGLang's schedule and updater), so it turns
    MOEPLACE_ONLINE on; MOEPLACE_ONLINE at EP 2 or more needs ``--enable-eplb``, which is added. SGLang refuses
    ``--enable-eplb`` at EP 1, where MOEPLACE_ONLINE runs without it."""
    from moeplace.sglang.settings import SWITCH_OFF, SettingError, switch

    raw = os.environ.get("MOEPLACE_ONLINE", "").strip().lower()
    try:
        on = switch("MOEPLACE_ONLINE")
    except SettingError as e:
        raise MoeplaceError(f"{e} (SGLang's moeplace plugin would stop at start)") from None
    ep = layout.effective_ep_size
    if layout.enable_eplb:
        if raw and raw in SWITCH_OFF:
            raise MoeplaceError(f"--enable-eplb with MOEPLACE_ONLINE={raw}: SGLang's own rebalancer would replace the "
                                "placement with its token-balanced layout; unset MOEPLACE_ONLINE (moeplace then serves "
                                "as the rebalancer) or drop --enable-eplb")
        if ep < 2:
            raise MoeplaceError(f"--enable-eplb needs 2 or more EP ranks ({layout.ep_size_reason()}); at EP 1 "
                                "MOEPLACE_ONLINE=1 re-places online without it")
        return ({} if on else {"MOEPLACE_ONLINE": "1"}), []
    if on and ep >= 2:
        return {}, ["--enable-eplb"]
    return {}, []


def check_plugin_settings(added: Mapping[str, str]) -> None:
    """The plugin's settings in the environment SGLang will start with (this one plus ``added``), checked
    as the plugin checks them at start (``settings.check_settings``): a bad one is found now, not minutes later."""
    from moeplace.sglang.settings import SettingError, check_settings

    try:
        check_settings({**os.environ, **added})
    except SettingError as e:
        raise MoeplaceError(f"{e} (SGLang's moeplace plugin would stop at start)") from None


def split_flags(placement: Placement, layout: SglangLayout) -> list[str]:
    """The EP x TP split a placement was made for (``optimize --ep-size``) as the SGLang flags the arguments
    leave out: ``--ep-size`` (its EP groups) and ``--tp-size`` (its GPUs)."""
    split = placement.metrics.get("ep_split")
    if not isinstance(split, dict):
        return []
    flags = []
    if "ep_size" not in layout.given and layout.moe_a2a_backend not in EP_SPANNING_A2A_BACKENDS:
        flags += ["--ep-size", str(split["ep_size"])]
    if "tp_size" not in layout.given:
        flags += ["--tp-size", str(split["gpus"])]
    return flags


def split_mismatch(placement: Placement, layout: SglangLayout) -> str | None:
    """A line when SGLang's --tp-size gives the placement's EP groups another MoE TP than it was costed for."""
    split = placement.metrics.get("ep_split")
    if not isinstance(split, dict) or layout.tp_size == split["gpus"]:
        return None
    return (f"the placement was made for {split['ep_size']} EP groups x MoE TP {split['moe_tp']} on {split['gpus']} "
            f"GPUs; --tp-size {layout.tp_size} runs MoE TP {layout.tp_size // layout.effective_ep_size} (the placement "
            f"fits, its costs were for the other split)")


def dispatch_mismatch(placement: Placement, layout: SglangLayout) -> str | None:
    """A line when the placement's replicas were placed for another SGLang rule than the one SGLang will
    run (a placement without spare slots, or made for balanced dispatch, runs the same under any)."""
    made_for = placement.metrics.get("dispatch")
    if placement.num_redundant == 0 or made_for not in ("dynamic", "static") or made_for == layout.dispatch_rule:
        return None
    why = (f"--ep-dispatch-algorithm {layout.ep_dispatch_algorithm}" if layout.ep_dispatch_algorithm
           else f"--moe-a2a-backend {layout.moe_a2a_backend}")
    return (f"the placement's spare slots were placed for SGLang's {made_for} replica choice, but SGLang will use "
            f"{layout.dispatch_rule} ({why}); re-optimize with --dispatch {layout.dispatch_rule}"
            + (" or pass --ep-dispatch-algorithm dynamic" if made_for == "dynamic" else ""))


def cost_rule_weights(placement: Placement) -> RuleWeights | None:
    """The rule by cost's integer weights under the cost model the placement was made with
    (``dispatch.by_cost.rule_weights``, row blocks included where the model has them; None when only reads cost:
    the rule by cost is then the balanced rule). Raises MoeplaceError (one line) when the placement carries no
    usable cost model."""
    from moeplace.cost.model import CostModel
    from moeplace.dispatch.by_cost import rule_weights

    model = placement.metrics.get("cost_model")
    try:
        a, b = float(model["a_us_per_expert"]), float(model["b_us_per_token"])
        r, block_m = float(model.get("r_us_per_block", 0.0)), model.get("block_m", 0)
    except (AttributeError, KeyError, TypeError, ValueError):
        raise MoeplaceError("the placement was made for moeplace's cost rule but records no cost model (a_us_per_expert, "
                            "b_us_per_token); re-optimize it with --dispatch cost") from None
    if not all(0 <= v < float("inf") for v in (a, b, r)) or isinstance(block_m, bool) or not isinstance(block_m, int) \
            or block_m < 0 or block_m & (block_m - 1) or (r > 0 and block_m == 0):
        raise MoeplaceError(f"the placement's cost model has a_us_per_expert {a:g}, b_us_per_token {b:g}, "
                            f"r_us_per_block {r:g}, block_m {block_m!r}: the coefficients must be finite and "
                            "non-negative, block_m a power of two (rows) where r_us_per_block > 0")
    return rule_weights(CostModel(a, b, 0.0, r_us_per_block=r, block_m=block_m))


def cost_rule_note(placement: Placement) -> str | None:
    """A line for a placement made for the cost rule whose cost model makes tokens free (the balanced rule runs)."""
    if placement.metrics.get("dispatch") != "cost" or placement.num_redundant == 0 or cost_rule_weights(placement):
        return None
    return ("the placement was made for moeplace's cost rule under a cost model with no token or row-block term; "
            "the SGLang plugin runs the balanced rule, which is the rule by cost there")


def dispatch_env(placement: Placement, sglang_args: Sequence[str]) -> dict[str, str]:
    """The plugin's rule for a placement whose spare slots were placed for moeplace's dispatch:
    ``MOEPLACE_DISPATCH=balanced``, or for the rule by cost ``MOEPLACE_DISPATCH=cost`` with the rule's weights
    from the placement's cost model: ``MOEPLACE_DISPATCH_Q`` where only reads and pairs cost, else
    ``MOEPLACE_DISPATCH_WEIGHTS`` (every rank must see the same router ids: no DP attention). Either one already
    in the environment is kept."""
    made_for = placement.metrics.get("dispatch")
    if made_for not in ("balanced", "cost") or placement.num_redundant == 0:
        return {}
    weights = cost_rule_weights(placement) if made_for == "cost" else None
    rule = "cost" if weights else "balanced"
    what = "moeplace's rule by cost" if made_for == "cost" else "balanced dispatch"
    if any(a == "--enable-dp-attention" or a.startswith("--enable-dp-attention=") for a in sglang_args):
        raise MoeplaceError(f"the placement was made for {what}, which needs every rank to see the same "
                            "router ids: drop --enable-dp-attention (attention in tensor parallel)")
    chosen = os.environ.get("MOEPLACE_DISPATCH", "").strip()
    if chosen and chosen != rule:
        raise MoeplaceError(f"the placement was made for {what} but MOEPLACE_DISPATCH={chosen!r}; "
                            f"unset it or set it to {rule}")
    if rule == "balanced":
        return {"MOEPLACE_DISPATCH": "balanced"}
    for name in ("MOEPLACE_DISPATCH_Q", "MOEPLACE_DISPATCH_WEIGHTS"):   # the user's own choice
        if os.environ.get(name, "").strip():
            return {"MOEPLACE_DISPATCH": "cost", name: os.environ[name].strip()}
    if (weights.pair, weights.block) == (1, 0):
        return {"MOEPLACE_DISPATCH": "cost", "MOEPLACE_DISPATCH_Q": str(weights.read)}
    return {"MOEPLACE_DISPATCH": "cost",
            "MOEPLACE_DISPATCH_WEIGHTS": f"{weights.read},{weights.pair},{weights.block},{weights.block_m}"}


def require_sglang(python: str) -> None:
    """Raise MoeplaceError (one line) unless ``python -m sglang.launch_server`` can find SGLang.

    Asks ``python`` itself (it may not be this interpreter); locating the package imports nothing.
    """
    probe = ("import importlib.util, sys\n"
             "try:\n    spec = importlib.util.find_spec('sglang')\nexcept (ImportError, ValueError):\n    spec = None\n"
             "sys.exit(0 if spec is not None else 3)")
    try:
        result = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MoeplaceError(f"cannot run {python} ({e})") from None
    if result.returncode == 3:
        raise MoeplaceError(f"SGLang is not installed for {python}: pip install 'moeplace[sglang]' (SGLang 0.5.23)")
    if result.returncode:
        said = " ".join(result.stderr.decode(errors="replace").split())
        raise MoeplaceError(f"{python} failed to start: {said[-200:]}")


def exec_sglang(plan: LaunchPlan) -> None:
    """Write the SGLang file, then replace this process by SGLang; never returns.

    Call ``require_sglang(plan.command[0])`` first: once exec'd, a missing SGLang is SGLang's to report.
    """
    save_sglang(plan.sglang_file, plan.placement)
    sys.stdout.flush()
    sys.stderr.flush()
    # exec, not a child: signals, exit code and the terminal belong to SGLang directly.
    os.execve(plan.command[0], plan.command, {**os.environ, **plan.env})
