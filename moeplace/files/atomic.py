"""Crash-safe file writes: write a temp file beside the target, fsync, then rename over it.

Inside ``all_or_nothing()`` the renames wait until the block ends, so a command that writes several
files (a placement, SGLang's map, plots) leaves all of them or none.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterator

from moeplace.errors import MoeplaceError

# (temp file, target) pairs written inside all_or_nothing(), and the folders made for them; None outside.
_staged: contextvars.ContextVar[tuple[list[tuple[str, Path]], list[Path]] | None] = \
    contextvars.ContextVar("moeplace_staged_writes", default=None)


def replace_regular(tmp: str | os.PathLike, target: Path) -> None:
    """Rename ``tmp`` over ``target`` unless ``target`` is something other than a regular file (a device,
    a FIFO, a socket, a folder): a rename would replace that node, so it is refused and ``tmp`` removed."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise MoeplaceError(f"{target}: is not a regular file; moeplace replaces only regular files")
    os.replace(tmp, target)


def _remove_folders(folders: list[Path]) -> None:
    """Remove the folders ``atomic_open`` made where they are still empty, deepest first."""
    for folder in sorted(set(folders), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temp file next to ``path``; on success rename it to ``path``, on error delete it.

    Readers never see a half-written file: either the old one or the complete new one.
    """
    target = Path(path)
    staged = _staged.get()
    # The folders to make, noted before any is made: a signal that lands between the mkdir and the temp
    # file (SIGTERM unwinds as an exception anywhere) still finds them to remove.
    made = [p for p in target.parents if not p.exists()]
    tmp = None
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as e:   # a bad output path is the user's to fix: one line, not a traceback
            raise MoeplaceError(f"{path}: cannot write here ({e.strerror or e})") from None
        with os.fdopen(fd, mode) as f:
            # mkstemp makes the file private (0600); give it the mode a plain open() would.
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            yield f
            f.flush()
            os.fsync(f.fileno())
        if staged is None:
            replace_regular(tmp, target)
        else:
            staged[0].append((tmp, target))
            staged[1].extend(made)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _remove_folders(made)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def all_or_nothing() -> Iterator[None]:
    """Every ``atomic_open`` inside the block keeps its temp file until the block ends: then all are
    renamed into place, or, if the block raised (an error, Ctrl-C, SIGTERM), all are deleted with the
    folders made for them. Inside another such block it adds nothing: the outer block decides."""
    if _staged.get() is not None:
        yield
        return
    staged: tuple[list[tuple[str, Path]], list[Path]] = ([], [])
    token = _staged.set(staged)
    try:
        yield
    except BaseException:
        for tmp, _ in staged[0]:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _remove_folders(staged[1])
        raise
    finally:
        _staged.reset(token)
    for tmp, target in staged[0]:   # none may replace a device or FIFO: checked before any is renamed
        if os.path.exists(target) and not os.path.isfile(target):
            for other, _ in staged[0]:
                with contextlib.suppress(OSError):
                    os.unlink(other)
            _remove_folders(staged[1])
            raise MoeplaceError(f"{target}: is not a regular file; moeplace replaces only regular files")
    for tmp, target in staged[0]:
        replace_regular(tmp, target)
