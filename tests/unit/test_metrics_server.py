"""The broker's /metrics and /health listener: its 503 says why, and idle connections are capped."""

from __future__ import annotations

import asyncio

import pytest

from epdq.metrics import MetricsServer

pytestmark = pytest.mark.timeout(30)


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def test_health_says_why_it_is_not_ready():
    reason: list[str | None] = ["no workers"]
    server = MetricsServer(lambda: "epdq_up 1\n", lambda: reason[0])
    port = await server.start("127.0.0.1", 0)
    try:
        reply = await get(port, "/health")
        assert reply.startswith(b"HTTP/1.1 503") and reply.endswith(b"\r\n\r\nno workers\n")
        reason[0] = "draining: the broker is shutting down"
        assert (await get(port, "/health")).endswith(b"draining: the broker is shutting down\n")
        reason[0] = None
        assert (await get(port, "/health")).startswith(b"HTTP/1.1 200")
        assert (await get(port, "/metrics")).endswith(b"epdq_up 1\n")
    finally:
        server.close()


async def test_idle_connections_beyond_the_cap_are_closed_at_once():
    server = MetricsServer(lambda: "epdq_up 1\n")
    port = await server.start("127.0.0.1", 0)
    idle = []
    try:
        for _ in range(MetricsServer.MAX_CONNECTIONS):  # sent nothing: each holds a handler
            idle.append(await asyncio.open_connection("127.0.0.1", port))
        for _ in range(100):  # wait until the server has accepted all of them
            if server._open == MetricsServer.MAX_CONNECTIONS:
                break
            await asyncio.sleep(0.01)
        assert server._open == MetricsServer.MAX_CONNECTIONS
        try:  # one more: closed without an answer
            assert await get(port, "/metrics") == b""
        except ConnectionResetError:  # closed before our request was read
            pass
        for _, w in idle:
            w.close()
        for _ in range(100):
            if server._open == 0:
                break
            await asyncio.sleep(0.01)
        assert (await get(port, "/metrics")).endswith(b"epdq_up 1\n")
    finally:
        for _, w in idle:
            w.close()
        server.close()


def test_sample_values_keep_every_digit():
    # `:g` kept six significant digits: a counter past 1e6 seemed to stand still, ring bytes read 2.68435e+08
    from epdq.metrics import Histogram, render_family

    lines = render_family("x_total", "counter", "x", [({}, 1234567), ({"w": "a"}, 1234569.0), ({"w": "b"}, 0.125)])
    assert lines[2:] == ["x_total 1234567", 'x_total{w="a"} 1234569', 'x_total{w="b"} 0.125']
    assert render_family("y", "gauge", "y", [({}, 268435456)])[-1] == "y 268435456"
    assert render_family("z", "gauge", "z", [({}, float("inf")), ({}, float("nan"))])[2:] == ["z +Inf", "z NaN"]
    h = Histogram("h_seconds", "h", (0.005, 2.5, 1e7))
    h.observe(3.0)
    assert 'h_seconds_bucket{le="10000000"} 1' in h.render()
