"""Crash-safe file writes: write a temp file beside the target, fsync, then rename over it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

from moeplace.errors import MoeplaceError


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temp file next to ``path``; on success rename it to ``path``, on error delete it.

    Readers never see a half-written file: either the old one or the complete new one.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:   # a bad output path is the user's to fix: one line, not a traceback
        raise MoeplaceError(f"{path}: cannot write here ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, mode) as f:
            # mkstemp makes the file private (0600); give it the mode a plain open() would.
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)
