"""The last passes a server ran, in logical expert ids: what online re-placement fits and scores on.

Dimension letters: T token rows, L MoE layers, K top-k, P physical slots.

The tracer's drain thread adds each batch of passes it copied off the GPU (``add``), already in logical ids
(``logical_ids``: each pass's router ids mapped back through the map that was in force when the pass ran); the
decision takes a copy (``steps``). Only token-row passes of the modes asked for are kept (decode and verify by
default: the passes where the busiest rank's distinct experts set the time); the oldest go once more than
``capacity`` passes are held. Thread-safe: one lock around the chunk list.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from moeplace.model.spec import ModelSpec
from moeplace.trace import modes as M
from moeplace.trace.steps import RoutingSteps


class PassWindow:
    """The last ``capacity`` passes of ``modes`` (``moeplace.trace.modes`` selection names) of ``model``."""

    def __init__(self, model: ModelSpec, capacity: int, modes: str = "decode") -> None:
        if capacity < 1:
            raise ValueError(f"a window holds at least one pass, got {capacity}")
        self.model, self.capacity, self.modes = model, capacity, modes
        self._chunks: deque[RoutingSteps] = deque()
        self._held = 0
        self.seen = 0            # passes of the window's modes ever added
        self._lock = threading.Lock()

    def add(self, topk_ids: np.ndarray, rows: np.ndarray, modes: np.ndarray, num_tokens: np.ndarray) -> None:
        """Passes in order: ``topk_ids [T, L, K]`` logical ids (-1 none), ``rows [n]`` token rows of each (summing to
        T), their forward ``modes [n]`` and batch tokens ``num_tokens [n]``."""
        keep = M.mode_mask(np.asarray(modes, np.uint8), self.modes)
        if not keep.any():
            return
        chunk = RoutingSteps.from_topk(self.model, topk_ids, rows, modes).take(np.flatnonzero(keep))
        chunk.num_tokens = np.asarray(num_tokens, np.int32)[keep]
        with self._lock:
            self._chunks.append(chunk)
            self._held += chunk.num_steps
            self.seen += chunk.num_steps
            while self._held - self._chunks[0].num_steps >= self.capacity:
                self._held -= self._chunks.popleft().num_steps

    def steps(self) -> RoutingSteps:
        """A copy of the last ``capacity`` passes held (fewer before that many came), oldest first."""
        from moeplace.trace.steps import concat_steps

        with self._lock:
            chunks = list(self._chunks)
            held = self._held
        if not chunks:
            return RoutingSteps.empty(self.model)
        steps = concat_steps(chunks)
        return steps.slice(max(0, held - self.capacity), held) if held > self.capacity else steps

    def __len__(self) -> int:
        with self._lock:
            return min(self._held, self.capacity)


def logical_ids(physical: np.ndarray, maps: np.ndarray) -> np.ndarray:
    """``physical [T, L, K]`` router ids (slots; -1 none) as logical expert ids through ``maps [L, P]``
    (physical-to-logical, the MoE layers of the map in force for these rows)."""
    ids = physical.astype(np.int64)
    layer = np.arange(ids.shape[1])[None, :, None]
    return np.where(ids >= 0, maps[layer, np.maximum(ids, 0)], -1).astype(np.int16)
