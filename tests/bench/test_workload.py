"""The bench's requests: seeded, about the asked size, images fresh or repeated."""

import itertools

from epd.bench.config import BenchConfig
from epd.bench.sharegpt import Sample
from epd.bench.workload import bodies, conversations


def config(**changes):
    return BenchConfig(**({"prompt_tokens": 20, "output_tokens": 5} | changes))


def test_text_requests_ask_for_exact_lengths_and_differ():
    first, second = bodies(config(), "m", 2)
    text = first["messages"][0]["content"][-1]["text"]
    assert len(text.split()) == 20 and first["max_tokens"] == 5 and first["ignore_eos"]
    assert text != second["messages"][0]["content"][-1]["text"]
    assert bodies(config(), "m", 2) == [first, second]  # seeded


def test_images_are_fresh_per_request_unless_repeated():
    fresh = bodies(config(images=2, image_width=56, image_height=28), "m", 2)
    urls = [[p["image_url"]["url"] for p in b["messages"][0]["content"][:-1]] for b in fresh]
    assert len(urls[0]) == 2 and urls[0] != urls[1]
    repeated = bodies(config(images=1, repeat_images=True), "m", 3)
    assert len({b["messages"][0]["content"][0]["image_url"]["url"] for b in repeated}) == 1


def test_a_shared_system_prompt_and_conversations_in_turns():
    config = BenchConfig(
        requests=6,
        prompt_tokens=5,
        output_tokens=4,
        system_prompt_tokens=30,
        turns=3,
        images=1,
        image_width=32,
        image_height=32,
    )
    talks = conversations(config, "m", config.requests)
    assert [len(turns) for turns in talks] == [3, 3]
    first, second = talks
    system = first[0]["messages"][0]
    assert system["role"] == "system" and len(system["content"].split()) == 30
    assert all(turns[0]["messages"][0] == system for turns in talks)  # shared by every request
    for earlier, later in itertools.pairwise(first):  # each turn repeats the ones before
        assert later["messages"][: len(earlier["messages"])] == earlier["messages"]
        assert [m["role"] for m in later["messages"][len(earlier["messages"]) :]] == [
            "assistant",
            "user",
        ]
    image = first[0]["messages"][1]["content"][0]
    assert image["type"] == "image_url" and first[2]["messages"][1]["content"][0] == image
    assert second[0]["messages"][1] != first[0]["messages"][1]  # a new conversation's own
    assert bodies(config, "m", 2, offset=4) == second[1:]


def test_the_legacy_completions_endpoint_gets_the_conversation_as_one_prompt():
    config = BenchConfig(
        endpoint="/v1/completions", prompt_tokens=6, output_tokens=3, system_prompt_tokens=4
    )
    (body,) = bodies(config, "m", 1)
    assert "messages" not in body and body["max_tokens"] == 3 and body["stream"]
    system, user = body["prompt"].split("\n\n")
    assert len(system.split()) == 4 and len(user.split()) == 6
    assert body == bodies(config, "m", 1)[0]  # seeded too


def test_samples_give_each_request_its_text_and_length_repeated_where_too_few():
    samples = [Sample("first prompt", 7), Sample("second prompt", 9)]
    found = bodies(config(), "m", 3, samples=samples)
    texts = [b["messages"][0]["content"][-1]["text"] for b in found]
    assert texts == ["first prompt", "second prompt", "first prompt"]
    assert [b["max_tokens"] for b in found] == [7, 9, 7]
    warm = bodies(config(), "m", 1, offset=3, samples=samples)  # the warm-up's, after them
    assert warm[0]["messages"][0]["content"][-1]["text"] == "second prompt"
