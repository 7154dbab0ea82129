"""Faults, overload and restarts with real processes and sockets, on no-op engines.

No-op engines run the real worker, ring and broker code with no model behind them, so these
tests take seconds. The chaos test with the real model lives in test_chaos.py.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import time

import pytest

from epdq import AsyncClient, BrokerUnavailableError, BusyError, DeadlineExceededError, InvalidInputError
from epdq.broker import BrokerConfig
from epdq.cluster import Cluster, kill_child
from epdq.demo import demo_image
from epdq.security import SecurityConfig
from epdq.status import render, summary
from tests.integration.helpers import noop_spec, wait_stats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]




async def test_backpressure_gate_answers_busy(tmp_path):
    """Capacity 1, queue 1: one request runs, one waits, the rest get a typed busy answer."""
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(max_queued_requests=1, busy_retry_after_s=0.25),
        worker_defaults={"engine": "noop", "capacity": 1, "noop_token_s": 30.0},
    )  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        running = asyncio.create_task(c.generate("gate", max_tokens=1))
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
        queued = asyncio.create_task(c.generate("queued", max_tokens=1))
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_queued"] == 1)
        for _ in range(3):
            with pytest.raises(BusyError) as ei:
                await c.generate("more", max_tokens=1)
            assert ei.value.retry_after == 0.25
        s = await c.stats()
        assert s["counters"]["busy_rejections"] == 3
        running.cancel()
        queued.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 0 and s["gauges"]["requests_queued"] == 0)


async def test_a_client_that_fills_the_queue_does_not_lock_another_out(tmp_path):
    """Two client connections: one fills the queue; the other's request still gets in, and the
    first one's newest queued request is told busy in its place (queue_share.py)."""
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(max_queued_requests=2, busy_retry_after_s=0.25),
        worker_defaults={"engine": "noop", "capacity": 1, "noop_token_s": 30.0},
    )  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as flood, AsyncClient(cluster.address) as other:
        tasks = [asyncio.create_task(flood.generate("gate", max_tokens=1))]
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
        for i in range(2):
            tasks.append(asyncio.create_task(flood.generate(f"queued {i}", max_tokens=1)))
            await wait_stats(cluster.address, lambda s, n=i + 1: s["gauges"]["requests_queued"] == n)
        with pytest.raises(BusyError):
            await flood.generate("one more", max_tokens=1)  # full, for the client that filled it
        theirs = asyncio.create_task(other.generate("mine", max_tokens=1))
        with pytest.raises(BusyError, match="over its share of 1") as ei:
            await asyncio.wait_for(tasks[2], 10)  # the flood's newest made room
        assert ei.value.retry_after == 0.25
        s = await other.stats()
        assert s["counters"]["share_preemptions"] == 1 and s["gauges"]["requests_queued"] == 2
        assert "1 busy, 1 made room," in render(summary(s), cluster.address)  # `epdq status`
        assert not theirs.done() and not tasks[1].done()
        for t in [*tasks[:2], theirs]:
            t.cancel()
        await asyncio.gather(*tasks, theirs, return_exceptions=True)


async def test_the_brokers_timeout_is_the_default_deadline(tmp_path):
    """`epdq broker --timeout` used to have no effect: every client sent its own 120 s."""
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(default_timeout_s=1.0),
        worker_defaults={"engine": "noop", "noop_token_s": 30.0},
    )  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="deadline"):
            await asyncio.wait_for(c.generate("slow", max_tokens=2), 20)
        assert time.monotonic() - t0 < 5
        # a request's own timeout still wins
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(c.generate("slow", max_tokens=2, timeout=0.5), 20)


async def test_a_cancelled_request_is_forgotten_while_its_client_stays(tmp_path):
    """The broker's per-client request set used to keep every cancelled id until the client left:
    a long-lived client (the HTTP gateway) that saw many disconnects grew it without bound."""
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 30.0})
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        for i in range(3):
            t = asyncio.create_task(c.generate(f"cancel me {i}", max_tokens=2))
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 0)
        # well before the broker's 10 s client liveness would drop this (idle, unpinging) client
        s = await wait_stats(cluster.address, lambda s: s["gauges"]["clients"] == 0, timeout=4)
        assert s["counters"]["cancelled"] == 3
        assert s["counters"]["requests_failed"] == 0  # a client's cancel is no failure (it used to count as one)


async def test_a_burst_beyond_one_batch_is_answered_not_dropped(tmp_path):
    """5,000 requests in one loop turn: the client used to send them as one BATCH message, over
    the receiver's 4,096-message limit, which the broker dropped whole; each request then waited
    for its deadline and ended as DeadlineExceededError instead of BusyError."""
    spec = noop_spec(tmp_path, broker=BrokerConfig(max_queued_requests=20, busy_retry_after_s=0.25))
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=30) as c:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(c.generate(f"burst {i}", max_tokens=1) for i in range(5000)), return_exceptions=True
        )
        kinds = {type(r).__name__ for r in results}
        assert kinds <= {"GenerateResult", "BusyError"}, kinds
        assert sum(isinstance(r, BusyError) for r in results) >= 4000
        assert time.monotonic() - t0 < 20
        s = await c.stats()
        assert s["counters"]["protocol_errors"] == 0


async def test_a_large_upload_is_not_taken_for_a_silent_broker(tmp_path):
    """Pings queue behind the images this client sends; while they are still going through, the
    broker is not silent. 80 MiB of images against a 0.02 s liveness used to fail every request with
    "broker … silent" although the broker was busy receiving them."""
    spec = noop_spec(tmp_path)
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, heartbeat_s=0.02, liveness=1, timeout=60) as c:
        images = [demo_image(i, (64, 64)) + os.urandom(5 << 20) for i in range(4)]  # 5 MiB each
        results = await asyncio.gather(
            *(c.generate(f"upload {i}", images=images, max_tokens=1) for i in range(4)), return_exceptions=True
        )
        assert [type(r).__name__ for r in results] == ["GenerateResult"] * 4, results
        assert c.reconnects == 0


async def test_cancels_racing_their_dispatch_leave_no_pd_slot_taken(tmp_path):
    """A PREFILL and its ABORT in one batch: the PD worker cancelled a task that had not started,
    so it never answered the abort, and the broker kept that slot for good. After 16 of those a
    PD worker took nothing more and every request waited for its deadline."""
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 0.001})
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:

        async def one(i: int) -> None:
            async for _ in c.stream(f"p{i}", max_tokens=50):
                pass

        for rnd in range(12):
            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            await asyncio.sleep(0)
            await asyncio.sleep(0.002 * (rnd % 5))
            for t in tasks[::2]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        s = await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 0)
        (pd,) = [w for w in s["workers"] if w["role"] == "pd"]
        assert pd["inflight"] == 0, pd
        ok = await c.generate("after", max_tokens=2, timeout=10)
        assert len(ok.token_ids) == 2


async def test_an_image_over_the_brokers_limit_is_a_typed_error(tmp_path):
    """Over the broker's --max-image-mb but within the client's own limit: a typed error at once
    (it used to exceed ZeroMQ's frame cap, drop the connection and leave the request to its deadline)."""
    spec = noop_spec(tmp_path, broker=BrokerConfig(max_image_bytes=1 << 20))
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        big = demo_image(1, (64, 64)) + os.urandom(3 << 20)  # a PNG with 3 MiB of trailing bytes
        t0 = time.monotonic()
        with pytest.raises(InvalidInputError, match=r"image 0 is \d+ bytes \(limit 1048576\)"):
            await c.generate("x", images=[big])
        assert time.monotonic() - t0 < 10
        # one the client sends (it allows up to 63 MiB, the most a broker can be set to) but over the
        # broker's frame cap of 21 MiB as it was: ZeroMQ dropped it, and the request was "lost"
        with pytest.raises(InvalidInputError, match=r"image 0 is \d+ bytes \(limit 1048576\)"):
            await c.generate("x", images=[demo_image(1, (64, 64)) + os.urandom(30 << 20)])
        ok = await c.generate("x", images=[demo_image(1, (64, 64))], max_tokens=2)  # the link is fine
        assert len(ok.token_ids) == 2
        with pytest.raises(InvalidInputError, match="cannot decode"):  # refused by the encoder, later
            await c.generate("x", images=[demo_image(2, (64, 64))[:200]])
        # all counted as invalid (the encoder's refusal used to count only as a failure)
        assert (await c.stats())["counters"]["invalid_requests"] == 3


async def test_a_broker_allowing_larger_images_gets_them(tmp_path):
    """`--max-image-mb 30`: a 22 MiB image is served (the client and the encoders used to refuse
    anything over 20 MiB, whatever the broker allowed)."""
    spec = noop_spec(tmp_path, broker=BrokerConfig(max_image_bytes=30 << 20))
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        big = demo_image(4, (64, 64)) + os.urandom(22 << 20)  # a PNG with 22 MiB of trailing bytes
        ok = await c.generate("x", images=[big], max_tokens=2)
        assert len(ok.token_ids) == 2 and ok.timings.images == 1


async def test_too_many_images_is_a_typed_error(tmp_path):
    async with Cluster(noop_spec(tmp_path, log_format="json")) as cluster, AsyncClient(cluster.address) as c:
        with pytest.raises(InvalidInputError, match="limit 8") as refused:
            await c.generate("x", images=[demo_image(1, (64, 64))] * 9)
        with pytest.raises(InvalidInputError, match="empty"):
            await c.generate("x", images=[b""])
        ok = await c.generate("x", images=[demo_image(1, (64, 64))] * 8, max_tokens=2)
        assert len(ok.token_ids) == 2
    # the broker's JSON log: one line per request end, with its id, outcome and numbers
    events = [json.loads(line) for line in (tmp_path / "logs" / "broker.log").read_text().splitlines()
              if line.startswith("{")]  # fmt: skip
    failed = {e["request_id"]: e for e in events if e.get("event") == "request_failed"}
    assert failed[refused.value.request_id]["code"] == "invalid_input" and failed[refused.value.request_id]["level"] == "info"
    (done,) = [e for e in events if e.get("event") == "request_done"]
    assert done["request_id"] == ok.request_id and done["images"] == 8 and done["tokens"] == 2
    assert done["prompt_tokens"] == ok.prompt_tokens > 8 * 4  # eight 64x64 images of 4 rows each
    assert done["route"] == "epd" and done["worker"] == "pd-0" and done["total_s"] >= done["ttft_s"] > 0


async def test_broker_restart(tmp_path):
    """In-flight requests fail typed; workers re-register with the new broker; new requests work."""
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 0.2, "heartbeat_s": 0.5})
    async with Cluster(spec) as cluster:
        async with AsyncClient(cluster.address, heartbeat_s=0.2, liveness=5) as c:
            inflight = asyncio.create_task(c.generate("long", images=[demo_image(2, (64, 64))], max_tokens=200))
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
            t0 = time.monotonic()
            cluster.restart_broker(kill=True)
            with pytest.raises(BrokerUnavailableError, match="restarted|silent"):
                await inflight
            assert time.monotonic() - t0 < 10
            await wait_stats(cluster.address, lambda s: s["gauges"]["workers_encoder"] == 1 and s["gauges"]["workers_pd"] == 1)
            r = await c.generate("after restart", images=[demo_image(3, (64, 64))], max_tokens=3)
            assert len(r.token_ids) == 3 and r.timings.route == "epd"

            # Restarted while this client is idle (a rolling restart): the client has not seen the
            # new broker yet, and must not take its first PONG for the loss of the requests it
            # sent since, which the new broker holds (they used to fail after one ping).
            cluster.restart_broker(kill=False)
            await wait_stats(cluster.address, lambda s: s["gauges"]["workers_encoder"] == 1 and s["gauges"]["workers_pd"] == 1)
            after = await asyncio.gather(*(
                c.generate(f"idle restart {i}", images=[demo_image(4 + i, (64, 64))], max_tokens=4) for i in range(3)
            ))  # fmt: skip  (0.8 s each: several pings answered by the new broker while they run)
            assert [len(x.token_ids) for x in after] == [4, 4, 4]


async def test_a_paused_broker_does_not_blame_its_workers(tmp_path):
    """SIGSTOP the broker past its worker liveness (0.6 s here), then SIGCONT: the heartbeats its
    workers sent meanwhile are unread, not missing. It used to drop every worker on resume and
    fail their requests with worker_lost ("missed heartbeats")."""
    spec = noop_spec(tmp_path, broker=BrokerConfig(heartbeat_s=0.3, liveness=2),
                     worker_defaults={"engine": "noop", "noop_token_s": 0.1})  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        running = asyncio.create_task(c.generate("through a pause", images=[demo_image(5, (64, 64))], max_tokens=20))
        before = await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
        broker = cluster.child("broker").proc
        broker.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)  # over the broker's 0.6 s; workers give up on it after 5 x 0.3 s
        finally:
            broker.send_signal(signal.SIGCONT)
        r = await running
        assert len(r.token_ids) == 20
        s = await c.stats()
        assert s["counters"]["workers_lost"] == before["counters"]["workers_lost"]
        assert s["counters"]["pd_requeues"] == 0
    assert "the broker did not run for" in (tmp_path / "logs" / "broker.log").read_text()


async def test_rings_full_of_half_encoded_requests_do_not_deadlock(tmp_path):
    """Many requests of 3 large images each against small rings: each ring fills up with the first
    images of different requests, pinned while those requests wait for their others, which then
    find no room anywhere. Every request used to wait for its deadline. The broker now releases
    the pins of waiting requests on a blocked ring, so the blocked request gets room; a request
    whose images can never share one ring fails at once with RingFullError."""
    from epdq import RingFullError

    spec = noop_spec(tmp_path, encoders=2, worker_defaults={"engine": "noop", "ring_bytes": 1 << 20})
    big = [demo_image(1000 + i, (448, 448)) for i in range(96)]  # 128 KiB of embedding each
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        sem = asyncio.Semaphore(32)

        async def one(i: int):
            async with sem:
                return await c.generate(f"r{i}", images=big[3 * i : 3 * i + 3], max_tokens=2, route="epd")

        t0 = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(32)), return_exceptions=True)
        assert [type(r).__name__ for r in results] == ["GenerateResult"] * 32, results
        assert time.monotonic() - t0 < 40
        s = await c.stats()
        assert s["counters"]["ring_blocks"] >= 1, s["counters"]
        assert s["counters"]["requests_failed"] == 0

    # one encoder: eight such images (8 x 128 KiB + headers) can never share its 1 MiB ring
    spec = noop_spec(tmp_path / "one", worker_defaults={"engine": "noop", "ring_bytes": 1 << 20})
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        t0 = time.monotonic()
        with pytest.raises(RingFullError, match="at once in encoder"):
            await c.generate("too many", images=[demo_image(2000 + i, (448, 448)) for i in range(8)], max_tokens=2)
        assert time.monotonic() - t0 < 20  # it used to wait out its deadline, then say worker_lost
        ok = await c.generate("fits", images=[demo_image(3000, (448, 448))], max_tokens=2)  # the ring recovers
        assert len(ok.token_ids) == 2


async def test_dead_encoder_jobs_are_requeued(tmp_path):
    spec = noop_spec(tmp_path, encoders=2, worker_defaults={"engine": "noop", "noop_encode_s": 0.3})
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        tasks = [asyncio.create_task(c.generate(f"r{i}", images=[demo_image(10 + i, (64, 64))], max_tokens=2))
                 for i in range(8)]  # fmt: skip
        await wait_stats(cluster.address, lambda s: s["gauges"]["encodes_inflight"] >= 2)
        kill_child(cluster.child("encoder-0"))
        results = await asyncio.gather(*tasks)
        assert all(len(r.token_ids) == 2 for r in results)
        s = await c.stats()
        assert s["counters"]["workers_lost"] >= 1 and s["gauges"]["workers_encoder"] == 1


async def test_dead_pd_before_streaming_is_requeued_after_is_typed(tmp_path):
    spec = noop_spec(tmp_path, pds=2, worker_defaults={"engine": "noop", "noop_prefill_s": 2.0, "capacity": 4})
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        tasks = [asyncio.create_task(c.generate(f"r{i}", max_tokens=2)) for i in range(4)]
        await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 4)
        victim = next(w["worker_id"] for w in (await c.stats())["workers"] if w["role"] == "pd" and w["inflight"])
        kill_child(cluster.child(victim))
        results = await asyncio.gather(*tasks)  # nothing had streamed: every one is re-queued
        assert all(len(r.token_ids) == 2 for r in results)
        assert (await c.stats())["counters"]["pd_requeues"] >= 1


def _segments() -> set[str]:
    return set(glob.glob(f"/dev/shm/epdq-{os.getuid()}-*"))


@pytest.mark.slow
async def test_soak_ring_returns_to_baseline_and_nothing_leaks(tmp_path):
    n = int(os.environ.get("EPDQ_SOAK_REQUESTS", "400"))
    before = _segments()
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "ring_bytes": 2**20, "heartbeat_s": 0.2})
    async with Cluster(spec) as cluster:
        async with AsyncClient(cluster.address) as c:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                async with sem:
                    # 64 distinct images: repeats hit the cache, the small ring forces evictions
                    await c.generate("soak", images=[demo_image(i % 64, (224, 224))], max_tokens=2)

            await asyncio.gather(*(one(i) for i in range(n)))
            s = await wait_stats(
                cluster.address,
                lambda s: all(w["ring_pinned"] == 0 and w["ring_used"] > 0 for w in s["workers"] if w["role"] == "encoder")
                and s["gauges"]["index_pinned"] == 0,
            )
            enc = next(w for w in s["workers"] if w["role"] == "encoder")
            # entries stay resident for cache hits (used > 0) but nothing is pinned any more
            assert 0 < enc["ring_used"] <= enc["ring_capacity"] and enc["ring_entries"] > 0
            assert s["counters"]["requests_completed"] == n and s["counters"]["evictions"] > 0
            assert s["gauges"]["requests_queued"] == 0 and s["gauges"]["held_image_bytes"] == 0
        during = _segments() - before
        assert len(during) == 1  # the encoder's ring
        stat = os.stat(next(iter(during)))
        assert stat.st_mode & 0o777 == 0o600
        sock_dir = tmp_path / "sock"
        assert (sock_dir.stat().st_mode & 0o777) == 0o700
        assert (sock_dir / "broker").stat().st_mode & 0o777 == 0o600
    assert _segments() - before == set()


async def test_tcp_peer_without_an_allowed_key_is_refused(tmp_path, unused_tcp_port):
    from epdq import ConfigError, EpdqError
    from epdq.keys import ensure_cluster_keys

    keys = ensure_cluster_keys(tmp_path / "keys")
    spec = noop_spec(tmp_path, address=f"tcp://127.0.0.1:{unused_tcp_port}", keys_dir=str(keys))
    async with Cluster(spec) as cluster:
        async with cluster.client() as c:  # the cluster's client key: allowed
            assert len((await c.generate("hi", max_tokens=2)).token_ids) == 2
        stranger = ensure_cluster_keys(tmp_path / "stranger")  # same layout, keys nobody allowed
        (stranger / "broker.key").write_bytes((keys / "broker.key").read_bytes())  # knows the server key
        async with AsyncClient(cluster.address, keys_dir=str(stranger), liveness=2, heartbeat_s=0.2) as c:
            # said at once and as what it is (it used to look like a dead broker, after 1.5 s)
            t0 = time.monotonic()
            for _ in range(2):  # the second try reconnects afresh, and is refused again
                with pytest.raises(ConfigError, match="refused this client's CURVE key.*allow directory"):
                    await c.generate("let me in", max_tokens=2, timeout=1.5)
            with pytest.raises(ConfigError, match="refused this client's CURVE key"):
                await c.stats(timeout=1.5)
            assert time.monotonic() - t0 < 1.5
        impostor = ensure_cluster_keys(tmp_path / "impostor")  # holds some other broker's public key
        async with AsyncClient(cluster.address, keys_dir=str(impostor), liveness=2, heartbeat_s=0.2) as c:
            with pytest.raises(EpdqError) as ei:
                await c.generate("who are you", max_tokens=2, timeout=5)
            assert isinstance(ei.value, BrokerUnavailableError) and "broker's public key" in ei.value.message, ei.value
            with pytest.raises(BrokerUnavailableError, match="CURVE handshake with the broker failed"):
                await c.stats(timeout=0.5)
        # the client's own settings: ConfigError (as for a malformed address), not a request's InvalidInputError
        with pytest.raises(ConfigError, match="insecure"):  # plaintext tcp only when asked for
            await AsyncClient(cluster.address, security=SecurityConfig()).connect()
        with pytest.raises(ConfigError, match="keygen"):
            AsyncClient(cluster.address, keys_dir=str(tmp_path))
        async with cluster.client() as c:
            s = await c.stats()
        assert s["counters"]["requests_submitted"] == 1  # the stranger's request never arrived


async def test_dead_broker_fails_inflight_requests_typed(tmp_path):
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 0.2})
    async with Cluster(spec) as cluster:
        async with AsyncClient(cluster.address, heartbeat_s=0.2, liveness=5) as c:
            inflight = asyncio.create_task(c.generate("long", max_tokens=500, timeout=60))
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
            kill_child(cluster.child("broker"))
            t0 = time.monotonic()
            with pytest.raises(BrokerUnavailableError, match="silent"):
                await inflight
            assert time.monotonic() - t0 < 5  # heartbeat 0.2 s x liveness 5, not the 60 s deadline


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_overload_stays_bounded_and_admitted_requests_finish(tmp_path):
    """Offered load far above capacity: typed busy answers, bounded queue, flat broker memory."""
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(max_queued_requests=8, busy_retry_after_s=0.1),
        worker_defaults={"engine": "noop", "capacity": 2, "noop_token_s": 0.02},
    )  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        broker_pid = cluster.child("broker").proc.pid
        image = demo_image(7, (64, 64))

        async def one(i: int):
            t0 = time.monotonic()
            try:
                r = await c.generate(f"load {i}", images=[image], max_tokens=5, timeout=10)
                return ("ok", time.monotonic() - t0, r)
            except BusyError as e:
                assert e.retry_after == 0.1
                return ("busy", time.monotonic() - t0, None)

        rss = []
        for wave in range(3):
            outs = await asyncio.gather(*(one(wave * 1000 + i) for i in range(400)))
            rss.append(_rss_kib(broker_pid))
            ok = [o for o in outs if o[0] == "ok"]
            busy = [o for o in outs if o[0] == "busy"]
            assert len(ok) + len(busy) == 400
            assert len(busy) > 300 and len(ok) >= 8  # a burst: the queue (8) admits, the rest is told busy
            assert all(dt < 10 for _, dt, _ in ok)  # admitted ones finish well within the deadline
            assert all(len(r.token_ids) == 5 for _, _, r in ok)
        s = await c.stats()
        assert s["gauges"]["requests_queued"] == 0 and s["counters"]["busy_rejections"] > 900
        assert rss[-1] - rss[0] < 20 * 1024, f"broker RSS grew {rss} KiB"


async def test_prometheus_metrics_reflect_traffic(tmp_path, unused_tcp_port):
    import urllib.request

    spec = noop_spec(tmp_path, broker=BrokerConfig(metrics_address=f"127.0.0.1:{unused_tcp_port}"),
                     worker_defaults={"engine": "noop", "heartbeat_s": 0.2})  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address) as c:
        for _ in range(3):
            await c.generate("metrics", images=[demo_image(1, (64, 64))], max_tokens=4)
        await wait_stats(cluster.address, lambda s: any(w["ring_used"] for w in s["workers"]))

        def get(path: str) -> tuple[int, str]:
            with urllib.request.urlopen(f"http://127.0.0.1:{unused_tcp_port}{path}", timeout=5) as r:
                return r.status, r.read().decode()

        status, text = await asyncio.to_thread(get, "/metrics")
        assert status == 200
        lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        assert float(lines["epdq_requests_completed_total"]) == 3
        assert float(lines["epdq_cache_hits_total"]) == 2 and float(lines["epdq_encodes_done_total"]) == 1
        assert float(lines["epdq_cache_misses_total"]) == 1
        assert float(lines["epdq_ttft_seconds_count"]) == 3 and float(lines["epdq_tpot_seconds_count"]) == 3
        assert float(lines["epdq_encode_seconds_count"]) == 1
        assert float(lines['epdq_workers{role="encoder",state="idle"}']) == 1
        assert float(lines['epdq_ring_used_bytes{worker="encoder-0"}']) > 0
        assert "epdq_busy_rejections_total" in lines and "epdq_requests_queued" in lines
        assert (await asyncio.to_thread(get, "/health"))[0] == 200


async def test_a_broker_speaking_another_protocol_fails_requests_at_once(tmp_path):
    """A broker of another release answers with messages this client cannot decode: the requests
    fail with a ProtocolError naming the likely cause, instead of waiting for their deadline."""
    import msgspec
    import zmq
    import zmq.asyncio

    from epdq import ProtocolError
    from epdq import protocol as P

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/old-broker.sock"
    router.bind(address)

    async def old_broker() -> None:
        while True:
            ident, *frames = await router.recv_multipart()
            bodies = P.split_batch(frames) if frames[0] == P.BATCH_TYPE else [frames]
            for body in bodies:
                msg, _ = P.decode(body)
                if isinstance(msg, P.Ping):
                    await router.send_multipart([ident, *P.encode(P.Pong(msg.nonce, "old"))])
                elif isinstance(msg, P.Submit):  # a TOKENS with a field this release does not know
                    header = msgspec.msgpack.encode([msg.request_id, [1], "x", "stop", None, 3, "new field"])
                    await router.send_multipart([ident, bytes([P.MsgType.TOKENS]), header])
                elif isinstance(msg, P.StatsRequest):
                    typ, header = P.encode(P.Stats(msg.nonce, {}, {}, []))
                    header = msgspec.msgpack.encode([*msgspec.msgpack.decode(header), "new field"])
                    await router.send_multipart([ident, typ, header])

    server = asyncio.create_task(old_broker())
    try:
        async with AsyncClient(address, timeout=60) as c:
            t0 = time.monotonic()
            with pytest.raises(ProtocolError, match=f"another epdq release.*protocol version {P.PROTOCOL_VERSION}"):
                await c.generate("hello", max_tokens=2)
            assert time.monotonic() - t0 < 10
            # stats() too: it waited out its timeout and blamed an unreachable broker
            t0 = time.monotonic()
            with pytest.raises(ProtocolError, match="another epdq release"):
                await c.stats(timeout=30)
            assert time.monotonic() - t0 < 10
            # its PONG says no protocol version (older than 6): new requests are refused before they
            # are sent, naming both versions (a BATCH of ours would be dropped by it unread)
            with pytest.raises(ProtocolError, match=rf"protocol version 5 or older.*client speaks protocol version {P.PROTOCOL_VERSION}"):
                await asyncio.wait_for(c.generate("hello again", max_tokens=2), 1)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close(linger=0)
        ctx.term()


async def test_supervise_restarts_what_exits_then_gives_up(tmp_path):
    """`epdq up` keeps serving when a process dies: the PD worker is started again, registers,
    and serves; past its restart budget the supervisor stops with the child's log lines."""
    async with Cluster(noop_spec(tmp_path)) as cluster:
        said: list[str] = []
        supervisor = asyncio.create_task(cluster.supervise(max_restarts=1, say=said.append, interval_s=0.1, backoff_s=0.2))
        first = cluster.child("pd-0")
        kill_child(first)

        def back_up() -> bool:  # the new process has registered (its own lines in the shared log)
            ch = cluster.child("pd-0")
            if ch is first:
                return False
            with open(ch.log_path, "rb") as f:
                f.seek(ch.log_offset)
                return b"registered with broker" in f.read()

        end = time.monotonic() + 60
        while not back_up():
            assert time.monotonic() < end, "pd-0 did not come back"
            await asyncio.sleep(0.1)
        assert said and said[0].startswith("pd-0 was killed by SIGKILL; restarting it in 0.2 s (1/1")
        async with AsyncClient(cluster.address) as c:
            ok = await c.generate("x", images=[demo_image(3, (64, 64))], max_tokens=2)
        assert len(ok.token_ids) == 2 and cluster.child("pd-0").restarts == 1
        # a rolling restart (SIGTERM: it drains and exits 0) is not a crash: it does not count
        for _ in range(2):
            first = cluster.child("pd-0")  # registered: its SIGTERM handler is in place
            first.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + 60
            while not back_up():
                assert time.monotonic() < end and not supervisor.done(), f"pd-0 did not come back: {said}"
                await asyncio.sleep(0.1)
        assert said[-1].startswith("pd-0 exited with code 0 (told to stop")
        assert cluster.child("pd-0").restarts == 1 and not supervisor.done()
        kill_child(cluster.child("pd-0"))
        with pytest.raises(RuntimeError, match="pd-0 was killed by SIGKILL after 1 restarts in a row"):
            await asyncio.wait_for(supervisor, 30)


_EXIT_SENDER = """
import sys, zmq
from epdq.launch import let_last_messages_leave
ctx = zmq.Context.instance()
s = ctx.socket(zmq.PUSH)
s.setsockopt(zmq.SNDHWM, 0)
s.connect(sys.argv[1])
for _ in range(400):
    s.send(bytes(256 * 1024))
s.close(linger=10000)
let_last_messages_leave(timeout_s=20)
"""


def test_last_messages_leave_before_the_process_exits(tmp_path):
    """A process's last messages (its BYEs) must not die with the ZeroMQ I/O thread at exit:
    pyzmq never terminates a context left to interpreter exit, whatever the sockets' linger
    (without `let_last_messages_leave` about a third of these 100 MiB were lost here)."""
    import subprocess
    import sys

    import zmq

    addr = f"ipc://{tmp_path}/exit.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        pull.bind(addr)
        subprocess.run([sys.executable, "-c", _EXIT_SENDER, addr], check=True, timeout=120)
        n = 0
        while pull.poll(2000):
            pull.recv(copy=False)
            n += 1
        assert n == 400
    finally:
        pull.close(linger=0)
        ctx.term()
