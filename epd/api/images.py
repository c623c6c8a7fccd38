"""Getting a request's image bytes: data: URLs (base64) and http(s) URLs, with limits."""

from __future__ import annotations

import base64
import binascii
import time

import requests
import urllib3

from epd.api.errors import APIError, bad_request


def load_image_bytes(url: str, index: int, max_bytes: int, timeout_s: float) -> bytes:
    """The encoded file behind an image_url; a 400 naming image `index` when it cannot be had."""
    if url.startswith("data:"):
        return _from_data_url(url, index, max_bytes)
    if url.startswith(("http://", "https://")):
        return _fetch(url, index, max_bytes, timeout_s)
    raise bad_request(
        f"image {index}: only data: and http(s): URLs are supported", code="invalid_image"
    )


def _from_data_url(url: str, index: int, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise bad_request(f"image {index}: data URL must be base64 encoded", code="invalid_image")
    if len(payload) * 3 // 4 > max_bytes:
        raise bad_request(f"image {index}: larger than {max_bytes} bytes", code="invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"image {index}: invalid base64 data", code="invalid_image") from None


def _fetch(url: str, index: int, max_bytes: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s  # `timeout` below bounds each read, this the total

    def fail(reason: str) -> APIError:
        return bad_request(f"image {index}: {reason}", code="invalid_image")

    try:
        with requests.get(url, stream=True, timeout=timeout_s) as response:
            if response.status_code != 200:
                raise fail(f"fetching {url} gave HTTP {response.status_code}")
            data = bytearray()
            # read1 returns whatever one read brings, so a server that trickles bytes still
            # meets the deadline check after each of them.
            while chunk := response.raw.read1(64 * 1024, decode_content=True):
                data += chunk
                if len(data) > max_bytes:
                    raise fail(f"larger than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise fail(f"fetching {url} took over {timeout_s}s")
            return bytes(data)
    except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
        raise fail(f"cannot fetch {url}: {type(e).__name__}") from None
