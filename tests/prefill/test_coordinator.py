"""Waits end: a silent encoder or decoder becomes a timeout error, never a hang. And the
prefill settings reach the batcher."""

import asyncio
import base64
import io
import re
from dataclasses import replace

import pytest
import torch
import zmq
from fastapi.testclient import TestClient
from PIL import Image

from epd.api.app import create_app
from epd.api.server import build_service
from epd.config.roles import PrefillConfig
from epd.generation.params import SamplingParams
from epd.generation.status import Status
from epd.prefill import router as router_module
from epd.prefill.coordinator import Coordinator, within
from epd.prefill.encoding import check_payloads, split
from epd.prefill.errors import BadRequest, PrefillError, Unavailable
from epd.prefill.metrics import PrefillMetrics
from epd.prefill.request import PreparedRequest, Request
from epd.prefill.router import DISOWNED_PER_S, EncodeWait
from epd.wire.codec import WireError, decode
from epd.wire.messages import (
    Abort,
    EncodeRequest,
    Failure,
    ImageEmbeddings,
    KVHandoff,
    KVMissing,
    TokenDelta,
)


def ipc_config(checkpoint, tmp_path, **settings) -> PrefillConfig:
    """A prefill's settings with its own, its encoder's and its decoder's sockets in tmp_path."""
    peers = {"encoders": (f"ipc://{tmp_path}/encode",), "decoders": (f"ipc://{tmp_path}/decode",)}
    return PrefillConfig(
        model=str(checkpoint), bind=f"ipc://{tmp_path}/prefill", **(peers | settings)
    )


def test_split_images_over_encoders():
    assert split(5, 2) == [(0, 2), (2, 5)]
    assert split(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split(2, 4) == [(0, 1), (1, 2)]
    assert split(3, 1) == [(0, 3)]


@pytest.mark.parametrize(
    "rows,problem",
    [
        (torch.zeros(8, 16), None),
        (torch.zeros(8, 7), "embeddings 7 wide, not the model's 16"),
        (torch.zeros(9, 16), "9 embedding rows for 8 image slots"),
        (torch.zeros(8, 16), "unusable grids"),  # with the grid (3, 5) below
        (torch.full((8, 16), 7e4), "embeddings up to 7e+04, past torch.float16's range"),
    ],
)
def test_image_payloads_must_fit_the_slots_and_the_model(rows, problem):
    """A payload that does not fit would be cached by its image's hash and fail each later
    request with that image too."""
    request = PreparedRequest("r", [1] * 8, [b"png"], ((4, 8),), (8,), SamplingParams(4))
    grid = (3, 5) if problem == "unusable grids" else (4, 8)
    payload = ImageEmbeddings("r", 0, (grid,), rows)
    if problem is None:
        assert check_payloads(request, [0], [payload], 16, torch.float16)[0].shape == (8, 16)
    else:
        with pytest.raises(PrefillError, match=re.escape(problem)):
            check_payloads(request, [0], [payload], 16, torch.float16)


def test_each_payload_holds_its_own_images_rows():
    """Two encoders' parts whose rows add up but do not match each part's own images: image
    0 must not take a row of image 1 (and be cached by its hash so)."""
    request = PreparedRequest(
        "r", [1] * 8, [b"a", b"b"], ((4, 4), (4, 4)), (4, 4), SamplingParams(4)
    )
    short = ImageEmbeddings("r", 0, ((4, 4),), torch.zeros(1, 16))
    long = ImageEmbeddings("r", 1, ((4, 4),), torch.ones(7, 16))
    with pytest.raises(PrefillError, match="1 embedding rows for 4 image slots"):
        check_payloads(request, [0, 1], [short, long], 16, torch.float32)
    parts = [ImageEmbeddings("r", i, ((4, 4),), torch.full((4, 16), float(i))) for i in (0, 1)]
    rows = check_payloads(request, [0, 1], parts, 16, torch.float32)
    assert [r.unique().tolist() for r in rows] == [[0.0], [1.0]]


def test_within_raises_the_given_error_on_time():
    async def main():
        with pytest.raises(ValueError, match="late"):
            await within(asyncio.sleep(5), 0.05, ValueError("late"))  # type: ignore[arg-type]
        assert await within(asyncio.sleep(0, "on time"), 1, ValueError()) == "on time"  # type: ignore[arg-type]

    asyncio.run(main())


@pytest.fixture
def silent_peers(tiny_checkpoint, tmp_path):
    """A prefill whose encoder and decoder accept messages and never answer."""
    context = zmq.Context()
    sinks = []
    for name in ("encode", "decode"):
        sink = context.socket(zmq.PULL)
        sink.bind(f"ipc://{tmp_path}/{name}")
        sinks.append(sink)
    config = ipc_config(
        tiny_checkpoint,
        tmp_path,
        served_model_name=("tiny",),
        encode_timeout_s=0.5,
        token_timeout_s=0.5,
    )
    with TestClient(create_app(build_service(config))) as client:
        yield client, sinks
    for sink in sinks:
        sink.close(linger=0)
    context.term()


def image_message():
    png = io.BytesIO()
    Image.new("RGB", (28, 28)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def test_silent_encoder_times_out(silent_peers):
    client, (encode_sink, _) = silent_peers
    response = client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": image_message()}
    )
    assert response.status_code == 504
    assert "no image embeddings within 0.5s" in response.json()["error"]["message"]
    assert encode_sink.poll(1000)  # the request did reach the encoder
    sent = decode(encode_sink.recv_multipart())
    assert isinstance(sent, EncodeRequest)


def test_silent_decoder_times_out(silent_peers):
    client, (_, decode_sink) = silent_peers
    # ignore_eos: a first token that ended the reply would need no decoder
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = client.post("/v1/chat/completions", json=body | {"ignore_eos": True})
    assert response.status_code == 504
    assert "decode sent nothing for 0.5s" in response.json()["error"]["message"]
    assert decode_sink.poll(1000)
    sent = decode(decode_sink.recv_multipart())
    assert isinstance(sent, KVHandoff)


def test_the_prefill_budget_and_min_chunk_reach_the_batcher(tiny_checkpoint, tmp_path):
    config = ipc_config(
        tiny_checkpoint,
        tmp_path,
        max_prefill_tokens=64,
        min_chunk_tokens=8,
        threads=2,
        busy_threads=1,
    )
    service = build_service(config)
    with TestClient(create_app(service)):
        coordinator = service.coordinator
        batcher = coordinator.batcher
        assert (batcher.max_tokens, batcher.min_chunk) == (64, 8)
        assert (batcher.threads, batcher.busy_threads) == (2, 1)
        # Fewer threads while another API request is in flight beside the forward's: being
        # read or tokenised, encoding, decoding.
        batcher.forward = [object()]  # type: ignore[list-item]
        service.gate.in_flight = 1  # the forward's own
        assert batcher.forward_threads() == 2
        service.gate.in_flight = 2
        assert batcher.forward_threads() == 1
        service.gate.in_flight = 0
        assert batcher.forward_threads() == 2
        batcher.forward = []
        coordinator.requests["decoding"] = Request("decoding", status=Status.DECODING)
        assert batcher.forward_threads() == 1
        assert coordinator.counts() == {"encoding": 0, "waiting": 0, "running": 0, "decoding": 1}
        del coordinator.requests["decoding"]
        coordinator.requests["encoding"] = Request("encoding")
        assert batcher.forward_threads() == 1
        del coordinator.requests["encoding"]
        assert batcher.forward_threads() == 2


@pytest.mark.parametrize("read", [False, True])
def test_a_stream_is_released_once_however_its_reply_ends(tiny_checkpoint, tmp_path, read):
    """A reply that never reads its deltas (its client left as the response began) still
    releases the stream and aborts it in decode; one that read them to the end aborts nothing."""
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        sent = []
        coordinator.router.outbox.send = lambda peer, message: sent.append(message) or True
        stream = Request("r1", "decoder", choices=1)
        coordinator.router.streams["r1"] = stream
        deltas = coordinator.deltas(stream)
        if read:
            stream.queue.put_nowait(
                TokenDelta("r1", token_ids=(7,), text="", completion_tokens=1, finish_reason="stop")
            )
            assert [d.finish_reason async for d in deltas] == ["stop"]
        del deltas  # dropped, read or not
        await asyncio.sleep(0)  # the release is scheduled on the loop
        await asyncio.sleep(0)
        running = coordinator.batcher.others_running()
        await coordinator.stop()
        return sent, running, dict(coordinator.router.streams)

    sent, running, streams = asyncio.run(main())
    assert streams == {} and not running  # prefill no longer counts it as running
    assert [type(m) for m in sent] == ([] if read else [Abort])


DECODER = "tcp://127.0.0.1:9"


def prefilled(service):
    """A real prefilled request that has a choice left for decode, its blocks held."""
    done = service.engine.run("r1", [5, 6, 7], None, SamplingParams(4, temperature=0))
    assert done.handoff is not None
    return replace(done, table=service.engine.kv.table())


def test_a_hand_off_the_wire_cannot_carry_leaves_no_stream_behind(tiny_checkpoint, tmp_path):
    """A send that raises (a value msgpack cannot hold, say) fails its request; a stream left
    behind would be waited on by nobody and keep prefill counting it as running for ever."""
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)

    def refuse(peer, message):
        raise OverflowError("can't serialize ints that large")

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        coordinator.router.outbox.send = refuse
        coordinator.router.outbox.is_up = lambda address: True
        with pytest.raises(OverflowError):
            await coordinator.hand_off(Request("r1"), prefilled(service), DECODER, ())
        running = coordinator.batcher.others_running()
        await coordinator.stop()
        return running, dict(coordinator.router.streams)

    assert asyncio.run(main()) == (False, {})


def test_a_hand_off_too_large_for_decode_is_the_requests_bad_request(tiny_checkpoint, tmp_path):
    """Settings each within bounds can add up to a header decode would refuse unread: the
    request fails alone, as a 400, and leaves no stream behind."""
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)

    def refuse(peer, message):
        raise WireError("its 70000-byte header is over the 65536 a peer takes")

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        coordinator.router.outbox.send = refuse
        coordinator.router.outbox.is_up = lambda address: True
        coordinator.start()
        sampling = SamplingParams(4, temperature=0, ignore_eos=True)  # a hand-off, whatever
        request = PreparedRequest("r1", list(range(5, 25)), [], (), (), sampling)
        with pytest.raises(BadRequest, match="too large to hand to decode: its 70000-byte"):
            await coordinator.submit(request)  # its hand-off let go of its record already
        await coordinator.stop()
        return dict(coordinator.router.streams), dict(coordinator.requests)

    assert asyncio.run(main()) == ({}, {})


def test_a_salted_request_gets_no_image_encoded_for_another_salt(tiny_checkpoint, tmp_path):
    """The image cache: an image sent again under the same salt skips encode; under another
    salt, or none, it is encoded again, so its time tells nothing of what others sent."""
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)
    lm, encoded = service.engine.lm, []

    async def encode_images(request, indices, attempt=0):
        encoded.append(request.cache_salt)
        rows = torch.ones(8, lm.config.hidden_size, dtype=lm.lm_head.weight.dtype)
        return [ImageEmbeddings(request.request_id, 0, request.grids, rows)]

    def asking(salt):
        return PreparedRequest(
            "r", [1] * 8, [b"png"], ((4, 8),), (8,), SamplingParams(4), cache_salt=salt
        )

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        encoding = coordinator.encoding
        encoding.encode_images = encode_images
        keys = [(await encoding.embed(asking(s))).digests for s in (None, "t-1", "t-1", "t-2")]
        again = await encoding.embed(asking(None))
        await coordinator.stop()
        return keys, again.digests

    keys, again = asyncio.run(main())
    assert encoded == [None, "t-1", "t-2"]  # the second t-1 and the last unsalted hit
    assert keys[1] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3 and again == keys[0]


def reply_of(config, service, first, from_decode):
    """What a reader of the stream gets (deltas, then the error that ended it, if one did) and
    what prefill sent: prefill's first deltas of two choices, then decode's."""

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        sent = []
        coordinator.router.outbox.send = lambda peer, message: sent.append(message) or True
        stream = Request("r1", "decoder", choices=2, first=first, max_tokens=4)
        coordinator.router.streams["r1"] = stream
        for delta in from_decode:
            stream.queue.put_nowait(delta)
        got = []
        try:
            async for delta in coordinator.deltas(stream):
                got.append((delta.index, delta.text))
        except PrefillError as e:
            got.append(str(e))
        await coordinator.stop()
        return got, [type(m).__name__ for m in sent]

    return asyncio.run(main())


FIRST = (
    TokenDelta("r1", (5,), "a", completion_tokens=1),
    TokenDelta("r1", (6,), "", completion_tokens=1, finish_reason="stop", index=1),
)


def test_a_reply_is_prefills_first_tokens_then_decodes_for_the_open_choices(
    tiny_checkpoint, tmp_path
):
    config = ipc_config(tiny_checkpoint, tmp_path)
    then = TokenDelta("r1", (7, 8), "bc", completion_tokens=3, finish_reason="length")
    got, sent = reply_of(config, build_service(config), FIRST, [then])
    assert got == [(0, "a"), (1, ""), (0, "bc")] and sent == []  # finished: nothing to abort


@pytest.mark.parametrize(
    "wrong, problem",
    [
        # A decoder of the version before, which sent each first token itself.
        (TokenDelta("r1", (5,), "a", completion_tokens=1), "does not follow on"),
        (TokenDelta("r1", (9,), "x", completion_tokens=2, index=1), "which is not open"),
        (TokenDelta("r1", (7,) * 4, "x", completion_tokens=5), "past the request's max_tokens"),
    ],
)
def test_a_decoder_that_repeats_a_token_or_revives_a_choice_fails_the_request(
    tiny_checkpoint, tmp_path, wrong, problem
):
    config = ipc_config(tiny_checkpoint, tmp_path)
    got, sent = reply_of(config, build_service(config), FIRST, [wrong])
    assert got[:2] == [(0, "a"), (1, "")] and problem in got[2] and len(got) == 3
    assert sent == ["Abort"]  # decode frees what it holds of the request


def test_a_lost_decoders_last_words_come_before_the_loss(tiny_checkpoint, tmp_path, monkeypatch):
    """The disconnect is seen on another connection than the decoder's messages, so it can
    overtake them: a request it ended in its last words ends with its reason; one it left
    open (and an image it was encoding) fails for the loss, but not at once; one handed to it
    once it is back is not its to fail."""
    monkeypatch.setattr(router_module, "LAST_WORDS_S", 0.2)
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)

    async def ending(coordinator, stream):
        try:
            async for _ in coordinator.deltas(stream):
                pass
        except PrefillError as e:
            return str(e)
        return "finished"

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        coordinator.router.outbox.send = lambda peer, message: True
        said, silent, later = (Request(r, "decoder", choices=1) for r in ("r1", "r2", "r3"))
        for stream in (said, silent):
            coordinator.router.streams[stream.request_id] = stream
        encoding = EncodeWait("decoder", asyncio.get_running_loop().create_future())
        coordinator.router.waits[("r4", 0)] = encoding
        endings = [asyncio.ensure_future(ending(coordinator, s)) for s in (said, silent, later)]
        coordinator.router.fail_held_by("decoder")
        for _ in range(3):
            await asyncio.sleep(0)
        assert silent.queue.empty() and not encoding.future.done()  # not at once
        coordinator.router.route(Failure("r1", "unavailable", "decode stopped before it finished"))
        coordinator.router.streams["r3"] = later  # the decoder is back, and takes a new request
        await asyncio.sleep(0.4)
        coordinator.router.route(
            TokenDelta("r3", (7,), "", completion_tokens=1, finish_reason="stop")
        )
        results = await asyncio.gather(*endings)
        results.append(str(encoding.future.exception()))
        await coordinator.stop()
        return results

    lost = "lost the connection to decoder while it held this request"
    assert asyncio.run(main()) == ["decode stopped before it finished", lost, "finished", lost]


def route_deltas(
    checkpoint,
    tmp_path,
    deltas: list[TokenDelta],
    streams: tuple[Request, ...] = (),
    metrics: PrefillMetrics | None = None,
) -> tuple[tuple[str, ...], list, int]:
    """A coordinator holding `streams` routes `deltas`: its decoders, what it sent them, and
    how many messages it refused."""
    config = ipc_config(checkpoint, tmp_path)
    service = build_service(config)

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog, metrics)
        sent = []
        coordinator.router.outbox.send = lambda peer, message: sent.append((peer, message)) or True
        coordinator.router.streams |= {stream.wire_id: stream for stream in streams}
        refused = coordinator.router.inbox.refusals.total
        for delta in deltas:
            coordinator.router.route(delta)
        refused = coordinator.router.inbox.refusals.total - refused
        await coordinator.stop()
        return sent, refused

    return config.decoders, *asyncio.run(main())


def test_tokens_for_a_request_prefill_does_not_hold_make_decode_drop_it(tiny_checkpoint, tmp_path):
    """A hand-off made in this prefill's name by someone else (or a request whose client
    left) holds decode's room until told: its first tokens here ask every decoder, once, to
    drop it; the tokens of a request prefill holds go to it."""
    ours = Request("ours", "decoder", choices=1)
    ghost = [TokenDelta("ghost", (7,), "", completion_tokens=1)] * 3
    deltas = [*ghost, TokenDelta("ours", (7,), "a", completion_tokens=1)]
    decoders, sent, _ = route_deltas(tiny_checkpoint, tmp_path, deltas, (ours,))
    assert sent == [(d, Abort("ghost")) for d in decoders] and ours.queue.qsize() == 1


def test_what_a_decoder_a_stream_has_left_still_sends_never_reaches_the_stream(
    tiny_checkpoint, tmp_path
):
    """A stream moved to another decoder has a wire id of its own there: the decoder it left
    (stopped, then woken) still sends under the old one, and is asked to drop it."""
    moved = Request("ours", "decoder-b", choices=1, migrations=1)
    late = TokenDelta("ours", (7,), "stale", completion_tokens=9)
    fresh = TokenDelta("ours.m1", (8,), "b", completion_tokens=10)
    decoders, sent, _ = route_deltas(tiny_checkpoint, tmp_path, [late, fresh], (moved,))
    assert sent == [(d, Abort("ours")) for d in decoders]
    assert moved.queue.qsize() == 1 and moved.queue.get_nowait() is fresh


def test_decoders_report_their_kv_cache_with_the_deltas_of_requests_prefill_holds(
    tiny_checkpoint, tmp_path
):
    """Prefill's `epd:kv_cache_usage_perc{decoder}` is what each decoder said with its latest
    delta of a request that prefill handed it; a delta for a request prefill does not hold, or
    from a decoder it no longer uses (its series went with it), changes nothing."""
    decoder = f"ipc://{tmp_path}/decode"
    streams = (Request("ours", decoder, choices=1), Request("moved", "ipc://gone", choices=1))
    deltas = [
        TokenDelta("ours", (7,), "a", 1, kv_cache_usage=0.5),
        TokenDelta("ours", (8,), "b", 2),  # a decoder of the version before: no report
        TokenDelta("ghost", (7,), "", 1, kv_cache_usage=0.9),
        TokenDelta("moved", (7,), "", 1, kv_cache_usage=0.7),
    ]
    metrics = PrefillMetrics("tiny")
    route_deltas(tiny_checkpoint, tmp_path, deltas, streams, metrics)
    usage = metrics.unlabelled.get_sample_value
    assert usage("epd:kv_cache_usage_perc", {"decoder": decoder}) == 0.5
    assert usage("epd:kv_cache_usage_perc", {"decoder": "ipc://gone"}) is None


def test_a_flood_of_forged_tokens_is_not_amplified_into_aborts(tiny_checkpoint, tmp_path):
    """Deltas for ever-new ids cost the sender 22 bytes each: prefill asks decoders to drop
    at most DISOWNED_PER_S of them a second and refuses the rest, so the queue that carries
    its real hand-offs is not filled with Aborts."""
    deltas = [TokenDelta(f"forged-{i}", (7,), "", completion_tokens=1) for i in range(5000)]
    decoders, sent, refused = route_deltas(tiny_checkpoint, tmp_path, deltas)
    aborted = len(sent) // len(decoders)
    assert 0 < aborted <= 2 * DISOWNED_PER_S  # the loop may cross one second's boundary
    assert refused == 5000 - aborted


def test_ending_fails_a_request_between_its_forward_and_its_hand_off(tiny_checkpoint, tmp_path):
    """A forward that ran on through the drain's end hands nothing to decode: its request gets
    the error, and what the API awaits through `unless_ended` ends at once."""
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)
    sent = []

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        coordinator.router.outbox.send = lambda peer, message: sent.append(message) or True
        coordinator.router.outbox.is_up = lambda address: True
        fetching = asyncio.ensure_future(coordinator.unless_ended(asyncio.sleep(30)))
        await asyncio.sleep(0)
        ended = Unavailable("the server stopped before this request finished")
        coordinator.end_all(ended)
        fetched = await asyncio.wait_for(asyncio.gather(fetching, return_exceptions=True), 1)
        with pytest.raises(Unavailable) as failed:
            await coordinator.hand_off(Request("r1"), prefilled(service), DECODER, ())
        await coordinator.stop()
        return fetched[0], failed.value, ended

    fetched, failed, ended = asyncio.run(main())
    assert fetched is ended and failed is ended and not sent


def test_a_decoder_that_lacks_blocks_gets_the_hand_off_again_from_those_it_holds(
    tiny_checkpoint, tmp_path
):
    """Prefill leaves out of a hand-off the blocks it handed that decoder before; a decoder
    that evicted some says how many it holds, and gets the rows after them, from prefill's
    blocks, held until decode's first word. One that keeps asking fails its request."""
    config = ipc_config(tiny_checkpoint, tmp_path)
    service = build_service(config)
    ids = list(range(5, 45))  # two whole blocks and 8 tokens

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        sent = []
        coordinator.router.outbox.send = lambda peer, message: sent.append(message) or True
        coordinator.router.outbox.is_up = lambda address: True
        coordinator.start()
        request = PreparedRequest("r1", ids, [], (), (), SamplingParams(4, temperature=0))
        first = await coordinator.submit(request)
        coordinator.release(first)
        stream = await coordinator.submit(replace(request, request_id="r2"))
        handoffs = [m for m in sent if isinstance(m, KVHandoff)]
        deltas = coordinator.deltas(stream)
        await anext(deltas)  # prefill's own first token
        reading = asyncio.ensure_future(anext(deltas))
        coordinator.router.route(KVMissing("r2", held_blocks=1))
        await asyncio.sleep(0.2)  # the rows are copied on the engine's thread
        handoffs += [m for m in sent[len(handoffs) + 1 :] if isinstance(m, KVHandoff)]
        held = coordinator.engine.kv.blocks.held
        coordinator.router.route(KVMissing("r2", held_blocks=0))
        await asyncio.sleep(0.2)
        coordinator.router.route(KVMissing("r2", held_blocks=0))
        with pytest.raises(PrefillError, match="asked 3 times"):
            await reading
        await coordinator.stop()
        return handoffs, [m for m in sent if isinstance(m, KVHandoff)], held

    (whole, partial, *_), every, held = asyncio.run(main())
    assert (whole.cached_blocks, whole.cache.shape[1]) == (0, 40)
    assert (partial.cached_blocks, partial.cache.shape[1]) == (2, 8)
    again = every[2]
    assert (again.cached_blocks, again.cache.shape[1]) == (1, 24)
    torch.testing.assert_close(again.cache[:, 16:], partial.cache)
    assert again.first_tokens == partial.first_tokens
    assert held == 2 + 1  # the prompt's blocks, held while decode may ask again
    assert service.engine.kv.blocks.held == 0  # and let go when the request ended


def test_a_decoder_lost_during_the_prefill_is_replaced_and_the_hand_off_made_whole(
    tiny_checkpoint, tmp_path
):
    """The decoder is chosen before the prefill, so that the hand-off leaves out its blocks;
    one that goes meanwhile gives way to another, which gets the rows it lacks: all of them."""
    first, second = f"ipc://{tmp_path}/decode-a", f"ipc://{tmp_path}/decode-b"
    config = ipc_config(tiny_checkpoint, tmp_path, decoders=(first, second))
    service = build_service(config)
    ids = list(range(5, 45))  # two whole blocks and 8 tokens

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        sent, up = [], {first}
        coordinator.router.outbox.send = lambda peer, message: sent.append((peer, message)) or True
        coordinator.router.outbox.is_up = lambda address: address in up
        coordinator.start()
        request = PreparedRequest("r1", ids, [], (), (), SamplingParams(4, temperature=0))
        coordinator.release(await coordinator.submit(request))  # the first decoder holds it
        prefill = coordinator.batcher.prefill

        async def prefill_then_lose_the_decoder(prompt, record):
            result = await prefill(prompt, record)
            up.clear()
            up.add(second)
            return result

        coordinator.batcher.prefill = prefill_then_lose_the_decoder
        stream = await coordinator.submit(replace(request, request_id="r2"))
        coordinator.release(stream)
        await coordinator.stop()
        return [(peer, m) for peer, m in sent if isinstance(m, KVHandoff)], stream.decoder

    handoffs, decoder = asyncio.run(main())
    assert [peer for peer, _ in handoffs] == [first, second] and decoder == second
    assert all((h.cached_blocks, h.cache.shape[1]) == (0, 40) for _, h in handoffs)


def test_a_prompt_goes_to_the_decoder_that_holds_its_blocks(tiny_checkpoint, tmp_path):
    """Not round-robin: the next turn of a prompt goes where its blocks are, and its hand-off
    carries only the rows after them."""
    decoders = (f"ipc://{tmp_path}/decode-a", f"ipc://{tmp_path}/decode-b")
    config = ipc_config(tiny_checkpoint, tmp_path, decoders=decoders)
    service = build_service(config)
    ids = list(range(5, 45))  # two whole blocks and 8 tokens

    async def main():
        coordinator = Coordinator(config, service.engine, 64, service.watchdog)
        sent = []
        coordinator.router.outbox.send = lambda peer, message: sent.append((peer, message)) or True
        coordinator.router.outbox.is_up = lambda address: True
        coordinator.start()
        request = PreparedRequest("r0", ids, [], (), (), SamplingParams(4, temperature=0))
        for i in range(4):
            coordinator.release(await coordinator.submit(replace(request, request_id=f"r{i}")))
        await coordinator.stop()
        return [(peer, m) for peer, m in sent if isinstance(m, KVHandoff)]

    handoffs = asyncio.run(main())
    assert len({peer for peer, _ in handoffs}) == 1  # rotation alone would alternate
    assert [h.cached_blocks for _, h in handoffs] == [0, 2, 2, 2]
