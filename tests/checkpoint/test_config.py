"""Configs come from the checkpoint's own files."""

import json
import shutil

import pytest

from epd.checkpoint.config import (
    CheckpointError,
    load_generation_config,
    load_model_config,
    load_processor_config,
)
from epd.checkpoint.tokenizer import load_tokenizer


def test_values_come_from_the_files(tiny_checkpoint):
    config = load_model_config(tiny_checkpoint)
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert config.media_placeholder_token_id == tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert config.text.vocab_size == len(tokenizer)
    assert config.text.latent_dim == 32 + 8
    eos = load_generation_config(tiny_checkpoint).eos_token_ids
    assert set(eos) == {tokenizer.convert_tokens_to_ids(t) for t in ("[EOS]", "<|im_end|>")}
    processor = load_processor_config(tiny_checkpoint)
    assert processor.in_token_limit == 4096 and processor.pad_input
    assert processor.image_mean == (0.48145466, 0.4578275, 0.40821073)


def edited(tiny_checkpoint, tmp_path, file, edit):
    out = shutil.copytree(tiny_checkpoint, tmp_path / "c")
    raw = json.loads((out / file).read_text())
    edit(raw)
    (out / file).write_text(json.dumps(raw))
    return out


def test_other_checkpoints_other_values(tiny_checkpoint, tmp_path):
    def edit(raw):
        raw["media_placeholder_token_id"] = 163605
        raw["text_config"]["q_lora_rank"] = 12

    config = load_model_config(edited(tiny_checkpoint, tmp_path, "config.json", edit))
    assert config.media_placeholder_token_id == 163605 and config.text.q_lora_rank == 12


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda r: r.update(model_type="qwen2_vl"), "model_type 'qwen2_vl'"),
        (lambda r: r.pop("vision_config"), "lacks 'vision_config'"),
        (lambda r: r["text_config"].pop("kv_lora_rank"), "lacks required key 'kv_lora_rank'"),
        (lambda r: r["text_config"].update(rope_scaling={"type": "yarn"}), "rope_scaling"),
        (lambda r: r["text_config"].update(scoring_func="softmax"), "scoring_func"),
    ],
)
def test_unsupported_configs_are_named(tiny_checkpoint, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_model_config(edited(tiny_checkpoint, tmp_path, "config.json", edit))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model_config(tmp_path)
