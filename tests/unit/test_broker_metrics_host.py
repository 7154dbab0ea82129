"""`epdq broker --metrics [::1]:PORT`: the bracketed IPv6 form passed the config's check, then the
listener was asked for host '[::1]' and the broker exited with a ConfigError."""

from __future__ import annotations

import asyncio
import socket

import pytest
import zmq

from epdq.broker import Broker, BrokerConfig

pytestmark = pytest.mark.timeout(30)


def _free_ipv6_loopback_port() -> int:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")


@pytest.mark.parametrize("form", ["[::1]:{port}", "::1:{port}"])
async def test_metrics_on_an_ipv6_literal(form, tmp_path):
    port = _free_ipv6_loopback_port()
    ctx = zmq.Context()
    broker = Broker(BrokerConfig(address=f"ipc://{tmp_path}/b.sock", metrics_address=form.format(port=port)), ctx=ctx)
    ready = asyncio.Event()
    serving = asyncio.create_task(broker.serve(ready))
    waiter = asyncio.create_task(ready.wait())
    try:
        done, _ = await asyncio.wait({serving, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert waiter in done, "the broker ended (or hung) before it was ready"
        reader, writer = await asyncio.open_connection("::1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
        assert reply.startswith(b"HTTP/1.1 200")
    finally:
        waiter.cancel()
        broker.stop()
        await serving  # on the old code: ConfigError "cannot serve metrics on [::1]:..."
        ctx.destroy(linger=0)
