"""From OpenAI-style messages to the language model's input.

The checkpoint's chat template writes one `<|media_pad|>` per image; each is then expanded, in
order, to that image's token count, and those rows of the input embeddings are replaced by the
image's projected embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase


def image_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every image part of the conversation, in prompt order."""
    return [
        part
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the chat-templated conversation, ending in the assistant generation prompt;
    `tools` (OpenAI's function specs) go to the template, which may show them or not."""
    text = tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=True,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def expand_placeholders(
    ids: Sequence[int], placeholder_id: int, token_counts: Sequence[int]
) -> list[int]:
    """Repeat the i-th placeholder token token_counts[i] times."""
    found = sum(1 for t in ids if t == placeholder_id)
    if found != len(token_counts):
        raise ValueError(f"prompt has {found} image placeholders but {len(token_counts)} images")
    expanded: list[int] = []
    counts = iter(token_counts)
    for t in ids:
        expanded.extend([t] * next(counts) if t == placeholder_id else [t])
    return expanded


def image_slots(
    input_ids: torch.Tensor, image_embeds: torch.Tensor, placeholder_id: int
) -> torch.Tensor:
    """Where the placeholders are in input_ids (T,), as a mask; raises unless there is one per
    row of image_embeds (N, D)."""
    slots = input_ids == placeholder_id
    if int(slots.sum()) != image_embeds.shape[0]:
        raise ValueError(
            f"prompt has {int(slots.sum())} image token slots but the images gave "
            f"{image_embeds.shape[0]} embedding rows"
        )
    return slots


def scatter_image_embeddings(
    embeds: torch.Tensor, input_ids: torch.Tensor, image_embeds: torch.Tensor, placeholder_id: int
) -> torch.Tensor:
    """Replace placeholder rows of embeds (T, D) with image_embeds (N, D), in order."""
    slots = image_slots(input_ids, image_embeds, placeholder_id)
    out = embeds.clone()
    out[slots] = image_embeds.to(embeds.dtype)
    return out
