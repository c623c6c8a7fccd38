import pytest

from epd.local import LocalPipeline


@pytest.fixture(scope="module")
def local(tiny_checkpoint):
    return LocalPipeline(tiny_checkpoint)


def test_the_first_text_is_timed_where_a_streaming_client_sees_it(local):
    """A random model's first token is often a piece of a UTF-8 character, whose text shows
    only with a later token: the time to the first text then runs past the first token's."""
    held_back = shown = 0
    for i in range(12):  # greedy: the same outputs every run
        body = {"model": "m", "prompt": [10 + i, 20, 30], "max_tokens": 6, "temperature": 0}
        reply = local.complete(body)
        if reply.first_text_s is not None:
            assert reply.first_token_s <= reply.first_text_s <= reply.total_s
        if reply.deltas[0].text:
            shown += 1
            assert reply.first_text_s == reply.first_token_s
        elif any(delta.text for delta in reply.deltas):
            held_back += 1
            assert reply.first_text_s > reply.first_token_s
    assert held_back and shown  # both kinds met, or the test would prove nothing


def test_a_reply_without_text_has_no_time_to_its_first_text(local):
    for i in range(12):
        body = {"model": "m", "prompt": [10 + i, 20, 30], "max_tokens": 1, "temperature": 0}
        reply = local.complete(body)
        if not reply.text:
            assert reply.first_text_s is None
            return
    pytest.fail("no one-token reply without text among these prompts")
