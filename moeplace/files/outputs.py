"""Where a command will write, checked before it starts any work.

Each output must be a regular file or a new path (never a device such as /dev/null, a FIFO, a socket
or a folder, whose node a rename would replace), must be writable (tried, not guessed: ``os.access``
says yes to root on /proc), must not be one of the command's inputs (the same path, or the same file
through a link) and must not be another output. Found at once, each is one line naming the option;
found after the work (or never: an input replaced by a placement), it costs the user far more.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
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
    for opt, p in files.items():
        if p is not None:
            check_file_name(opt, p)
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


def check_file_name(option: str, path: str | os.PathLike) -> None:
    """Refuse a file output named as a folder (``newdir/``): the write would make a file ``newdir``."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)) or Path(text).name in ("", ".", ".."):
        raise MoeplaceError(f"{option} {text}: names a folder (it ends in '/'); give a file name")


def check_writable(option: str, path: Path, folder: bool = False) -> None:
    """Raise MoeplaceError unless ``path`` (a file, or a folder if ``folder``) can be created or replaced
    with a regular file (or folder). The folder that would hold it is tried with a temp file, removed at once."""
    kind = node_kind(path)
    if kind is not None:
        if folder and kind != "folder":
            raise MoeplaceError(f"{option} {path}: is {_article(kind)}, not a folder")
        if not folder and kind == "folder":
            raise MoeplaceError(f"{option} {path}: is a folder; give a file name")
        if not folder and kind != "file":
            raise MoeplaceError(f"{option} {path}: is {_article(kind)}, not a regular file; moeplace writes only "
                                f"regular files (give a new file name)")
        where = path if folder else path.absolute().parent
    else:
        where = nearest_existing(path)
        if not where.is_dir():
            raise MoeplaceError(f"{option} {path}: cannot write there ({where} is a file, not a folder)")
    problem = _try_write(where, made_below=where != (path.absolute() if folder else path.absolute().parent))
    if problem:
        raise MoeplaceError(f"{option} {path}: cannot write there ({problem} in {where})")


def node_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is (following links): "file", "folder", "character device", "block device", "FIFO",
    "socket"; None where nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return "unreadable path"
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _article(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _try_write(where: Path, made_below: bool) -> str | None:
    """Why a file (or, if ``made_below``, a folder) cannot be made in ``where``; None if it can.
    Tried for real and removed at once: permissions alone do not tell (root, read-only mounts, /proc)."""
    try:
        if made_below:
            probe = tempfile.mkdtemp(prefix=".moeplace-probe.", dir=where)
            os.rmdir(probe)
        else:
            fd, probe = tempfile.mkstemp(prefix=".moeplace-probe.", dir=where)
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def nearest_existing(path: Path) -> Path:
    """The closest of ``path``'s folders that exists (where a write would have to make the rest)."""
    return next(p for p in path.absolute().parents if p.exists())


def output_inside(path: str | os.PathLike, folder: str | os.PathLike, at_depth: int | None = None) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (through links), ``at_depth`` folders down if given."""
    try:
        rest = Path(path).resolve().relative_to(Path(folder).resolve())
    except ValueError:
        return False
    return at_depth is None or len(rest.parts) == at_depth


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
