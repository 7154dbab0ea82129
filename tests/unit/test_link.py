"""A worker's link to the broker, against a scripted broker socket (real ZeroMQ, ipc)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq

from epdq import protocol as P
from epdq.worker.link import BrokerLink

pytestmark = pytest.mark.timeout(30)


def register() -> P.Register:
    return P.Register("pd-test", "pd", "n", 4, "scope", "m", 1)


@pytest.fixture
def broker(tmp_path):
    """A bare ROUTER standing in for the broker; closed at the end."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/b.sock"
    sock.bind(addr)
    yield addr, sock
    sock.close(0)
    ctx.term()


async def recv_all(sock: zmq.Socket, wait_s: float, *, until: int = 0) -> list[tuple[bytes, object]]:
    """Every message that arrives within `wait_s`, decoded (BATCHes opened); with `until`, stop
    as soon as that many have arrived (a loaded machine may take longer than `wait_s` for them)."""
    out = []
    end = time.monotonic() + wait_s
    while time.monotonic() < end or len(out) < until:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await asyncio.sleep(0.01)
            continue
        ident, body = frames[0], frames[1:]
        parts = P.split_batch(body) if body[0] == P.BATCH_TYPE else [body]
        out += [(ident, P.decode(p)[0]) for p in parts]
    return out


@contextlib.asynccontextmanager
async def registering(broker, heartbeat_s: float):
    """A started link and the identity its REGISTER came from; closed at the end."""
    addr, sock = broker
    link = BrokerLink(addr, register(), lambda m, p: None, heartbeat_s=heartbeat_s, liveness=5)
    link.start()
    try:
        (ident, reg), = await asyncio.wait_for(recv_all(sock, 0.3, until=1), 10)
        assert isinstance(reg, P.Register)
        yield link, ident
    finally:
        link.close()


async def test_byes_that_arrive_together_get_one_register(broker):
    _, sock = broker
    async with registering(broker, 0.5) as (link, ident):
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        # a new broker answering five queued heartbeats: five BYEs in a row
        for _ in range(5):
            sock.send_multipart([ident, *P.encode(P.Bye("unknown worker: register again"))])
        got = [m for _, m in await recv_all(sock, 0.4) if isinstance(m, P.Register)]
        assert len(got) == 1  # it used to be five: the broker dropped and re-registered it 4 times
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        sock.send_multipart([ident, *P.encode(P.Bye("later"))])  # registered again: a BYE counts anew
        assert [type(m) for _, m in await recv_all(sock, 0.3) if isinstance(m, P.Register)] == [P.Register]


async def test_reconnect_backoff_doubles_while_the_broker_stays_away(tmp_path):
    link = BrokerLink(f"ipc://{tmp_path}/nobody.sock", register(), lambda m, p: None, heartbeat_s=0.02, liveness=2)
    connects: list[float] = []
    real = link._connect
    link._connect = lambda: (connects.append(time.monotonic()), real())[1]
    link.start()
    try:
        await asyncio.sleep(1.6)
    finally:
        link.close()
    gaps = [b - a for a, b in zip(connects, connects[1:], strict=False)]
    # silence after ~0.06 s, then 0.02 s doubling: ~0.08, 0.1, 0.14, 0.22, 0.38, 0.7 s apart; it used
    # to stay ~0.08 s apart (the first heartbeat after a reconnect reset the backoff)
    assert 3 <= len(gaps) <= 8, gaps
    assert gaps[-1] > 3 * gaps[0], gaps


async def test_a_shorter_interval_from_the_broker_applies_at_once(broker):
    # the worker starts with its own 1 s; a broker asking for 0.1 s (and judging by it) used to get
    # the first heartbeat only after the full second, and dropped the worker right after it registered
    _, sock = broker
    async with registering(broker, 1.0) as (_link, ident):
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.1))])
        beats = [m for _, m in await recv_all(sock, 0.6) if isinstance(m, P.Heartbeat)]
        assert len(beats) >= 3, beats


async def test_after_a_brokers_farewell_its_successor_gets_a_register_at_once(broker):
    """A REGISTER sent on the old broker's shutdown BYE was lost with it, and the successor's
    "register again" was then ignored for 5 heartbeats: ~5 s of a cluster without workers after
    every planned broker restart."""
    _, sock = broker
    async with registering(broker, 0.5) as (link, ident):
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        sock.send_multipart([ident, *P.encode(P.Bye(P.BYE_SHUTTING_DOWN))])
        assert not [m for _, m in await recv_all(sock, 0.2) if isinstance(m, P.Register)]
        assert not link.registered.is_set()
        sock.send_multipart([ident, *P.encode(P.Bye("unknown worker: register again"))])  # the new broker
        got = [m for _, m in await recv_all(sock, 0.2) if isinstance(m, P.Register)]
        assert len(got) == 1

