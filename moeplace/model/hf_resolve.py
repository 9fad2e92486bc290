"""Find a model's folder (the one holding ``config.json``) from what a user types: a path or a
Hugging Face model id, offline.

Accepted, in this order:

1. a local folder that holds ``config.json``;
2. the path of a ``config.json`` file (its folder is returned);
3. a Hugging Face model id (``openai/gpt-oss-20b``), looked up in the local Hugging Face cache the
   way ``huggingface_hub`` lays it out::

       <cache>/models--openai--gpt-oss-20b/refs/main            -> a commit hash
       <cache>/models--openai--gpt-oss-20b/snapshots/<hash>/config.json

   where ``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub`` (huggingface_hub's own
   order). The revision is a ref name (``refs/<revision>``) or a commit hash; when the cache has no
   ``refs/main`` (a model fetched at a pinned commit) and exactly one snapshot holds a
   ``config.json``, that one is used.

Nothing here touches the network or imports ``huggingface_hub``: a model that is not in the cache
is an error that says how to get it, never a download.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from moeplace.errors import MoeplaceError

CONFIG_NAME = "config.json"
# Hugging Face repo ids: "name" or "org/name", letters, digits, "-", "_", "." (no "--" or ".." runs).
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache folder this environment points at (it may not exist)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(os.path.expanduser(xdg)) / "huggingface" / "hub"


def looks_like_repo_id(text: str) -> bool:
    """True for ``name`` or ``org/name`` spelled as the Hugging Face hub allows."""
    return bool(_REPO_ID.match(text)) and "--" not in text and ".." not in text


def resolve_model_dir(name_or_path: str, revision: str = "main") -> Path:
    """The folder holding the model's ``config.json``; raise MoeplaceError (one line) if there is none.

    name_or_path: a model folder, a ``config.json`` path, or a Hugging Face id found in the local cache.
    revision: for an id, the ref name or commit hash of the cached snapshot to use.
    """
    path = Path(os.path.expanduser(name_or_path))   # "~user" of no user stays as typed
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise MoeplaceError(f"{name_or_path}: the folder has no {CONFIG_NAME} (want a Hugging Face model "
                                f"folder, its {CONFIG_NAME}, or a model id in the local cache)")
        return path
    if path.is_file():
        if path.name != CONFIG_NAME:
            raise MoeplaceError(f"{name_or_path}: a file, but not a {CONFIG_NAME} (give the model folder or "
                                f"its {CONFIG_NAME})")
        return path.parent
    if not looks_like_repo_id(name_or_path):
        raise MoeplaceError(f"{name_or_path}: no such folder or file (and not a Hugging Face model id)")
    return cached_snapshot(name_or_path, revision)


def model_name(folder: str | os.PathLike) -> str:
    """What to call the model in ``folder``: its Hugging Face id for a snapshot folder of the cache
    (``.../models--org--name/snapshots/<rev>``), else the folder's name."""
    parts = Path(folder).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return Path(folder).resolve().name


def cached_snapshot(repo_id: str, revision: str = "main", cache: Path | None = None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` that holds ``config.json``."""
    cache = cache if cache is not None else hf_hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    fetch = (f"not a local folder, and not in the Hugging Face cache {cache}; fetch its config with "
             f"'huggingface-cli download {repo_id} {CONFIG_NAME}' (or set HF_HUB_CACHE / HF_HOME), "
             f"or give the model folder")
    if not repo.is_dir():
        raise MoeplaceError(f"{repo_id}: {fetch}")
    snapshots = repo / "snapshots"
    ref = repo / "refs" / revision
    if ref.is_file():
        try:
            commit = ref.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise MoeplaceError(f"{repo_id}: cannot read {ref} ({e})") from None
        where = f"revision {revision!r} (commit {commit[:12]})"
    elif (snapshots / revision).is_dir():
        commit, where = revision, f"commit {revision[:12]}"
    elif revision == "main":
        with_config = sorted(s.name for s in _list_dirs(snapshots) if (s / CONFIG_NAME).is_file())
        if len(with_config) != 1:
            found = f"{len(with_config)} snapshots with a {CONFIG_NAME}" if with_config else f"no {CONFIG_NAME}"
            raise MoeplaceError(f"{repo_id}: the Hugging Face cache {repo} has no refs/main and {found}; "
                                f"give the snapshot folder itself")
        commit, where = with_config[0], f"commit {with_config[0][:12]} (the only cached snapshot)"
    else:
        raise MoeplaceError(f"{repo_id}: revision {revision!r} is not in the Hugging Face cache {repo}")
    folder = snapshots / commit
    if not (folder / CONFIG_NAME).is_file():
        raise MoeplaceError(f"{repo_id}: the cached {where} has no {CONFIG_NAME} ({folder}); fetch it with "
                            f"'huggingface-cli download {repo_id} {CONFIG_NAME}'")
    return folder


def _list_dirs(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir()]
    except OSError:
        return []
