"""Image bytes: load them on the client, sniff them in the broker, decode them in a worker.

Only PNG, JPEG, WebP, GIF and BMP are accepted. A worker decodes with exactly those Pillow
plugins, never `Image.open`, so untrusted bytes never reach Pillow's other (and exotic) parsers,
and so our own pixel limit, read from the header before any pixel is decoded, is the only one
that applies: Pillow's global MAX_IMAGE_PIXELS is neither consulted nor changed.

Multi-frame images (animated GIF/WebP/PNG) are accepted and decoded as their first frame, the
frame Hugging Face and vLLM processors use. Transparent images are composited onto white before
the RGB conversion, as those processors do, so colocated and disaggregated paths agree. An EXIF
orientation (a phone photo taken sideways) is applied first, as vLLM does for every image it is
given: without it an encoder would embed the picture on its side while a colocated engine sees it
upright.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import io
import itertools
import os
import re
import stat
import sys
from typing import TYPE_CHECKING, Any

from epdq.errors import InvalidInputError

if TYPE_CHECKING:
    from PIL import Image

MAX_IMAGE_BYTES_DEFAULT = 20 * 2**20  # the broker's --max-image-mb unless set
# The most any broker can be set to accept (its 64 MiB message cap less 1 MiB for the header):
# what clients and workers check against, so that the broker's own setting is what decides.
MAX_IMAGE_BYTES_LIMIT = 63 * 2**20
MAX_IMAGE_PIXELS_DEFAULT = 40_000_000
FORMATS = ("png", "jpeg", "webp", "gif", "bmp")
_KEY_PERSON = b"epdq.image.v1"  # domain separation: these hashes mean nothing elsewhere
_BMP_DIB_SIZES = frozenset({12, 40, 52, 56, 64, 108, 124})
# Modes Pillow writes as PNG as they are ("I" is not one: it is sent as "I;16", see _to_png).
_PNG_MODES = frozenset({"1", "L", "LA", "I;16", "P", "RGB", "RGBA"})
# libjpeg walks every block of the image once per scan, so a progressive JPEG that repeats a tiny
# scan thousands of times takes minutes to decode from a few hundred KB. Real encoders write about
# 10 scans (libjpeg's progressive script: 10 for colour, 6 for grey); at this many a 40-Mpixel
# image costs at most a few times its normal decode.
_JPEG_MAX_SCANS = 100
# Marker segments and fill bytes a JPEG header walk looks at before giving up on the file. Before
# the first scan Pillow's own parser walks them in Python too (20 MiB of empty segments took it
# seconds); real files have dozens, and even a 63 MiB file of 64 KiB APP segments has ~1,000.
_JPEG_MAX_MARKERS = 2048
# A marker as libjpeg finds one anywhere: 0xFF then a code that is neither stuffing (0x00), a
# restart marker (RSTn, which begins nothing) nor another fill byte.
_JPEG_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")
_JPEG_SOS = re.compile(rb"\xff\xda")  # a regex: it reads a memoryview, and faster than bytes.count
# Extension sub-blocks (and stray bytes) a GIF header walk looks at before its first image; real
# files have a handful (a few hundred with a large XMP packet).
_GIF_MAX_BLOCKS = 4096


def image_key(scope: str, data: Any) -> bytes:
    """16-byte content key of one image under `scope` (model + processor settings)."""
    s = scope.encode()
    h = hashlib.blake2b(digest_size=16, person=_KEY_PERSON)
    # Length-prefixed so (scope, data) pairs can never collide by moving the boundary.
    h.update(len(s).to_bytes(8, "little"))
    h.update(s)
    h.update(memoryview(data))
    return h.digest()


def sniff_format(data: Any) -> str | None:
    """The format named by the magic bytes (the first 64 bytes are enough), or None."""
    b = bytes(memoryview(data)[:32])
    if b.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if b.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if b[:4] == b"RIFF" and b[8:12] == b"WEBP":
        return "webp"
    if b[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    # "BM" alone is too weak a signature: also require a known DIB header size.
    if b[:2] == b"BM" and len(b) >= 18 and int.from_bytes(b[14:18], "little") in _BMP_DIB_SIZES:
        return "bmp"
    return None


def load_image_bytes(image: Any, *, max_bytes: int = MAX_IMAGE_BYTES_LIMIT) -> bytes:
    """Client side: a path, a base64 data: URL, bytes-like object or PIL image, as the bytes to send."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif isinstance(image, str) and image[:5].lower() == "data:":
        data = decode_data_url(image)
    elif isinstance(image, str) and image.lower().startswith(("http://", "https://")):
        raise InvalidInputError(
            "the client does not fetch image URLs: pass the file, its bytes or a data: URL (the HTTP gateway "
            "fetches http(s) URLs when started with --allow-remote-urls)"
        )
    elif isinstance(image, (str, os.PathLike)):
        data = _read_file(image, max_bytes)
    elif is_pil_image(image):
        data = _to_png(image)
    else:
        raise InvalidInputError(f"an image must be a path, bytes or a PIL image, not {type(image).__name__}")
    if not data:
        raise InvalidInputError("image is empty")
    if len(data) > max_bytes:
        raise InvalidInputError(f"image is {len(data)} bytes (limit {max_bytes})")
    return data


# Above this many bytes, turning an image into the bytes to send (a base64 decode, ~0.35 GB/s
# here; a copy of a mutable buffer) takes longer than a hop to a worker thread (~0.1 ms).
LOAD_INLINE_BYTES = 64 * 1024


def loads_slowly(image: Any) -> bool:
    """Whether `load_image_bytes(image)` may stall an event loop: a PIL image (encoded as PNG,
    0.3 s for 12 MP here), a file (its read may wait on slow storage), a large `data:` URL or a
    large mutable buffer. Bytes and small `data:` URLs are not; neither is anything refused at once."""
    if isinstance(image, bytes):
        return False
    if isinstance(image, (bytearray, memoryview)):
        return (image.nbytes if isinstance(image, memoryview) else len(image)) > LOAD_INLINE_BYTES
    if isinstance(image, str):
        if image[:5].lower() == "data:":
            return len(image) > LOAD_INLINE_BYTES
        return not image.lower().startswith(("http://", "https://"))  # a path; a URL is refused
    return isinstance(image, os.PathLike) or is_pil_image(image)


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 `data:` URL (`data:image/png;base64,...`)."""
    head, sep, data = url.partition(",")
    if not sep or ";base64" not in head:
        raise InvalidInputError("image data: URL must be base64-encoded")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise InvalidInputError("image data: URL has invalid base64") from None


# Images with more pixels than this (together) are decoded on a thread, not on an event loop
# that other requests share: a thread hop costs ~0.1 ms, and this many pixels of PNG decode in
# about 0.4 ms here (a 12 MP JPEG takes ~70 ms).
DECODE_INLINE_PIXELS = 256 * 256


def header_pixels(data: Any) -> int:
    """Pixels the header of an image file says it has (0 if it is no image we decode): what
    decoding it will cost, known without decoding it."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        return 0
    fmt = sniff_format(view)
    size = _header_size(fmt, view) if fmt is not None else None
    return size[0] * size[1] if size else 0


def quick_to_decode(datas: Any) -> bool:
    """Whether these image files, together, decode fast enough for an event loop that other
    requests share (at most DECODE_INLINE_PIXELS, by their headers)."""
    return sum(header_pixels(d) for d in datas) <= DECODE_INLINE_PIXELS


def decode_image(
    data: Any,
    *,
    max_bytes: int = MAX_IMAGE_BYTES_DEFAULT,
    max_pixels: int = MAX_IMAGE_PIXELS_DEFAULT,
) -> Image.Image:
    """Worker side: validate and fully decode untrusted bytes into an RGB image."""
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:
        raise InvalidInputError(f"image data must be bytes-like: {e}") from None
    if view.nbytes == 0:
        raise InvalidInputError("image is empty")
    if view.nbytes > max_bytes:
        raise InvalidInputError(f"image is {view.nbytes} bytes (limit {max_bytes})")
    fmt = sniff_format(view)
    if fmt is None:
        raise InvalidInputError(f"not a supported image ({', '.join(FORMATS)})")
    size = _header_size(fmt, view)
    if size is None:
        raise InvalidInputError(f"{fmt} header is truncated or malformed")
    _check_size(size, max_pixels)
    if fmt == "jpeg":
        _check_jpeg_scans(view)

    from PIL import Image

    try:
        im = _plugin(fmt)(io.BytesIO(view))
        # Some formats (GIF frames) can grow past their header's size while opening.
        _check_size(im.size, max_pixels)
        im.load()
        return _to_rgb(_upright(im), Image)
    except InvalidInputError:
        raise
    except Exception as e:  # untrusted bytes through C decoders: any failure is the input's
        raise InvalidInputError(f"cannot decode {fmt} image: {type(e).__name__}: {e}") from None


# -- helpers --------------------------------------------------------------------------------------


def _check_size(size: tuple[int, int], max_pixels: int) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise InvalidInputError(f"image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise InvalidInputError(f"image is {w}x{h} = {w * h} pixels (limit {max_pixels})")


def _read_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    try:
        # O_NONBLOCK: a FIFO swapped in for the file must not hang the open; checked below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        hint = "" if isinstance(e, OSError) and e.errno not in (errno.ENOENT, errno.ENAMETOOLONG) else (
            " (image data goes as bytes or a base64 data: URL, not as a bare string)"
        )  # fmt: skip
        raise InvalidInputError(f"cannot open image file {_shown(path)}: {why}{hint}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"image path {_shown(path)} is not a regular file")
        if st.st_size > max_bytes:
            raise InvalidInputError(f"image file is {st.st_size} bytes (limit {max_bytes})")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)  # the file may have grown since fstat
    if len(data) > max_bytes:
        raise InvalidInputError(f"image file is over {max_bytes} bytes")
    return data


def _shown(path: str | os.PathLike) -> str:
    """A path for an error message: a string that was never a path (base64 pasted in) can be megabytes."""
    p = os.fspath(path)
    return repr(p) if len(p) <= 200 else f"{p[:80]!r}... ({len(p)} characters)"


def is_pil_image(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")  # if PIL was never imported, obj can't be one of its images
    return pil is not None and isinstance(obj, pil.Image)


def _to_png(im: Image.Image) -> bytes:
    try:
        # turned now, as vLLM turns a PIL image it is given: the PNG carries no EXIF orientation
        im = _upright(im)
        if im.mode == "I":
            # Pillow cannot write mode I as PNG. As I;16 (clamped to 0..65535) it keeps 16-bit
            # pixels exact, and every value still becomes the RGB that Pillow's I -> RGB gives,
            # what a colocated engine makes of this image.
            im = im.convert("I;16")
        elif im.mode == "La":  # premultiplied alpha: Pillow converts it to nothing but LA
            im = im.convert("LA")
        elif im.mode not in _PNG_MODES:
            im = im.convert("RGBA" if "A" in im.getbands() else "RGB")
        buf = io.BytesIO()
        im.save(buf, format="PNG")  # lossless; same pixels and info give the same bytes
        return buf.getvalue()
    except Exception as e:
        raise InvalidInputError(f"cannot encode the PIL image as PNG: {type(e).__name__}: {e}") from None


def _plugin(fmt: str) -> Any:
    if fmt == "png":
        from PIL.PngImagePlugin import PngImageFile as cls
    elif fmt == "jpeg":
        from PIL.JpegImagePlugin import JpegImageFile as cls
    elif fmt == "webp":
        from PIL.WebPImagePlugin import WebPImageFile as cls
    elif fmt == "gif":
        from PIL.GifImagePlugin import GifImageFile as cls
    else:
        from PIL.BmpImagePlugin import BmpImageFile as cls
    return cls


_EXIF_ORIENTATION = 0x0112


def _upright(im: Image.Image) -> Image.Image:
    """`im` turned as its EXIF orientation says; what vLLM's `normalize_image` does, in the same
    way (a broken EXIF block leaves the image as it is), so both paths see the same pixels."""
    try:
        if im.getexif().get(_EXIF_ORIENTATION, 1) not in (2, 3, 4, 5, 6, 7, 8):
            return im  # the common case: no EXIF, or upright; skips exif_transpose's copy
        from PIL import ImageOps

        return ImageOps.exif_transpose(im)
    except Exception:  # untrusted EXIF: a block Pillow cannot parse is ignored, as vLLM ignores it
        return im


def _to_rgb(im: Image.Image, Image: Any) -> Image.Image:
    if im.mode == "RGB":
        return im
    if "A" in im.getbands() or "transparency" in im.info:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _u(b: memoryview, lo: int, hi: int, order: str = "little", signed: bool = False) -> int:
    return int.from_bytes(b[lo:hi], order, signed=signed)


def _header_size(fmt: str, b: memoryview) -> tuple[int, int] | None:
    """(width, height) from the file header alone, without asking Pillow."""
    if fmt == "png":
        if len(b) < 24 or b[12:16] != b"IHDR":
            return None
        return _u(b, 16, 20, "big"), _u(b, 20, 24, "big")
    if fmt == "gif":
        return _gif_size(b)
    if fmt == "bmp":
        if _u(b, 14, 18) == 12:
            return (_u(b, 18, 20), _u(b, 20, 22)) if len(b) >= 22 else None
        # Negative height means top-down rows; negative width is invalid (checked as <= 0).
        return (_u(b, 18, 22, signed=True), abs(_u(b, 22, 26, signed=True))) if len(b) >= 26 else None
    if fmt == "webp":
        return _webp_size(b)
    return _jpeg_size(b)


def _webp_size(b: memoryview) -> tuple[int, int] | None:
    chunk = b[12:16]
    if chunk == b"VP8 " and len(b) >= 30 and b[23:26] == b"\x9d\x01\x2a":  # lossy key frame
        return _u(b, 26, 28) & 0x3FFF, _u(b, 28, 30) & 0x3FFF
    if chunk == b"VP8L" and len(b) >= 25 and b[20] == 0x2F:  # lossless: 14-bit (size - 1) fields
        bits = _u(b, 21, 25)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(b) >= 30:  # extended: 24-bit (canvas size - 1) fields
        return _u(b, 24, 27) + 1, _u(b, 27, 30) + 1
    return None


def _gif_size(b: memoryview) -> tuple[int, int] | None:
    """The canvas Pillow decodes a GIF's first frame onto: the logical screen, grown to hold the
    first image where its descriptor places it (a 43-byte file with a 1x1 screen and a 1x1 image
    at (6299, 6299) decodes to 6300x6300). None if the walk does not reach that descriptor."""
    n = len(b)
    if n < 13:
        return None
    flags = b[10]
    i = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the global colour table
    budget = _GIF_MAX_BLOCKS
    while budget > 0 and i < n:
        budget -= 1
        c = b[i]
        if c == 0x2C:  # image descriptor: left, top, width, height
            if i + 9 > n:
                return None
            right, bottom = _u(b, i + 1, i + 3) + _u(b, i + 5, i + 7), _u(b, i + 3, i + 5) + _u(b, i + 7, i + 9)
            return max(_u(b, 6, 8), right), max(_u(b, 8, 10), bottom)
        if c == 0x3B:  # trailer: no image at all
            return None
        if c == 0x21:  # extension: label, then sub-blocks up to an empty one
            i += 2
            while budget > 0 and i < n and b[i]:
                budget -= 1
                i += 1 + b[i]
            i += 1
        else:
            i += 1  # Pillow skips a stray byte here, so the walk does too
    return None


def _jpeg_size(b: memoryview) -> tuple[int, int] | None:
    # Walks segment lengths (EXIF/ICC segments may push the frame header far in), no copying.
    i, n = 2, len(b)
    for _ in range(_JPEG_MAX_MARKERS):
        if i + 4 > n:
            return None
        if b[i] != 0xFF:
            return None
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn: P, Y, X
            return (_u(b, i + 7, i + 9, "big"), _u(b, i + 5, i + 7, "big")) if i + 9 <= n else None
        length = _u(b, i + 2, i + 4, "big")
        if length < 2:
            return None
        i += 2 + length
    return None


def _check_jpeg_scans(data: memoryview) -> None:
    """InvalidInputError if libjpeg would decode more than _JPEG_MAX_SCANS scans of this file."""
    # Every scan libjpeg reads begins with these two bytes, so their count bounds the scans: the
    # common case ends here, at C speed (~1.4 ms for a 12-Mpixel photo whose decode takes 70).
    # Above it, walk the markers up to the first image's end, since a phone's motion photo
    # carries its video (any bytes) after that.
    if next(itertools.islice(_JPEG_SOS.finditer(data), _JPEG_MAX_SCANS, None), None) is None:
        return
    scans, i = 0, 2
    for _ in range(_JPEG_MAX_MARKERS):
        # Skips entropy-coded data (only stuffed 0xFF00 and RSTn there) and stray bytes, as libjpeg does.
        m = _JPEG_MARKER.search(data, i)
        if m is None:
            return
        i = m.start()
        code = data[i + 1]
        if code == 0xD9:  # end of image
            return
        if code in (0x01, 0xD8):  # markers without a length
            i += 2
            continue
        if code == 0xDA:
            scans += 1
            if scans > _JPEG_MAX_SCANS:
                raise InvalidInputError(f"jpeg has over {_JPEG_MAX_SCANS} scans (a decompression bomb)")
        # libjpeg reads exactly the segment's length (or fails): skipping more could miss a scan
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        i += 2 + max(length, 2)
    raise InvalidInputError(f"jpeg has over {_JPEG_MAX_MARKERS} marker segments")
