import io
import time

import pytest
from PIL import Image

from epd.multimodal.images import ImageError, decode_image, open_image


def jpeg(size: tuple[int, int] = (64, 64)) -> bytes:
    file = io.BytesIO()
    Image.new("RGB", size, "red").save(file, "JPEG")
    return file.getvalue()


def test_a_jpeg_padded_with_fill_bytes_is_refused_at_once():
    """Pillow reads fill bytes one at a time: 4 MiB of them after the start marker took 4 s
    to open. The header is refused within a bounded number of reads."""
    data = jpeg()
    padded = data[:2] + b"\xff" * (4 << 20) + data[2:]
    start = time.perf_counter()
    with pytest.raises(ImageError, match="image 3: its size is not found within"):
        open_image(padded, 3, 10**8)
    assert time.perf_counter() - start < 0.5


def test_a_few_fill_bytes_are_read_and_the_pixels_are_decoded_whole():
    data = jpeg((640, 480))
    padded = data[:2] + b"\xff" * 64 + data[2:]
    assert open_image(padded, 0, 10**8).size == (640, 480)
    assert decode_image(padded, 0, 10**8).getpixel((320, 240))[0] > 200  # red, every row read
