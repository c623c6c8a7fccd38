"""The image processor on real photographs, against straightforward reference code."""

import math
from pathlib import Path

import numpy as np
import pytest
import skimage
import torch
from PIL import Image

from epd.checkpoint.config import load_processor_config
from epd.multimodal.image_processor import ImageProcessor

PHOTOS = Path(skimage.__file__).parent / "data"
# (file, expected (h, w) grid): landscape, portrait-ish, square, RGBA, and two large enough to be
# scaled down to the 4096-patch budget.
CASES = [
    ("chelsea.png", (22, 34)),  # 451×300
    ("coffee.png", (30, 44)),  # 600×400
    ("rocket.jpg", (32, 46)),  # 640×427
    ("astronaut.png", (38, 38)),  # 512×512
    ("logo.png", (36, 36)),  # 500×500 RGBA
    ("hubble_deep_field.jpg", (62, 70)),  # 1000×872: 4402 patches → 964×841, padded
    ("retina.jpg", (66, 66)),  # 1411×1411: 10000 patches → 903×903, padded
]


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    return ImageProcessor(load_processor_config(tiny_checkpoint))


def reference(image: Image.Image, limit=4096, patch=14, mean=None, std=None):
    """kimi-vl.md's steps written out plainly with NumPy."""
    image = image.convert("RGB")
    w, h = image.size
    if (w // patch) * (h // patch) > limit:
        s = math.sqrt(limit / ((w // patch) * (h // patch)))
        image = image.resize((int(w * s), int(h * s)), Image.Resampling.BICUBIC)
    arr = np.asarray(image).astype(np.float64) / 255
    pad_h, pad_w = (-arr.shape[0]) % 28, (-arr.shape[1]) % 28
    arr = np.pad(arr, ((0, pad_h), (0, pad_w), (0, 0)))  # black, right and bottom
    arr = (arr - np.array(mean)) / np.array(std)
    gh, gw = arr.shape[0] // patch, arr.shape[1] // patch
    patches = [
        arr[r * patch : (r + 1) * patch, c * patch : (c + 1) * patch].transpose(2, 0, 1)
        for r in range(gh)
        for c in range(gw)
    ]
    return np.stack(patches), (gh, gw)


@pytest.mark.parametrize("name,grid", CASES)
def test_real_photo_matches_reference(processor, name, grid):
    image = Image.open(PHOTOS / name)
    patches, got_grid = processor.preprocess(image)
    cfg = processor.config
    want, want_grid = reference(image, mean=cfg.image_mean, std=cfg.image_std)
    assert got_grid == want_grid == grid
    assert patches.shape == (grid[0] * grid[1], 3, 14, 14)
    np.testing.assert_allclose(patches.numpy(), want, atol=1e-5)
    assert processor.grid_for_size(*image.size) == grid
    assert processor.tokens(processor.grid_for_size(*image.size)) == grid[0] * grid[1] // 4


def test_several_images_concatenate(processor):
    images = [Image.new("RGB", (840, 560), "red"), Image.new("RGB", (560, 280), "blue")]
    out = processor(images)
    assert out.grids == ((40, 60), (20, 40))
    assert out.pixel_values.shape == (2400 + 800, 3, 14, 14)
    assert isinstance(out.grids[0][0], int)


def test_padding_is_black_before_normalisation(processor):
    patches, grid = processor.preprocess(Image.new("RGB", (30, 20), "white"))
    assert grid == (2, 4)  # 20×30 pixels pad to 28×56
    black = (torch.zeros(3) - torch.tensor(processor.config.image_mean)) / torch.tensor(
        processor.config.image_std
    )
    last = patches[-1]  # bottom-right patch is all padding
    torch.testing.assert_close(last, black[:, None, None].expand(3, 14, 14))


def test_grid_side_limit_is_refused(processor):
    with pytest.raises(ValueError, match="grid"):
        processor.grid_for_size(14 * 600, 14)  # a 1×600 strip stays under the patch budget
    with pytest.raises(ValueError, match="empty"):
        processor.grid_for_size(0, 10)
