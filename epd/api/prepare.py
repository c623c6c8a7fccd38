"""From a validated chat request and its image files to everything prefill needs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from epd.api.errors import APIError, bad_request
from epd.api.schema import ChatCompletionRequest
from epd.checkpoint.config import load_model_config, load_processor_config
from epd.generation.params import SamplingParams
from epd.multimodal.grids import Grid
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import ImageError, open_image
from epd.multimodal.prompt import expand_placeholders, image_parts, render_prompt
from epd.prefill.request import PreparedRequest


@dataclass(frozen=True)
class Conversation:
    """A chat request read once: its messages for the chat template and its image URLs."""

    request: ChatCompletionRequest
    messages: list[dict[str, Any]]
    image_urls: list[str]


@dataclass(frozen=True)
class PromptBuilder:
    tokenizer: PreTrainedTokenizerBase
    processor: ImageProcessor
    placeholder_id: int
    context_length: int
    default_max_tokens: int
    max_image_pixels: int = 50_000_000

    @cached_property
    def special_tokens(self) -> list[str]:
        return list(self.tokenizer.all_special_tokens) + list(self.tokenizer.get_added_vocab())

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        default_max_tokens: int,
        max_image_pixels: int = 50_000_000,
    ) -> PromptBuilder:
        config = load_model_config(checkpoint)
        return cls(
            tokenizer=tokenizer,
            processor=ImageProcessor(load_processor_config(checkpoint)),
            placeholder_id=config.media_placeholder_token_id,
            context_length=config.text.max_position_embeddings,
            default_max_tokens=default_max_tokens,
            max_image_pixels=max_image_pixels,
        )

    def read(self, request: ChatCompletionRequest) -> Conversation:
        """The request's chat messages, built once, and the image URLs they hold."""
        messages = self.messages(request)
        urls = [part["image_url"]["url"] for part in image_parts(messages)]
        return Conversation(request, messages, urls)

    def messages(self, request: ChatCompletionRequest) -> list[dict[str, Any]]:
        """Messages for the chat template; a `developer` message is Kimi's `system` turn."""
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        for message in messages:
            if message["role"] == "developer":
                message["role"] = "system"
            self.refuse_special_tokens(message["content"])
        return messages

    def refuse_special_tokens(self, content: str | list[dict[str, Any]]) -> None:
        """Text that spells a control token (<|im_end|>, <|media_pad|>, ...) would forge turns or
        image slots once the rendered prompt is tokenised, so it is refused."""
        texts = [content] if isinstance(content, str) else [p.get("text", "") for p in content]
        for text in texts:
            for token in self.special_tokens:
                if token in text:
                    raise bad_request(f"message text contains the reserved token {token}")

    def grids(self, images: list[bytes]) -> tuple[Grid, ...]:
        """Each image's (h, w) grid from its header alone; a 400 for a bad image."""
        grids = []
        for index, data in enumerate(images):
            try:
                image = open_image(data, index, self.max_image_pixels)
                grids.append(self.processor.grid_for_size(*image.size))
            except (ImageError, ValueError) as e:
                raise bad_request(str(e), code="invalid_image") from None
        return tuple(grids)

    def prepare(self, conversation: Conversation, images: list[bytes]) -> PreparedRequest:
        """The request as prefill takes it, once its images are fetched."""
        grids = self.grids(images)
        counts = [self.processor.tokens(grid) for grid in grids]
        prompt = render_prompt(self.tokenizer, conversation.messages)
        ids = expand_placeholders(prompt, self.placeholder_id, counts)
        request = conversation.request
        return PreparedRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            prompt_ids=ids,
            images=images,
            grids=grids,
            image_tokens=tuple(counts),
            sampling=self.sampling(request, len(ids)),
        )

    def sampling(self, request: ChatCompletionRequest, prompt_tokens: int) -> SamplingParams:
        room = self.context_length - prompt_tokens
        asked = request.max_completion_tokens or request.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise APIError(
                400,
                f"the prompt has {prompt_tokens} tokens (images included) and asks for "
                f"{asked or 1} more, over the context length of {self.context_length}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=asked or min(room, self.default_max_tokens),
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=max(request.top_k, 0),
            seed=request.seed,
            stop=request.stop_list,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
            ignore_eos=request.ignore_eos,
        )
