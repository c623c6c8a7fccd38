"""A model named by its Hugging Face repository: found in a cache laid out as huggingface_hub
lays it (blobs, snapshot links, refs), served under its name."""

import hashlib
import os
from pathlib import Path

import pytest

from epd.checkpoint.config import CheckpointError
from epd.checkpoint.hub import checkpoint_folder, on_disk
from epd.config.roles import DecodeConfig, PrefillConfig

REPOSITORY = "moonshotai/Kimi-VL-A3B-Instruct"
COMMIT = "a" * 40


def lay_out_cache(cache: Path, checkpoint: Path, refs: dict[str, str]) -> Path:
    """`checkpoint`'s files as one snapshot of REPOSITORY in `cache`: each file a blob named by
    its hash and a link to it in snapshots/COMMIT; `refs` maps branch or tag names to commits."""
    repo = cache / f"models--{REPOSITORY.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in checkpoint.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as huggingface_hub reads it (once, at import): the cache alone."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    checkpoint_folder.cache_clear()
    yield
    checkpoint_folder.cache_clear()


def test_a_repository_name_is_its_snapshot_under_its_name(offline, tmp_path, tiny_checkpoint):
    snapshot = lay_out_cache(tmp_path, tiny_checkpoint, {"main": COMMIT})
    config = on_disk(PrefillConfig(model=REPOSITORY, download_dir=str(tmp_path)))
    assert Path(config.model) == snapshot and (Path(config.model) / "config.json").is_file()
    assert config.model_name == REPOSITORY
    assert REPOSITORY in config.model_names


def test_a_revision_is_found_through_its_ref(offline, tmp_path, tiny_checkpoint):
    snapshot = lay_out_cache(tmp_path, tiny_checkpoint, {"main": "b" * 40, "v1": COMMIT})
    config = on_disk(DecodeConfig(model=REPOSITORY, revision="v1", download_dir=str(tmp_path)))
    assert Path(config.model) == snapshot


def test_served_names_given_win_over_the_repositorys(offline, tmp_path, tiny_checkpoint):
    lay_out_cache(tmp_path, tiny_checkpoint, {"main": COMMIT})
    config = on_disk(
        PrefillConfig(model=REPOSITORY, download_dir=str(tmp_path), served_model_name=("a", "b"))
    )
    assert config.model_name == "a" and config.model_names[:2] == ("a", "b")


def test_a_snapshot_path_is_served_under_the_path_given(tmp_path, tiny_checkpoint):
    snapshot = lay_out_cache(tmp_path, tiny_checkpoint, {"main": COMMIT})
    config = on_disk(PrefillConfig(model=str(snapshot)))
    assert config.model == str(snapshot) and config.model_name == str(snapshot)


def test_a_directory_is_served_as_it_is(tiny_checkpoint):
    config = PrefillConfig(model=str(tiny_checkpoint))
    assert on_disk(config) == config and config.model_name == tiny_checkpoint.name


def test_a_directory_under_home_is_expanded(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("HOME", str(tiny_checkpoint.parent))
    config = on_disk(PrefillConfig(model=f"~/{tiny_checkpoint.name}"))
    assert config.model == str(tiny_checkpoint) and config.model_name == tiny_checkpoint.name


def test_a_repository_missing_from_the_cache_offline_is_an_error_naming_it(offline, tmp_path):
    with pytest.raises(CheckpointError, match=f"{REPOSITORY} is not a directory, and"):
        on_disk(PrefillConfig(model=REPOSITORY, download_dir=str(tmp_path)))


def test_a_revision_not_cached_is_an_error_naming_it(offline, tmp_path, tiny_checkpoint):
    lay_out_cache(tmp_path, tiny_checkpoint, {"main": COMMIT})
    with pytest.raises(CheckpointError, match=f"v9 of {REPOSITORY}"):
        on_disk(PrefillConfig(model=REPOSITORY, revision="v9", download_dir=str(tmp_path)))


@pytest.mark.parametrize("model", ["/no/such/dir", "./missing", "a/b/c", "a b"])
def test_a_path_that_is_no_directory_is_an_error_without_a_lookup(model):
    with pytest.raises(CheckpointError, match="is not a directory, nor a Hugging Face"):
        checkpoint_folder(model)
