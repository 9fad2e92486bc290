"""Where a command will write, checked before it starts any work.

Each output must be writable, must not be one of the command's inputs (the same path, or the same
file through a link) and must not be another output. Found at once, each is one line naming the
option; found after the work (or never: an input replaced by a placement), it costs the user far more.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from moeplace.errors import MoeplaceError
from moeplace.trace.store import PARTIAL_SUFFIX, SHARD_SUFFIX


def check_outputs(files: Mapping[str, str | os.PathLike | None],
                  inputs: Mapping[str, str | os.PathLike | None] | None = None,
                  folders: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """Raise MoeplaceError unless every output can be written without harm.

    files: option -> file the command writes; folders: option -> folder it writes files in;
    inputs: name -> file or folder it reads (a name such as ``TRACE`` or ``--placement``). None
    values (an output not asked for) are skipped. A trace folder among the inputs also refuses a
    trace file written into it: the next read of the folder would take it for one of its shards.
    """
    given_inputs = [(name, Path(p)) for name, p in (inputs or {}).items() if p is not None and Path(p).exists()]
    outputs = [(opt, Path(p), False) for opt, p in files.items() if p is not None] \
        + [(opt, Path(p), True) for opt, p in (folders or {}).items() if p is not None]
    for i, (opt, path, is_folder) in enumerate(outputs):
        for name, source in given_inputs:
            if _same(path, source):
                raise MoeplaceError(f"{opt} {path}: is the {name} this command reads; write the output elsewhere")
            if source.is_dir() and not is_folder and _is_shard_name(path) and _same(path.parent, source):
                raise MoeplaceError(f"{opt} {path}: is inside the {name} folder {source}, which reads every "
                                    f"{SHARD_SUFFIX} file in it as a shard; write it outside the folder")
        for other_opt, other, _ in outputs[:i]:
            if _same(path, other):
                raise MoeplaceError(f"{opt} {path}: is also {other_opt}; give each output its own file")
        check_writable(opt, path, is_folder)


def check_writable(option: str, path: Path, folder: bool = False) -> None:
    """Raise MoeplaceError unless ``path`` (a file, or a folder if ``folder``) can be created or replaced."""
    if path.exists():
        if folder and not path.is_dir():
            raise MoeplaceError(f"{option} {path}: is a file, not a folder")
        if not folder and path.is_dir():
            raise MoeplaceError(f"{option} {path}: is a folder; give a file name")
        where = path if folder else path.absolute().parent
    else:
        where = nearest_existing(path)
        if not where.is_dir():
            raise MoeplaceError(f"{option} {path}: cannot write there ({where} is a file, not a folder)")
    if not os.access(where, os.W_OK | os.X_OK):
        raise MoeplaceError(f"{option} {path}: cannot write there (no permission to write in {where})")


def nearest_existing(path: Path) -> Path:
    """The closest of ``path``'s folders that exists (where a write would have to make the rest)."""
    return next(p for p in path.absolute().parents if p.exists())


def _same(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file or folder (through links too); a missing path by its name."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_shard_name(path: Path) -> bool:
    return path.name.endswith(SHARD_SUFFIX) or path.name.endswith(SHARD_SUFFIX + PARTIAL_SUFFIX)
