"""What ordinary OpenAI and vLLM clients send, over the three processes, against the one-process
path: routine fields, an earlier reply echoed back, and the sampling controls."""

import asyncio
import contextlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from .test_stack import CASES, ask, body

TEXT = CASES["text only"]
IMAGE = CASES["one image"]


def tokens(reply):
    return [t.token for t in reply.choices[0].logprobs.content]


def local_tokens(completion):
    return [e.token for d in completion.deltas for e in d.logprobs]


@pytest.fixture(scope="module")
def free(local, model_name):
    """The greedy reply without controls, whose tokens the controls below act on."""
    return local.chat(body(model_name, TEXT, max_tokens=24, temperature=0, logprobs=True))


def controls_for(free):
    ids = free.token_ids
    return {
        "logit_bias bans the first token": {"logit_bias": {str(ids[0]): -100}},
        "logit_bias forces a token": {"logit_bias": {"42": 100}},
        "frequency_penalty": {"frequency_penalty": 2.0},
        "presence_penalty": {"presence_penalty": 2.0},
        "repetition_penalty": {"repetition_penalty": 3.0},
        "stop_token_ids": {"stop_token_ids": [ids[0]]},
        "min_tokens bans the stop token": {"stop_token_ids": [ids[0]], "min_tokens": 2},
    }


CONTROLS = [
    "logit_bias bans the first token",
    "logit_bias forces a token",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "min_tokens bans the stop token",
]


@pytest.mark.parametrize("name", CONTROLS)
def test_controls_change_greedy_output_as_the_one_process_path_does(
    client, model_name, local, free, name
):
    extra = controls_for(free)[name]
    params = {"max_tokens": 24, "temperature": 0, "logprobs": True}
    reply = ask(client, model_name, TEXT, **params, extra_body=extra)
    expected = local.chat(body(model_name, TEXT, **params, **extra))
    assert tokens(reply) == local_tokens(expected)
    assert reply.choices[0].message.content == expected.text
    assert expected.token_ids != free.token_ids  # the control did something
    ids = expected.token_ids
    if name == "logit_bias bans the first token":
        assert free.token_ids[0] not in ids
    if name == "logit_bias forces a token":
        assert set(ids) == {42}
    if name == "stop_token_ids":  # the first token, sampled by prefill, ends it
        assert ids == free.token_ids[:1] and reply.choices[0].finish_reason == "stop"
    if name in ("frequency_penalty", "presence_penalty"):  # the free reply repeats one token
        assert len(set(ids)) == len(ids) > len(set(free.token_ids))
    if name == "min_tokens bans the stop token":
        assert ids[0] != free.token_ids[0]


def test_seeded_min_p_sampling_equals_the_one_process_path(client, model_name, local):
    params = {"max_tokens": 16, "temperature": 1.5, "seed": 5}
    extra = {"min_p": 0.2, "repetition_penalty": 1.3}
    reply = ask(client, model_name, IMAGE, **params, extra_body=extra)
    expected = local.chat(body(model_name, IMAGE, **params, **extra))
    assert reply.choices[0].message.content == expected.text


def test_routine_fields_and_an_echoed_reply_are_accepted(client, model_name, local):
    routine = {
        "response_format": {"type": "text"},
        "metadata": {"session": "s1"},
        "store": False,
        "user": "user-1",
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "n": 1,
    }
    first = ask(client, model_name, TEXT, max_tokens=8, temperature=0, **routine)
    # The openai client's own dump of the reply: refusal, tool_calls, audio... all null.
    echoed = first.choices[0].message.model_dump()
    assert echoed["tool_calls"] is None and "refusal" in echoed
    conversation = [*TEXT, echoed, {"role": "user", "content": "And then?"}]
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # Qwen's; Kimi's reads none
    reply = ask(
        client,
        model_name,
        conversation,
        max_tokens=12,
        temperature=0,
        **routine,
        extra_body=thinking,
    )
    expected = local.chat(body(model_name, conversation, max_tokens=12, temperature=0))
    assert reply.choices[0].message.content == expected.text


def test_an_answer_the_client_began_is_continued_as_the_one_process_path_does(
    client, model_name, local
):
    begun = [*TEXT, {"role": "assistant", "content": "It is a"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    reply = ask(client, model_name, begun, max_tokens=12, temperature=0, extra_body=extra)
    expected = local.chat(body(model_name, begun, max_tokens=12, temperature=0, **extra))
    fresh = local.chat(body(model_name, begun, max_tokens=12, temperature=0))
    assert reply.choices[0].message.content == expected.text != fresh.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens < fresh.prompt_tokens
    # vLLM's `echo`: the reply begins with the answer the client began, whole or streamed.
    echo = {**extra, "echo": True}
    whole = ask(client, model_name, begun, max_tokens=12, temperature=0, extra_body=echo)
    assert whole.choices[0].message.content == "It is a" + expected.text
    chunks = ask(
        client, model_name, begun, max_tokens=12, temperature=0, stream=True, extra_body=echo
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    plain = ask(client, model_name, TEXT, max_tokens=3, temperature=0, extra_body={"echo": True})
    assert (
        plain.choices[0].message.content
        == local.chat(body(model_name, TEXT, max_tokens=3, temperature=0)).text
    )  # the last message is the user's: nothing to echo


def test_asking_for_what_is_not_there_names_the_field(client, model_name):
    with pytest.raises(openai.BadRequestError, match="audio output") as error:
        ask(client, model_name, TEXT, extra_body={"modalities": ["text", "audio"]})
    assert error.value.body["param"] == "audio"
    with pytest.raises(openai.BadRequestError, match="max_n"):
        ask(client, model_name, TEXT, n=17)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        ask(client, model_name, TEXT, logit_bias={"10000000": 5})


def test_async_streaming_with_controls_equals_non_streaming(stack, model_name, local):
    _, base = stack
    extra = {"min_tokens": 4, "skip_special_tokens": False}

    async def stream() -> str:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="unused", max_retries=0
        )
        chunks = await client.chat.completions.create(
            model=model_name,
            messages=IMAGE,
            max_tokens=20,
            temperature=0,
            frequency_penalty=1.5,
            stream=True,
            extra_body=extra,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        await client.close()
        return text

    params = {"max_tokens": 20, "temperature": 0, "frequency_penalty": 1.5, **extra}
    expected = local.chat(body(model_name, IMAGE, **params))
    assert asyncio.run(stream()) == expected.text


def test_stream_chunks_carry_usage_null_until_the_last_and_the_request_id(stack, model_name):
    _, base = stack
    request = {
        "model": model_name,
        "messages": TEXT,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # an unseeded sample may draw eos before 5
    }
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{base + 20}/v1/chat/completions",
        json=request,
        headers={"x-request-id": "trace-7"},
        timeout=60,
    ) as response:
        assert response.headers["x-request-id"] == "trace-7"
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[0]["id"].startswith("chatcmpl-trace-7-")  # the id logs carry


def test_a_repeated_long_prompt_reports_the_tokens_prefill_s_prefix_cache_gave(client, model_name):
    """The openai client reads usage.prompt_tokens_details.cached_tokens: the first time at
    most the chat template's opening that other requests share, then every whole 16-token
    block that prefill kept of the prompt, all but its last token's."""
    story = " ".join(f"the {i}th square is red" for i in range(12))
    messages = [{"role": "user", "content": story}]
    params = {"max_tokens": 2, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first, again = (ask(client, model_name, messages, **params).usage for _ in range(2))
    cached = again.prompt_tokens_details.cached_tokens
    assert cached == (again.prompt_tokens - 1) // 16 * 16 > 16
    assert first.prompt_tokens_details.cached_tokens < cached


def test_a_model_by_id_through_the_client(client, model_name):
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("someone/else")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_json_schema_output_is_valid_on_a_random_model(client, model_name, local, sampling):
    strict = {**JSON_SCHEMA, "json_schema": {**JSON_SCHEMA["json_schema"], "strict": True}}
    reply = ask(client, model_name, TEXT, max_tokens=200, response_format=strict, **sampling)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert reply.choices[0].finish_reason == "stop" and not re.search(r"[\n\t]| [,:{}]", text)
    expected = local.chat(
        body(model_name, TEXT, max_tokens=200, response_format=strict, **sampling)
    )
    assert text == expected.text


def test_vllm_guided_extras(client, model_name, local):
    choices = ["circle", "square", "triangle"]
    for extra, check in [
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"guided_regex": r"[a-z]{3,8}@[a-z]{2,5}\.com"}, lambda t: "@" in t and t[-4:] == ".com"),
        ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (
            {"guided_grammar": 'start: "x" ("y" | "z")~2..4'},
            lambda t: re.fullmatch("x[yz]{2,4}", t),
        ),
        # vLLM's current name for them
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
    ]:
        reply = ask(client, model_name, IMAGE, max_tokens=120, temperature=0, extra_body=extra)
        text = reply.choices[0].message.content
        assert check(text) is not False, (extra, text)
        assert (
            text == local.chat(body(model_name, IMAGE, max_tokens=120, temperature=0, **extra)).text
        )


def test_json_object_streams_what_it_returns_whole(stack, client, model_name):
    _, base = stack
    params = {"max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}
    whole = ask(client, model_name, TEXT, **params).choices[0].message.content
    assert whole.startswith("{") and not re.search(r"^\{\s", whole)

    async def stream() -> str:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="unused", max_retries=0
        )
        chunks = await client.chat.completions.create(
            model=model_name, messages=TEXT, stream=True, **params
        )
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        await client.close()
        return text

    assert asyncio.run(stream()) == whole


@pytest.mark.parametrize(
    "extra,fragment",
    [
        ({"guided_regex": "(unclosed"}, "unusable grammar"),
        ({"guided_json": "{not json"}, "invalid guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "give one of"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            "structured output: unusable grammar: Invalid type: nonsense",
        ),
    ],
)
def test_unusable_structured_output_is_a_400(client, model_name, extra, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        ask(client, model_name, TEXT, max_tokens=5, extra_body=extra)


def test_a_grammar_that_gives_up_is_a_400_each_time_it_is_asked(client, model_name):
    # The lexer reaches its limit at the first token; later copies of the compiled grammar
    # shared that lexer and once answered 200 with an empty reply the regex does not accept.
    for _ in range(3):
        with pytest.raises(openai.BadRequestError, match="lexer"):
            ask(client, model_name, TEXT, max_tokens=5, extra_body={"guided_regex": "a{999999}"})


def test_n_choices_are_each_sampled_on_their_own_and_reproducible(client, model_name, local):
    params = {"max_tokens": 12, "temperature": 1.2, "seed": 21}
    reply = ask(client, model_name, IMAGE, n=3, **params)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) > 1
    together = local.chat(body(model_name, IMAGE, n=3, **params))
    assert texts == [c.text for c in together.choices]
    for i, text in enumerate(texts):  # choice i is the request seeded with seed + i
        alone = local.chat(body(model_name, IMAGE, **(params | {"seed": 21 + i})))
        assert text == alone.text
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in together.choices)
    assert reply.usage.prompt_tokens == together.prompt_tokens  # the prompt counted once


def test_n_choices_stream_with_their_index(client, model_name):
    params = {"max_tokens": 6, "temperature": 0, "n": 2}
    whole = ask(client, model_name, TEXT, **params)
    assert whole.choices[0].message.content == whole.choices[1].message.content  # greedy
    chunks = list(
        ask(client, model_name, TEXT, stream=True, stream_options={"include_usage": True}, **params)
    )
    texts, finishes = ["", ""], [None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_legacy_completions_equal_the_one_process_path(client, model_name, local):
    params = {"max_tokens": 12, "temperature": 0, "logprobs": 2}
    prompt = "The red circle and the blue square"
    reply = client.completions.create(model=model_name, prompt=prompt, **params)
    expected = local.complete({"model": model_name, "prompt": prompt, **params})
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.text == expected.text
    assert choice.logprobs.tokens == [e.token for d in expected.deltas for e in d.logprobs]
    assert len(choice.logprobs.top_logprobs[0]) == 2
    assert choice.logprobs.text_offset[1] == len(choice.logprobs.tokens[0])
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    ids = local.builder.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=model_name, prompt=ids, **params)
    assert by_ids.choices[0].text == choice.text  # token ids are the same prompt


def test_legacy_completions_stream_and_default_to_16_tokens(client, model_name):
    whole = client.completions.create(
        model=model_name, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 16  # this API's default max_tokens
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt="Once upon a time",
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [whole.choices[0].text] * 2
    assert chunks[-1].usage.completion_tokens == 32


def test_legacy_completions_follow_a_response_format(client, model_name, local):
    """vLLM's legacy endpoint takes response_format too: a JSON object from the random model,
    as the one-process path writes it."""
    prompt, json_object = "The red circle as JSON:", {"type": "json_object"}
    params = {"model": model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0}
    reply = client.completions.create(**params, extra_body={"response_format": json_object})
    text = reply.choices[0].text
    assert text.startswith("{") and not text.startswith("{ ")
    assert text == local.complete({**params, "response_format": json_object}).text
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_legacy_completions_take_a_benchmarks_many_stop_strings(client, model_name, local):
    """lm-eval's local-completions sends a task's stop strings as they are: HumanEval's five,
    and the eos text, over OpenAI's 4; the reply is cut as the one-process path cuts it."""
    prompt, params = "def add(a, b):", {"max_tokens": 24, "temperature": 0}
    free = local.complete({"model": model_name, "prompt": prompt, "ignore_eos": True, **params})
    assert len(free.text) >= 9
    stop = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|im_end|>", free.text[6:9]]
    reply = client.completions.create(
        model=model_name, prompt=prompt, stop=stop, extra_body={"ignore_eos": True}, **params
    )
    body = {"model": model_name, "prompt": prompt, "stop": stop, "ignore_eos": True, **params}
    expected = local.complete(body)
    choice = reply.choices[0]
    assert choice.text == expected.text and len(choice.text) <= 6
    assert choice.finish_reason == "stop"
    assert choice.stop_reason in stop  # vLLM's extra, from decode over the wire
    assert reply.system_fingerprint.startswith("epd-")
    kept = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept_text = (
        client.completions.create(
            model=model_name, prompt=prompt, stop=stop, extra_body=kept, **params
        )
        .choices[0]
        .text
    )
    assert kept_text == local.complete(body | kept).text
    assert kept_text.startswith(choice.text) and kept_text[len(choice.text) :] in stop


def test_legacy_completions_take_several_prompts(client, model_name, local):
    """LangChain's OpenAI.batch and lm-eval send a list: each prompt's n choices in turn, each
    as that prompt alone gets it, whole and streamed; usage over all of them."""
    prompts = ["The red circle", "Once upon a time", "A blue square is"]
    params = {"max_tokens": 6, "temperature": 0, "n": 2}
    reply = client.completions.create(model=model_name, prompt=prompts, **params)
    alone = [local.complete({"model": model_name, "prompt": p, **params}) for p in prompts]
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [a.text for a in alone for _ in range(2)]
    assert reply.usage.prompt_tokens == sum(a.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == sum(2 * len(a.token_ids) for a in alone)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=prompts,
            stream=True,
            stream_options={"include_usage": True},
            **params,
        )
    )
    texts = [""] * 6
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in reply.choices]
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens


def test_legacy_echo_scores_the_prompt_as_lm_eval_asks(client, model_name, local):
    """lm-eval's loglikelihood request: token-id prompts, echo, one logprob, one new token.
    Each prompt token after the first has its logprob after those before, as the one-process
    path scores it; the first has none; the new token follows, its offset after the text."""
    tokenizer = local.builder.tokenizer
    prompts = [tokenizer.encode("The red circle is"), tokenizer.encode("Once upon a time")]
    params = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "seed": 1234, "echo": True}
    reply = client.completions.create(model=model_name, prompt=prompts, **params)
    for ids, choice in zip(prompts, sorted(reply.choices, key=lambda c: c.index), strict=True):
        alone = local.complete({"model": model_name, "prompt": ids, **params})
        text = tokenizer.decode(ids)
        assert choice.text == text + alone.text
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids) + 1
        assert logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        scored = logprobs.token_logprobs[1 : len(ids)]
        assert scored == pytest.approx([e.logprob for e in alone.prompt_logprobs], abs=1e-5)
        assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
        for token, value, top in zip(
            logprobs.tokens[1:-1], scored, logprobs.top_logprobs[1:-1], strict=True
        ):  # lm-eval's is_greedy: the token is the likeliest where its logprob is the best's
            assert (value == max(top.values())) == (token in top)
        assert logprobs.text_offset[-1] == len(text)  # the new token starts after the prompt
        assert reply.usage.prompt_tokens == sum(map(len, prompts))


def test_legacy_echo_with_max_tokens_0_gives_the_prompt_alone(client, model_name, local):
    """vLLM's and older lm-eval's way to score a prompt: nothing new, the prompt scored."""
    ids = local.builder.tokenizer.encode("The red circle is")
    params = {"max_tokens": 0, "temperature": 0, "logprobs": 1, "echo": True}
    reply = client.completions.create(model=model_name, prompt=ids, **params)
    (choice,) = reply.choices
    alone = local.complete({"model": model_name, "prompt": ids, **params})
    assert choice.text == local.builder.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [e.logprob for e in alone.prompt_logprobs], abs=1e-5
    )
    assert len(choice.logprobs.tokens) == len(ids) and reply.usage.completion_tokens == 0


def test_prompt_logprobs_score_the_prompt_as_vllm_gives_them(client, model_name, local):
    """vLLM's `prompt_logprobs` on a chat with an image: beside the choices, None for the
    first prompt token, then each token by id with its logprob and rank after those before it,
    and its likeliest alternatives ranked; as the one-process path scores them."""
    messages = CASES["one image"]
    params = {"max_tokens": 2, "temperature": 0}
    reply = client.chat.completions.create(
        model=model_name, messages=messages, **params, extra_body={"prompt_logprobs": 2}
    )
    alone = local.chat(body(model_name, messages, **params, prompt_logprobs=2))
    scores = reply.model_extra["prompt_logprobs"]
    assert len(scores) == reply.usage.prompt_tokens == alone.prompt_tokens
    assert scores[0] is None
    tokenizer = local.builder.tokenizer
    for entry, expected in zip(scores[1:], alone.prompt_logprobs, strict=True):
        own = entry[str(expected.token_id)]
        assert own["logprob"] == pytest.approx(expected.logprob, abs=1e-4)
        assert own["rank"] == expected.rank >= 1
        assert own["decoded_token"] == tokenizer.decode([expected.token_id])
        ranked = sorted(entry.items(), key=lambda item: item[1]["rank"])
        best = [(str(t), v) for t, v in expected.top]
        assert [t for t, _ in ranked[:2]] == [t for t, _ in best]  # ties aside
        assert len(entry) == 2 + (str(expected.token_id) not in dict(best))
    # The legacy endpoint gives each choice its prompt's; streaming them is refused, as vLLM.
    ids = tokenizer.encode("The red circle is")
    legacy = client.completions.create(
        model=model_name, prompt=ids, max_tokens=1, n=2, extra_body={"prompt_logprobs": 0}
    )
    for choice in legacy.choices:
        scored = choice.model_extra["prompt_logprobs"]
        assert scored[0] is None and [list(e) for e in scored[1:]] == [[str(t)] for t in ids[1:]]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs cannot be streamed"):
        client.chat.completions.create(
            model=model_name, messages=TEXT, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_legacy_echo_streams_the_prompt_first(client, model_name):
    prompt = "Once upon a time"
    params = {"max_tokens": 4, "temperature": 0, "echo": True, "n": 2}
    whole = client.completions.create(model=model_name, prompt=prompt, **params)
    assert all(c.text.startswith(prompt) and c.logprobs is None for c in whole.choices)
    texts = ["", ""]
    for chunk in client.completions.create(model=model_name, prompt=prompt, stream=True, **params):
        for choice in chunk.choices:
            if not texts[choice.index]:  # each choice's first chunk carries the prompt
                assert choice.text.startswith(prompt)
            texts[choice.index] += choice.text
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        ({"prompt": "x", "max_tokens": 0}, "allowed only with echo"),
        ({"prompt": ["a"] * 65, "n": 2}, "65 prompts of n=2 choices each are more than 128"),
        ({"prompt": ["a", "", "b"]}, "the prompt is empty"),
        ({"prompt": [10**7]}, "outside the vocabulary"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": "<|media_pad|>"}, "image placeholder"),
        ({"prompt": "x", "logprobs": 21}, "invalid logprobs"),
        (  # a bound on what echo's reply holds: 8 × 200 tokens × 21 entries × 2 choices
            {"prompt": [[5] * 200] * 8, "echo": True, "logprobs": 20, "n": 2},
            "would reply with 67200 logprobs",
        ),
    ],
)
def test_legacy_completions_refuse_what_they_cannot_do(client, model_name, params, fragment):
    with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
        client.completions.create(model=model_name, **params)


def test_legacy_completions_follow_a_grammar(client, model_name):
    reply = client.completions.create(
        model=model_name,
        prompt="Pick one:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_choice": ["circle", "square"]},
    )
    assert reply.choices[0].text in ("circle", "square")


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_tool_choice_gives_a_call_with_valid_arguments(client, model_name, local):
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = {"max_tokens": 60, "temperature": 0, "tools": TOOLS, "tool_choice": named}
    reply = ask(client, model_name, ASK_WEATHER, **params)
    choice = reply.choices[0]
    # OpenAI and vLLM finish a named call as its text: `stop` (`tool_calls` is for a list)
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert call.function.arguments == local.chat(body(model_name, ASK_WEATHER, **params)).text

    chunks = list(ask(client, model_name, ASK_WEATHER, stream=True, **params))
    deltas = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert deltas[0][0].id.startswith("call_") and deltas[0][0].function.name == "get_weather"
    assert "".join(d[0].function.arguments for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    short = ask(client, model_name, ASK_WEATHER, **(params | {"max_tokens": 3})).choices[0]
    (cut,) = short.message.tool_calls  # cut short, still the call: whole as streamed
    assert short.finish_reason == "length" and short.message.content is None
    assert call.function.arguments.startswith(cut.function.arguments) and cut.function.arguments


@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_calls_of_the_given_tools(client, model_name, parallel):
    params = {"max_tokens": 400, "temperature": 0, "tools": TOOLS, "tool_choice": "required"}
    reply = ask(client, model_name, ASK_WEATHER, parallel_tool_calls=parallel, **params)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    assert len(calls) == 1 or parallel
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed = list(
        ask(client, model_name, ASK_WEATHER, parallel_tool_calls=parallel, stream=True, **params)
    )
    got = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert [(t.function.name, t.function.arguments) for t in got] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_tool_round_trip_and_auto(client, model_name, local):
    named = {"type": "function", "function": {"name": "get_time"}}
    first = ask(
        client,
        model_name,
        ASK_WEATHER,
        max_tokens=30,
        temperature=0,
        tools=TOOLS,
        tool_choice=named,
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *ASK_WEATHER,
        first.choices[0].message.model_dump(),  # content None, tool_calls as the client got them
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    params = {"max_tokens": 12, "temperature": 0, "tools": TOOLS, "tool_choice": "auto"}
    reply = ask(client, model_name, conversation, **params)
    assert reply.choices[0].message.tool_calls is None  # Kimi-VL's template has no call markup
    assert (
        reply.choices[0].message.content
        == local.chat(body(model_name, conversation, **params)).text
    )


@pytest.mark.parametrize(
    "params,fragment",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS * 2}, "unique"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "give one of",
        ),
    ],
)
def test_unusable_tool_requests_are_400(client, model_name, params, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        ask(client, model_name, ASK_WEATHER, max_tokens=5, **params)


def test_a_tool_message_needs_its_call_id(client, model_name):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        ask(client, model_name, [*ASK_WEATHER, {"role": "tool", "content": "x"}], max_tokens=5)


def test_controls_that_leave_no_token_are_a_400_and_hurt_no_neighbour(client, model_name, local):
    impossible = {"guided_regex": "", "min_tokens": 1}  # only eos fits, and eos is banned
    with ThreadPoolExecutor(2) as pool:
        honest = pool.submit(ask, client, model_name, TEXT, max_tokens=16, temperature=0)
        with pytest.raises(openai.BadRequestError, match="leave no token"):
            ask(client, model_name, TEXT, max_tokens=5, extra_body=impossible)
        expected = local.chat(body(model_name, TEXT, max_tokens=16, temperature=0)).text
        assert honest.result().choices[0].message.content == expected


def test_each_request_ends_with_one_log_line(stack, model_name):
    process, base = stack
    url = f"http://127.0.0.1:{base + 20}/v1/chat/completions"
    done = {"model": model_name, "messages": TEXT, "max_tokens": 5, "ignore_eos": True}
    assert httpx.post(url, json=done, headers={"x-request-id": "log-1"}, timeout=60).is_success
    refused = httpx.post(url, json={**done, "top_p": 7}, headers={"x-request-id": "log-2"})
    assert refused.status_code == 400
    deadline = time.monotonic() + 10
    while "request log-2: 400" not in process.output and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = process.output.splitlines()
    (ok,) = [line for line in lines if "request chatcmpl-log-1-" in line]
    assert " done: " in ok and "+ 5 output tokens, 0 images, TTFT" in ok
    (bad,) = [line for line in lines if "request log-2: 400 after" in line]
    assert "top_p" in bad


def test_a_request_with_headers_past_the_bound_is_refused_and_the_api_goes_on(stack):
    _, base = stack
    url = f"http://127.0.0.1:{base + 20}/v1/models"
    # h11 reads no further than 16 KiB: a 400, sent while the client may still be writing,
    # which then sees the connection reset instead.
    with contextlib.suppress(httpx.TransportError):
        refused = httpx.get(url, headers={"x-padding": "a" * 1_000_000}, timeout=30)
        assert refused.status_code == 400
    assert httpx.get(url, timeout=30).status_code == 200
