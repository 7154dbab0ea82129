"""One AsyncClient across several `asyncio.run` calls (scripts, notebooks): a real broker and a
no-op worker as processes. The client used to raise a bare `RuntimeError: Event loop is closed`
from the second loop on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from epdq import AsyncClient, BrokerUnavailableError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EPDQ = [sys.executable, "-m", "cli.main"]


@pytest.fixture
def cluster(tmp_path):
    address = f"ipc://{tmp_path}/broker.sock"
    procs = [subprocess.Popen([*EPDQ, "broker", "--address", address], stderr=subprocess.DEVNULL)]
    procs.append(subprocess.Popen(
        [*EPDQ, "worker", "--role", "both", "--engine", "noop", "--broker", address], stderr=subprocess.DEVNULL
    ))  # fmt: skip
    try:
        yield address
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_one_client_serves_one_asyncio_run_after_another(cluster):
    client = AsyncClient(cluster)

    async def wait_for_worker() -> None:
        async with asyncio.timeout(60):
            while not (await client.stats())["workers"]:
                await asyncio.sleep(0.1)

    async def ask(text: str) -> str:
        return (await client.generate(text, max_tokens=2, timeout=30)).finish_reason

    asyncio.run(client.connect())  # connected in a loop that then closes
    asyncio.run(wait_for_worker())
    assert asyncio.run(ask("second loop")) == "length"

    async def within() -> str:
        async with client:
            return await ask("async with, third loop")

    assert asyncio.run(within()) == "length"
    with pytest.raises(BrokerUnavailableError, match="not connected"):
        asyncio.run(ask("after close"))
    asyncio.run(client.connect())
    assert asyncio.run(ask("connected again")) == "length"
    asyncio.run(client.close())


def test_a_client_whose_loop_still_runs_elsewhere_says_so(cluster):
    client = AsyncClient(cluster)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(client.connect(), loop).result(30)

        async def stats() -> dict:
            return await client.stats()

        with pytest.raises(RuntimeError, match="another event loop that is still open"):
            asyncio.run(stats())
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
