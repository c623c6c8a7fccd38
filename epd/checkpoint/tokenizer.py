"""The checkpoint's tokenizer and chat template.

Checkpoints that ship a `tokenizer.json` load through the tokenizers library; the real Kimi-VL
ships a tiktoken tokenizer as remote code, which needs `trust_remote_code`.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from epd.checkpoint.config import CheckpointError, load_generation_config

SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "[PAD]",
)


def load_tokenizer(
    checkpoint: str | Path, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    path = Path(checkpoint)
    try:
        if (path / "tokenizer.json").is_file() and not trust_remote_code:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(
                str(path), trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {checkpoint}: {e}") from e
    if not tokenizer.chat_template:
        raise CheckpointError(f"the tokenizer of {checkpoint} has no chat template")
    return tokenizer


STOP_TOKENS = ("<|im_end|>", "[EOS]")  # Kimi-VL ends a reply on either


def stop_token_ids(checkpoint: str | Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """generation_config.json's eos ids, plus <|im_end|> and [EOS] should it omit one."""
    ids = list(load_generation_config(checkpoint).eos_token_ids)
    for token in STOP_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def decode_text(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool = False
) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert isinstance(text, str)
    return text
