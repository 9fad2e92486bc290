"""The plugin's settings (environment variables), each checked against the values it documents.

One function, ``check_settings``, serves both the plugin (at SGLang's start, in every process) and
``moeplace launch`` (before it starts SGLang, on the environment SGLang will get): a value outside
those below stops the start with one line naming the variable and what it takes, never a feature that
silently stays off.

Every switch takes the same spellings, in any case and with spaces around them:

    on:  1, true, yes, on          off: 0, false, no, off, or unset/empty

    MOEPLACE_TRACE (switch) or MOEPLACE_TRACE_DIR=DIR    live router tracer
    MOEPLACE_TRACE_MAX_TOKENS, _SLOTS, _FLUSH_STEPS       positive integers (tracer buffers)
    MOEPLACE_TRACE_FLUSH_SECONDS, _SHARD_MB               positive numbers
    MOEPLACE_KV_SORT (switch)                             sorted KV free list
    MOEPLACE_KV_STATS=FILE                                KV allocation runs
    MOEPLACE_VERIFY_KERNEL (switch)                       verify attention kernel
    MOEPLACE_DISPATCH=balanced|cost (or off/empty)        per-step replica choice, with
    MOEPLACE_DISPATCH_MAX_TOKENS, _Q, _WEIGHTS            the rule's batch limit and weights
    MOEPLACE_ONLINE (switch)                              online re-placement, with
    MOEPLACE_ONLINE_WINDOW, _PERIOD, _CHUNK, _HORIZON     positive integers (passes, layers)
    MOEPLACE_ONLINE_MOVE_GBPS, _MIN_GAIN, _DIR            GB/s, a share, the control folder

No torch or SGLang import: ``moeplace launch --dry-run`` checks them anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("", "0", "false", "no", "off")
SWITCH_VALUES = f"{', '.join(SWITCH_ON)} (on) or {', '.join(SWITCH_OFF[1:])}, or unset (off)"
SWITCHES = ("MOEPLACE_TRACE", "MOEPLACE_KV_SORT", "MOEPLACE_VERIFY_KERNEL", "MOEPLACE_ONLINE")
DISPATCH_OFF = ("", "off", "none", "0", "false", "no")


class SettingError(ValueError):
    """A MOEPLACE_* variable holds a value the plugin does not take; the message is one line naming it."""


def switch(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether switch ``name`` is on; SettingError for a value that is neither on nor off."""
    raw = (os.environ if env is None else env).get(name, "")
    value = raw.strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    raise SettingError(f"{name}={raw!r}: a switch takes {SWITCH_VALUES}")


def dispatch_rule(env: Mapping[str, str] | None = None) -> str | None:
    """MOEPLACE_DISPATCH's rule ("balanced" or "cost"), None when off; SettingError for any other value."""
    raw = (os.environ if env is None else env).get("MOEPLACE_DISPATCH", "")
    value = raw.strip().lower()
    if value in DISPATCH_OFF:
        return None
    if value in ("balanced", "cost"):
        return value
    raise SettingError(f"MOEPLACE_DISPATCH={raw!r}: takes balanced or cost (or off, or unset)")


@dataclass(frozen=True)
class Settings:
    """What the environment turns on (every value already checked)."""

    trace: bool
    kv_sort: bool
    kv_stats: bool
    verify_kernel: bool
    dispatch: str | None
    online: bool = False


def check_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Check every moeplace variable in ``env`` (default: this process's) and say what it turns on.

    Raises SettingError, one line naming the first bad variable and the values it takes. The numbers of
    an enabled feature are checked here too (the tracer's buffers, the dispatch rule's weights).
    """
    env = os.environ if env is None else env
    on = {name: switch(name, env) for name in SWITCHES}
    trace = on["MOEPLACE_TRACE"] or bool(env.get("MOEPLACE_TRACE_DIR", "").strip())
    rule = dispatch_rule(env)
    online = on["MOEPLACE_ONLINE"]
    if trace or online:
        from moeplace.sglang.tracer import check_env

        try:
            check_env(env)
        except ValueError as e:
            raise SettingError(str(e)) from None
    if online:
        from moeplace.sglang import online as online_settings

        try:
            online_settings.check_env(env)
        except ValueError as e:
            raise SettingError(str(e)) from None
    if rule is not None:
        from moeplace.sglang.balanced_dispatch import DispatchConfig

        try:
            DispatchConfig.from_env(env)
        except ValueError as e:
            raise SettingError(str(e)) from None
    elif any(env.get(v, "").strip() for v in ("MOEPLACE_DISPATCH_Q", "MOEPLACE_DISPATCH_WEIGHTS")):
        raise SettingError("MOEPLACE_DISPATCH_Q / MOEPLACE_DISPATCH_WEIGHTS are set but MOEPLACE_DISPATCH is not "
                           "cost: set MOEPLACE_DISPATCH=cost or unset them")
    stray = sorted(name for name, value in env.items() if name.startswith("MOEPLACE_ONLINE_") and value.strip())
    if stray and not online:
        raise SettingError(f"{stray[0]} is set but MOEPLACE_ONLINE is not on: set MOEPLACE_ONLINE=1 or unset it")
    return Settings(trace, on["MOEPLACE_KV_SORT"], bool(env.get("MOEPLACE_KV_STATS", "").strip()),
                    on["MOEPLACE_VERIFY_KERNEL"], rule, online)
