"""Graceful leave on SIGTERM, with real broker and worker processes (no-op engines).

A worker told to stop (SIGTERM: Kubernetes, systemd, `epdq up`'s Ctrl-C) first drains: it tells the
broker to send it nothing new and finishes what it holds, so a planned restart loses nothing (the
requests it was streaming used to fail with WorkerLostError). Ctrl-C or a second SIGTERM, or the
drain timeout, cut the drain short and the worker leaves as before.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from epdq import AsyncClient, BusyError, WorkerLostError
from epdq.cluster import Cluster
from epdq.demo import demo_image
from epdq.status import render, summary
from tests.integration.helpers import noop_spec, wait_stats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN_S = 0.05  # the no-op PD engine's time per output token
MAX_TOKENS = 30  # so a request streams for ~1.5 s


def _worker(stats: dict, wid: str) -> dict | None:
    return next((w for w in stats["workers"] if w["worker_id"] == wid), None)


async def _wait_exit(cluster: Cluster, name: str, timeout: float) -> int:
    proc = cluster.child(name).proc
    end = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < end, f"{name} did not exit within {timeout} s"
        await asyncio.sleep(0.05)
    return proc.returncode


async def test_pd_worker_drains_on_sigterm(tmp_path):
    spec = noop_spec(tmp_path, encoders=1, pds=2,
                     worker_defaults={"engine": "noop", "capacity": 2, "noop_token_s": TOKEN_S})  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        first = [
            asyncio.create_task(c.generate(f"first {i}", images=[demo_image(i, (64, 64))], max_tokens=MAX_TOKENS))
            for i in range(4)
        ]  # fmt: skip
        s = await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 4)
        held = _worker(s, "pd-0")["inflight"]
        assert held == 2  # round robin: two on each PD worker
        cluster.child("pd-0").proc.send_signal(signal.SIGTERM)
        s = await wait_stats(cluster.address, lambda s: (_worker(s, "pd-0") or {}).get("draining"), timeout=10)
        assert s["gauges"]["workers_draining"] == 1
        table = render(summary(s), cluster.address)  # `epdq status`
        assert any(line.split()[:2] == ["pd-0", "pd*"] for line in table.splitlines()), table
        assert "* draining" in table
        # new work while pd-0 drains goes to pd-1 only: pd-0's count never goes up again
        later = [asyncio.create_task(c.generate(f"later {i}", max_tokens=3)) for i in range(3)]
        seen = []
        while cluster.child("pd-0").proc.poll() is None:
            w = _worker(await c.stats(), "pd-0")
            if w is None:
                break
            seen.append(w["inflight"])
            await asyncio.sleep(0.05)
        assert seen and max(seen) <= held and seen == sorted(seen, reverse=True), seen
        assert await _wait_exit(cluster, "pd-0", 15) == 0  # drained and left: a clean exit
        results = await asyncio.gather(*first, *later)  # nothing lost: every request answered in full
        assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * 4 + [3] * 3
        s = await c.stats()
        assert _worker(s, "pd-0") is None and s["counters"]["pd_requeues"] == 0
        assert s["counters"]["requests_failed"] == 0
        assert s["counters"]["workers_lost"] == 0  # a planned leave (it used to count as lost)
        log = cluster.child("pd-0").tail(60)
        assert "draining" in log and "drained" in log, log


async def test_encoder_drains_its_jobs_and_pinned_entries(tmp_path):
    spec = noop_spec(tmp_path, encoders=2, pds=1,
                     worker_defaults={"engine": "noop", "capacity": 1, "noop_encode_s": 0.5}, )  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        jobs = [asyncio.create_task(c.generate(f"enc {i}", images=[demo_image(50 + i, (64, 64))], max_tokens=2))
                for i in range(2)]  # fmt: skip
        await wait_stats(cluster.address, lambda s: s["gauges"]["encodes_inflight"] == 2)
        cluster.child("encoder-0").proc.send_signal(signal.SIGTERM)
        await wait_stats(cluster.address, lambda s: (_worker(s, "encoder-0") or {}).get("draining"), timeout=10)
        # a new image while encoder-0 drains: encoded by encoder-1
        fresh = asyncio.create_task(c.generate("fresh", images=[demo_image(99, (64, 64))], max_tokens=2))
        assert await _wait_exit(cluster, "encoder-0", 15) == 0
        results = await asyncio.gather(*jobs, fresh)
        assert all(len(r.token_ids) == 2 for r in results)
        s = await c.stats()
        assert s["counters"]["encode_requeues"] == 0 and s["counters"]["requests_failed"] == 0
        assert [w["worker_id"] for w in s["workers"] if w["role"] == "encoder"] == ["encoder-1"]
        assert s["counters"]["workers_lost"] == 0


async def test_second_sigterm_or_timeout_cuts_the_drain_short(tmp_path):
    spec = noop_spec(tmp_path, encoders=0, pds=0, both=1,
                     worker_defaults={"engine": "noop", "noop_token_s": 0.5, "drain_timeout_s": 5.0})  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        # a request that would stream for 50 s: longer than the drain timeout
        long = asyncio.create_task(c.generate("long", max_tokens=100))
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
        await asyncio.sleep(0.6)  # it has streamed: it cannot be re-queued
        t0 = time.monotonic()
        cluster.child("both-0").proc.send_signal(signal.SIGTERM)
        assert await _wait_exit(cluster, "both-0", 15) == 0
        assert 4.8 <= time.monotonic() - t0 < 10  # it waited for the drain timeout, not for the request
        with pytest.raises(WorkerLostError):
            await long
        assert "drain timed out" in cluster.child("both-0").tail(40)

        cluster.respawn(cluster.child("both-0"))
        await wait_stats(cluster.address, lambda s: len(s["workers"]) == 1, timeout=30)
        long = asyncio.create_task(c.generate("long again", max_tokens=100))
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
        t0 = time.monotonic()
        proc = cluster.child("both-0").proc
        proc.send_signal(signal.SIGTERM)
        await wait_stats(cluster.address, lambda s: s["gauges"]["workers_draining"] == 1, timeout=10)
        proc.send_signal(signal.SIGTERM)  # the second one: stop now
        assert await _wait_exit(cluster, "both-0", 10) == 0
        assert time.monotonic() - t0 < 4  # well before the drain timeout
        assert "drain cut short" in cluster.child("both-0").tail(40)
        # it had not streamed yet (first token after 0.5 s): back in the queue for the next worker
        s = await wait_stats(cluster.address, lambda s: s["gauges"]["requests_ready"] == 1)
        assert s["counters"]["pd_requeues"] == 1 and not long.done()
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)


async def test_broker_drains_on_sigterm(tmp_path):
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": TOKEN_S})
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        streams = [asyncio.create_task(c.generate(f"long {i}", images=[demo_image(70 + i, (64, 64))],
                                                  max_tokens=MAX_TOKENS)) for i in range(2)]  # fmt: skip
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 2)
        t0 = time.monotonic()
        cluster.child("broker").proc.send_signal(signal.SIGTERM)
        s = await wait_stats(cluster.address, lambda s: s["gauges"]["broker_draining"] == 1, timeout=10)
        assert summary(s)["draining"] and "DRAINING" in render(summary(s), cluster.address)  # `epdq status`
        with pytest.raises(BusyError, match="shutting down") as ei:  # new work is refused, typed
            await c.generate("new", max_tokens=2)
        assert ei.value.retry_after >= 1.0
        assert (await c.stats())["counters"]["busy_rejections"] == 1  # counted like any busy answer
        results = await asyncio.gather(*streams)  # what was in flight finishes in full
        assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * 2
        assert await _wait_exit(cluster, "broker", 10) == 0
        assert time.monotonic() - t0 < spec.drain_timeout_s  # it left once they were done
        log = cluster.child("broker").tail(40)
        assert "draining" in log and "drained" in log, log
