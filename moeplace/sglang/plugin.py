"""The ``sglang.srt.plugins`` entry point: SGLang calls ``register()`` in every process it starts.

SGLang's ``load_plugins()`` runs each plugin's callable, then ``HookRegistry.apply_hooks()``, in the
launcher, the engine and every scheduler/TP worker, so the hooks registered here reach every rank.
Each feature is off unless its variable is set; when all are off this module imports nothing.

    MOEPLACE_TRACE=1 or MOEPLACE_TRACE_DIR=DIR   live router tracer   (moeplace.sglang.tracer)
    MOEPLACE_KV_SORT=1                            sorted KV free list  (moeplace.sglang.kv_sort)
    MOEPLACE_VERIFY_KERNEL=1                      verify attention     (moeplace.sglang.verify_backend)
    MOEPLACE_DISPATCH=balanced                    per-step replica choice (moeplace.sglang.balanced_dispatch)
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def _enabled(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def enabled_features() -> list[str]:
    """The features the environment turns on, in the order ``register`` installs them."""
    features = []
    if _enabled("MOEPLACE_TRACE") or os.environ.get("MOEPLACE_TRACE_DIR"):
        features.append("trace")
    if _enabled("MOEPLACE_KV_SORT"):
        features.append("kv_sort")
    if _enabled("MOEPLACE_VERIFY_KERNEL"):
        features.append("verify_kernel")
    if os.environ.get("MOEPLACE_DISPATCH", "").strip():
        features.append("dispatch")
    return features


def register() -> None:
    """Register the enabled features' hooks with SGLang's HookRegistry (SGLang applies them)."""
    features = enabled_features()
    # Imports stay inside the branches: a feature that is off costs nothing, not even an import.
    if "trace" in features:
        from moeplace.sglang import tracer

        tracer.install()
    if "kv_sort" in features:
        from moeplace.sglang import kv_sort

        kv_sort.install()
    if "verify_kernel" in features:
        from moeplace.sglang import verify_backend

        verify_backend.install()
    if "dispatch" in features:
        from moeplace.sglang import balanced_dispatch

        balanced_dispatch.install()
