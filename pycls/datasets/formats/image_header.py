"""The width and height an image file declares, read from its header without decoding it.

A decompression bomb is a small file declaring a huge image (a 100 KB PNG of 30000 x 30000
pixels decodes to 2.7 GB). Its header says so before any pixel is decoded, so the loader can
refuse it by its declared size. PNG, JPEG, GIF and WebP headers are read here; the other formats
PIL opens (BMP, TIFF, ...) are sized by PIL's ``Image.open``, which reads only the header.
"""

import io
import struct
import warnings

from PIL import Image

# PIL's own default limit (Image.MAX_IMAGE_PIXELS): about a quarter gigabyte as 8-bit RGB. The
# largest ImageNet image has 12.6 million pixels.
DEFAULT_MAX_PIXELS = 89_478_485

_PNG = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (C4, C8 and CC are other segments); each carries the image size
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of a PNG, JPEG, GIF or WebP file, or None."""
    view = memoryview(data).cast("B")  # bytes, a bytearray or a uint8 numpy array
    data = bytes(view) if view[:2] == b"\xff\xd8" else bytes(view[:32])
    if data.startswith(_PNG) and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_size(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return _pil_size(bytes(view))


# PIL refuses to open an image of more than twice its own limit (DecompressionBombError) without
# saying its size: such an image is larger than this many pixels, its size given as _HUGE
_PIL_REFUSES = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
_HUGE = (-1, -1)


def _pil_size(data: bytes) -> tuple[int, int] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:  # the header only: nothing decoded
                return image.size
    except Image.DecompressionBombError:
        return _HUGE
    except Exception:  # not an image PIL knows: the decoders say why
        return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 " and len(data) >= 30:
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Walks the segments before the first scan to the start-of-frame marker."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
        elif marker in _SOF:
            if i + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return width, height
        elif marker == 0xDA:  # a scan before any frame header: not a JPEG we can size
            return None
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def too_many_pixels(data: bytes, max_pixels: int) -> str | None:
    """Why an image declaring more than ``max_pixels`` pixels is refused (0: no limit), or None."""
    size = declared_size(data) if max_pixels > 0 else None
    if size is None or (size != _HUGE and size[0] * size[1] <= max_pixels):
        return None
    width, height = size
    declared = f"{width} x {height} = {width * height:,} pixels"
    if size == _HUGE:
        declared = f"more than {_PIL_REFUSES:,} pixels (too many for PIL to open)"
    return (
        f"it declares {declared}, more than the limit of {max_pixels:,} "
        "(DATA_LOADER.MAX_IMAGE_PIXELS; a decompression bomb, or an image to shrink before "
        "training)"
    )


# The most bytes an image file of one pixel takes: 16-bit RGBA stored without compression (a PNG
# can) is 8, and its header (EXIF, a colour profile, comments) adds at most a few hundred KB
_MAX_BYTES_PER_PIXEL = 8
_MAX_HEADER_BYTES = 1 << 20


def too_many_bytes(size: int, max_pixels: int) -> str | None:
    """Why an encoded image of ``size`` bytes is refused before it is read or decoded (more than
    an image of ``max_pixels`` pixels can take: 8 bytes a pixel and 1 MiB of header), or None
    (``max_pixels`` 0: no limit). A tar member is checked before it is read, a parquet cell
    after its page is decompressed."""
    if max_pixels <= 0:
        return None
    most = max_pixels * _MAX_BYTES_PER_PIXEL + _MAX_HEADER_BYTES
    if size <= most:
        return None
    return (
        f"it holds {size:,} bytes, more than an image of DATA_LOADER.MAX_IMAGE_PIXELS "
        f"{max_pixels:,} pixels can take ({most:,}: 8 bytes a pixel and 1 MiB of header)"
    )
