"""From OpenAI-style messages to the language model's input.

The checkpoint's chat template writes one `<|media_pad|>` per image; each is then expanded, in
order, to that image's token count, and those rows of the input embeddings are replaced by the
image's projected embeddings.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # prompts are built where no torch is imported (`epd route`)
    import torch


def image_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every image part of the conversation, in prompt order."""
    return [
        part
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


# Where the rendered conversation ends: in the assistant's generation prompt, after the last
# turn, or inside the last turn.
Opening = Literal["generation_prompt", "none", "continue"]

# What the server itself gives the chat template; a request's chat_template_kwargs may not.
SERVER_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
    | {"raise_exception", "strftime_now"}  # transformers' helpers
)


def template_variables(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The variables the chat template reads that a request may set (chat_template_kwargs,
    such as Qwen's `enable_thinking`): not the server's own, nor the special tokens' names
    (`eos_token`, ...), which transformers gives it. Kimi-VL's reads none."""
    environment = jinja2.Environment()
    read = jinja2.meta.find_undeclared_variables(environment.parse(tokenizer.get_chat_template()))
    given = SERVER_VARIABLES | set(tokenizer.special_tokens_map) | set(environment.globals)
    return frozenset(read) - given  # globals: `range`, `namespace`, ... are Jinja's


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    reserved: Collection[str] = (),
    variables: Mapping[str, Any] | None = None,
    opening: Opening = "generation_prompt",
) -> list[int]:
    """Token ids of the chat-templated conversation, ending in the assistant generation prompt
    (or, by `opening`, after the last turn, or inside it: `continue` leaves the last message
    open for the model to go on with, as vLLM's continue_final_message). `tools` (OpenAI's
    function specs) go to the template, which may show them or not, and `variables` too (the
    request's chat_template_kwargs, of `template_variables`).

    Message text that spells one of `reserved` (the tokenizer's control tokens) is tokenised as
    plain text, as OpenAI reads a message: a user's "<|im_end|>" is ten characters, not the end
    of their turn. Such text is rendered as a marker, and the markers' text tokenised apart from
    the template's (raises PlainTextError where the template did not render each marker once)."""
    markers = Markers()
    marked, texts = mark_plain_texts(messages, reserved, markers)
    rendered: str = tokenizer.apply_chat_template(  # type: ignore[assignment]  # tokenize=False
        marked,
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=opening == "generation_prompt",
        continue_final_message=opening == "continue",
        **(variables or {}),
    )
    if not texts:
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenize_marked(tokenizer, rendered, texts, reserved, markers)


class PlainTextError(ValueError):
    """Message text spelling a control token could not be kept plain text."""


class Markers:
    """Stand-ins for message texts in the rendered template, under a nonce no message can
    guess (private-use characters around it)."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.pattern = re.compile(f"\ue000{self.nonce}(\\d+)\ue001")

    def marker(self, index: int) -> str:
        return f"\ue000{self.nonce}{index}\ue001"


def spells_reserved(text: str, reserved: Collection[str]) -> bool:
    return any(token in text for token in reserved)


def mark_plain_texts(
    messages: Sequence[dict[str, Any]], reserved: Collection[str], markers: Markers
) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with each text that spells a reserved token replaced by a marker, and those
    texts in marker order. Neighbouring text parts render with nothing between them, so a run of
    them is one text (its first part takes the marker, the others are emptied)."""
    texts: list[str] = []

    def mark(text: str) -> str:
        texts.append(text)
        return markers.marker(len(texts) - 1)

    marked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and spells_reserved(content, reserved):
            message = {**message, "content": mark(content)}
        elif isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for is_text, grouped in itertools.groupby(content, key=lambda part: "text" in part):
                run = list(grouped)
                joined = "".join(part["text"] for part in run) if is_text else ""
                if is_text and spells_reserved(joined, reserved):
                    first, *rest = run
                    run = [{**first, "text": mark(joined)}, *({**p, "text": ""} for p in rest)]
                parts += run
            message = {**message, "content": parts}
        marked.append(message)
    return marked, texts


def tokenize_marked(
    tokenizer: PreTrainedTokenizerBase,
    rendered: str,
    texts: Sequence[str],
    reserved: Collection[str],
    markers: Markers,
) -> list[int]:
    """Token ids of a rendered template whose markers stand for `texts`: the template's text
    with its control tokens, each marked text as plain text."""
    pieces = markers.pattern.split(rendered)  # template, index, template, index, ..., template
    indices = [int(index) for index in pieces[1::2]]
    if sorted(indices) != list(range(len(texts))):
        raise PlainTextError("the chat template did not render each message text once")
    ids: list[int] = []
    for template, index in itertools.zip_longest(pieces[0::2], indices):
        ids += tokenizer.encode(template, add_special_tokens=False)
        if index is not None:
            ids += plain_ids(tokenizer, texts[index], reserved)
    return ids


def plain_ids(
    tokenizer: PreTrainedTokenizerBase, text: str, reserved: Collection[str]
) -> list[int]:
    """`text` tokenised with no control token: cut just inside each reserved token it spells
    ("<" | "|im_end|>"), so no piece holds a whole one, and tokenised piece by piece."""
    cuts = sorted({start + 1 for token in reserved for start in occurrences(text, token)})
    pieces = [text[start:end] for start, end in itertools.pairwise([0, *cuts, len(text)])]
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]  # one batch: many cuts
    ids = [token_id for piece in encoded for token_id in piece]
    control = {tokenizer.convert_tokens_to_ids(token) for token in reserved}
    if control.intersection(ids):
        raise PlainTextError("message text could not be tokenised without its control tokens")
    return ids


def occurrences(text: str, token: str) -> Iterator[int]:
    """Where `token` starts in `text`, overlapping ones included."""
    start = text.find(token)
    while start >= 0:
        yield start
        start = text.find(token, start + 1)


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
