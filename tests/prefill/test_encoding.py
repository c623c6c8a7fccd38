"""A request's images on the encoders: judged on the encoders a send would use."""

import asyncio

import pytest

import epd.prefill.encode_load as encode_load
from epd.config.roles import PrefillConfig
from epd.generation.params import SamplingParams
from epd.prefill.encoding import Encoding
from epd.prefill.errors import Overloaded
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.request import PreparedRequest
from epd.prefill.router import Router

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
    return Encoding(config, None, router, PrefillMetrics("tiny"), lambda: True)  # type: ignore[arg-type]


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
