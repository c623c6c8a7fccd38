"""Reading client images safely: known formats only, size checked before pixels are decoded."""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """An image that cannot be used; the message names the image by its position."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index}: {reason}")
        self.index = index


def open_image(data: bytes, index: int, max_pixels: int) -> Image.Image:
    """Open the header only: format and size are known, no pixel is decoded yet."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (UnidentifiedImageError, Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ImageError(index, f"not a readable {', '.join(FORMATS)} image") from None
    except OSError as e:
        raise ImageError(index, f"unreadable image: {e}") from None
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
