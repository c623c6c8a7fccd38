"""Images named by file:// URLs, under the one directory the operator allowed
(`--allowed-local-media-path`, as vLLM's) and nowhere else.

The path is resolved, links included, before it is compared with the directory, so neither
`..` nor a link inside it reaches a file outside. Only a regular file is read (a FIFO or a
device would block or never end), opened without blocking and never past the size limit. Every
failure says the same words, so answers cannot map which files exist outside what is allowed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from epd.api.errors import APIError, bad_request


def from_file_url(url: str, index: int, root: Path | None, max_bytes: int) -> bytes:
    """The file a file:// URL names, if it lies under `root`; a 400 otherwise."""
    if root is None:
        raise refused(
            index,
            "file: URLs are refused; start the server with --allowed-local-media-path DIR to "
            "allow the images under DIR",
        )
    parts = urlsplit(url)
    try:  # a NUL byte or a loop of links cannot be resolved: no file of the directory either
        path = Path(unquote(parts.path)).resolve()
    except (ValueError, OSError, RuntimeError):
        path = None
    if path is None or parts.netloc not in ("", "localhost") or not path.is_relative_to(root):
        raise refused(index, f"{url[:100]} is not under the allowed local media path")
    return read_regular_file(path, index, max_bytes)


def read_regular_file(path: Path, index: int, max_bytes: int) -> bytes:
    try:
        # a link put in its place since it was resolved is not followed
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        raise refused(index, f"{path.name[:100]} cannot be read") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refused(index, f"{path.name[:100]} cannot be read")
        if info.st_size > max_bytes:
            raise refused(index, f"larger than {max_bytes} bytes")
        data = os.read(fd, max_bytes + 1)  # a file that grew meanwhile is still bounded
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise refused(index, f"larger than {max_bytes} bytes")
    return data


def refused(index: int, why: str) -> APIError:
    return bad_request(f"image {index}: {why}", code="invalid_image")
