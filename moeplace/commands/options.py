"""Options shared by the commands, defined once, with the bounds of every number a command takes.

Every numeric option is bounded here by what the program can hold: counts by a C int (numpy and the
kernels index with them), ids and ranks by the int16 they are stored in, waits by what a timeout may be
(larger ones overflow the platform's, and no run lasts so long), sizes and budgets by what any machine
has. A value past them is one line naming the option, before any work.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import click

from moeplace.dispatch.loads import DISPATCH_RULES
from moeplace.errors import MoeplaceError
from moeplace.model.spec import MAX_EXPERTS, MAX_RANKS
from moeplace.trace.load import DEFAULT_WINDOW
from moeplace.trace.modes import MODE_SELECTIONS

# What each dispatch rule (metrics.DISPATCH_RULES) models, for --help; a rule without a line here is listed by name.
DISPATCH_HELP = {
    "dynamic": "token row % replicas, as SGLang does with --moe-a2a-backend none",
    "static": "a fixed replica per source rank, as SGLang does with DeepEP",
    "balanced": "per step, each expert's tokens to the replica that keeps the busiest rank's distinct experts "
                "lowest: moeplace's own rule, not one of SGLang's",
    "cost": "moeplace's rule by the cost model: balanced, then where tokens or row blocks pay, experts moved or "
            "their tokens split over their replicas to lower the busiest rank's predicted time (the same as "
            "balanced at verify batch; spare slots placed as for balanced; the SGLang plugin runs it as "
            "MOEPLACE_DISPATCH=cost, which `moeplace launch` sets)",
}


MAX_COUNT = 2**31 - 1        # steps, tokens, windows: a C int
MAX_SECONDS = 30 * 86400.0   # a wait or a recording: 30 days (threading.TIMEOUT_MAX and socket timeouts are far above)
MAX_GB = 1e6                 # memory per GPU: no machine has a petabyte
MAX_EFFORT = 1e15            # stepaware's work budget: about 20 days of search at its measured speed


def count(low: int = 1, high: int = MAX_COUNT) -> click.IntRange:
    """A whole number from ``low`` to ``high`` (default: a count, below what a C int holds)."""
    return click.IntRange(low, high)


def ranks_count(low: int = 1) -> click.IntRange:
    """Ranks, nodes or EP groups: rank ids are int16."""
    return click.IntRange(low, MAX_RANKS)


def slots_count() -> click.IntRange:
    """Spare slots per layer: slot ids are int16."""
    return click.IntRange(0, MAX_EXPERTS)


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf, which pass every bound check (nan compares false)."""

    def _describe_range(self) -> str:
        """The range as help and errors show it, in short numbers (1e+15, not 1000000000000000.0)."""
        low = None if self.min is None else f"{self.min:g}{'<' if self.min_open else '<='}"
        high = None if self.max is None else f"{'<' if self.max_open else '<='}{self.max:g}"
        if low is None:
            return f"x{high}"
        if high is None:
            return f"x{'>' if self.min_open else '>='}{self.min:g}"
        return f"{low}x{high}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class _HiddenAliasOption(click.Option):
    """An option that also answers to the ``aliases`` spellings, shown neither in --help nor in error messages."""

    def __init__(self, *args: Any, aliases: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aliases = aliases

    def _shown(self, method: Callable, ctx: click.Context | None) -> Any:
        opts = self.opts
        self.opts = [o for o in opts if o not in self.aliases]
        try:
            return method(ctx)
        finally:
            self.opts = opts

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        return self._shown(super().get_help_record, ctx)

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return self._shown(super().get_error_hint, ctx)


class OutputFile(click.Path):
    """A file a command writes: a regular file or a new path, refused at once (before any work) when it names
    a folder (``newdir/``, an existing folder) or a node a write would replace (a device, a FIFO, a socket)."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from moeplace.files.outputs import check_file_name, node_kind

        text = os.fspath(value)
        name = param.get_error_hint(ctx) if param is not None else "output"
        try:
            check_file_name(name, text)
        except MoeplaceError:
            self.fail(f"{text!r} names a folder (it ends in '/'); give a file name", param, ctx)
        kind = node_kind(text)
        if kind not in (None, "file", "folder"):
            self.fail(f"{text!r} is a {kind}, not a regular file: moeplace writes only regular files "
                      f"(give a new file name)", param, ctx)
        return super().convert(value, param, ctx)


def out_option(help: str) -> Callable:
    """``-o/--out FILE``, the output option of every command that writes a file (``--output`` works too)."""
    return click.option("-o", "--out", "--output", "out", cls=_HiddenAliasOption, aliases=("--output",),
                        required=True, type=OutputFile(), help=help)


def sglang_out_option(help: str) -> Callable:
    """``--sglang-out FILE``: where SGLang's ``--init-expert-location`` file goes (``--sglang-file`` works too)."""
    return click.option("--sglang-out", "--sglang-file", "sglang_out", cls=_HiddenAliasOption,
                        aliases=("--sglang-file",), type=OutputFile(), metavar="FILE.json", help=help)


def seed_option(help: str) -> Callable:
    """``--seed``: numpy takes any non-negative integer."""
    return click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True, help=help)


def effort_option(default: float | None, shown: str) -> Callable:
    """stepaware's ``--effort`` work budget (steps x slots x ranks cells of its swap search)."""
    return click.option("--effort", type=FiniteFloatRange(1, MAX_EFFORT), default=default, show_default=shown,
                        help="stepaware's swap-search work budget, in step x slot x rank cells.")


def holdout_option(default: float, help: str) -> Callable:
    """``--holdout``: the share of the trace's last steps kept apart from fitting."""
    return click.option("--holdout", type=FiniteFloatRange(0, 1, max_open=True), default=default,
                        show_default=True, help=help)


def dispatch_help() -> str:
    rules = "; ".join(f"{r} ({DISPATCH_HELP[r]})" if r in DISPATCH_HELP else r for r in DISPATCH_RULES)
    return f"How tokens pick among an expert's replicas: {rules}."


def trace_options(f: Callable | None = None, *, dispatch: bool = True) -> Callable:
    """TRACE argument plus the options that say how to read it and which steps to use; ``--dispatch`` only
    where the command uses it (``@trace_options(dispatch=False)`` leaves it out)."""
    if f is None:
        return lambda g: trace_options(g, dispatch=dispatch)
    decorators = [
        click.argument("trace", type=click.Path(exists=True, dir_okay=True)),
        click.option("--ranks", type=ranks_count(), default=8, show_default=True,
                     help="EP ranks (GPUs) the experts are spread over."),
        click.option("--mode", type=click.Choice(list(MODE_SELECTIONS)), default="all", show_default=True,
                     help="Which steps count: verify (speculative verify), decode (decode + verify), "
                          "prefill, or all."),
        click.option("--dispatch", type=click.Choice(DISPATCH_RULES), default="dynamic", show_default=True,
                     help=dispatch_help()),
        click.option("--model", "model_ref", metavar="MODEL",
                     help="The model's folder, its config.json, or its Hugging Face id (read from the local "
                          "cache, offline): gives the experts' shape and weight format for the MoE µs "
                          "(default: known from the trace's model name, else a generic shape, with a warning)."),
        click.option("--cost-model", "cost_model_path", type=click.Path(exists=True, dir_okay=False),
                     help="Cost-model JSON (a_us_per_expert, b_us_per_token, c_us; optionally r_us_per_block "
                          "with block_m, the cost of each row block past an expert's first) to use instead of the "
                          "one derived for the model's experts; or a cost set that `moeplace calibrate` wrote on "
                          "the serving GPU, from which every layout's cost is derived."),
        click.option("--gpu", "gpu", metavar="NAME",
                     help="The GPU the server runs on: its shipped cost measurements (H200, the default, and "
                          "H100) and its memory for spare slots; a GPU none ships for gets the nearest one's, with "
                          "a warning (`moeplace calibrate` measures yours)."),
        click.option("--window", type=count(), default=DEFAULT_WINDOW, show_default=True,
                     help="For per-token decode runs (.npz): consecutive tokens per emulated verify step."),
        click.option("--top-k", type=count(1, MAX_EXPERTS), default=None,
                     help="For logical_count JSON files, which do not record it (default 8)."),
        click.option("--max-steps", type=count(), default=None,
                     help="Use at most this many steps: optimize and advise take them evenly spaced over the "
                          "trace (default 20,000: more rarely changes the placement); report and compare "
                          "stream the first ones (default: all)."),
    ]
    if not dispatch:
        del decorators[3]   # --dispatch
    for d in reversed(decorators):
        f = d(f)
    return f
