"""A model as vLLM takes it: a checkpoint directory, or a Hugging Face repository name that
`huggingface_hub` finds in its cache (`HF_HUB_CACHE`, `HF_HOME`; a branch or tag through
`refs/`) or downloads into it, and only finds with `HF_HUB_OFFLINE=1`.

The lookup and the download are one call (`snapshot_download`), so what tests see in a cache laid
out on disk is what a download would serve. A repository is served under its name, not the
commit hash its snapshot folder is named by.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TypeVar

from epd.checkpoint.config import CheckpointError
from epd.config.roles import ModelOptions

# What serving reads: config, weights, tokenizer files (tiktoken's too), chat templates, the
# model card; not the PyTorch .bin copies some repositories also hold.
SERVED_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.py", "*.jinja", "*.md"]
Config = TypeVar("Config", bound=ModelOptions)


def on_disk(config: Config) -> Config:
    """`config` with its model a directory: a repository's snapshot, found or downloaded, served
    under the repository's name unless served names are given."""
    folder = checkpoint_folder(config.model, config.revision, config.download_dir)
    if folder == Path(config.model).expanduser():  # a directory: as given, `~` expanded
        return dataclasses.replace(config, model=str(folder))
    names = config.served_model_name or (config.model,)
    return dataclasses.replace(config, model=str(folder), served_model_name=names)


@functools.cache  # `epd serve` resolves each child's model: one lookup (or download) for all
def checkpoint_folder(model: str, revision: str = "", cache_dir: str = "") -> Path:
    """The directory `model` names: itself, or a repository's snapshot in the cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    return snapshot(model, revision, cache_dir)


def snapshot(repository: str, revision: str, cache_dir: str) -> Path:
    # Imported here: the other roles' commands and `epd --help` do without it.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        found = snapshot_download(
            repository,
            revision=revision or None,
            cache_dir=cache_dir or None,
            allow_patterns=SERVED_FILES,
        )
    except HFValidationError:
        raise CheckpointError(
            f"{repository} is not a directory, nor a Hugging Face repository name"
        ) from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        where = f"{revision} of {repository}" if revision else repository
        raise CheckpointError(
            f"{repository} is not a directory, and {where} could not be had from the Hugging "
            f"Face cache or Hub: {first_line(e)}"
        ) from None
    return Path(found)


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
