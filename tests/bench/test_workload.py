"""The bench's requests: seeded, about the asked size, images fresh or repeated."""

from epd.bench.config import BenchConfig
from epd.bench.workload import bodies


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
