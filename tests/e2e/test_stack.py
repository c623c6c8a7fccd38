"""The three-process stack through the official openai client, against the one-process path."""

import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from PIL import Image

from epd.checkpoint.tokenizer import load_tokenizer
from epd.multimodal.prompt import render_prompt

from .stack import data_url, health, image_part, text_part

RED = data_url(Image.new("RGB", (840, 560), "red"))  # grid (40, 60): 600 tokens
BLUE = data_url(Image.new("RGB", (560, 280), "blue"))  # grid (20, 40): 200 tokens
GREEN_JPEG = data_url(Image.new("RGB", (300, 200), "green"), "JPEG")

CASES = {
    "text only": [{"role": "user", "content": "Hello there"}],
    "one image": [{"role": "user", "content": [image_part(RED), text_part("What colour is it?")]}],
    "two sizes": [
        {"role": "user", "content": [image_part(RED), image_part(BLUE), text_part("Compare them.")]}
    ],
    "across turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image_part(RED), text_part("Colour?")]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": [text_part("And this one?"), image_part(GREEN_JPEG)]},
    ],
}


def ask(client, model, messages, **params):
    return client.chat.completions.create(model=model, messages=messages, **params)


def body(model, messages, **params):
    return {"model": model, "messages": messages, **params}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_single_process(client, model_name, local, case):
    params = {"max_tokens": 24, "temperature": 0, "logprobs": True}
    reply = ask(client, model_name, CASES[case], **params)
    expected = local.chat(body(model_name, CASES[case], **params))
    choice = reply.choices[0]
    assert [t.token for t in choice.logprobs.content] == [
        e.token for d in expected.deltas for e in d.logprobs
    ]
    # The image prompts run in chunks here (over 512 tokens) and whole in the one-process path.
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [e.logprob for d in expected.deltas for e in d.logprobs], abs=1e-4
    )
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == expected.prompt_tokens


def test_prompt_tokens_count_image_tokens(client, model_name, tiny_checkpoint):
    messages = CASES["two sizes"]
    reply = ask(client, model_name, messages, max_tokens=1)
    text_tokens = (
        len(render_prompt(load_tokenizer(tiny_checkpoint), messages)) - 2
    )  # 2 placeholders
    assert reply.usage.prompt_tokens == text_tokens + 600 + 200


def test_streaming_equals_non_streaming(client, model_name):
    messages = CASES["one image"]
    whole = ask(client, model_name, messages, max_tokens=20, temperature=0)
    chunks = list(
        ask(
            client,
            model_name,
            messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_concurrent_requests_each_equal_single_process(client, model_name, local):
    jobs = [(case, n) for n, case in enumerate(CASES)] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(
            pool.map(
                lambda job: ask(
                    client, model_name, CASES[job[0]], max_tokens=16 + job[1], temperature=0
                ),
                jobs,
            )
        )
    for (case, n), reply in zip(jobs, replies, strict=True):
        expected = local.chat(body(model_name, CASES[case], max_tokens=16 + n, temperature=0))
        assert reply.choices[0].message.content == expected.text, case


def test_seeded_sampling_equals_single_process(client, model_name, local):
    params = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 11}
    reply = ask(client, model_name, CASES["one image"], **params, extra_body={"top_k": 50})
    expected = local.chat(body(model_name, CASES["one image"], **params, top_k=50))
    assert reply.choices[0].message.content == expected.text
    again = ask(client, model_name, CASES["one image"], **params, extra_body={"top_k": 50})
    assert again.choices[0].message.content == reply.choices[0].message.content


def test_stop_string_and_max_tokens(client, model_name, local):
    free = local.chat(body(model_name, CASES["text only"], max_tokens=30, temperature=0)).text
    stop = free[5:8]
    reply = ask(client, model_name, CASES["text only"], max_tokens=30, temperature=0, stop=[stop])
    assert reply.choices[0].message.content == free[: free.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    short = ask(client, model_name, CASES["text only"], max_completion_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


INTERNAL_HOSTS = ("127.0.0.1", "127.1", "0x7f000001", "0.0.0.0", "[::1]", "localhost")


@pytest.mark.parametrize("host", [*INTERNAL_HOSTS, "10.0.0.7", "169.254.169.254"])
def test_image_urls_to_internal_addresses_are_refused(client, model_name, host):
    """By default prefill fetches only from public addresses: no loopback or private network."""
    messages = [{"role": "user", "content": [image_part(f"http://{host}:7102/x.png")]}]
    with pytest.raises(openai.BadRequestError, match=r"image 0: host .* is not a public address"):
        ask(client, model_name, messages, max_tokens=2)


def test_corrupt_image_is_400_naming_it(client, model_name):
    png = io.BytesIO()
    Image.new("RGB", (200, 200), "red").save(png, "PNG")
    truncated = png.getvalue()[:-60]  # the header reads, the pixels do not
    import base64

    url = "data:image/png;base64," + base64.b64encode(truncated).decode()
    messages = [{"role": "user", "content": [image_part(RED), image_part(url)]}]
    with pytest.raises(openai.BadRequestError, match="image 1: corrupt image data"):
        ask(client, model_name, messages, max_tokens=4)
    # The stack is unharmed.
    again = ask(
        client, model_name, CASES["one image"], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert again.usage.completion_tokens == 2


def test_a_repeated_image_skips_encode_and_answers_the_same(stack, client, model_name, local):
    _, base = stack
    messages = [
        {
            "role": "user",
            "content": [image_part(data_url(Image.new("RGB", (140, 84), "teal"))), text_part("?")],
        }
    ]
    before = prefill_health(base)["image_cache"]
    replies = [ask(client, model_name, messages, max_tokens=8, temperature=0) for _ in range(2)]
    after = prefill_health(base)["image_cache"]
    assert (after["misses"] - before["misses"], after["hits"] - before["hits"]) == (1, 1)
    expected = local.chat(body(model_name, messages, max_tokens=8, temperature=0)).text
    assert [r.choices[0].message.content for r in replies] == [expected, expected]


def test_cached_and_new_images_keep_their_places(stack, client, model_name, local):
    """[seen, new, seen again]: cached rows and freshly encoded ones land in prompt order."""
    seen = data_url(Image.new("RGB", (112, 56), "olive"))
    ask(client, model_name, [{"role": "user", "content": [image_part(seen)]}], max_tokens=1)
    new = data_url(Image.new("RGB", (56, 84), "navy"))
    content = [image_part(seen), image_part(new), image_part(seen), text_part("Which?")]
    messages = [{"role": "user", "content": content}]
    reply = ask(client, model_name, messages, max_tokens=12, temperature=0, logprobs=True)
    expected = local.chat(body(model_name, messages, max_tokens=12, temperature=0, logprobs=True))
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for d in expected.deltas for e in d.logprobs], abs=1e-4
    )
    assert reply.choices[0].message.content == expected.text


def prefill_health(base):
    return health(base + 20)[1]
