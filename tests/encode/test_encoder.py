"""The encode step: any supported format in, normalised grids and per-image rows out."""

import io

import pytest
import torch
from PIL import Image

from epd.checkpoint.config import load_processor_config
from epd.checkpoint.weights import load_model
from epd.encode.encoder import Encoder
from epd.encode.server import handle
from epd.multimodal.image_processor import ImageProcessor
from epd.multimodal.images import ImageError
from epd.wire.messages import EncodeRequest, Failure, ImageEmbeddings


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint):
    model = load_model(tiny_checkpoint, role="encode")
    return Encoder(model, ImageProcessor(load_processor_config(tiny_checkpoint)), 10_000_000)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_formats(encoder, fmt):
    grids, embeddings = encoder.encode([encoded(Image.new("RGB", (840, 560), "red"), fmt)])
    assert grids == ((40, 60),) and type(grids[0][0]) is int
    assert embeddings.shape == (600, 64)


def test_animated_gif_gives_its_first_frame(encoder):
    frames = [Image.new("RGB", (56, 56), c) for c in ("red", "blue")]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    first = encoder.encode([encoded(frames[0], "PNG")])[1]
    torch.testing.assert_close(encoder.encode([gif])[1], first)


def test_grids_and_rows_follow_the_images(encoder):
    images = [encoded(Image.new("RGB", size, "blue"), "PNG") for size in [(840, 560), (560, 280)]]
    grids, embeddings = encoder.encode(images)
    assert grids == ((40, 60), (20, 40)) and embeddings.shape[0] == 800


def test_bad_image_is_named_by_its_index_in_the_request(encoder):
    good = encoded(Image.new("RGB", (28, 28)), "PNG")
    with pytest.raises(ImageError, match="image 3"):
        encoder.encode([good, b"junk"], indices=[2, 3])


def test_server_turns_failures_into_messages(encoder):
    good = encoded(Image.new("RGB", (28, 28)), "PNG")
    reply = handle(encoder, EncodeRequest("r", 0, (good,), (0,), "tcp://x:1"))
    assert isinstance(reply, ImageEmbeddings) and reply.grids == ((2, 2),)
    truncated = encoded(Image.new("RGB", (200, 200), "red"), "PNG")[:-60]
    reply = handle(encoder, EncodeRequest("r", 0, (good, truncated), (0, 1), "tcp://x:1"))
    assert isinstance(reply, Failure) and reply.code == "bad_image" and "image 1" in reply.message


def test_requests_batched_in_one_forward_get_their_own_rows(encoder):
    from epd.encode.server import encode_prepared, prepare

    sizes = [((840, 560), "red"), ((112, 56), "blue"), ((300, 200), "green")]
    requests = [
        EncodeRequest(f"r{i}", 0, (encoded(Image.new("RGB", size, c), "PNG"),), (0,), "tcp://x:1")
        for i, (size, c) in enumerate(sizes)
    ]
    ready = [(r, prepare(encoder, r)) for r in requests]
    batched = encode_prepared(encoder, ready)
    for (request, _), reply in zip(ready, batched, strict=True):
        alone = handle(encoder, request)
        assert reply.request_id == request.request_id and reply.grids == alone.grids
        torch.testing.assert_close(reply.embeddings, alone.embeddings, atol=1e-5, rtol=1e-5)


def test_a_batch_that_fails_is_tried_request_by_request(encoder, monkeypatch):
    from epd.encode.server import encode_prepared, prepare

    requests = [
        EncodeRequest(
            f"r{i}", 0, (encoded(Image.new("RGB", (56, 56), c), "PNG"),), (0,), "tcp://x:1"
        )
        for i, c in enumerate(["red", "blue"])
    ]
    ready = [(r, prepare(encoder, r)) for r in requests]
    forward = encoder.forward

    def breaks_on_blue_or_batches(batch):
        if len(batch) > 1 or batch[0] is ready[1][1]:
            raise RuntimeError("out of memory")
        return forward(batch)

    monkeypatch.setattr(encoder, "forward", breaks_on_blue_or_batches)
    red, blue = encode_prepared(encoder, ready)
    assert isinstance(red, ImageEmbeddings) and red.request_id == "r0"
    assert isinstance(blue, Failure) and blue.code == "internal" and "out of memory" in blue.message


def test_rows_that_overflowed_fail_their_request_alone(encoder, monkeypatch):
    """A NaN or inf in one request's rows (an overflow in a low-precision tower) is refused by
    its message; the others batched with it still get theirs."""
    from epd.encode.server import encode_prepared, prepare

    requests = [
        EncodeRequest(
            f"r{i}", 0, (encoded(Image.new("RGB", (56, 56), c), "PNG"),), (0,), "tcp://x:1"
        )
        for i, c in enumerate(["red", "blue", "green"])
    ]
    ready = [(r, prepare(encoder, r)) for r in requests]
    forward = encoder.forward

    def overflows_on_blue(batch):
        rows = [row.clone() for row in forward(batch)]  # (tokens, hidden) per request
        for row, prepared in zip(rows, batch, strict=True):
            if prepared is ready[1][1]:
                row[0, 0] = float("inf")
        return rows

    monkeypatch.setattr(encoder, "forward", overflows_on_blue)
    red, blue, green = encode_prepared(encoder, ready)
    assert isinstance(red, ImageEmbeddings) and isinstance(green, ImageEmbeddings)
    assert isinstance(blue, Failure) and blue.request_id == "r1" and blue.code == "internal"
    assert "NaN or infinite" in blue.message


def test_a_lone_requests_forward_takes_the_idle_cores(encoder, tiny_checkpoint):
    """A batch encoded while the machine's other processes leave its cores runs on
    `alone_threads`; any other on the encoder's own share."""
    from epd.config.roles import EncodeConfig
    from epd.encode.server import EncodeServer
    from epd.wire.addresses import Prefills

    config = EncodeConfig(model=str(tiny_checkpoint), threads=1, alone_threads=2)
    server = EncodeServer(encoder, None, None, config, Prefills.parse(()))  # type: ignore[arg-type]
    before = torch.get_num_threads()
    try:
        server.use_threads(alone=True)
        assert torch.get_num_threads() == 2
        server.use_threads(alone=False)
        assert torch.get_num_threads() == 1
        unset = EncodeServer(
            encoder,
            None,
            None,
            EncodeConfig(model=str(tiny_checkpoint), threads=1),
            Prefills.parse(()),
        )  # type: ignore[arg-type]
        unset.use_threads(alone=True)
        assert torch.get_num_threads() == 1  # 0: as threads
    finally:
        torch.set_num_threads(before)


def test_a_step_encodes_on_the_idle_cores_by_the_window_before_its_requests(
    encoder, tiny_checkpoint
):
    """No hint comes with a request: encode judges the cores by its own window (`OthersIdle`),
    sampled in every step, the idle ones too, and by its queue: a request with others behind
    it is not a lone one."""
    from epd.config.roles import EncodeConfig
    from epd.encode.server import EncodeServer
    from epd.wire.addresses import Prefills

    reply_to = "tcp://127.0.0.1:7102"
    request = EncodeRequest("r1", 0, (encoded(Image.new("RGB", (28, 28)), "PNG"),), (0,), reply_to)

    class Inbox:
        def __init__(self, messages):
            self.messages = list(messages)

        def recv(self, timeout_ms):
            return self.messages.pop(0) if self.messages else None

        def pending(self):
            return bool(self.messages)

    class Outbox:
        queued = 0

        def __init__(self):
            self.sent = []

        def poll(self):
            return []

        def send(self, to, message):
            self.sent.append((to, message))
            return True

    config = EncodeConfig(model=str(tiny_checkpoint), threads=1, alone_threads=2)
    outbox = Outbox()
    server = EncodeServer(encoder, Inbox([]), outbox, config, Prefills.parse((reply_to,)))  # type: ignore[arg-type]

    class Idle:  # the window's verdicts in turn, and whether the others run at this moment
        def __init__(self, windows, running):
            self.windows, self.running = windows, running

        def __call__(self):
            return self.windows.pop(0)

        def now(self):
            return not self.running

    used: list[bool] = []
    server.others_idle = Idle([True, False], running=True)  # type: ignore[assignment]
    server.use_threads = used.append  # type: ignore[method-assign]
    server.step()  # nothing came: sampled all the same
    assert server.others_idle.windows == [False] and used == []
    server.inbox = Inbox([request])  # type: ignore[assignment]
    server.step()
    assert used == [False]  # the others were busy in the window before it, and still are
    server.others_idle = Idle([False], running=False)  # type: ignore[assignment]
    server.step()  # nothing came
    server.inbox = Inbox([request])  # type: ignore[assignment]
    server.others_idle.windows.append(False)
    server.step()
    assert used == [False, True]  # busy in the window, but their work has just ended
    server.others_idle = Idle([True, True], running=False)  # type: ignore[assignment]
    server.inbox = Inbox([request, request])  # type: ignore[assignment]
    server.step(), server.step()
    assert used == [False, True, False, True]  # idle, but another waited behind the first
    assert len(outbox.sent) == 4 and all(isinstance(m, ImageEmbeddings) for _, m in outbox.sent)
