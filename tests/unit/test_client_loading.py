"""The client turns images into bytes off its event loop where that may take a while (a PIL
image to encode, a file to read, a large data: URL to decode): one large image used to stall
every other request of that loop (a 12 MP PIL image, 0.2-1.2 s; the HTTP gateway serves all its
clients from one loop). Small bytes stay on the loop: a thread hop costs more than they do."""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import threading

import pytest

from epdq import AsyncClient, InvalidInputError, client_input, media
from epdq import client as client_mod
from epdq import protocol as P
from epdq.demo import demo_image


@pytest.fixture
def client():
    return AsyncClient("ipc:///nonexistent/epdq-test.sock")  # never connected: nothing is sent


async def prepare_async(client: AsyncClient, prompt=None, **kwargs):
    """`_prepare_async` with generate()'s defaults, as generate and stream call it."""
    bound = inspect.signature(AsyncClient.generate).bind(client, prompt, **kwargs)
    bound.apply_defaults()
    return await client._prepare_async(*list(bound.arguments.values())[1:])


@pytest.fixture
def threads(monkeypatch):
    """The threads `build_messages` ran on."""
    seen: list[int] = []
    real = client_mod.build_messages

    def recording(*a, **k):
        seen.append(threading.get_ident())
        return real(*a, **k)

    monkeypatch.setattr(client_mod, "build_messages", recording)
    return seen


def pil_image():
    from PIL import Image

    return Image.open(io.BytesIO(demo_image(3, (32, 32))))


def data_url(nbytes: int) -> str:
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(nbytes)).decode()


@pytest.mark.parametrize(
    "images, messages, slow",
    [
        ([demo_image(1, (16, 16))], None, False),
        ((demo_image(1, (16, 16)),) * 3, None, False),
        (demo_image(1, (16, 16)), None, False),  # one image given bare
        ((), None, False),
        (None, None, False),
        ([bytearray(16)], None, False),
        ([bytearray(media.LOAD_INLINE_BYTES + 1)], None, True),  # copied
        ([memoryview(bytes(media.LOAD_INLINE_BYTES + 1))], None, True),
        ([data_url(100)], None, False),
        ([data_url(media.LOAD_INLINE_BYTES)], None, True),  # decoded
        (["photo.png"], None, True),  # a file to read
        ("https://example.com/a.png", None, False),  # refused at once
        ((x for x in [b"x"]), None, True),  # a generator: consumed once, on the thread
        ({"a": 1}, None, False),  # refused at once
        (5, None, False),
        (None, [{"role": "user", "content": "hi"}], False),
        (None, [{"role": "user", "content": [{"type": "image", "image": b"\x89PNG"}]}], False),
        (None, [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}], True),
        (None, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(10)}}]}], False),
        (None, [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(1 << 17)}]}], True),
        (None, [{"role": "user", "content": [5, None, {"type": 3}]}], False),  # malformed: refused at once
        (None, "not a list", False),
    ],
)
def test_which_images_load_on_a_thread(images, messages, slow):
    assert client_input.input_loads_slowly(images, messages) is slow


def test_a_pil_image_counts_as_slow():
    assert client_input.input_loads_slowly([pil_image()], None)
    assert client_input.input_loads_slowly(pil_image(), None)
    assert client_input.input_loads_slowly(None, [{"role": "user", "content": [{"type": "image", "image": pil_image()}]}])


async def test_a_pil_image_is_encoded_off_the_event_loop(client, threads):
    im = pil_image()
    _, frames, _, _ = await prepare_async(client, "hi", images=[im])
    assert threads and threads[0] != threading.get_ident()
    # the same frames as on the loop: the PNG the synchronous path makes
    _, sync_frames, _, _ = client._prepare("hi", [im], None, 16, 0.0, 1.0, None, None, False, None, "auto")
    assert frames[2:] == sync_frames[2:] and P.decode(frames)[0].n_images == 1


async def test_large_data_urls_are_decoded_off_the_event_loop(client, threads):
    png = demo_image(5, (64, 64)) + bytes(media.LOAD_INLINE_BYTES)  # trailing bytes: a large file
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}]
    _, frames, copy, _ = await prepare_async(client, None, messages=msgs)
    assert threads[0] != threading.get_ident()
    assert bytes(frames[-1]) == png and not copy  # large: sent zero-copy


async def test_small_bytes_stay_on_the_event_loop(client, threads):
    _, frames, _, _ = await prepare_async(client, "hi", images=[demo_image(1, (16, 16))])
    assert threads == [threading.get_ident()]
    assert frames[-1] == demo_image(1, (16, 16))


async def test_a_generator_of_images_is_consumed_once(client, threads):
    made = []

    def gen():
        for seed in (1, 2):
            made.append(seed)
            yield demo_image(seed, (16, 16))

    _, frames, _, _ = await prepare_async(client, "hi", images=gen())
    assert made == [1, 2] and len(frames) == 4
    assert frames[2:] == [demo_image(1, (16, 16)), demo_image(2, (16, 16))]


async def test_bad_arguments_fail_before_a_slow_image_is_loaded(client, monkeypatch):
    def must_not_run(im):
        raise AssertionError("encoded an image for a request that is refused anyway")

    monkeypatch.setattr(media, "_to_png", must_not_run)
    for kwargs, match in [
        (dict(seed="7"), "seed must be"),
        (dict(route="bogus"), "route must be one of"),
        (dict(timeout=0), "timeout must be in"),
    ]:
        with pytest.raises(InvalidInputError, match=match):
            await prepare_async(client, "hi", images=[pil_image()], **kwargs)


async def test_errors_of_images_loaded_on_a_thread_reach_the_caller(client, tmp_path):
    with pytest.raises(InvalidInputError, match="cannot open image file"):
        await prepare_async(client, "hi", images=[str(tmp_path / "missing.png")])
    bad = "data:image/png;base64," + "!" * (media.LOAD_INLINE_BYTES + 4)
    with pytest.raises(InvalidInputError, match="invalid base64"):
        await prepare_async(client, None, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": bad}]}])


async def test_a_client_closed_while_its_images_load_refuses_the_request(monkeypatch):
    from epdq.errors import BrokerUnavailableError

    started, release = threading.Event(), threading.Event()
    real = client_mod.build_messages

    def gated(*a, **k):
        started.set()
        assert release.wait(5)
        return real(*a, **k)

    monkeypatch.setattr(client_mod, "build_messages", gated)
    c = AsyncClient("ipc:///nonexistent/epdq-test.sock")
    await c.connect()
    try:
        task = asyncio.create_task(c.generate("hi", images=[pil_image()], max_tokens=1, timeout=1))
        assert await asyncio.to_thread(started.wait, 5)
        await c.close()  # while the image is being encoded
        release.set()
        with pytest.raises(BrokerUnavailableError, match="not connected"):
            await asyncio.wait_for(task, 5)
    finally:
        release.set()
        await c.close()
