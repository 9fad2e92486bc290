"""resolve_model_dir: a folder, a config.json, or a Hugging Face id found in the local cache, offline.

The cache is built on disk as huggingface_hub lays it out (blobs, snapshot symlinks, refs); where
huggingface_hub is installed, its own offline lookup is the oracle.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from moeplace.errors import MoeplaceError
from moeplace.model.hf_resolve import hf_hub_cache, looks_like_repo_id, model_name, resolve_model_dir

CONFIG = {"num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2}
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def cache_model(cache: Path, repo_id: str, commit: str, files: dict[str, str], ref: str | None = "main") -> Path:
    """Put ``files`` into ``cache`` as huggingface_hub does: content in blobs/, symlinks in snapshots/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.write_text(text)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.chdir(tmp_path)   # an id must not be mistaken for a folder of the test's own cwd
    return folder


def test_local_folder_and_config_path(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    assert resolve_model_dir(str(folder)) == folder
    assert resolve_model_dir(str(folder / "config.json")) == folder


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(MoeplaceError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))


def test_other_file_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(MoeplaceError, match="not a config.json"):
        resolve_model_dir(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("repo_id", ["openai/gpt-oss-20b", "moonshotai/Kimi-K2-Instruct", "gpt2"])
def test_id_from_cache_via_refs_main(cache: Path, repo_id: str) -> None:
    cache_model(cache, repo_id, COMMIT_A, {"config.json": "{}"}, ref=None)       # an older snapshot
    newest = cache_model(cache, repo_id, COMMIT_B, {"config.json": "{}"})        # the one refs/main names
    cache_model(cache, repo_id + "-base", COMMIT_A, {"config.json": "{}"})       # a neighbour, not a match
    assert resolve_model_dir(repo_id) == newest


def test_revision_by_ref_and_commit(cache: Path) -> None:
    a = cache_model(cache, "org/m", COMMIT_A, {"config.json": "{}"})
    b = cache_model(cache, "org/m", COMMIT_B, {"config.json": "{}"}, ref="v2")
    assert resolve_model_dir("org/m") == a
    assert resolve_model_dir("org/m", revision="v2") == b
    assert resolve_model_dir("org/m", revision=COMMIT_B) == b
    with pytest.raises(MoeplaceError, match="revision 'v3' is not in the Hugging Face cache"):
        resolve_model_dir("org/m", revision="v3")


def test_single_snapshot_without_ref(cache: Path) -> None:
    snap = cache_model(cache, "org/m", COMMIT_A, {"config.json": "{}"}, ref=None)
    assert resolve_model_dir("org/m") == snap
    cache_model(cache, "org/m", COMMIT_B, {"config.json": "{}"}, ref=None)
    with pytest.raises(MoeplaceError, match="no refs/main and 2 snapshots"):
        resolve_model_dir("org/m")


def test_not_cached_says_how_to_fetch(cache: Path) -> None:
    with pytest.raises(MoeplaceError) as e:
        resolve_model_dir("openai/gpt-oss-20b")
    msg = str(e.value)
    assert "\n" not in msg and str(cache) in msg and "huggingface-cli download openai/gpt-oss-20b config.json" in msg


def test_snapshot_without_config(cache: Path) -> None:
    cache_model(cache, "org/m", COMMIT_A, {"tokenizer.json": "{}"})
    with pytest.raises(MoeplaceError, match="has no config.json"):
        resolve_model_dir("org/m")


def test_dangling_config_symlink(cache: Path) -> None:
    snap = cache_model(cache, "org/m", COMMIT_A, {"config.json": "{}"})
    (snap / "config.json").resolve().unlink()   # blob gone, as after an interrupted download
    with pytest.raises(MoeplaceError, match="has no config.json"):
        resolve_model_dir("org/m")


@pytest.mark.parametrize("text", ["/no/such/folder", "./x/y/z", "a/b/c", "org/--bad", "~nope/.."])
def test_paths_that_are_not_ids(cache: Path, text: str) -> None:
    with pytest.raises(MoeplaceError, match="no such folder or file"):
        resolve_model_dir(text)


@pytest.mark.parametrize("text, ok", [("openai/gpt-oss-20b", True), ("gpt2", True), ("Org_1/m.v2", True),
                                      ("a/b/c", False), ("/abs", False), ("org/a--b", False), ("", False)])
def test_repo_id_spelling(text: str, ok: bool) -> None:
    assert looks_like_repo_id(text) is ok


@pytest.mark.parametrize("env, want", [
    ({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}, "/c/hub"),
    ({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/h/hub"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
    ({}, "~/.cache/huggingface/hub"),
])
def test_cache_location_order(monkeypatch: pytest.MonkeyPatch, env: dict, want: str) -> None:
    for key in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert hf_hub_cache() == Path(want).expanduser()


@pytest.mark.parametrize("ref", ["main", None])
def test_agrees_with_huggingface_hub(cache: Path, ref: str | None) -> None:
    """huggingface_hub's own offline lookup finds the same snapshot folder (where it is installed)."""
    hub = pytest.importorskip("huggingface_hub")
    snap = cache_model(cache, "openai/gpt-oss-20b", COMMIT_A, {"config.json": json.dumps(CONFIG)}, ref=ref)
    revision = "main" if ref else COMMIT_A
    theirs = hub.try_to_load_from_cache("openai/gpt-oss-20b", "config.json", cache_dir=str(cache), revision=revision)
    assert Path(theirs).parent == snap == resolve_model_dir("openai/gpt-oss-20b", revision=revision)


def test_model_name(cache: Path, tmp_path: Path) -> None:
    snap = cache_model(cache, "openai/gpt-oss-20b", COMMIT_A, {"config.json": "{}"})
    assert model_name(resolve_model_dir("openai/gpt-oss-20b")) == model_name(snap) == "openai/gpt-oss-20b"
    assert model_name(tmp_path / "DeepSeek-V3") == "DeepSeek-V3"
