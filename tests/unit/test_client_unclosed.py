"""A client dropped while connected says so (ResourceWarning), as asyncio's transports and
aiohttp's sessions do; one closed, or never connected, says nothing."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from epdq import AsyncClient


def _dropped(tmp_path, *, close: bool, connect: bool = True) -> list[warnings.WarningMessage]:
    address = f"ipc://{tmp_path}/nobody.sock"  # ZeroMQ connects lazily: no broker needed

    async def use() -> None:
        client = AsyncClient(address)
        if connect:
            await client.connect()
        if close:
            await client.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(use())  # the loop, and with it the socket's reader, is gone after this
        gc.collect()
    return [w for w in caught if issubclass(w.category, ResourceWarning) and "AsyncClient" in str(w.message)]


def test_a_connected_client_dropped_without_close_warns(tmp_path):
    (w,) = _dropped(tmp_path, close=False)
    assert "unclosed AsyncClient for ipc://" in str(w.message)
    assert "async with" in str(w.message)


@pytest.mark.parametrize("close, connect", [(True, True), (False, False)])
def test_a_closed_or_never_connected_client_is_silent(tmp_path, close, connect):
    assert _dropped(tmp_path, close=close, connect=connect) == []
