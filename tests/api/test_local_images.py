"""file:// image URLs: files under the allowed directory only, whatever the URL or a link says."""

import asyncio
import os

import pytest

from epd.api.errors import APIError
from epd.api.images import ImageLoader, MediaPolicy

PNG = b"\x89PNG fake image bytes"


def load(url, root, max_bytes=1000):
    async def run():
        loader = ImageLoader(MediaPolicy(max_bytes, 2.0, local_root=root))
        try:
            return await loader.load_one(url, 0)
        finally:
            loader.close()

    return asyncio.run(run())


def refusal(url, root, **kwargs) -> str:
    with pytest.raises(APIError) as caught:
        load(url, root, **kwargs)
    assert caught.value.status == 400 and caught.value.code == "invalid_image"
    return caught.value.message


@pytest.fixture
def media(tmp_path):
    """An allowed directory with an image in it (and one in a folder below), a secret beside it."""
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(PNG)
    (root / "sub" / "b c.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    return root.resolve()


def test_a_file_under_the_allowed_directory_is_read(media):
    assert load(f"file://{media}/a.png", media) == PNG
    assert load(f"FILE://localhost{media}/sub/b%20c.png", media) == PNG


def test_file_urls_are_refused_unless_a_directory_is_allowed(media):
    assert "--allowed-local-media-path" in refusal(f"file://{media}/a.png", None)


@pytest.mark.parametrize(
    "path", ["{media}/../secret.png", "{media}/sub/../../secret.png", "/etc/passwd"]
)
def test_a_path_outside_the_directory_is_refused(media, path):
    url = "file://" + path.format(media=media)
    assert "is not under the allowed local media path" in refusal(url, media)


def test_a_link_inside_the_directory_to_a_file_outside_is_refused(media):
    (media / "link.png").symlink_to(media.parent / "secret.png")
    assert "is not under the allowed local media path" in refusal(f"file://{media}/link.png", media)


@pytest.mark.parametrize("path", ["{media}/a%00.png", "{media}/loop/a.png"])
def test_a_path_that_cannot_be_resolved_is_a_400(media, path):
    (media / "loop").symlink_to(media / "loop")
    url = "file://" + path.format(media=media)
    assert "is not under the allowed local media path" in refusal(url, media)


def test_a_remote_host_is_refused(media):
    assert "not under" in refusal(f"file://example.com{media}/a.png", media)


def test_missing_files_and_folders_say_the_same(media):
    assert refusal(f"file://{media}/none.png", media).endswith("cannot be read")
    assert refusal(f"file://{media}/sub", media).endswith("cannot be read")


def test_a_fifo_is_refused_without_blocking(media):
    os.mkfifo(media / "pipe.png")
    assert refusal(f"file://{media}/pipe.png", media).endswith("cannot be read")


def test_a_file_over_the_size_limit_is_refused(media):
    assert "larger than 4 bytes" in refusal(f"file://{media}/a.png", media, max_bytes=4)
