"""The re-placement decision in a process of its own, beside an SGLang scheduler.

``analysis.replace.decide`` is numpy work of seconds that holds the GIL much of the time; in a thread of the
scheduler's process it would slow every pass. So the scheduler starts this module once
(``python -m moeplace.sglang.decider``, through ``subprocess``: fork and exec, never a bare fork of a process
that holds CUDA and NCCL) and hands it each window. It imports numpy and moeplace's analysis only, runs at the
lowest CPU priority on at most half the machine's CPUs, and ends when its input closes (the scheduler ended).

Protocol, over its stdin and stdout: length-prefixed pickles (8-byte little-endian length, then the bytes).
A request is ``encode_request``'s dict, an answer ``{"decision": Decision.to_json(), "target": [L, P] or None}``
or ``{"error": "one line"}``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
import sys
import traceback
from typing import IO, Any

import numpy as np

from moeplace.trace.steps import STEP_ARRAYS

def write_message(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any:
    """The next message, or None when the stream has closed."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def encode_request(steps: Any, current: Any, dispatch: str, cost_model: Any, config: Any) -> dict:
    """What the decider needs: the window (``RoutingSteps``), the map in force (``Placement``), the server's rule,
    its cost model and the decision's settings, as plain arrays and dicts."""
    return {"model": current.model.to_json(), "steps": {name: getattr(steps, name) for name in STEP_ARRAYS},
            "phy2log": np.asarray(current.phy2log), "ranks": current.ranks, "nodes": current.nodes,
            "dispatch": dispatch, "cost_model": cost_model.to_json(), "config": dataclasses.asdict(config)}


def answer(request: dict) -> dict:
    """Run the decision a request asks for."""
    from moeplace.analysis.replace import ReplaceConfig, decide
    from moeplace.cost.model import CostModel
    from moeplace.files.placement import Placement
    from moeplace.model.spec import ModelSpec
    from moeplace.trace.steps import RoutingSteps

    model = ModelSpec.from_json(request["model"])
    steps = RoutingSteps(model, **request["steps"])
    current = Placement(model, request["ranks"], request["phy2log"], nodes=request["nodes"])
    decision = decide(steps, current, request["dispatch"], CostModel(**request["cost_model"]),
                      ReplaceConfig(**request["config"]))
    return {"decision": decision.to_json(), "target": decision.target}


def _quiet_down() -> None:
    """Lowest CPU priority, and at most half the CPUs: the server's own threads come first."""
    try:
        os.nice(19)
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[len(cpus) // 2:] or cpus)
    except (AttributeError, OSError):
        pass


def main() -> None:
    _quiet_down()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # nothing but answers on the pipe
    while True:
        request = read_message(inp)
        if request is None:
            return
        try:
            reply = answer(request)
        except Exception as e:  # noqa: BLE001 (the scheduler logs it and keeps serving)
            reply = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=5)}
        write_message(out, reply)


if __name__ == "__main__":
    main()
