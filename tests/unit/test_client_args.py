"""The client refuses arguments of the wrong type before anything is sent: the broker would drop
such a SUBMIT as a malformed message, and the caller would wait for its deadline."""

from __future__ import annotations

import asyncio
import inspect
import math
import os

import pytest

from epdq import AsyncClient, ConfigError, InvalidInputError
from epdq import protocol as P


@pytest.fixture
def client():
    return AsyncClient("ipc:///nonexistent/epdq-test.sock")  # never connected: _prepare sends nothing


def prepare(client: AsyncClient, prompt=None, **kwargs):
    """`_prepare` with generate()'s defaults, as generate and stream call it."""
    bound = inspect.signature(AsyncClient.generate).bind(client, prompt, **kwargs)
    bound.apply_defaults()
    return client._prepare(*list(bound.arguments.values())[1:])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed="7"), "seed must be"),
        (dict(seed=2**63), "seed must be"),
        (dict(seed=True), "seed must be"),
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(max_tokens="4"), "max_tokens must be an integer"),
        (dict(temperature="hot"), "temperature must be a finite number"),
        # value ranges too: these were sent (images uploaded first) and refused by the broker
        (dict(temperature=5), r"temperature must be in \[0, 2\], not 5.0"),
        (dict(temperature=-0.1), r"temperature must be in \[0, 2\]"),
        (dict(top_p=0), r"top_p must be in \(0, 1\], not 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(stop=["x"] * 17), r"17 stop strings \(at most 16\)"),
        (dict(stop=""), "a stop string must have 1..256 characters, not 0"),
        (dict(stop=["y" * 257]), "a stop string must have 1..256 characters, not 257"),
        (dict(stop=b"x"), "stop must be a string or a list of strings, not bytes"),
        (dict(stop={"a": 1}), "stop must be a string or a list of strings, not dict"),
        (dict(top_p=math.nan), "top_p must be a finite number"),
        (dict(stop=[1]), "stop must be"),
        (dict(stop=5), "stop must be"),
        (dict(ignore_eos=1), "ignore_eos must be"),
        (dict(timeout="soon"), "timeout must be a number"),
        (dict(timeout=math.inf), "timeout must be a number"),
        (dict(timeout=0), r"timeout must be in \(0, 3600\]"),
        (dict(timeout=7200), r"timeout must be in \(0, 3600\] s \(the broker's limit\)"),
        # each of these used to be sent (dropped by the broker as malformed, or an OverflowError)
        (dict(route=5), "route must be one of auto, epd, colocated"),
        (dict(route=None), "route must be one of"),
        (dict(route="bogus"), "route must be one of"),
        (dict(max_tokens=2**70), r"max_tokens must be in \[1, 32768\]"),
        (dict(max_tokens=0), r"max_tokens must be in \[1, 32768\]"),
        (dict(images=5), "images must be a list of images, not int"),
        (dict(images={"a": 1}), "images must be a list of images, not dict"),
        (dict(prompt="a\ud800b"), "text is not valid Unicode"),
        (dict(messages=[{"role": "user", "content": 5}]), "content must be"),
        (dict(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "text must be a string"),
        (dict(messages=[{"role": 3, "content": "x"}]), "needs a role"),
        (dict(messages=[{"role": "bot", "content": "x"}]), "unknown role"),
        (dict(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "unsupported content part"),
        # within the character limit, over the header's byte limit (4 bytes each in UTF-8)
        (dict(messages=[{"role": "user", "content": "\U0001f600" * P.MAX_TEXT_CHARS}]), "bytes encoded"),
    ],
)
def test_bad_arguments_are_refused_before_sending(client, kwargs, match):
    prompt = None if "messages" in kwargs else kwargs.pop("prompt", "hi")
    with pytest.raises(InvalidInputError, match=match):
        prepare(client, prompt, **kwargs)


def test_one_image_may_be_given_bare(client):
    from PIL import Image

    from epdq.demo import demo_image

    png = demo_image(1, (16, 16))
    for one in (png, bytearray(png), Image.open(__import__("io").BytesIO(png)), None, ()):
        _, frames, _, _ = prepare(client, "hi", images=one)
        assert len(frames) == 2 + (one not in (None, ())), type(one)


def test_unusable_key_files_are_refused_at_construction(tmp_path):
    # they were read only at connect: serve-http failed inside uvicorn's start-up (traceback, exit 3)
    from epdq.keys import ensure_cluster_keys

    keys = ensure_cluster_keys(tmp_path / "k")
    os.chmod(keys / "client.key_secret", 0o644)
    with pytest.raises(ConfigError, match="accessible by other users"):
        AsyncClient("tcp://127.0.0.1:7700", keys_dir=str(keys))


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((None,), {}, ConfigError, "address must be a string"),
        (("bogus",), {}, ConfigError, "address must look like"),
        # plaintext off this host: refused at construction, where it used to surface only at connect
        (("tcp://10.1.2.3:7700",), dict(insecure=True), ConfigError, "not a loopback address"),
        (("ipc:///x",), dict(liveness="5"), ValueError, "liveness must be an integer"),
        (("ipc:///x",), dict(timeout=0), ValueError, r"timeout must be a number of seconds in \(0, 3600\]"),
        (("ipc:///x",), dict(heartbeat_s=-1), ValueError, "heartbeat_s must be"),
    ],
)
def test_bad_client_settings_are_refused_at_construction(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        AsyncClient(*args, **kwargs)


def test_good_arguments_make_a_decodable_submit(client):
    rid, frames, _, timeout = prepare(
        client, None, messages=[{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}],
        max_tokens=3, temperature=1, top_p=0.5, seed=-(2**63), stop="\n", ignore_eos=True, timeout=2,
    )  # fmt: skip
    msg, payload = P.decode(frames)
    assert isinstance(msg, P.Submit) and msg.request_id == rid and payload == []
    assert msg.sampling == P.Sampling(3, 1.0, 0.5, -(2**63), ["\n"], True)
    assert timeout == 2.0 and type(timeout) is float
    # no timeout: 0 on the wire, so the broker applies its own --timeout
    _, frames, _, _ = prepare(client, "hi")
    assert P.decode(frames)[0].timeout_s == 0.0


def test_stop_strings_may_come_in_any_iterable(client):
    for stop in (("a", "b"), {"a"}, (x for x in ["a"]), {"a": 1}.keys()):
        _, frames, _, _ = prepare(client, "hi", stop=stop)
        assert set(P.decode(frames)[0].sampling.stop) <= {"a", "b"}, stop


async def test_a_connected_client_refuses_out_of_range_values_at_once():
    # no broker behind the address: anything sent would wait 5 s for BrokerUnavailableError
    async with AsyncClient("ipc:///nonexistent/epdq-test.sock") as c:
        async with asyncio.timeout(1):
            with pytest.raises(InvalidInputError, match="temperature"):
                await c.generate("hi", temperature=5)
            with pytest.raises(InvalidInputError, match="top_p"):
                async for _ in c.stream("hi", top_p=0):
                    pass


def test_generate_and_stream_show_their_keywords():
    documented = ["prompt", "images", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
                  "ignore_eos", "timeout", "route"]  # fmt: skip
    for fn in (AsyncClient.generate, AsyncClient.stream):
        assert list(inspect.signature(fn).parameters)[1:] == documented
    with pytest.raises(TypeError, match="generate"):
        AsyncClient("ipc:///x").generate("hi", tokens=3).close()


async def test_each_client_socket_has_its_own_unguessable_identity():
    # without one the broker's ROUTER numbered clients from a counter, and a client that connected
    # under another's number took its link over and read its tokens
    import zmq

    async with AsyncClient("ipc:///nonexistent/epdq-test.sock") as a, AsyncClient("ipc:///nonexistent/x.sock") as b:
        ids = [c._channel.sock.getsockopt(zmq.IDENTITY) for c in (a, b)]
        a._reopen()  # a fresh socket after a silent broker: a fresh identity
        ids.append(a._channel.sock.getsockopt(zmq.IDENTITY))
    assert len(set(ids)) == 3 and all(i.startswith(b"c-") and len(i) == 34 for i in ids), ids
