"""From a validated chat request and its image files to everything prefill needs."""

from __future__ import annotations

import itertools
import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
from msgspec.structs import replace
from transformers import PreTrainedTokenizerBase

from epd.api.errors import APIError, bad_request
from epd.api.schema import ChatCompletionRequest, CompletionRequest, GenerationRequest
from epd.api.tool_prompts import ForcedTools, describe_tools
from epd.checkpoint.config import (
    CheckpointError,
    context_length,
    load_model_config,
    load_processor_config,
    load_sampling_defaults,
)
from epd.checkpoint.tokenizer import decode_text
from epd.generation.grammar import (
    GrammarError,
    Grammars,
    GrammarUnavailable,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from epd.generation.params import SamplingParams
from epd.generation.reasoning import Markers, markers_for, opened
from epd.multimodal.grids import Grid
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import ImageError, open_image
from epd.multimodal.prompt import (
    SERVER_VARIABLES,
    PlainTextError,
    expand_placeholders,
    image_parts,
    render_prompt,
    template_variables,
)
from epd.prefill.request import PreparedRequest

MAX_FIRST_LOGPROBS = 128  # logprob entries of the first tokens of all choices
# Prompt tokens × (1 + alternatives) × n a legacy `echo` with `logprobs` may put in its reply,
# over all its prompts: each is an object held until the reply is sent, and JSON made on the
# event loop (~6 MB at this bound). lm-eval's requests have a few thousand.
MAX_SCORED_ENTRIES = 1 << 16


@dataclass(frozen=True)
class Conversation:
    """A chat request read once: its messages and tools for the chat template, its image URLs."""

    request: ChatCompletionRequest
    messages: list[dict[str, Any]]
    image_urls: list[str]
    tools: list[dict[str, Any]] | None = None
    variables: dict[str, Any] = field(default_factory=dict)  # of its chat_template_kwargs


@dataclass(frozen=True)
class PromptBuilder:
    tokenizer: PreTrainedTokenizerBase
    processor: ImageProcessor
    placeholder_id: int
    context_length: int
    vocab_size: int
    default_max_tokens: int
    max_image_pixels: int = 50_000_000
    max_n: int = 16
    defaults: dict[str, float] = field(default_factory=dict)  # generation_config.json's
    reasoning: Markers | None = None  # a reasoning model's markers (`api/reasoning.py`)
    seeds: random.Random | None = None  # draws the seeds of unseeded requests (`--seed`)

    def __post_init__(self) -> None:
        try:  # refuse a checkpoint whose defaults no request could use, at start-up
            SamplingParams(**({"max_tokens": 1} | self.defaults))  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"generation_config.json: unusable sampling default: {e}") from e

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
        max_n: int = 16,
        reasoning_parser: str = "auto",
        max_model_len: int = 0,
        generation_config: str = "auto",
        seed: int = -1,
        override_generation_config: str = "",
    ) -> PromptBuilder:
        config = load_model_config(checkpoint)
        template = tokenizer.chat_template or ""
        return cls(
            tokenizer=tokenizer,
            processor=ImageProcessor(load_processor_config(checkpoint)),
            placeholder_id=config.media_placeholder_token_id,
            context_length=context_length(config.text, max_model_len),
            vocab_size=config.text.vocab_size,
            default_max_tokens=default_max_tokens,
            max_image_pixels=max_image_pixels,
            max_n=max_n,
            defaults=load_sampling_defaults(
                checkpoint, generation_config, override_generation_config
            ),
            reasoning=markers_for(reasoning_parser, checkpoint, template),
            seeds=random.Random(seed) if seed >= 0 else None,
        )

    def seed(self, asked: int | None) -> int | None:
        """A request's seed: its own, else the server's next draw where it was given one."""
        if asked is not None or self.seeds is None:
            return asked
        return self.seeds.getrandbits(63)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string is at least as long:
        a byte-level token has one character per byte)."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def check_text_fits(self, texts: list[str]) -> None:
        """Refuse text that cannot fit the context whatever it tokenises to, before tokenising
        it: 10 MB of text would hold the tokenizer for seconds and take gigabytes."""
        chars = sum(map(len, texts))
        if chars > self.context_length * self.max_token_chars:
            raise bad_request(
                f"the prompt has {chars} characters: more than {self.context_length} tokens "
                f"(the context length) of at most {self.max_token_chars} characters can hold",
                code="context_length_exceeded",
            )

    def read(self, request: ChatCompletionRequest) -> Conversation:
        """The request's chat messages, built once, and the image URLs they hold."""
        messages = self.messages(request)
        urls = [part["image_url"]["url"] for part in image_parts(messages)]
        tools = [t.model_dump(exclude_none=True) for t in request.tools or ()] or None
        # Names, descriptions and schemas of tools reach the prompt too. The size comes
        # first: scanning 10 MB for every reserved token would itself take a while.
        shown = json.dumps(tools, ensure_ascii=False) if tools else ""
        calls = [
            call["function"]["arguments"] for m in messages for call in m.get("tool_calls", ())
        ]
        variables = self.variables(request)
        texts = list(strings_in(variables))
        self.check_text_fits(
            [shown, *calls, *texts, *(text for m in messages for text in texts_of(m))]
        )
        # Message text stays plain text however it is spelled (`render_prompt`); a template
        # that renders tools, tool calls or its variables does so from data, where no marker
        # can stand in.
        self.refuse_special_tokens(
            ([shown] if self.template_shows_tools else [])
            + (calls if self.template_shows_tool_calls else [])
            + texts
        )
        if tools and not self.template_shows_tools:
            note = {"role": "system", "content": describe_tools(request.tools or [])}
            return Conversation(request, [note, *messages], urls, variables=variables)
        return Conversation(request, messages, urls, tools, variables)

    @cached_property
    def template_variables(self) -> frozenset[str]:
        return template_variables(self.tokenizer)

    def variables(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The request's chat_template_kwargs that the template reads; vLLM drops the others
        too (Kimi-VL's template reads none, so `enable_thinking` changes nothing, as it should).
        Setting what the server gives the template is a 400: it would not be what was asked."""
        asked = request.chat_template_kwargs or {}
        given = SERVER_VARIABLES | set(self.tokenizer.special_tokens_map)
        if taken := sorted(given.intersection(asked)):
            raise bad_request(
                f"chat_template_kwargs may not set {taken[0]}: the server gives it",
                param="chat_template_kwargs",
            )
        return {name: value for name, value in asked.items() if name in self.template_variables}

    @cached_property
    def template_shows_tools(self) -> bool:
        """Whether the chat template renders a request's tools (Kimi-VL's does not)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "probe_tool_name", "parameters": {}}}
        return render_prompt(self.tokenizer, probe, [tool]) != render_prompt(self.tokenizer, probe)

    @cached_property
    def template_shows_tool_calls(self) -> bool:
        """Whether the chat template renders an assistant turn's tool calls (Kimi-VL's does
        not)."""
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "probe_args"}}
        probe: list[dict[str, Any]] = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        return "probe_args" in self.tokenizer.decode(render_prompt(self.tokenizer, probe))

    def messages(self, request: ChatCompletionRequest) -> list[dict[str, Any]]:
        """Messages for the chat template; a `developer` message is Kimi's `system` turn, and an
        assistant turn echoed without content (`content: null`) is an empty one."""
        messages = []
        for m in request.messages:
            fields = {"role", "content", "name", "tool_calls", "tool_call_id"}
            message = m.model_dump(include=fields, exclude_none=True)
            message.setdefault("content", "")
            if message["role"] == "developer":
                message["role"] = "system"
            messages.append(message)
        return messages

    def refuse_special_tokens(self, texts: list[str]) -> None:
        """Tool or template-variable text that spells a control token (<|im_end|>,
        <|media_pad|>, ...) would forge turns or image slots once the rendered prompt is
        tokenised, so it is refused."""
        for text in texts:
            for token in self.special_tokens:
                if token in text:
                    raise bad_request(
                        f"a tool, tool call or chat_template_kwargs value contains the reserved "
                        f"token {token}"
                    )

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

    def prepare(
        self,
        conversation: Conversation,
        images: list[bytes],
        request_id: str = "",
        grids: tuple[Grid, ...] | None = None,
    ) -> PreparedRequest:
        """The request as prefill takes it, once its images are fetched; its id holds the
        client's `x-request-id` where one was given (made unique: clients reuse theirs).
        `grids`: the images' grids where the caller has read them already (not read again)."""
        grids, counts = self.image_tokens(images, grids)
        ids = self.prompt_ids(conversation, counts)
        return PreparedRequest(
            request_id=unique_id("chatcmpl", request_id),
            prompt_ids=ids,
            images=images,
            grids=grids,
            image_tokens=tuple(counts),
            sampling=self.with_reasoning(self.sampling(conversation.request, len(ids)), ids),
            prompt_logprobs=conversation.request.prompt_logprobs,
            cache_salt=conversation.request.cache_salt,
        )

    def with_reasoning(self, sampling: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
        """A chat's sampling with its reasoning model's markers, and whether its prompt already
        opened the reasoning (in what follows the prompt's last control token)."""
        if self.reasoning is None:
            return sampling
        last = max((i for i, t in enumerate(prompt_ids) if t in self.special_ids), default=-1)
        tail = decode_text(self.tokenizer, prompt_ids[last + 1 :])
        markers = (self.reasoning.start, self.reasoning.end)
        return replace(sampling, reasoning=markers, reasoning_open=opened(self.reasoning, tail))

    @cached_property
    def special_ids(self) -> frozenset[int]:
        ids = self.tokenizer.convert_tokens_to_ids(self.special_tokens)
        return frozenset(ids if isinstance(ids, list) else [ids])

    def image_tokens(
        self, images: list[bytes], grids: tuple[Grid, ...] | None = None
    ) -> tuple[tuple[Grid, ...], list[int]]:
        """Each image's (h, w) grid and the tokens it becomes; a 400 for a bad image."""
        grids = self.grids(images) if grids is None else grids
        return grids, [self.processor.tokens(grid) for grid in grids]

    def prompt_ids(self, conversation: Conversation, image_tokens: list[int]) -> list[int]:
        """The conversation's prompt, each image's placeholder repeated for its tokens."""
        try:
            prompt = render_prompt(
                self.tokenizer,
                conversation.messages,
                conversation.tools,
                self.special_tokens,
                conversation.variables,
                conversation.request.opening,
            )
            return expand_placeholders(prompt, self.placeholder_id, image_tokens)
        except PlainTextError as e:
            raise bad_request(f"message text spelling a reserved token: {e}") from None
        except jinja2.TemplateError as e:  # the template's raise_exception, or its variables
            raise bad_request(f"the chat template refused the request: {str(e)[:500]}") from None
        except ValueError as e:  # no last message to continue, image slots not one an image
            raise bad_request(str(e)[:300]) from None

    def prepare_completion(
        self, request: CompletionRequest, request_id: str = "", which: int = 0
    ) -> PreparedRequest:
        """A legacy completion's prompt `which` of its prompts, text (tokenised as it is, no chat
        template) or token ids; neither may hold the image placeholder, which would claim image
        rows."""
        prompt = request.prompts[which]
        if isinstance(prompt, str):
            self.check_text_fits([prompt])
            ids = list(self.tokenizer.encode(prompt))
        else:
            if outside := [t for t in prompt if t >= self.vocab_size]:
                raise bad_request(
                    f"prompt token id {outside[0]} is outside the vocabulary of {self.vocab_size}",
                    param="prompt",
                )
            ids = list(prompt)
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        if self.placeholder_id in ids:
            raise bad_request("the prompt holds the image placeholder token", param="prompt")
        return PreparedRequest(
            request_id=unique_id("cmpl", request_id),
            prompt_ids=ids,
            images=[],
            grids=(),
            image_tokens=(),
            sampling=self.sampling(request, len(ids)),
            prompt_logprobs=scored_alternatives(request),
            cache_salt=request.cache_salt,
        )

    def sampling(self, request: GenerationRequest, prompt_tokens: int) -> SamplingParams:
        """The request's sampling; a field it leaves out takes the checkpoint's default."""
        room = self.context_length - prompt_tokens
        asked = request.asked_tokens
        if room < 1 or (asked is not None and asked > room):
            raise APIError(
                400,
                f"the prompt has {prompt_tokens} tokens (images included) and asks for "
                f"{asked or 1} more, over the context length of {self.context_length}",
                param=request.asked_tokens_param,
                code="context_length_exceeded",
            )
        default_max = int(self.defaults.get("max_tokens", self.default_max_tokens))
        given = {
            name: value
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if (value := getattr(request, name)) is not None
        }
        chosen = self.defaults | given
        self.check_token_ids(request)
        self.check_choices(request)
        try:
            return SamplingParams(
                max_tokens=asked or min(room, default_max),
                temperature=float(chosen.get("temperature", 1.0)),
                top_p=float(chosen.get("top_p", 1.0)),
                top_k=max(int(chosen.get("top_k", 0)), 0),
                min_p=float(chosen.get("min_p", 0.0)),
                repetition_penalty=float(chosen.get("repetition_penalty", 1.0)),
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                logit_bias=request.bias_pairs,
                min_tokens=request.min_tokens,
                stop_token_ids=tuple(request.stop_token_ids or ()),
                skip_special_tokens=request.skip_special_tokens,
                seed=self.seed(request.seed),
                stop=request.stop_list,
                logprobs=request.wants_logprobs,
                top_logprobs=request.top_logprob_count,
                ignore_eos=request.ignore_eos,
                include_stop_str=request.include_stop_str_in_output,
                grammar=output_grammar(request),
                n=request.n,
            )
        except ValueError as e:  # e.g. min_tokens over max_tokens, a schema too large
            raise bad_request(str(e)) from None

    def check_choices(self, request: GenerationRequest) -> None:
        if request.n > self.max_n:
            raise bad_request(
                f"n={request.n} is over this server's limit of {self.max_n} (max_n)", param="n"
            )
        logprobs = request.n * (request.top_logprob_count + 1) if request.wants_logprobs else 0
        if logprobs > MAX_FIRST_LOGPROBS:  # they travel in one hand-off header
            raise bad_request(
                f"n × (top_logprobs + 1) is {logprobs}, over {MAX_FIRST_LOGPROBS}", param="n"
            )

    def check_token_ids(self, request: GenerationRequest) -> None:
        for param, ids in (
            ("logit_bias", [t for t, _ in request.bias_pairs]),
            ("stop_token_ids", request.stop_token_ids or []),
        ):
            if outside := [t for t in ids if t >= self.vocab_size]:
                raise bad_request(
                    f"{param}: token id {outside[0]} is outside the vocabulary of "
                    f"{self.vocab_size}",
                    param=param,
                )


def texts_of(message: dict[str, Any]) -> list[str]:
    """The text a chat message's content puts in the prompt: neighbouring text parts come as
    one text (the template renders them with nothing between); an image part ends a run."""
    content = message.get("content") or ""
    if isinstance(content, str):
        return [content]
    runs = itertools.groupby(content, key=lambda part: "text" in part)
    return ["".join(p["text"] for p in parts) for is_text, parts in runs if is_text]


def strings_in(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys too (a template may render either)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


def scored_alternatives(request: CompletionRequest) -> int | None:
    """The alternatives to score each prompt token with: for `prompt_logprobs`, and for an
    `echo` with `logprobs` (None: neither asks for the prompt's scores)."""
    asked = [request.prompt_logprobs, request.logprobs if request.echo else None]
    return max((a for a in asked if a is not None), default=None)


def check_scored(request: GenerationRequest, prepared: list[PreparedRequest]) -> None:
    """A 400 if the prompts' tokens the reply would score (a legacy `echo` with `logprobs`
    in each of its n choices, `prompt_logprobs` once for a chat and in each choice of a legacy
    completion), with their alternatives, are more than MAX_SCORED_ENTRIES."""
    tokens = sum(len(p.prompt_ids) for p in prepared)
    asked = [("prompt_logprobs", request.prompt_logprobs, 1)]  # a chat's: beside its choices
    if isinstance(request, CompletionRequest):  # in each choice, as the echo's
        echoed = request.logprobs if request.echo else None
        asked = [
            ("echo", echoed, request.n),
            ("prompt_logprobs", request.prompt_logprobs, request.n),
        ]
    for param, alternatives, copies in asked:
        if alternatives is None:
            continue
        entries = tokens * (1 + alternatives) * copies
        if entries > MAX_SCORED_ENTRIES:
            raise bad_request(
                f"{param} would reply with {entries} logprobs ({tokens} prompt tokens × "
                f"({alternatives} alternatives + 1) × {copies}), over {MAX_SCORED_ENTRIES}",
                param=param,
            )


def unique_id(kind: str, request_id: str) -> str:
    """A reply id holding the client's request id, made unique: clients reuse theirs."""
    return (
        f"{kind}-{request_id}-{uuid.uuid4().hex[:8]}"
        if request_id
        else f"{kind}-{uuid.uuid4().hex}"
    )


def output_grammar(request: GenerationRequest) -> str:
    """llguidance grammar text for the request's structured output ("": none)."""
    fmt = request.response_format
    param = (request.output_constraints() or [""])[0]
    forced = ForcedTools.of(request) if isinstance(request, ChatCompletionRequest) else None
    try:
        if forced is not None:
            return json_schema_grammar(forced.schema())
        if fmt is not None and fmt.type == "json_object":
            return json_schema_grammar({"type": "object"})
        if fmt is not None and fmt.json_schema is not None:
            return json_schema_grammar(fmt.json_schema.schema_)
        if request.guided_json is not None:
            guided = request.guided_json
            return json_schema_grammar(json.loads(guided) if isinstance(guided, str) else guided)
        if request.guided_regex is not None:
            return regex_grammar(request.guided_regex)
        if request.guided_choice is not None:
            return choice_grammar(request.guided_choice)
        if request.guided_grammar is not None:
            return lark_grammar(request.guided_grammar)
    except (ValueError, RecursionError) as e:  # not JSON, or not a schema llguidance reads
        raise bad_request(f"invalid {param}: {str(e)[:500]}", param=param) from None
    return ""


class HasGrammars(Protocol):
    @property
    def grammars(self) -> Grammars: ...  # built on first use (a second for a large vocabulary)


def check_grammar(engine: HasGrammars, sampling: SamplingParams) -> None:
    """A 400 naming the problem for a grammar this tokenizer cannot follow (or for a tokenizer
    llguidance cannot read). Call it off the event loop: it may compile."""
    if not sampling.grammar:
        return
    try:
        engine.grammars.check(sampling.grammar)
    except GrammarUnavailable as e:
        raise bad_request(str(e), code="structured_outputs_unavailable") from None
    except GrammarError as e:
        raise bad_request(f"structured output: {e}", code="invalid_grammar") from None
