"""The client refuses arguments of the wrong type before anything is sent: the broker would drop
such a SUBMIT as a malformed message, and the caller would wait for its deadline."""

from __future__ import annotations

import math

import pytest

from epdq import AsyncClient, InvalidInputError
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
        (dict(timeout=0), "timeout must be > 0"),
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
    prompt = None if "messages" in kwargs else "hi"
    with pytest.raises(InvalidInputError, match=match):
        client._prepare(prompt, **kwargs)


def test_good_arguments_make_a_decodable_submit(client):
    rid, frames, _, timeout = client._prepare(
        None, messages=[{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}],
        max_tokens=3, temperature=1, top_p=0.5, seed=-(2**63), stop="\n", ignore_eos=True, timeout=2,
    )  # fmt: skip
    msg, payload = P.decode(frames)
    assert isinstance(msg, P.Submit) and msg.request_id == rid and payload == []
    assert msg.sampling == P.Sampling(3, 1.0, 0.5, -(2**63), ["\n"], True)
    assert timeout == 2.0 and type(timeout) is float
