"""Online re-placement inside a running SGLang server (``MOEPLACE_ONLINE=1``): the placement kept fresh, no restart.

Dimension letters: H hidden layers, L MoE layers, P physical slots.

What runs where
---------------
* Window: the router tracer (``moeplace.sglang.tracer``, on without shards unless ``MOEPLACE_TRACE`` is set too)
  keeps the last ``MOEPLACE_ONLINE_WINDOW`` decode and verify passes on the host in logical ids
  (``trace.window.PassWindow``), filled by its drain thread off the serving path.
* Decision: a worker thread hands the window and the map in force to the decider process
  (``moeplace.sglang.decider``, which runs ``analysis.replace.decide``: fitted and refined candidates scored out
  of fold, moves counted) and takes its answer. The scheduler's thread never waits for it.
* Apply: between passes, on the scheduler's thread, a chunk of ``MOEPLACE_ONLINE_CHUNK`` layers per pass through
  SGLang's own ``ExpertLocationUpdater`` (weights copied in place, so CUDA graphs stay valid; its metadata
  update writes the maps in place); the balanced and cost dispatch kernel's tables are refreshed in place after
  each chunk (``balanced_dispatch.refresh``), and the tracer labels every pass with the map it ran under.

Who drives it
-------------
* EP 1 (one GPU; SGLang refuses ``--enable-eplb`` there): the tracer's pass hook calls ``Replacer.on_pass_end``;
  every ``MOEPLACE_ONLINE_PERIOD`` passes a decision starts, and a re-placement it asks for is applied from the
  next pass on.
* EP 2 or more: SGLang's rebalancer (``--enable-eplb``) keeps its schedule (``--eplb-rebalance-num-iterations``,
  ``--eplb-rebalance-layers-per-chunk``) and its updater; moeplace replaces its ``rebalance`` (trigger and
  algorithm): at each of SGLang's rebalance points rank 0's latest decision is broadcast to every rank
  (``torch.distributed``), applied by every rank on the same passes, and the next decision starts. A server at EP
  2 or more with ``MOEPLACE_ONLINE`` and without ``--enable-eplb`` stops at start with one line.

What an operator sees and controls (``MOEPLACE_ONLINE_DIR``)
------------------------------------------------------------
* ``status-r{rank}.json``: the last decision (``Decision.to_json``), the totals, the window's size;
* one log line per re-placement: gain, moved replicas and bytes, the stall it took;
* ``moeplace online request DIR`` writes ``request-{id}.json`` (decide now, a dry run, or apply a given
  placement); the worker answers in ``response-{id}.json``;
* with SGLang's ``--enable-metrics``, gauges on its ``/metrics`` (``METRICS``).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from moeplace.analysis.replace import MIN_GAIN, ReplaceConfig
from moeplace.files.atomic import atomic_write_text
from moeplace.sglang.tracer import check_writable, env_number

logger = logging.getLogger("moeplace.online")

DEFAULT_DIR = "moeplace-online"
# variable -> (default, type, largest value taken)
NUMBERS: dict[str, tuple[float, type, float]] = {
    "MOEPLACE_ONLINE_WINDOW": (1000, int, 1 << 20),
    "MOEPLACE_ONLINE_PERIOD": (1000, int, 1 << 30),
    "MOEPLACE_ONLINE_CHUNK": (4, int, 4096),
    "MOEPLACE_ONLINE_HORIZON": (10_000, int, 1 << 40),
    "MOEPLACE_ONLINE_MOVE_GBPS": (50.0, float, 1e6),
    "MOEPLACE_ONLINE_MIN_GAIN": (MIN_GAIN, float, 0.999),
}
REQUEST_KINDS = ("decide", "dry-run", "apply")
STATUS_SECONDS = 5.0   # the status file is written after every decision and re-placement, and this often between
METRICS = {   # name -> what it shows
    "moeplace:window_e_max_distinct": "E[max distinct] of the map in force on the window, out of fold (last decision)",
    "moeplace:replace_gain": "share of E[max distinct] re-placing would remove, out of fold (last decision)",
    "moeplace:replacements": "re-placements applied since start",
    "moeplace:moved_replicas": "expert replicas copied by re-placements since start",
    "moeplace:moved_bytes": "bytes of expert weights copied by re-placements since start",
}


@dataclass(frozen=True)
class OnlineConfig:
    """The ``MOEPLACE_ONLINE_*`` settings (``from_env``); ``replace`` carries the decision's own."""

    window: int = 1000
    period: int = 1000
    chunk: int = 4
    folder: Path = Path(DEFAULT_DIR)
    replace: ReplaceConfig = field(default_factory=ReplaceConfig)
    poll_seconds: float = 0.5

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OnlineConfig":
        """The variables in ``env`` (default: this process's); ValueError names the first bad one."""
        env = os.environ if env is None else env
        value = {name: env_number(name, default, kind, env, top, from_zero=name == "MOEPLACE_ONLINE_MIN_GAIN")
                 for name, (default, kind, top) in NUMBERS.items()}
        folder = (env.get("MOEPLACE_ONLINE_DIR", "").strip() or env.get("MOEPLACE_TRACE_DIR", "").strip()
                  or DEFAULT_DIR)
        decision = ReplaceConfig(min_gain=value["MOEPLACE_ONLINE_MIN_GAIN"],
                                 horizon=value["MOEPLACE_ONLINE_HORIZON"],
                                 move_gbps=value["MOEPLACE_ONLINE_MOVE_GBPS"])
        return cls(value["MOEPLACE_ONLINE_WINDOW"], value["MOEPLACE_ONLINE_PERIOD"], value["MOEPLACE_ONLINE_CHUNK"],
                   Path(folder), decision)


def check_env(env: Mapping[str, str]) -> None:
    """Every ``MOEPLACE_ONLINE_*`` value in ``env`` (ValueError names the first bad one); the control folder must be
    one the server can write."""
    folder = OnlineConfig.from_env(env).folder
    check_writable("MOEPLACE_ONLINE_DIR", str(folder))


@dataclass(frozen=True)
class Served:
    """What the decision needs to know of the running server (read once, at its first pass)."""

    model: Any               # ModelSpec
    moe_layers: tuple[int, ...]
    ranks: int               # EP size
    nodes: int
    rank: int                # this process's rank in the world group
    ep_rank: int
    dispatch: str            # the rule among replicas the server runs
    cost_model: Any          # CostModel of one rank
    replica_bytes: float     # one expert of one layer


class Replacer:
    """Online re-placement's state in one scheduler process (module docstring)."""

    def __init__(self, config: OnlineConfig, tracer: Any, refresh: Callable[[], None] = lambda: None) -> None:
        self.config, self.tracer, self.refresh = config, tracer, refresh
        self.served: Served | None = None
        self.passes = 0
        self.replacements = 0
        self.moved_replicas = 0
        self.moved_bytes = 0.0
        self.last: dict | None = None              # the last decision's JSON
        self.ready: tuple[dict, Any] | None = None   # (decision JSON, target [L, P]) waiting to be applied
        self.applying: Iterator[None] | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._busy = threading.Event()             # a job is queued or running
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._decider: subprocess.Popen | None = None
        self._gauges: dict[str, Any] | None = None
        self._closed = False

    # ------------------------------------------------------------------ scheduler thread

    def on_pass_end(self, runner: Any) -> None:
        """EP 1's driver, after every pass: apply a chunk of a re-placement in progress, start one that is ready,
        and every ``period`` passes ask for a decision."""
        if not self._started(runner.model_config) or self.served.ranks > 1:   # SGLang's rebalancer drives EP 2+
            return
        self.passes += 1
        if self.applying is not None:
            self._step_apply()
            return
        ready = self._take_ready()
        if ready is not None:
            self.applying = self._apply(runner, *ready)
            self._step_apply()
            return
        if self.passes % self.config.period == 0:
            self.ask("decide")

    def _step_apply(self) -> None:
        try:
            next(self.applying)
        except StopIteration:
            self.applying = None

    def _started(self, model_config: Any) -> bool:
        """Read the server once its MoE layers are known (SGLang's ``ModelConfig``); start the worker thread."""
        if self.served is not None:
            return True
        if getattr(self.tracer, "_moe_layers", None) is None or self.tracer.window is None:
            return False
        self.served = describe_server(model_config, self.tracer)
        self.config = replace(self.config, replace=replace(self.config.replace,
                                                           replica_bytes=self.served.replica_bytes))
        try:
            self.config.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning("moeplace online: cannot write to %s (%s): no status or requests", self.config.folder, e)
        self._write_status()   # also tells `moeplace online request` a server answers here
        self._thread = threading.Thread(target=self._work_loop, name="moeplace-online", daemon=True)
        self._thread.start()
        logger.info("moeplace online re-placement on: a decision every %d passes on the last %d decode and verify "
                    "passes, rule %s, control and status in %s", self.config.period, self.config.window,
                    self.served.dispatch, self.config.folder)
        return True

    def ask(self, kind: str, request_id: str | None = None, placement: Any = None) -> bool:
        """Queue a decision (``decide``, ``dry-run``) or the apply of ``placement`` ([L, P]); False while one is
        queued or running already (periodic asks are skipped, never piled up)."""
        if request_id is None and self._busy.is_set():
            return False
        self._busy.set()
        self._jobs.put((kind, request_id, placement))
        return True

    def _take_ready(self) -> tuple[dict, Any] | None:
        with self._lock:
            ready, self.ready = self.ready, None
        return ready

    def current_map(self) -> np.ndarray:
        """[H, P] the map in force (SGLang's metadata, updated in place by its updater)."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        return get_global_expert_location_metadata().physical_to_logical_map_cpu.numpy().copy()

    def _apply(self, runner: Any, decision: dict, target: np.ndarray) -> Iterator[None]:
        """EP 1: move to ``target [L, P]``, ``MOEPLACE_ONLINE_CHUNK`` layers a pass, through SGLang's updater."""
        from sglang.srt.runtime_context import get_parallel

        full = self.current_map()
        new = full.copy()
        new[list(self.served.moe_layers)] = target
        layers, size = list(self.served.moe_layers), self.config.chunk
        weights = runner.model.routed_experts_weights_of_layer

        def update(metadata: Any, chunk: list[int]) -> None:
            runner.expert_location_updater.update(weights, metadata, update_layer_ids=chunk,
                                                  nnodes=get_parallel().nnodes, rank=get_parallel().tp_rank)

        yield from self._move(runner.model_config, full, new,
                              [layers[i:i + size] for i in range(0, len(layers), size)], update, decision)

    def _move(self, model_config: Any, full: np.ndarray, new: np.ndarray, chunks: list[list[int]],
              update: Callable[[Any, list[int]], None], decision: dict) -> Iterator[None]:
        """From the map ``full`` to ``new`` ([H, P]) a chunk of layers per pass (``chunks``, the layers that change
        only): SGLang's metadata of ``new`` built once, ``update(metadata, chunk)`` (SGLang's updater, which also
        writes the map in place), the dispatch tables refreshed; the stall timed, then logged and counted."""
        import torch
        from sglang.srt.eplb.expert_location import ExpertLocationMetadata

        chunks = [layers for layers in ([layer for layer in chunk if (full[layer] != new[layer]).any()]
                                        for chunk in chunks) if layers]
        if not chunks:
            return
        began = _synchronized_clock()
        metadata = ExpertLocationMetadata.init_by_mapping(model_config, torch.from_numpy(new),
                                                          moe_ep_rank=self.served.ep_rank)
        stall = 0.0
        for i, chunk in enumerate(chunks):
            if i:
                yield
                began = _synchronized_clock()
            update(metadata, chunk)
            self.refresh()
            stall += _synchronized_clock() - began
        self._applied(full, new, stall, decision)

    def _applied(self, old: np.ndarray, new: np.ndarray, stall: float, decision: dict) -> None:
        """Count a re-placement and say it in one log line."""
        moved = int((old != new).sum())
        moved_bytes = moved * self.config.replace.replica_bytes
        self.replacements += 1
        self.moved_replicas += moved
        self.moved_bytes += moved_bytes
        logger.info("moeplace online: re-placed %d layers, %.1f%% to gain out of fold, moved %d expert replicas "
                    "(%.2f GB), stall %.1f ms over the passes it took", int((old != new).any(axis=1).sum()),
                    100 * float(decision.get("gain", 0.0)), moved, moved_bytes / 1e9, 1e3 * stall)
        self._update_metrics()
        self._write_status()

    # ------------------------------------------------------------------ EP 2 or more: SGLang's rebalancer

    def rebalance(self, manager: Any) -> Iterator[None]:
        """REPLACE of SGLang's ``EPLBManager.rebalance`` (a generator it advances between passes): rank 0's latest
        decision to every rank, applied a chunk at a time through SGLang's ``update_expert_location_with_recovery``;
        then the next decision starts."""
        import torch
        import torch.distributed as dist
        from sglang.srt.eplb.eplb_manager import update_expert_location_with_recovery
        from sglang.srt.model_executor.model_runner_components.moe_ep_setup import init_lplb_solvers
        from sglang.srt.runtime_context import get_exec, get_parallel

        model = manager._get_model()
        if not self._started(manager._model_config):
            return
        full = self.current_map()
        ready = self._take_ready() if self.served.rank == 0 else None
        message = np.zeros(1 + full.size, np.int64)
        if ready is not None:
            new = full.copy()
            new[list(self.served.moe_layers)] = ready[1]
            message[0], message[1:] = 1, new.ravel()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        shared = torch.from_numpy(message).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(shared, src=0)
        if self.served.rank == 0:
            self.ask("decide")
        message = shared.cpu().numpy()
        if not message[0]:
            return
        new = message[1:].reshape(full.shape)

        def update(metadata: Any, chunk: list[int]) -> None:
            update_expert_location_with_recovery(
                expert_location_updater=manager._get_expert_location_updater(), model=model,
                new_expert_location_metadata=metadata, update_layer_ids=chunk, tp_rank=get_parallel().tp_rank,
                expert_backup_client=manager._get_expert_backup_client(),
                update_weights_from_disk_callable=getattr(manager._get_weight_updater(), "update_weights_from_disk",
                                                          None),
                ep_dispatch_algorithm=get_exec().moe.ep_dispatch_algorithm,
                init_lplb_solvers_callable=lambda: init_lplb_solvers(model_config=manager._model_config))

        yield from self._move(manager._model_config, full, new, manager._compute_update_layer_ids_chunks(), update,
                              ready[0] if ready is not None else {"gain": float("nan")})

    # ------------------------------------------------------------------ worker thread

    def _work_loop(self) -> None:
        """Decisions and requests, one at a time; polls the control folder while idle."""
        written = time.monotonic()
        while not self._closed:
            try:
                kind, request_id, placement = self._jobs.get(timeout=self.config.poll_seconds)
            except queue.Empty:
                self._poll_requests()
                if time.monotonic() - written > STATUS_SECONDS:   # the window's size and the pass count, kept fresh
                    self._write_status()
                    written = time.monotonic()
                continue
            try:
                self._job(kind, request_id, placement)
            except Exception as e:  # noqa: BLE001 (online re-placement must never take the server down)
                logger.exception("moeplace online: %s failed", kind)
                self._respond(request_id, {"error": f"{type(e).__name__}: {e}"})
            finally:
                if self._jobs.empty():
                    self._busy.clear()

    def _job(self, kind: str, request_id: str | None, placement: Any) -> None:
        if kind == "apply":
            with self._lock:
                self.ready = ({"gain": 0.0, "line": "applied on request"}, placement)
            self._respond(request_id, {"line": "the placement is applied from the next pass", "replace": True})
            return
        steps = self.tracer.window.steps()
        decision = self.decide(steps)
        self.last = decision["decision"]
        self._update_metrics()
        self._write_status()
        if kind == "decide" and decision["target"] is not None:
            with self._lock:
                self.ready = (decision["decision"], decision["target"])
        if "error" not in decision:
            logger.info("moeplace online%s: %s", " (dry run)" if kind == "dry-run" else "", self.last["line"])
        self._respond(request_id, decision["decision"])

    def decide(self, steps: Any) -> dict:
        """The decider process's answer for ``steps`` (the window) and the map in force."""
        from moeplace.files.placement import Placement
        from moeplace.sglang.decider import encode_request, read_message, write_message

        served = self.served
        current = Placement(served.model, served.ranks, self.current_map()[list(served.moe_layers)],
                            nodes=served.nodes)
        request = encode_request(steps, current, served.dispatch, served.cost_model, self.config.replace)
        proc = self._decider_process()
        write_message(proc.stdin, request)
        reply = read_message(proc.stdout)
        if reply is None:
            self._decider = None
            raise RuntimeError(f"the decider process ended (exit code {proc.poll()})")
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def _decider_process(self) -> subprocess.Popen:
        if self._decider is None or self._decider.poll() is not None:
            env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
            self._decider = subprocess.Popen([sys.executable, "-m", "moeplace.sglang.decider"], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env=env, close_fds=True)
        return self._decider

    # ------------------------------------------------------------------ control folder, status, metrics

    def _poll_requests(self) -> None:
        """Take the requests ``moeplace online request`` wrote (rank 0 alone answers at EP 2 or more)."""
        if self.served is None or self.served.rank != 0:
            return
        try:
            found = sorted(self.config.folder.glob("request-*.json"))
        except OSError:
            return
        for path in found:
            request_id = path.stem.removeprefix("request-")
            try:
                request = json.loads(path.read_text())
                path.unlink()
            except (OSError, ValueError):
                continue
            kind = request.get("kind")
            if kind not in REQUEST_KINDS:
                self._respond(request_id, {"error": f"unknown request {kind!r}; one of {', '.join(REQUEST_KINDS)}"})
                continue
            placement = None
            if kind == "apply":
                try:
                    placement = self._requested_placement(request.get("placement"))
                except ValueError as e:
                    self._respond(request_id, {"error": str(e)})
                    continue
            self.ask(kind, request_id, placement)

    def _requested_placement(self, rows: Any) -> np.ndarray:
        """[L, P] from a request's ``placement`` (the MoE layers' rows), checked against the server."""
        from moeplace.files.placement import Placement, placement_problems

        served = self.served
        phy2log = np.asarray(rows, np.int64) if isinstance(rows, list) else None
        width = self.current_map().shape[1]
        if phy2log is None or phy2log.shape != (len(served.moe_layers), width):
            raise ValueError(f"the placement must be [{len(served.moe_layers)} MoE layers, {width} slots]")
        problems = placement_problems(Placement(served.model, served.ranks, phy2log, nodes=served.nodes))
        if problems:
            raise ValueError("; ".join(problems[:3]))
        return phy2log

    def _respond(self, request_id: str | None, answer: dict) -> None:
        if request_id is None:
            return
        try:
            atomic_write_text(self.config.folder / f"response-{request_id}.json", json.dumps(answer) + "\n")
        except OSError as e:
            logger.warning("moeplace online: cannot answer request %s (%s)", request_id, e)

    def status(self) -> dict:
        return {"rank": self.served.rank if self.served else None, "passes": self.passes,
                "window_passes": len(self.tracer.window) if self.tracer.window is not None else 0,
                "replacements": self.replacements, "moved_replicas": self.moved_replicas,
                "moved_bytes": self.moved_bytes, "last_decision": self.last}

    def _write_status(self) -> None:
        if self.served is None:
            return
        try:
            atomic_write_text(self.config.folder / f"status-r{self.served.rank:03d}.json",
                              json.dumps(self.status()) + "\n")
        except OSError:
            pass

    def _update_metrics(self) -> None:
        """SGLang's ``/metrics`` gauges (``--enable-metrics``: prometheus_client in its multiprocess mode)."""
        if self._gauges is None:
            self._gauges = make_gauges()
        if not self._gauges:
            return
        last = self.last or {}
        values = {"moeplace:window_e_max_distinct": last.get("current", 0.0),
                  "moeplace:replace_gain": 1 - last["chosen"] / last["current"] if last.get("current") else 0.0,
                  "moeplace:replacements": self.replacements, "moeplace:moved_replicas": self.moved_replicas,
                  "moeplace:moved_bytes": self.moved_bytes}
        for name, value in values.items():
            self._gauges[name].set(float(value))

    def close(self) -> None:
        self._closed = True
        if self._decider is not None and self._decider.poll() is None:
            self._decider.stdin.close()
            self._decider.terminate()


def make_gauges() -> dict[str, Any]:
    """One gauge per ``METRICS`` entry where the server exports metrics (``--enable-metrics``), else none."""
    try:
        from sglang.srt.runtime_context import get_server_args

        if not getattr(get_server_args(), "enable_metrics", False):
            return {}
        from prometheus_client import Gauge
    except Exception:  # noqa: BLE001 (no metrics: nothing to export)
        return {}
    return {name: Gauge(name, doc, multiprocess_mode="mostrecent") for name, doc in METRICS.items()}


def _synchronized_clock() -> float:
    """Seconds, after the GPU's queued work (a stall is the GPU's time too)."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
    return time.perf_counter()


def describe_server(model_config: Any, tracer: Any) -> Served:
    """The running server as the decision needs it: model, ranks, the dispatch rule, the cost model."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.runtime_context import get_parallel, get_server_args

    from moeplace.cost.derive import derive_cost_model
    from moeplace.cost.gpus import resolve_gpu
    from moeplace.model.config import expert_shape_from_hf_config
    from moeplace.sglang import balanced_dispatch

    args = get_server_args()
    meta = get_global_expert_location_metadata()
    model = tracer.model_spec()
    hf = model_config.hf_config
    shape = expert_shape_from_hf_config(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf), "the served model")
    local = meta.num_physical_experts // meta.ep_size
    hooked = balanced_dispatch._DISPATCH   # moeplace's rule where MOEPLACE_DISPATCH installed it, else SGLang's
    rule = hooked.config.rule if hooked is not None else getattr(args, "ep_dispatch_algorithm", None) or "dynamic"
    return Served(model=model, moe_layers=tuple(model.moe_layers), ranks=int(meta.ep_size),
                  nodes=int(getattr(args, "nnodes", 1) or 1), rank=int(get_parallel().tp_rank),
                  ep_rank=int(get_parallel().moe_ep_rank), dispatch=rule,
                  cost_model=derive_cost_model(shape, local, model.top_k, resolve_gpu(gpu_name()).measured),
                  replica_bytes=float(shape.bytes))


def gpu_name() -> str | None:
    """This server's GPU, whose shipped cost models the decision weighs reads with (None: no CUDA, the default's)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


# ---------------------------------------------------------------------- install

_REPLACER: Replacer | None = None
REBALANCE = "sglang.srt.eplb.eplb_manager.EPLBManager.rebalance"
PLACEMENT = "sglang.srt.eplb.expert_location.compute_initial_expert_location_metadata"


def check_server(metadata: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on SGLang's initial expert placement: stop a server where online re-placement cannot run."""
    problem = server_problem(metadata)
    if problem:
        print(f"moeplace: MOEPLACE_ONLINE is set but {problem}; stopping rather than serving without it "
              f"(unset MOEPLACE_ONLINE to serve without online re-placement)", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return None


def server_problem(metadata: Any) -> str | None:
    """Why this server cannot re-place online, else None."""
    from sglang.srt.layers.moe.topk import is_expert_remapping_enabled
    from sglang.srt.runtime_context import get_exec

    if metadata is None:
        return "SGLang built no expert placement (not an MoE model?)"
    if not is_expert_remapping_enabled():
        return ("SGLang runs without an expert map (router ids are the slots), so moved weights would serve the "
                "wrong experts: start with a placement (`moeplace launch`, or --init-expert-location)")
    if int(metadata.ep_size) > 1 and not get_exec().moe.enable_eplb:
        return (f"the server runs {int(metadata.ep_size)} EP ranks, where moeplace re-places through SGLang's "
                "rebalancer: add --enable-eplb (`moeplace launch` adds it)")
    return None


def install_with_tracer() -> Replacer:
    """The plugin's installer: the router tracer (without shards unless ``MOEPLACE_TRACE`` asks for them) keeping
    the window, then online re-placement."""
    from moeplace.sglang import tracer as tracing

    config = OnlineConfig.from_env()
    traced = tracing._TRACER   # installed first where MOEPLACE_TRACE is on (the plugin's order): then it writes shards
    if traced is None:
        trace_config = tracing.TracerConfig.from_env()
        trace_config.write_shards = False
        traced = tracing.install(trace_config)
    traced.config.window = config.window
    return install(traced, config)


def install(tracer: Any, config: OnlineConfig | None = None) -> Replacer:
    """Register online re-placement with SGLang's HookRegistry (``tracer``: the router tracer, keeping the window)."""
    global _REPLACER
    import atexit

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from moeplace.sglang import balanced_dispatch

    if _REPLACER is not None:
        return _REPLACER
    config = config or OnlineConfig.from_env()
    _REPLACER = Replacer(config, tracer, refresh=balanced_dispatch.refresh)
    tracer.listeners.append(_REPLACER.on_pass_end)
    HookRegistry.register(REBALANCE, lambda manager: _REPLACER.rebalance(manager), HookType.REPLACE)
    HookRegistry.register(PLACEMENT, check_server, HookType.AFTER)
    atexit.register(_REPLACER.close)
    return _REPLACER
