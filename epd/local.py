"""A chat request served in one process by the same pieces the three processes use.

The reference for the disaggregated stack: the encoder, prefill engine and decode scheduler run
back to back here, with no wire between them, so the stack's greedy output must equal this one
token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epd.api.images import MediaPolicy, load_images_now
from epd.api.prepare import PromptBuilder, check_grammar
from epd.api.schema import parse_completion, parse_request
from epd.checkpoint.tokenizer import load_tokenizer, stop_token_ids
from epd.checkpoint.weights import load_model
from epd.config.roles import PrefillConfig
from epd.decode.scheduler import Scheduler
from epd.encode.encoder import Encoder
from epd.generation.sampling import Scored
from epd.generation.transcript import Output
from epd.prefill.engine import PrefillEngine
from epd.prefill.request import PreparedRequest


@dataclass(frozen=True)
class Choice:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    deltas: list[Output]

    @classmethod
    def of(cls, deltas: list[Output]) -> Choice:
        return cls(
            text="".join(d.text for d in deltas),
            token_ids=[t for d in deltas for t in d.token_ids],
            finish_reason=deltas[-1].finish_reason,
            deltas=deltas,
        )


@dataclass(frozen=True)
class Completion:
    choices: list[Choice]  # one per n
    prompt_tokens: int
    first_token_s: float  # time to the first token, which may carry no text yet
    # Time to the first output with text (None if none had any): what a streaming client
    # times as its first token (benchmarks compare the stack with it, as `epd bench` and
    # OpenAI-style benchmarks time the first chunk with content).
    first_text_s: float | None
    total_s: float
    prompt_logprobs: tuple[Scored, ...] = ()  # a legacy `echo` or `prompt_logprobs`: scored

    # The first choice's, which is the only one unless the request asked for n > 1.
    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def deltas(self) -> list[Output]:
        return self.choices[0].deltas


class LocalPipeline:
    def __init__(
        self,
        checkpoint: str | Path,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        allowed_media_domains: tuple[str, ...] = (),
        cpu_weight_copies: bool = True,
        reasoning_parser: str = "auto",
    ) -> None:
        model = load_model(checkpoint, "all", device, dtype, cpu_weight_copies)
        tokenizer = load_tokenizer(checkpoint)
        # The API's default limits, and the hosts image URLs may name as in `epd prefill`.
        self.limits = PrefillConfig(
            model=str(checkpoint), allowed_media_domains=allowed_media_domains
        )
        limits = self.limits
        self.builder = PromptBuilder.from_checkpoint(
            checkpoint,
            tokenizer,
            limits.default_max_tokens,
            limits.max_image_pixels,
            limits.max_n,
            reasoning_parser,
        )
        self.encoder = Encoder(model, self.builder.processor, self.builder.max_image_pixels)
        eos_ids = stop_token_ids(checkpoint, tokenizer)
        self.engine = PrefillEngine(
            model.language_model, tokenizer, self.builder.placeholder_id, eos_ids
        )
        self.scheduler = Scheduler(model.language_model, tokenizer, eos_ids)

    def chat(self, body: dict[str, Any]) -> Completion:
        """A /v1/chat/completions body, served here."""
        start = time.perf_counter()
        request = parse_request(body)
        conversation = self.builder.read(request)
        images = load_images_now(MediaPolicy.of(self.limits), conversation.image_urls)
        return self.run(self.builder.prepare(conversation, images), start)

    def complete(self, body: dict[str, Any]) -> Completion:
        """A /v1/completions body, served here."""
        start = time.perf_counter()
        return self.run(self.builder.prepare_completion(parse_completion(body)), start)

    def run(self, prepared: PreparedRequest, start: float) -> Completion:
        check_grammar(self.engine, prepared.sampling)
        images = prepared.images
        embeddings = self.encoder.encode(images)[1] if images else None
        prefilled = self.engine.run(
            prepared.request_id,
            prepared.prompt_ids,
            embeddings,
            prepared.sampling,
            prompt_logprobs=prepared.prompt_logprobs,
        )
        deltas = {index: [first] for index, first in enumerate(prefilled.first)}
        first_token_s = time.perf_counter() - start
        first_text_s = first_token_s if any(first.text for first in prefilled.first) else None
        if prefilled.handoff is not None:  # as decode, which sends only what comes after
            continued = [output for _, output in self.scheduler.add(prefilled.handoff)]
            if continued != list(prefilled.first):  # the two roles must agree on the reply
                raise RuntimeError(f"decode read the first tokens as {continued}, not as prefill")
        while len(self.scheduler):
            step = self.scheduler.step()
            if step.failed or step.refused:
                raise RuntimeError([*step.refused, *step.failed][0][1])
            for sequence, delta in step.produced:
                deltas[sequence.index].append(delta)
                if first_text_s is None and delta.text:
                    first_text_s = time.perf_counter() - start
        total_s = time.perf_counter() - start
        return Completion(
            choices=[Choice.of(deltas[i]) for i in sorted(deltas)],
            prompt_tokens=len(prepared.prompt_ids),
            prompt_logprobs=prefilled.prompt_logprobs,
            first_token_s=first_token_s,
            first_text_s=first_text_s,
            total_s=total_s,
        )
