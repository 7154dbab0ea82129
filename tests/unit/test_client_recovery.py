"""The client after a socket it could not make, a STATS reply that answers several requests, and
arguments too large for a float or for repr(): each is handled, or refused with a typed error, and
never leaves the client (or a gateway's connection slot) dead for good."""

from __future__ import annotations

import asyncio
import errno
import time

import pytest
import zmq

import epdq.client as client_module
from epdq import AsyncClient, BrokerUnavailableError, InvalidInputError
from epdq import protocol as P
from epdq.client_input import make_sampling, shown
from epdq.gateway_clients import BrokerConnections

NOWHERE = "ipc:///nonexistent/epdq-test.sock"  # no broker: connecting never completes, sending queues
HUGE = 10**5000  # repr() refuses an int of over 4,300 digits (ValueError)
BIG = 10**400  # float() and math.isfinite() overflow


class FlakySockets:
    """make_socket, failing the next `fail` calls as a process at its file limit does (EMFILE)."""

    def __init__(self) -> None:
        self.fail = 0
        self.failed = 0

    def __call__(self, *args, **kwargs):
        if self.fail:
            self.fail -= 1
            self.failed += 1
            raise zmq.ZMQError(errno.EMFILE)
        return make_socket(*args, **kwargs)


make_socket = client_module.make_socket


@pytest.fixture
def flaky(monkeypatch):
    f = FlakySockets()
    monkeypatch.setattr(client_module, "make_socket", f)
    return f


async def until(cond, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_the_watcher_reconnects_after_a_failed_reopen(flaky):
    c = AsyncClient(NOWHERE, heartbeat_s=0.05, liveness=2)
    await c.connect()
    try:
        flaky.fail = 1  # the socket made after the broker's silence
        with pytest.raises(BrokerUnavailableError, match="silent"):
            await c.generate("hi", timeout=30)
        await until(lambda: flaky.failed == 1)
        # the watcher lived on, and made the socket at a later beat
        await until(lambda: c._channel is not None)
        assert not c._pinger.done() and c.reconnects == 1
    finally:
        await c.close()


async def test_a_request_reopens_a_connection_that_failed_to_reopen(flaky):
    c = AsyncClient(NOWHERE, heartbeat_s=30)  # the watcher does not get a turn
    await c.connect()
    try:
        flaky.fail = 1
        assert not c._try_reopen() and c._channel is None
        # "client is not connected" before: the request now reopens it, and waits for its answer
        with pytest.raises(BrokerUnavailableError, match="no answer from"):
            await c.stats(timeout=0.05)
        assert c._channel is not None and c.reconnects == 1
        flaky.fail = 1
        assert not c._try_reopen()
        flaky.fail = 1  # still failing: said, typed, and tried again by the next request
        with pytest.raises(BrokerUnavailableError, match="cannot reconnect"):
            await c.stats(timeout=0.05)
        with pytest.raises(BrokerUnavailableError, match="no answer from"):
            await c.stats(timeout=0.05)
    finally:
        await c.close()
    with pytest.raises(BrokerUnavailableError, match="not connected"):  # closed by the user: stays closed
        await c.stats(timeout=0.05)


async def test_a_gateway_slot_takes_a_client_only_once_it_connected(flaky):
    made: list[AsyncClient] = []

    def factory() -> AsyncClient:
        made.append(AsyncClient(NOWHERE))
        return made[-1]

    conns = BrokerConnections(factory, "none", 1)
    flaky.fail = 1
    with pytest.raises(zmq.ZMQError):
        await conns.get()
    assert conns.open == 0  # not the dead client, for every later request
    client = await conns.get()
    try:
        assert client is made[1] and client._channel is not None and conns.open == 1
    finally:
        await conns.close()


async def test_one_stats_reply_answers_every_earlier_request():
    # The broker answers a connection's STATS at most every ~50 ms, once for all received
    # meanwhile, with the latest nonce: the earlier requests must not wait for their timeout.
    c = AsyncClient(NOWHERE)
    loop = asyncio.get_running_loop()
    waiters = {n: loop.create_future() for n in (3, 4, 6, 9)}
    c._stats_waiters.update(waiters)
    reply = P.Stats(6, {"submitted": 5}, {}, [])
    c._on_frames(P.encode(reply))
    for n in (3, 4, 6):
        assert waiters[n].done() and waiters[n].result() == reply
    assert not waiters[9].done() and list(c._stats_waiters) == [9]
    c._on_frames(P.encode(P.Stats(2, {}, {}, [])))  # an older reply answers nothing newer
    assert not waiters[9].done()
    waiters[9].cancel()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=BIG), "temperature must be a finite number, not an integer of 1329 bits"),
        (dict(top_p=-BIG), "top_p must be a finite number"),
        (dict(temperature=HUGE), "temperature must be a finite number"),
        (dict(max_tokens=HUGE), "max_tokens must be in"),
        (dict(seed=HUGE), "seed must be a 64-bit"),
        (dict(timeout=BIG), "timeout must be a number of seconds"),
        (dict(timeout=HUGE), "timeout must be a number of seconds"),
        (dict(route=HUGE), "route must be one of"),
    ],
)
def test_huge_integers_are_invalid_input(kwargs, match):
    c = AsyncClient(NOWHERE)
    args = dict(max_tokens=4, temperature=0.0, top_p=1.0, seed=None, stop=None, ignore_eos=False, timeout=None,
                route="auto")  # fmt: skip
    args.update(kwargs)
    with pytest.raises(InvalidInputError, match=match) as e:
        c._check_args(**args)
    assert len(e.value.message) < 120


async def test_stats_timeout_and_content_type_too():
    c = AsyncClient(NOWHERE)
    for timeout in (BIG, HUGE):
        with pytest.raises(InvalidInputError, match="timeout must be a number of seconds > 0"):
            await c.stats(timeout=timeout)
    with pytest.raises(InvalidInputError, match="unsupported content part type an integer of"):
        from epdq.client_input import build_messages

        build_messages(None, (), [{"role": "user", "content": [{"type": HUGE}]}])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(timeout=BIG), "timeout must be a number"),
        (dict(timeout=HUGE), "timeout must be a number"),
        (dict(heartbeat_s=BIG), "heartbeat_s must be a number"),
        (dict(heartbeat_s=HUGE), "heartbeat_s must be a number"),
        # accepted before, and the watcher's heartbeat_s * liveness then overflowed and killed it
        (dict(liveness=HUGE), "liveness must be an integer"),
        (dict(liveness=BIG), "liveness must be an integer"),
    ],
)
def test_the_constructor_refuses_huge_integers_with_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        AsyncClient(NOWHERE, **kwargs)
    assert len(str(e.value)) < 120


def test_shown_is_bounded():
    assert shown(HUGE) == "an integer of 16610 bits"
    assert shown("x" * 1000) == repr("x" * 1000)[:40]
    assert shown(2**64) == repr(2**64)

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no")

    assert shown(Unprintable()) == "a Unprintable"
    with pytest.raises(InvalidInputError, match="max_tokens must be an integer, not a Unprintable"):
        make_sampling(Unprintable(), 0.0, 1.0, None, None, False)
