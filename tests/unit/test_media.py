"""Unit tests of image loading, sniffing, hashing and hostile-input decoding."""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib

import pytest
from PIL import Image

from epdq.errors import InvalidInputError
from epdq.media import (
    MAX_IMAGE_PIXELS_DEFAULT,
    decode_image,
    image_key,
    load_image_bytes,
    sniff_format,
)


def encoded(fmt: str, size=(37, 21), mode="RGB", color=(10, 200, 30), **kw) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header(width: int, height: int) -> bytes:
    """Signature + IHDR (8-bit RGB) + a tiny IDAT: a file that *declares* its dimensions."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    )


# -- keys -----------------------------------------------------------------------------------------


def test_image_key_is_16_bytes_and_content_addressed():
    a, b = encoded("PNG"), encoded("PNG", color=(1, 2, 3))
    k = image_key("model-x/proc-1", a)
    assert isinstance(k, bytes) and len(k) == 16
    assert image_key("model-x/proc-1", bytes(a)) == k
    assert image_key("model-x/proc-1", bytearray(a)) == k
    assert image_key("model-x/proc-1", memoryview(a)) == k
    assert image_key("model-x/proc-2", a) != k
    assert image_key("model-x/proc-1", b) != k


def test_image_key_scope_boundary_cannot_shift():
    assert image_key("ab", b"cd") != image_key("a", b"bcd")
    assert image_key("", b"abcd") != image_key("abcd", b"")


# -- sniffing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,name", [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp"), ("GIF", "gif"), ("BMP", "bmp")]
)
def test_sniff_format(fmt, name):
    data = encoded(fmt)
    assert sniff_format(data) == name
    assert sniff_format(memoryview(data)[:64]) == name


@pytest.mark.parametrize("data", [b"", b"\x89PN", os.urandom(64), b"BM" + b"\0" * 62, b"II*\0" + b"\0" * 60])
def test_sniff_rejects_non_images(data):
    assert sniff_format(data) is None


# -- decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_decode_each_format_to_rgb(fmt):
    im = decode_image(encoded(fmt))
    assert im.mode == "RGB" and im.size == (37, 21)
    r, g, b = im.getpixel((5, 5))
    assert abs(r - 10) <= 3 and abs(g - 200) <= 3 and abs(b - 30) <= 3


def test_decode_accepts_bytes_like():
    data = encoded("PNG")
    for d in (data, bytearray(data), memoryview(data)):
        assert decode_image(d).size == (37, 21)


def test_decode_composites_transparency_on_white():
    im = decode_image(encoded("PNG", mode="RGBA", color=(255, 0, 0, 0)))
    assert im.mode == "RGB" and im.getpixel((0, 0)) == (255, 255, 255)
    p = Image.new("P", (4, 4), 1)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    buf = io.BytesIO()
    p.save(buf, format="PNG", transparency=1)
    assert decode_image(buf.getvalue()).getpixel((0, 0)) == (255, 255, 255)


def oriented(fmt: str, orientation: int | None, exif: bytes | None = None) -> bytes:
    """A 12x7 picture whose every pixel differs, saved with an EXIF orientation tag."""
    im = Image.new("RGB", (12, 7))
    im.putdata([(x * 20, y * 30, (x * 7 + y * 13) % 256) for y in range(7) for x in range(12)])
    if exif is None and orientation is not None:
        e = Image.Exif()
        e[0x0112] = orientation
        exif = e.tobytes()
    buf = io.BytesIO()
    im.save(buf, format=fmt, **({"exif": exif} if exif is not None else {}), **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # Pillow's, on the garbage case
def test_decode_applies_exif_orientation_exactly_as_vllm_does(fmt):
    # A colocated vLLM engine turns every image it is given upright (normalize_image); an encoder
    # that did not would embed a phone photo on its side, and the two routes would answer differently.
    from vllm.multimodal.image import convert_image_mode, normalize_image

    cases = [None, *range(1, 9), 0, 9, 65535]
    cases_bytes = [oriented(fmt, o) for o in cases] + [oriented(fmt, None, exif=b"Exif\x00\x00MM\x00*garbage")]
    for data in cases_bytes:
        ours = decode_image(data)
        theirs = convert_image_mode(normalize_image(Image.open(io.BytesIO(data))), "RGB")
        assert ours.size == theirs.size and ours.tobytes() == theirs.tobytes()
    # orientations 5..8 swap the axes
    assert decode_image(oriented(fmt, 6)).size == (7, 12)
    assert decode_image(oriented(fmt, 3)).size == (12, 7)
    # turned once only: the colocated engine applies normalize_image again to what we decoded
    once = decode_image(oriented(fmt, 6))
    assert normalize_image(once).tobytes() == once.tobytes()


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_a_pil_image_with_an_exif_orientation_is_sent_as_its_file_would_be(orientation):
    # The client re-encodes a PIL image as PNG, which used to drop its EXIF block: an encoder got
    # a phone photo on its side, while the same file, or vLLM given the same PIL image, turned it.
    from vllm.multimodal.image import convert_image_mode, normalize_image

    data = oriented("JPEG", orientation)
    sent = decode_image(load_image_bytes(Image.open(io.BytesIO(data))))
    from_file = decode_image(data)
    vllm_given_pil = convert_image_mode(normalize_image(Image.open(io.BytesIO(data))), "RGB")
    assert sent.size == from_file.size == vllm_given_pil.size
    assert sent.tobytes() == vllm_given_pil.tobytes()


def test_decode_takes_the_first_frame_of_an_animation():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    im = decode_image(buf.getvalue())
    assert im.getpixel((1, 1)) == (255, 0, 0)


def test_decode_large_jpeg_header_segments():
    # An EXIF segment near its 64 KiB maximum pushes the frame header far into the file.
    im = Image.new("RGB", (16, 16), (0, 0, 0))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=b"Exif\0\0" + b"\0" * 65000, icc_profile=b"\0" * 200_000)
    assert decode_image(buf.getvalue()).size == (16, 16)


@pytest.mark.parametrize(
    "data,match",
    [
        (b"", "empty"),
        (os.urandom(4096), "not a supported image"),
        (b"GIF89a", "truncated or malformed"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 8, "truncated or malformed"),
        (encoded("TIFF"), "not a supported image"),
        (encoded("ICO"), "not a supported image"),
    ],
)
def test_decode_rejects_garbage(data, match):
    with pytest.raises(InvalidInputError, match=match):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_decode_rejects_truncated(fmt):
    data = encoded(fmt, size=(64, 64), color=(1, 2, 3))
    noisy = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))  # incompressible
    buf = io.BytesIO()
    noisy.save(buf, format=fmt)
    data = buf.getvalue()
    with pytest.raises(InvalidInputError):
        decode_image(data[: len(data) // 2])


def test_decode_rejects_zero_size():
    with pytest.raises(InvalidInputError, match="no pixels"):
        decode_image(png_header(0, 10))


@pytest.mark.parametrize("dims", [(100_000, 100_000), (10_000, 10_000), (7000, 7000), (2**31 - 1, 2**31 - 1)])
def test_decode_rejects_bombs_from_the_header(dims):
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidInputError, match="pixels"):
        decode_image(png_header(*dims))  # (warnings are errors here: no bomb warning either)
    assert Image.MAX_IMAGE_PIXELS == before  # global PIL state untouched


def test_decode_rejects_jpeg_and_webp_bombs():
    jpeg = bytearray(encoded("JPEG", size=(16, 16)))
    sof = next(i for i in range(2, len(jpeg) - 1) if jpeg[i] == 0xFF and jpeg[i + 1] == 0xC0)
    jpeg[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)
    with pytest.raises(InvalidInputError, match="pixels"):
        decode_image(bytes(jpeg))
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\0" * 4 + (16383).to_bytes(3, "little") * 2
    webp = b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x
    with pytest.raises(InvalidInputError, match="pixels"):
        decode_image(webp)


def test_decode_pixel_and_byte_limits_are_parameters():
    data = encoded("PNG", size=(64, 64))
    assert decode_image(data, max_pixels=64 * 64).size == (64, 64)
    with pytest.raises(InvalidInputError, match="pixels"):
        decode_image(data, max_pixels=64 * 64 - 1)
    with pytest.raises(InvalidInputError, match="bytes"):
        decode_image(data, max_bytes=len(data) - 1)
    assert MAX_IMAGE_PIXELS_DEFAULT < Image.MAX_IMAGE_PIXELS  # ours binds before Pillow's would warn


def test_decode_rejects_corrupt_pixel_data():
    data = bytearray(encoded("PNG", size=(32, 32)))
    idat = data.index(b"IDAT")
    data[idat + 4 : idat + 20] = os.urandom(16)
    with pytest.raises(InvalidInputError):
        decode_image(bytes(data))


# -- loading on the client ------------------------------------------------------------------------


def test_load_path_and_pathlike(tmp_path):
    data = encoded("JPEG")
    p = tmp_path / "x.jpg"
    p.write_bytes(data)
    assert load_image_bytes(p) == data
    assert load_image_bytes(str(p)) == data


def test_load_rejects_bad_paths(tmp_path):
    with pytest.raises(InvalidInputError, match="not a regular file"):
        load_image_bytes(tmp_path)
    with pytest.raises(InvalidInputError, match="cannot open"):
        load_image_bytes(tmp_path / "missing.png")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InvalidInputError, match="not a regular file"):
        load_image_bytes(fifo)  # must not block waiting for a writer
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(InvalidInputError, match="empty"):
        load_image_bytes(empty)
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * 2048)
    with pytest.raises(InvalidInputError, match="limit 1024"):
        load_image_bytes(big, max_bytes=1024)


def test_load_bytes_pass_through_and_limits():
    data = encoded("PNG")
    assert load_image_bytes(data) == data
    assert load_image_bytes(bytearray(data)) == data
    assert load_image_bytes(memoryview(data)) == data
    with pytest.raises(InvalidInputError):
        load_image_bytes(b"")
    with pytest.raises(InvalidInputError):
        load_image_bytes(data, max_bytes=10)


def test_load_data_urls_and_refuse_http_urls():
    data = encoded("PNG")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert load_image_bytes(url) == data
    with pytest.raises(InvalidInputError, match="must be base64-encoded"):
        load_image_bytes("data:image/png,rawbytes")
    with pytest.raises(InvalidInputError, match="invalid base64"):
        load_image_bytes("data:image/png;base64,not*base64")
    with pytest.raises(InvalidInputError, match="limit 10"):
        load_image_bytes(url, max_bytes=10)
    for remote in ("http://example.com/cat.png", "HTTPS://example.com/cat.png"):
        with pytest.raises(InvalidInputError, match="does not fetch image URLs"):
            load_image_bytes(remote)


def test_load_pil_image_is_lossless_and_deterministic():
    im = Image.frombytes("RGB", (23, 17), os.urandom(23 * 17 * 3))
    a, b = load_image_bytes(im), load_image_bytes(im.copy())
    assert a == b and sniff_format(a) == "png"
    assert decode_image(a).tobytes() == im.tobytes()
    cmyk = Image.new("CMYK", (4, 4), (0, 0, 0, 0))
    assert decode_image(load_image_bytes(cmyk)).size == (4, 4)


@pytest.mark.parametrize("bad", [None, 3, 1.5, ["x.png"], {"image": b"x"}])
def test_load_rejects_other_types(bad):
    with pytest.raises(InvalidInputError):
        load_image_bytes(bad)


def test_the_client_leaves_the_image_size_limit_to_the_broker(tmp_path):
    # the client refused files over 20 MiB, whatever the broker's --max-image-mb: raising it did nothing
    from epdq.broker import BrokerConfig
    from epdq.media import MAX_IMAGE_BYTES_LIMIT
    from epdq.transport import MAX_MESSAGE_BYTES_DEFAULT
    from epdq.worker.runner import WorkerConfig

    big = tmp_path / "big.png"
    big.write_bytes(demo_png_header() + bytes(30 * 2**20))
    assert len(load_image_bytes(big)) > 30 * 2**20
    BrokerConfig("ipc:///tmp/x", max_image_bytes=MAX_IMAGE_BYTES_LIMIT)  # the most a broker accepts
    with pytest.raises(ValueError):
        BrokerConfig("ipc:///tmp/x", max_image_bytes=MAX_IMAGE_BYTES_LIMIT + 1)
    assert MAX_IMAGE_BYTES_LIMIT == MAX_MESSAGE_BYTES_DEFAULT - 2**20
    assert WorkerConfig(role="encoder", broker="ipc:///tmp/x").max_image_bytes == MAX_IMAGE_BYTES_LIMIT
    with pytest.raises(InvalidInputError, match="limit"):
        load_image_bytes(bytes(MAX_IMAGE_BYTES_LIMIT + 1))


def demo_png_header() -> bytes:
    return b"\x89PNG\r\n\x1a\n"
