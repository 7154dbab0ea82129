"""The client refuses arguments of the wrong type before anything is sent: the broker would drop
such a SUBMIT as a malformed message, and the caller would wait for its deadline."""

from __future__ import annotations

import math
import os

import pytest

from epdq import AsyncClient, ConfigError, InvalidInputError
from epdq import protocol as P


@pytest.fixture
def client():
    return AsyncClient("ipc:///nonexistent/epdq-test.sock")  # never connected: _prepare sends nothing


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed="7"), "seed must be"),
        (dict(seed=2**63), "seed must be"),
        (dict(seed=True), "seed must be"),
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(max_tokens="4"), "max_tokens must be an integer"),
        (dict(temperature="hot"), "temperature must be a finite number"),
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
        client._prepare(prompt, **kwargs)


def test_one_image_may_be_given_bare(client):
    from PIL import Image

    from epdq.demo import demo_image

    png = demo_image(1, (16, 16))
    for one in (png, bytearray(png), Image.open(__import__("io").BytesIO(png)), None, ()):
        _, frames, _, _ = client._prepare("hi", images=one)
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
    rid, frames, _, timeout = client._prepare(
        None, messages=[{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}],
        max_tokens=3, temperature=1, top_p=0.5, seed=-(2**63), stop="\n", ignore_eos=True, timeout=2,
    )  # fmt: skip
    msg, payload = P.decode(frames)
    assert isinstance(msg, P.Submit) and msg.request_id == rid and payload == []
    assert msg.sampling == P.Sampling(3, 1.0, 0.5, -(2**63), ["\n"], True)
    assert timeout == 2.0 and type(timeout) is float
    # no timeout: 0 on the wire, so the broker applies its own --timeout
    _, frames, _, _ = client._prepare("hi")
    assert P.decode(frames)[0].timeout_s == 0.0
