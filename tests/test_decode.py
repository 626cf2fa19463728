"""Image decoding: TorchCodec and torchvision give the same pixels (PIL too, for lossless files),
and pycls's own decode calls raise no deprecation warning."""

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from pycls.datasets import decode

BACKENDS = [
    "torchvision",
    pytest.param(
        "torchcodec",
        marks=pytest.mark.skipif(
            decode.torchcodec_decoders() is None, reason="torchcodec is not installed"
        ),
    ),
]


def _encoded(pixels, fmt, **kwargs):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt, **kwargs)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _pixels(seed=0, h=20, w=30):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _as_tensor(pixels):
    return torch.from_numpy(pixels).permute(2, 0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lossless_formats_decode_to_the_written_pixels(backend):
    pixels = _pixels()
    for fmt, kwargs in (("PNG", {}), ("WEBP", {"lossless": True}), ("BMP", {}), ("TIFF", {})):
        image = decode.decode_rgb(_encoded(pixels, fmt, **kwargs), backend)
        assert image.dtype == torch.uint8 and torch.equal(image, _as_tensor(pixels)), fmt
    gray = _pixels()[..., 0]
    image = decode.decode_rgb(_encoded(gray, "PNG"), backend)
    assert image.shape == (3, 20, 30) and all(torch.equal(c, torch.from_numpy(gray)) for c in image)
    palette = np.zeros((20, 30, 3), dtype=np.uint8)
    palette[::2] = (255, 0, 0)  # a GIF holds 256 colours at most: two here, kept exactly
    assert torch.equal(decode.decode_rgb(_encoded(palette, "GIF"), backend), _as_tensor(palette))


def test_torchcodec_and_torchvision_give_the_same_pixels():
    if decode.torchcodec_decoders() is None:
        pytest.skip("torchcodec is not installed")
    pixels = _pixels(1, 37, 53)
    for fmt in ("JPEG", "PNG", "WEBP", "GIF"):
        data = _encoded(pixels, fmt)
        assert torch.equal(
            decode.decode_rgb(data, "torchcodec"), decode.decode_rgb(data, "torchvision")
        ), fmt
    jpegs = [_encoded(_pixels(s), "JPEG", quality=90) for s in range(3)]
    for a, b in zip(decode.decode_jpegs(jpegs, backend="torchcodec"), decode.decode_jpegs(jpegs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_deprecation_warning_from_pycls_decoding(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode.decode_rgb(_encoded(_pixels(), "JPEG"), backend)
        decode.decode_rgb(_encoded(_pixels(), "PNG"), backend)
        decode.decode_jpegs([_encoded(_pixels(), "JPEG")], backend=backend)


def test_unreadable_bytes_and_unknown_backends_are_clear_errors():
    with pytest.raises(ValueError):
        decode.decode_rgb(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown image decoder 'pil'"):
        decode.backend_name("pil")
    if decode.torchcodec_decoders() is None:
        with pytest.raises(ImportError, match="pip install torchcodec"):
            decode.backend_name("torchcodec")
        assert decode.backend_name() == "torchvision"
    else:
        assert decode.backend_name() == "torchcodec"  # preferred where installed
