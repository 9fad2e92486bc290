"""Forward modes of a step. Codes are SGLang 0.5.23's ``ForwardMode`` integers, so recorder dumps map 1:1."""

from __future__ import annotations

import numpy as np

from moeplace.errors import MoeplaceError

UNKNOWN, EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY, DRAFT_EXTEND = 0, 1, 2, 3, 4, 5, 6

MODE_NAMES: dict[int, str] = {
    UNKNOWN: "unknown", EXTEND: "prefill", DECODE: "decode", MIXED: "mixed", IDLE: "idle",
    TARGET_VERIFY: "verify", DRAFT_EXTEND: "draft",
}

# What `--mode` selects. `decode` means steps that decide decode latency: plain decode and verify.
MODE_SELECTIONS: dict[str, tuple[int, ...]] = {
    "verify": (TARGET_VERIFY,),
    "decode": (DECODE, TARGET_VERIFY),
    "prefill": (EXTEND, MIXED),
    "all": tuple(MODE_NAMES),
}


def mode_mask(modes: np.ndarray, selection: str) -> np.ndarray:
    """Boolean mask of the steps whose mode is in ``selection`` (a key of MODE_SELECTIONS)."""
    if selection not in MODE_SELECTIONS:
        raise MoeplaceError(f"unknown mode {selection!r}; choose from {', '.join(MODE_SELECTIONS)}")
    return np.isin(modes, MODE_SELECTIONS[selection])
