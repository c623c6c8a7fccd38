"""A request's images on the encoders: judged on the encoders a send would use, and counted
in an encoder's queue only while they are on their way to it or in it."""

import asyncio

import pytest

import epd.prefill.encode_load as encode_load
from epd.config.roles import PrefillConfig
from epd.generation.params import SamplingParams
from epd.prefill.encoding import Encoding
from epd.prefill.errors import EncoderLost, Overloaded, Unavailable
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.request import PreparedRequest
from epd.prefill.router import LAST_WORDS_S, Router
from epd.wire.outbox import Losses

BUSY, IDLE = "ipc://busy-encoder", "ipc://idle-encoder"


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(encode_load.time, "perf_counter", lambda: now[0])
    return now


def encoding_of(checkpoint, tmp_path, clock) -> Encoding:
    """An Encoding over two live encoders, BUSY and IDLE, both measured at 1000 patches a
    second, BUSY with 40 s of another request's work out (the time limit is 60 s)."""
    config = PrefillConfig(
        model=str(checkpoint),
        bind=f"ipc://{tmp_path}/prefill",
        encoders=(BUSY, IDLE),
        encode_timeout_s=60,
    )
    router = Router(config, 1 << 20, PrefillMetrics("tiny"))
    router.outbox.is_up = lambda address: True
    for number, encoder in enumerate((BUSY, IDLE)):
        router.load.sending(("warm", number), encoder, 1000)
    clock[0] += 1.0
    for number in range(2):
        router.load.replied(("warm", number))
    router.load.sending(("other", 0), BUSY, 40_000)
    return Encoding(config, None, router, PrefillMetrics("tiny"))  # type: ignore[arg-type]


def request(patches: int) -> PreparedRequest:
    """A one-image request of `patches` patches (never decoded: nothing is encoded here)."""
    return PreparedRequest("r", [1], [b"image"], ((patches // 10, 10),), (1,), SamplingParams(4))


def test_an_image_is_judged_on_the_encoder_a_send_would_give_it_to(
    tiny_checkpoint, tmp_path, clock
):
    """BUSY comes first in the configured order and in this send's rotation, and cannot take
    10 s more in time; IDLE can: the request is admitted on IDLE, and sent there."""

    async def main():
        encoding = encoding_of(tiny_checkpoint, tmp_path, clock)
        router = encoding.router
        with pytest.raises(Overloaded, match="40000 image patches"):  # BUSY's own, not all
            router.load.admit([(BUSY, 10_000)])
        encoding.check_room([b"image"], ((1000, 10),))  # judged on IDLE
        sent = []
        router.outbox.send = lambda peer, message: sent.append(peer) or True
        router.pick = lambda peers, role: asyncio.sleep(0, [BUSY, IDLE])  # BUSY's turn
        task = asyncio.ensure_future(encoding.encode_images(request(10_000), [0]))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close()
        return sent, router.load.held(IDLE)

    assert asyncio.run(main()) == ([IDLE], 10_000)


def test_a_part_that_never_reaches_its_encoder_leaves_its_queue(tiny_checkpoint, tmp_path, clock):
    """A send the outbox refuses at once, or gives up on later, fails its request and takes
    its part out of that encoder's queue (not another's): left there, it held the queue up
    and refused every later request for up to 2 × encode_timeout_s."""

    async def main():
        encoding = encoding_of(tiny_checkpoint, tmp_path, clock)
        router, load = encoding.router, encoding.router.load
        router.outbox.send = lambda peer, message: False
        router.pick = lambda peers, role: asyncio.sleep(0, [IDLE])
        with pytest.raises(Unavailable, match="not reachable"):
            await encoding.encode_images(request(50_000), [0])
        assert load.held(IDLE) == 0
        encoding.admit(encoding.parts(((10, 10),), [0], [IDLE]))  # a small one goes

        load.sending(("lost", 0), IDLE, 50_000)  # queued for IDLE, never delivered
        load.sending(("lost", 1), BUSY, 100)  # delivered: BUSY has it to do
        polls = iter([Losses(requests=[(IDLE, "lost")])])
        router.outbox.poll = lambda: next(polls, Losses())
        watching = asyncio.ensure_future(router.watch_peers())
        await asyncio.sleep(0.05)
        watching.cancel()
        held = load.held(IDLE), load.held(BUSY)
        encoding.admit(encoding.parts(((10, 10),), [0], [IDLE]))
        router.close()
        return held

    assert asyncio.run(main()) == (0, 40_100)


def test_images_whose_encoder_was_lost_are_encoded_again_on_the_others(
    tiny_checkpoint, tmp_path, clock
):
    """A lost encoder's waits fail with EncoderLost (once its last words are read), and the
    request's images are sent again, their parts numbered apart from the lost try's, up to
    migration_limit times."""
    encoding = encoding_of(tiny_checkpoint, tmp_path, clock)
    router = encoding.router

    async def lose() -> BaseException | None:
        waiting = router.expect("r", 0, BUSY)
        router.fail_held_by(BUSY)
        await asyncio.sleep(LAST_WORDS_S + 0.2)
        return waiting.exception()

    assert isinstance(asyncio.run(lose()), EncoderLost)
    tries = []

    async def encode_images(request, indices, attempt=0):
        tries.append(attempt)
        if attempt < 2:
            raise EncoderLost(f"lost the encoder of try {attempt}")
        return ["rows"]

    encoding.encode_images = encode_images
    assert asyncio.run(encoding.encode_moving_on(request(100), [0])) == ["rows"]
    assert tries == [0, 1, 2]
    moved = encoding.metrics.migrations.labels("encode", "resumed")._value.get()
    assert moved == 2
    tries.clear()
    object.__setattr__(encoding.config, "migration_limit", 1)
    with pytest.raises(EncoderLost, match="try 1"):
        asyncio.run(encoding.encode_moving_on(request(100), [0]))
    assert tries == [0, 1]
