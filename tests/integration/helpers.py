"""Helpers shared by the integration tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from epdq import AsyncClient, BrokerUnavailableError
from epdq.cluster import ClusterSpec


def noop_spec(tmp_path, **kw: Any) -> ClusterSpec:
    """A cluster of no-op engines (real broker, worker and ring code, no model) over ipc."""
    defaults = dict(
        address=f"ipc://{tmp_path}/sock/broker", encoders=1, pds=1, log_dir=str(tmp_path / "logs"),
        worker_defaults={"engine": "noop"}, start_timeout_s=60,
    )  # fmt: skip
    defaults.update(kw)
    return ClusterSpec(**defaults)


async def wait_stats(addr: str, pred, timeout: float = 20.0) -> dict:
    """Poll the broker's stats until `pred(stats)`; AssertionError after `timeout` seconds."""
    async with AsyncClient(addr) as c:
        end = time.monotonic() + timeout
        s = None
        while True:
            try:
                s = await c.stats(timeout=1.0)
                if pred(s):
                    return s
            except BrokerUnavailableError:
                s = None
            if time.monotonic() > end:
                raise AssertionError(f"condition not met within {timeout}s; last stats: {s}")
            await asyncio.sleep(0.05)
