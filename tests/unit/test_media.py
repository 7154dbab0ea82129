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
    _JPEG_MAX_SCANS,
    DECODE_INLINE_PIXELS,
    MAX_IMAGE_PIXELS_DEFAULT,
    decode_image,
    header_pixels,
    image_key,
    load_image_bytes,
    quick_to_decode,
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


def jpeg_segments(data: bytes) -> list[bytes]:
    """A JPEG's markers with their bytes, a scan's entropy-coded data included (no RSTn here)."""
    out, i = [], 2
    while i < len(data):
        code = data[i + 1]
        if code == 0xD9:
            return [*out, data[i:]]
        j = i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if code == 0xDA:
            while not (data[j] == 0xFF and data[j + 1] != 0):
                j += 1
        out.append(data[i:j])
        i = j
    raise AssertionError("no EOI")


def repeated_scans(extra: int) -> bytes:
    """A progressive 64x64 JPEG whose smallest AC scan is repeated `extra` more times: each one
    makes libjpeg walk every block again (a 296 KB file of them took 6.6 s)."""
    segs = jpeg_segments(encoded("JPEG", size=(64, 64), mode="L", color=128, progressive=True))
    scan = min((s for s in segs if s[1] == 0xDA and s[7] > 0), key=len)  # Ss > 0: an AC scan
    return b"\xff\xd8" + b"".join(segs[:-1]) + scan * extra + segs[-1]


def scans_in(data: bytes) -> int:
    return sum(s[1] == 0xDA for s in jpeg_segments(data))


def test_decode_refuses_a_jpeg_that_repeats_its_scans():
    ok = repeated_scans(_JPEG_MAX_SCANS - scans_in(repeated_scans(0)))
    assert scans_in(ok) == _JPEG_MAX_SCANS
    assert decode_image(ok).size == (64, 64)
    with pytest.raises(InvalidInputError, match="scans"):
        decode_image(repeated_scans(_JPEG_MAX_SCANS))


def test_a_jpeg_with_scan_markers_outside_its_scans_still_decodes():
    # A phone's motion photo carries its video after the JPEG's end; any segment may carry any
    # bytes. Neither is a scan libjpeg decodes.
    data = encoded("JPEG", size=(16, 16), progressive=True)
    after_end = data + b"\xff\xda" * (2 * _JPEG_MAX_SCANS)
    body = b"\xff\xda" * (2 * _JPEG_MAX_SCANS)
    in_a_segment = data[:2] + b"\xff\xfe" + (len(body) + 2).to_bytes(2, "big") + body + data[2:]
    for d in (after_end, in_a_segment):
        assert decode_image(d).size == (16, 16)


@pytest.mark.parametrize("filler", [b"\xff\xfe\x00\x02", b"\xff"])
def test_decode_refuses_a_jpeg_of_endless_empty_segments_at_once(filler):
    # Before the first scan Pillow walks segments in Python too: 20 MiB of empty comments (or of
    # fill bytes) took it and the header walk ~8-12 s, which header_pixels called quick.
    data = encoded("JPEG", size=(16, 16))
    bloated = data[:2] + filler * 5000 + data[2:]
    assert header_pixels(bloated) == 0
    with pytest.raises(InvalidInputError, match="malformed"):
        decode_image(bloated)
    assert decode_image(data[:2] + filler * 100 + data[2:]).size == (16, 16)


def gif(screen: tuple[int, int], place: tuple[int, int], *, extensions: bytes = b"") -> bytes:
    """A GIF whose one 1x1 image lies at `place` on a logical screen of `screen`."""
    head = b"GIF89a" + struct.pack("<HH", *screen) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
    image = b"\x2c" + struct.pack("<HHHH", *place, 1, 1) + b"\x00" + b"\x02\x02\x4c\x01\x00"
    return head + extensions + image + b"\x3b"


GCE = b"\x21\xf9\x04\x01\x00\x00\x00\x00"  # graphic control: colour 0 is transparent
COMMENT = b"\x21\xfe" + (b"\x05hello" * 3) + b"\x00"
NETSCAPE = b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"


@pytest.mark.parametrize("extensions", [b"", GCE, COMMENT + NETSCAPE + GCE, b"\x00" + GCE])
@pytest.mark.parametrize("screen,place", [((1, 1), (299, 299)), ((300, 300), (0, 0)), ((10, 400), (250, 3))])
def test_header_pixels_of_a_gif_are_those_of_the_canvas_pillow_decodes(screen, place, extensions):
    # Pillow grows the canvas to hold an image placed past the logical screen: a 43-byte GIF with
    # a 1x1 screen decoded to 6300x6300 (2.3 s, 814 MiB) on an event loop told it was quick.
    data = gif(screen, place, extensions=extensions)
    size = Image.open(io.BytesIO(data)).size
    assert header_pixels(data) == size[0] * size[1] > DECODE_INLINE_PIXELS
    assert not quick_to_decode([data])
    assert decode_image(data).size == size
    with pytest.raises(InvalidInputError, match="pixels"):
        decode_image(data, max_pixels=size[0] * size[1] - 1)


def test_decode_refuses_a_gif_whose_first_image_lies_past_the_pixel_limit_before_pillow_sees_it():
    # 6325x6325 and more, from 35 bytes: refused from the header, before Pillow opens it (which
    # warns, or raises its own DecompressionBombError, past its global limit).
    for place in ((6324, 6324), (9999, 9999), (65535, 65535)):
        with pytest.raises(InvalidInputError, match="limit 40000000"):
            decode_image(gif((1, 1), place))


def test_a_gif_without_an_image_or_with_endless_extensions_is_refused_at_once():
    head = gif((8, 8), (0, 0))[:19]
    endless = head + (b"\x21\xfe" + b"\x01x" * 5000 + b"\x00") + gif((8, 8), (0, 0))[19:]
    for data in (head + b"\x3b", head, endless):
        assert header_pixels(data) == 0
        with pytest.raises(InvalidInputError, match="malformed"):
            decode_image(data)


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


def test_every_pil_mode_a_user_may_hold_is_sent():
    # "La" (premultiplied alpha) converts to nothing but LA in Pillow: the client refused it
    for mode in ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV",
                 "I", "I;16", "F"):  # fmt: skip
        sent = load_image_bytes(Image.new(mode, (5, 3)))
        assert decode_image(sent).size == (5, 3), mode
    la = Image.new("LA", (2, 2), (200, 255)).convert("La")
    assert decode_image(load_image_bytes(la)).getpixel((0, 0)) == (200, 200, 200)  # opaque: as it was


@pytest.mark.parametrize("mode", ["I", "I;16", "F"])
def test_a_pil_image_of_integer_or_float_pixels_is_sent_as_a_colocated_engine_sees_it(mode):
    # Mode I was taken for one Pillow writes as PNG: the client refused it ("cannot write mode I").
    import numpy as np
    from vllm.multimodal.image import convert_image_mode, normalize_image

    values = [-(2**31), -70000, -1, 0, 1, 127, 255, 256, 1000, 32767, 65535, 65536, 2**31 - 1]
    if mode == "I;16":
        values = [v for v in values if 0 <= v <= 65535]
    dtype = {"I": np.int32, "I;16": np.uint16, "F": np.float32}[mode]
    im = Image.fromarray(np.array([values], dtype=dtype))
    assert im.mode == mode
    images = [im]
    if mode == "I":
        with_16_bits = Image.fromarray(np.array([[0, 1, 300, 40000, 65535]], dtype=np.int32))
        images.append(with_16_bits)
        transparent = im.copy()
        transparent.info["transparency"] = 1000
        images.append(transparent)
    for im in images:
        sent = load_image_bytes(im)
        assert sent == load_image_bytes(im.copy())
        ours = decode_image(sent)
        theirs = convert_image_mode(normalize_image(im), "RGB")
        assert ours.size == theirs.size and ours.tobytes() == theirs.tobytes()
    if mode == "I":  # and 16-bit pixels travel exact
        sent = Image.open(io.BytesIO(load_image_bytes(with_16_bits)))
        assert sent.mode == "I;16" and sent.tobytes() == with_16_bits.convert("I;16").tobytes()
        assert [sent.getpixel((x, 0)) for x in range(5)] == [0, 1, 300, 40000, 65535]


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
