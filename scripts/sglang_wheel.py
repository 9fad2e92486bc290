"""Load single SGLang kernel modules from the sglang wheel, without installing SGLang.

The wheel's package ``__init__`` files import the whole server and its CUDA extensions; a kernel
module needs only a few small pieces of it. So the wheel is unpacked once into the user's cache
folder (``$XDG_CACHE_HOME/moeplace``, else ``~/.cache/moeplace``; ``MOEPLACE_CACHE`` overrides),
its packages are registered without running their ``__init__``, and the caller gives stand-ins for
the few helper modules the kernel imports. The kernel code itself is SGLang's, unmodified.

    from sglang_wheel import unpack, register_packages, stub   # scripts/ is on sys.path
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path


def cache_dir() -> Path:
    """The folder moeplace's scripts unpack wheels into."""
    if os.environ.get("MOEPLACE_CACHE"):
        return Path(os.environ["MOEPLACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeplace"


def unpack(wheel: str | None) -> tuple[Path, str]:
    """(root holding the ``sglang`` package, sglang version) for the wheel ``wheel`` (a glob).

    The wheel is unpacked into a folder named after it, through a temporary folder renamed into
    place, so an interrupted unpack is never mistaken for a whole one.
    """
    paths = sorted(glob.glob(wheel or ""))
    if not paths:
        raise SystemExit(f"no sglang wheel matches {wheel!r}; pass --sglang-wheel PATH (a glob is fine)")
    path = Path(paths[-1])
    root = cache_dir() / path.stem
    if not (root / "sglang").is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root.parent))
        zipfile.ZipFile(path).extractall(tmp)
        try:
            tmp.rename(root)
        except OSError:   # another process finished first
            pass
    version = next(root.glob("sglang-*.dist-info")).name[len("sglang-"):-len(".dist-info")]
    return root, version


def register_packages(root: Path, packages: list[str]) -> None:
    """Make each dotted package importable from ``root`` without running its ``__init__``."""
    for pkg in packages:
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root / pkg.replace(".", "/"))]
        sys.modules[pkg] = mod


def stub(name: str, **attrs) -> None:
    """Register a stand-in module ``name`` holding ``attrs``."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
