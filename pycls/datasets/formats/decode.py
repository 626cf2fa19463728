"""Encoded image bytes to uint8 RGB ``(3, H, W)`` tensors, by whichever decoder is installed.

TorchCodec decodes where it is installed (on the CPU, and JPEG batches on CUDA through nvJPEG):
torchvision 0.29 deprecated its own image codecs in its favour. Without it torchvision.io decodes,
its deprecation warning silenced (one per sample would drown the logs), and PIL reads the formats
neither does (BMP, TIFF, PPM ...). The decoders give the same pixels
(tests/datasets/formats/test_data.py, tests/datasets/formats/test_decode.py): each applies the EXIF
orientation a photo records (TorchCodec always does, so torchvision and PIL are asked to), so one
folder trains on the same images whatever is installed.
"""

import functools
import io
import warnings

import torch
from PIL import Image, ImageOps
from torchvision import io as tvio
from torchvision.transforms.v2.functional import pil_to_tensor, to_dtype

BACKENDS = ("auto", "torchcodec", "torchvision")


@functools.cache
def torchcodec_decoders():
    """The ``torchcodec.decoders`` module, or None when TorchCodec is not installed (or its
    libraries do not load on this machine)."""
    try:
        from torchcodec import decoders  # optional: the preferred decoder where installed
    except (ImportError, OSError, RuntimeError):
        return None
    return decoders


def backend_name(backend: str = "auto") -> str:
    """The decoder ``backend`` stands for: "auto" is torchcodec where installed."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown image decoder {backend!r}; expected one of {list(BACKENDS)}")
    if backend == "auto":
        return "torchcodec" if torchcodec_decoders() is not None else "torchvision"
    if backend == "torchcodec" and torchcodec_decoders() is None:
        raise ImportError("the torchcodec image decoder is not installed (pip install torchcodec)")
    return backend


def quiet(fn, *args, **kwargs):
    """Calls a torchvision.io codec without its per-call deprecation warning (torchvision 0.29)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args, **kwargs)


def _decode_pil(data: torch.Tensor) -> torch.Tensor:
    with Image.open(io.BytesIO(data.numpy().tobytes())) as im:
        return pil_to_tensor(ImageOps.exif_transpose(im).convert("RGB"))


def decode_rgb(data: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """A 1-D uint8 tensor of encoded bytes to uint8 ``(3, H, W)``, whatever the file's channels,
    bit depth or frames (an animation's first). Raises ValueError naming the first decoder's
    reason when no decoder reads it."""
    name = backend_name(backend)
    try:
        if name == "torchcodec":
            image = torchcodec_decoders().decode_image(data, mode="RGB")
        else:
            image = quiet(
                tvio.decode_image, data, mode=tvio.ImageReadMode.RGB, apply_exif_orientation=True
            )
    except (RuntimeError, ValueError) as err:
        try:
            image = _decode_pil(data)
        except Exception:  # PIL cannot read it either: the first decoder's reason is the useful one
            raise ValueError(str(err).strip().splitlines()[0] if str(err) else repr(err)) from err
    if image.ndim == 4:  # animated WebP / GIF: the first frame
        image = image[0]
    if image.dtype != torch.uint8:  # 16-bit PNGs
        image = to_dtype(image, torch.uint8, scale=True)
    return image


# Set when TorchCodec could not decode on CUDA here (a build without nvJPEG): "auto" then uses
# torchvision's nvJPEG decoder for the rest of the process, after one warning
_TORCHCODEC_CUDA_FAILED = []


def decode_jpegs(data, device: torch.device | str = "cpu", backend: str = "auto"):
    """One JPEG (1-D uint8 tensor) or a list of them to uint8 ``(3, H, W)`` on ``device`` (a
    list on CUDA is one nvJPEG batch); the bytes stay on the host."""
    name = backend_name(backend)
    on_cuda = torch.device(device).type == "cuda"
    if name == "torchcodec" and not (backend == "auto" and on_cuda and _TORCHCODEC_CUDA_FAILED):
        try:
            return torchcodec_decoders().decode_jpeg(data, mode="RGB", device=device)
        except RuntimeError as err:
            if backend != "auto" or not on_cuda:
                raise
            _TORCHCODEC_CUDA_FAILED.append(str(err))
            msg = f"torchcodec cannot decode on {device} ({err}); using torchvision's decoder"
            warnings.warn(msg, stacklevel=2)
    rgb = tvio.ImageReadMode.RGB
    return quiet(tvio.decode_jpeg, data, mode=rgb, device=device, apply_exif_orientation=True)
