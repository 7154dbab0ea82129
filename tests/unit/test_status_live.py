"""`epdq status` (live) outlasts the broker: it says since when the broker is unreachable and
resumes when one answers again (a broker restart is exactly when an operator watches it)."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq

from epdq.broker import Broker, BrokerConfig
from epdq.errors import BrokerUnavailableError
from epdq.status import show

pytestmark = pytest.mark.timeout(30)


async def wait_for(pred, lines, timeout=10.0):
    async with asyncio.timeout(timeout):
        while not pred(lines):
            await asyncio.sleep(0.05)


async def test_live_view_reports_a_missing_broker_then_resumes(tmp_path, capsys):
    address = f"ipc://{tmp_path}/b.sock"
    lines: list[dict] = []

    async def collect():
        while True:
            out = capsys.readouterr().out
            lines.extend(json.loads(x) for x in out.splitlines() if x)
            await asyncio.sleep(0.05)

    viewer = asyncio.create_task(show(address, once=False, as_json=True, interval=0.2))
    reader = asyncio.create_task(collect())
    ctx = zmq.Context()
    broker = None
    serving = None
    try:
        await wait_for(lambda ls: sum("error" in x for x in ls) >= 2, lines)  # refreshes go on
        down = [x for x in lines if "error" in x]
        assert down[0]["error"] == "broker_unavailable" and down[0]["since"] == down[-1]["since"]
        broker = Broker(BrokerConfig(address=address), ctx=ctx)
        serving = asyncio.create_task(broker.serve())
        await wait_for(lambda ls: "workers" in ls[-1], lines, timeout=20)  # the table is back
        assert not viewer.done()
    finally:
        viewer.cancel()
        reader.cancel()
        if broker is not None:
            broker.stop()
            await serving
        ctx.destroy(linger=0)


async def test_once_still_fails_fast(tmp_path):
    with pytest.raises(BrokerUnavailableError):
        await show(f"ipc://{tmp_path}/none.sock", once=True, as_json=True)
