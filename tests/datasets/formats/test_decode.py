"""Image decoding: TorchCodec and torchvision give the same pixels (PIL too, for lossless files),
and pycls's own decode calls raise no deprecation warning."""

import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from pycls.datasets.formats import decode

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


# EXIF orientation -> how the stored pixels turn into the picture (PIL's transpose constants)
ORIENTATIONS = {
    2: [Image.Transpose.FLIP_LEFT_RIGHT],
    3: [Image.Transpose.ROTATE_180],
    4: [Image.Transpose.FLIP_TOP_BOTTOM],
    5: [Image.Transpose.TRANSPOSE],
    6: [Image.Transpose.ROTATE_270],
    7: [Image.Transpose.TRANSVERSE],
    8: [Image.Transpose.ROTATE_90],
}


def _gradient(h, w):
    """A smooth picture that no flip or rotation maps onto itself (JPEG keeps it to a few
    levels, where random pixels lose tens)."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // w, y * 255 // h, (x + 2 * y) * 255 // (w + 2 * h)], -1).astype(
        np.uint8
    )


def _with_orientation(pixels, fmt, orientation):
    image = Image.fromarray(pixels)
    exif = image.getexif()
    exif[0x0112] = orientation  # the Orientation tag
    buffer = io.BytesIO()
    kwargs = {"quality": 95} if fmt == "JPEG" else {}
    image.save(buffer, format=fmt, exif=exif, **kwargs)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _upright(pixels, orientation):
    image = Image.fromarray(pixels)
    for op in ORIENTATIONS[orientation]:
        image = image.transpose(op)
    return _as_tensor(np.asarray(image))


@pytest.mark.parametrize("orientation", sorted(ORIENTATIONS))
@pytest.mark.parametrize("backend", [*BACKENDS, "pil"])
def test_every_decoder_applies_the_exif_orientation(backend, orientation):
    """A photo with an EXIF orientation decodes upright whichever decoder is installed: the same
    folder trains on the same images with TorchCodec, torchvision or PIL."""
    pixels = _gradient(24, 40)
    for fmt in ("JPEG", "PNG"):
        data = _with_orientation(pixels, fmt, orientation)
        if backend == "pil":
            image = decode._decode_pil(data)
        else:
            image = decode.decode_rgb(data, backend)
        want = _upright(pixels, orientation)
        assert image.shape == want.shape, (fmt, image.shape)
        tolerance = 6 if fmt == "JPEG" else 0  # JPEG rounding, mean absolute difference
        assert (image.float() - want.float()).abs().mean() <= tolerance, fmt


@pytest.mark.parametrize("orientation", [6, 8])
def test_jpeg_batches_apply_the_exif_orientation(orientation):
    pixels = _gradient(24, 40)
    (image,) = decode.decode_jpegs([_with_orientation(pixels, "JPEG", orientation)])
    want = _upright(pixels, orientation)
    assert image.shape == want.shape and (image.float() - want.float()).abs().mean() <= 6
