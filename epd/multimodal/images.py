"""Reading client images safely: known formats only, size checked before pixels are decoded."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# Reads of a file Pillow may make before it knows an image's format and size: a few dozen for
# a real one (a GIF's long comment a few thousand). Pillow's JPEG parser reads the fill bytes
# (0xFF) and junk between markers one at a time: a 64x64 JPEG with 4 MiB of fill took 4 s to
# open. Past this many reads (milliseconds), the image is refused.
MAX_HEADER_READS = 16_384


class ImageError(ValueError):
    """An image that cannot be used; the message names the image by its position."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index}: {reason}")
        self.index = index


class HeaderTooLong(Exception):
    """A header Pillow could not get through within MAX_HEADER_READS reads."""


class HeaderReader(io.BytesIO):
    """An image file that may be read in at most MAX_HEADER_READS pieces until `opened`."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads_left: int | None = MAX_HEADER_READS

    def read(self, size: int | None = -1, /) -> bytes:
        if self.reads_left is not None:
            if not self.reads_left:
                raise HeaderTooLong
            self.reads_left -= 1
        return super().read(size)

    def opened(self) -> None:
        self.reads_left = None  # the pixels are read in as many pieces as they take


def open_image(data: bytes, index: int, max_pixels: int) -> Image.Image:
    """Open the header only: format and size are known, no pixel is decoded yet."""
    file = HeaderReader(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(file, formats=FORMATS)
    except (UnidentifiedImageError, Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ImageError(index, f"not a readable {', '.join(FORMATS)} image") from None
    except HeaderTooLong:
        raise ImageError(
            index, f"its size is not found within {MAX_HEADER_READS} reads of its header"
        ) from None
    except OSError as e:
        raise ImageError(index, f"unreadable image: {e}") from None
    file.opened()
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(index, f"{width}x{height} pixels is over the limit of {max_pixels}")
    return image


def decode_image(data: bytes, index: int, max_pixels: int) -> Image.Image:
    """Fully decode to RGB (an animated GIF gives its first frame)."""
    image = open_image(data, index, max_pixels)
    try:
        image.seek(0)
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt pixel data
        raise ImageError(index, f"corrupt image data: {e}") from None
