"""The ``moeplace`` command line. Click only parses and calls; the work lives in importable modules.

Subcommands are imported lazily so that ``moeplace --help`` stays fast and never imports torch or SGLang.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

import click

from moeplace.errors import MoeplaceError

# name -> "module:attribute" of a click command; each module imports only what its command needs.
COMMANDS: dict[str, str] = {
    "report": "moeplace.commands.report:report",
    "optimize": "moeplace.commands.optimize:optimize",
    "compare": "moeplace.commands.optimize:compare",
    "trace": "moeplace.commands.trace:trace",
    "capture": "moeplace.commands.capture:capture",
    "launch": "moeplace.commands.launch:launch",
    "advise": "moeplace.commands.advise:advise",
    "online": "moeplace.commands.online:online",
    "calibrate": "moeplace.commands.calibrate:calibrate",
}

# Commands whose work is numpy, set up for it before numpy loads, unless the environment says otherwise
# (`launch` and `capture` are left alone: the SGLang they start inherits the environment):
# * BLAS on one thread: their matrix products are small, so a second thread gains nothing, and where it
#   shares a core with any other busy process it made `optimize` several times slower (BENCHMARKS.md#optimizer-and-cli-speed);
# * no transparent huge pages for numpy's large arrays (NUMPY_MADVISE_HUGEPAGE=0): where the kernel
#   compacts memory to find them at each first touch (THP defrag "madvise"), every new large array
#   stalled: `optimize` on 20,000 Kimi-shaped steps took 12.3 s wall, 4.3 s of it in the kernel, against
#   8.4-9.8 s and 1 s without (BENCHMARKS.md#optimizer-and-cli-speed).
NUMPY_COMMANDS = ("report", "optimize", "compare", "advise", "trace", "online")
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
HUGEPAGE_VARIABLE = "NUMPY_MADVISE_HUGEPAGE"


def numpy_environment() -> None:
    """One BLAS thread (OpenBLAS or MKL) and no huge-page advice, if numpy is not loaded yet and the
    environment does not set them."""
    if "numpy" in sys.modules:
        return
    if not any(v in os.environ for v in BLAS_THREAD_VARIABLES):
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    os.environ.setdefault(HUGEPAGE_VARIABLE, "0")


class LazyGroup(click.Group):
    """A click group whose subcommands load on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        if name in NUMPY_COMMANDS:
            numpy_environment()
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moeplace")
def cli() -> None:
    """Measure and fix per-step expert imbalance in MoE serving (SGLang, expert parallel).

    \b
    Typical use:
      moeplace report traces/gptoss20b-sample.mptrace --ranks 8
      moeplace optimize traces/gptoss20b-sample.mptrace --ranks 8 -o placement.json
    """


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every write in progress cleans up as on Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def _signal_behind(error: BaseException) -> type | None:
    """KeyboardInterrupt or Terminated where one of them caused ``error`` (its chain of causes), else None."""
    seen = error.__cause__ or error.__context__
    while seen is not None:
        if isinstance(seen, (KeyboardInterrupt, Terminated)):
            return type(seen)
        seen = seen.__cause__ or seen.__context__
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and exit code 2, never a traceback.

    SIGTERM (a job scheduler, ``kill``) unwinds like Ctrl-C: temp files are removed, nothing is left
    half-written, and a capture stops the server's recording.
    """
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        _run(argv)
    finally:   # main() called in process (tests, scripts) leaves the caller's handler as it was
        signal.signal(signal.SIGTERM, previous)


def _run(argv: list[str] | None) -> None:
    try:
        cli.main(args=argv, prog_name="moeplace", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:   # bare `moeplace` or `moeplace trace`: help, not an error
        click.echo(e.ctx.get_help())
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt):   # click turns Ctrl-C into Abort
            click.echo("interrupted", err=True)
            sys.exit(130)
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as e:
        # One line, as for every other user error; the command's --help teaches the usage.
        ctx = getattr(e, "ctx", None)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"error: {e.format_message()}{where}", err=True)
        sys.exit(e.exit_code)
    except MoeplaceError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:   # the file system said no (permissions, a full disk, a vanished file): one line too
        where = f"{e.filename}: " if e.filename else ""
        click.echo(f"error: {where}{e.strerror or e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Terminated:
        click.echo("terminated", err=True)
        sys.exit(128 + signal.SIGTERM)
    except ImportError as e:   # a signal during a C extension's import (matplotlib's) surfaces as this
        signalled = _signal_behind(e)
        if signalled is None:
            raise
        click.echo("interrupted" if signalled is KeyboardInterrupt else "terminated", err=True)
        sys.exit(130 if signalled is KeyboardInterrupt else 128 + signal.SIGTERM)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
