"""The ``sglang.srt.plugins`` entry point: SGLang calls ``register()`` in every process it starts.

SGLang's ``load_plugins()`` runs each plugin's callable, then ``HookRegistry.apply_hooks()``, in the
launcher, the engine and every scheduler/TP worker, so the hooks registered here reach every rank.
Each feature is off unless its variable is set; when all are off this module imports nothing.

    MOEPLACE_TRACE=1 or MOEPLACE_TRACE_DIR=DIR   live router tracer   (moeplace.sglang.tracer)
    MOEPLACE_KV_SORT=1                            sorted KV free list  (moeplace.sglang.kv_sort)
    MOEPLACE_KV_STATS=FILE                        KV allocation runs   (moeplace.sglang.kv_stats)
    MOEPLACE_VERIFY_KERNEL=1                      verify attention     (moeplace.sglang.verify_backend)
    MOEPLACE_DISPATCH=balanced|cost               per-step replica choice (moeplace.sglang.balanced_dispatch)
    MOEPLACE_ONLINE=1                             online re-placement  (moeplace.sglang.online)

Every value is checked first (``moeplace.sglang.settings``, which lists what each variable takes; a
switch is on for 1, true, yes, on and off for 0, false, no, off or unset): any other value stops the
process with one line naming the variable and its accepted values.

No feature an operator turns on may silently stay off. SGLang logs a plugin that raises, or a hook
it cannot apply ("Failed to apply hooks to ..."), and serves on without it; so a feature whose
install fails, or whose hook SGLang did not apply, stops the process here with one line naming it
(exit code 2, before the launcher parses its arguments).
"""

from __future__ import annotations

import sys
from typing import Callable

# feature -> the variable that turns it on (named in every message about it)
SWITCHES = {
    "trace": "MOEPLACE_TRACE",
    "kv_sort": "MOEPLACE_KV_SORT",
    "kv_stats": "MOEPLACE_KV_STATS",
    "verify_kernel": "MOEPLACE_VERIFY_KERNEL",
    "dispatch": "MOEPLACE_DISPATCH",
    "online": "MOEPLACE_ONLINE",
}


def enabled_features() -> list[str]:
    """The features the environment turns on, in the order ``register`` installs them; a variable that
    holds a value it does not take stops the process (one line, exit code 2)."""
    from moeplace.sglang.settings import SettingError, check_settings

    try:
        on = check_settings()
    except SettingError as e:
        print(f"moeplace: {e}; stopping rather than guessing", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return [feature for feature in SWITCHES if getattr(on, feature)]


def _installer(feature: str) -> Callable[[], object]:
    # Imports stay inside: a feature that is off costs nothing, not even an import.
    if feature == "trace":
        from moeplace.sglang import tracer
        return tracer.install
    if feature == "kv_sort":
        from moeplace.sglang import kv_sort
        return kv_sort.install
    if feature == "kv_stats":
        from moeplace.sglang import kv_stats
        return kv_stats.install
    if feature == "verify_kernel":
        from moeplace.sglang import verify_backend
        return verify_backend.install
    if feature == "dispatch":
        from moeplace.sglang import balanced_dispatch
        return balanced_dispatch.install
    from moeplace.sglang import online
    return online.install_with_tracer


def stop(feature: str, why: str) -> None:
    """End this SGLang process with one line: the feature the operator asked for cannot run."""
    print(f"moeplace: {SWITCHES[feature]} is set but {why}; stopping rather than serving without it "
          f"(unset {SWITCHES[feature]} to serve without moeplace's {feature.replace('_', ' ')})",
          file=sys.stderr, flush=True)
    raise SystemExit(2)


def register() -> None:
    """Install the enabled features; each one's HookRegistry targets are checked once SGLang applied them."""
    features = enabled_features()
    if not features:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    targets: dict[str, str] = {}   # hook target -> feature
    for feature in features:
        before = set(HookRegistry._hooks)
        try:
            _installer(feature)()
        except Exception as e:  # noqa: BLE001 (SGLang would log it and serve without the feature)
            stop(feature, f"it could not be installed ({type(e).__name__}: {e})")
        targets.update({t: feature for t in set(HookRegistry._hooks) - before})
    if targets:
        check_after_apply(targets)


def check_after_apply(targets: dict[str, str]) -> None:
    """Wrap ``HookRegistry.apply_hooks`` so that a target it could not patch stops the process.

    ``load_plugins`` calls ``apply_hooks`` right after the plugins ran; it catches every failure
    (a renamed function, an ImportError inside the target's module) and only logs it.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    original = HookRegistry.__dict__["apply_hooks"].__func__
    pending = dict(targets)

    def apply_hooks(cls) -> None:
        original(cls)
        for target, feature in sorted(pending.items()):
            if target not in cls._patched:
                stop(feature, f"SGLang could not apply its hook to {target} ({_why_unresolved(target)})")
        pending.clear()
        cls.apply_hooks = classmethod(original)

    HookRegistry.apply_hooks = classmethod(apply_hooks)


def _why_unresolved(target: str) -> str:
    """Why ``target`` (module.attr or module.Class.attr) does not resolve, in a few words."""
    import pkgutil

    obj_path, _, attr = target.rpartition(".")
    try:
        getattr(pkgutil.resolve_name(obj_path), attr)
    except Exception as e:  # noqa: BLE001 (whatever the import raised is the reason)
        return f"{type(e).__name__}: {e}"
    return "see SGLang's log above"
