"""Options shared by the commands that read a trace, defined once."""

from __future__ import annotations

from typing import Callable

import click

from moeplace.metrics import DISPATCH_RULES
from moeplace.trace.load import DEFAULT_WINDOW
from moeplace.trace.modes import MODE_SELECTIONS

# What each dispatch rule (metrics.DISPATCH_RULES) models, for --help; a rule without a line here is listed by name.
DISPATCH_HELP = {
    "dynamic": "token row % replicas, as SGLang does with --moe-a2a-backend none",
    "static": "a fixed replica per source rank, as SGLang does with DeepEP",
    "balanced": "per step, each expert's tokens to the replica that keeps the busiest rank's distinct experts "
                "lowest: moeplace's own rule, not one of SGLang's",
}


def dispatch_help() -> str:
    rules = "; ".join(f"{r} ({DISPATCH_HELP[r]})" if r in DISPATCH_HELP else r for r in DISPATCH_RULES)
    return f"How tokens pick among an expert's replicas: {rules}."


def trace_options(f: Callable) -> Callable:
    """TRACE argument plus the options that say how to read it and which steps to use."""
    decorators = [
        click.argument("trace", type=click.Path(exists=True, dir_okay=True)),
        click.option("--ranks", type=click.IntRange(min=1), default=8, show_default=True,
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
                     help="Cost-model JSON (a_us_per_expert, b_us_per_token, c_us) to use instead of the one "
                          "derived for the model's experts (H200 measurements, moeplace/data)."),
        click.option("--window", type=click.IntRange(min=1), default=DEFAULT_WINDOW, show_default=True,
                     help="For per-token decode runs (.npz): consecutive tokens per emulated verify step."),
        click.option("--top-k", type=click.IntRange(min=1), default=None,
                     help="For logical_count JSON files, which do not record it (default 8)."),
        click.option("--max-steps", type=click.IntRange(min=1), default=None,
                     help="Use at most this many steps: optimize and advise take them evenly spaced over the "
                          "trace (default 20,000: more rarely changes the placement); report and compare "
                          "stream the first ones (default: all)."),
    ]
    for d in reversed(decorators):
        f = d(f)
    return f
