"""Chaos with real processes and the real tiny model.

Two encoders and two PD workers serve a stream of multimodal requests while one encoder and one
PD worker are SIGKILLed mid-run. Every request must end with a result or a typed, retryable
error, none may outlive its deadline (plus the client's grace), every failed one must succeed
when sent again, and every successful output must be token-identical to the colocated engine
(a `both` worker in the same cluster) on the same prompt and images.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field

import pytest

from epdq import AsyncClient, EpdqError, GenerateResult, WorkerLostError
from epdq.cluster import Cluster, ClusterSpec, kill_child
from epdq.demo import demo_image


def _children(pid: int) -> list[int]:
    import subprocess

    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


async def _all_exit(pids: list[int], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = []
        for p in pids:
            try:
                os.kill(p, 0)
                alive.append(p)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        await asyncio.sleep(0.2)
    return False


pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

N_REQUESTS = 60
ENCODER_GATE = 24  # requests from this index on wait until the encoder is dead
PD_GATE = 40  # ... and from this one until the PD worker is dead: both die mid-run
CONCURRENCY = 6
MAX_TOKENS = 8
DEADLINE_S = 60.0
GRACE_S = 2.5  # the client waits at most timeout + 2 s for the broker's own deadline answer
OVERALL_S = 240.0  # the whole chaos phase; beyond it something hangs
SIZES = [(112, 112), (160, 96), (84, 140), (196, 168)]
POOL = [demo_image(300 + i, SIZES[i % len(SIZES)]) for i in range(12)]


@pytest.fixture(scope="module")
async def chaos_cluster(tmp_path_factory, model_dir):
    from epdq.ring import cleanup_stale_segments

    d = tmp_path_factory.mktemp("chaos")
    spec = ClusterSpec(address=f"ipc://{d}/broker.sock", encoders=2, pds=2, both=1, model=model_dir,
                       log_dir=str(d / "logs"), start_timeout_s=400)  # fmt: skip
    try:
        async with Cluster(spec) as c:
            yield c
    finally:
        cleanup_stale_segments()  # the SIGKILLed encoder never unlinked its ring


@dataclass
class Outcome:
    index: int
    prompt: str
    images: list[bytes]
    start: float = 0.0
    end: float = 0.0
    result: GenerateResult | None = None
    error: BaseException | None = None
    retried: GenerateResult | None = None
    tags: list[str] = field(default_factory=list)

    @property
    def elapsed(self) -> float:
        return self.end - self.start


def make_requests() -> list[Outcome]:
    rng = random.Random(1234)
    out = []
    for i in range(N_REQUESTS):
        k = 1 + i % 3
        imgs = [POOL[rng.randrange(len(POOL))] for _ in range(k)]  # repeats: cache hits and dedup joins
        if 8 <= i < ENCODER_GATE:  # fresh images too, so the encoders are busy when one dies
            imgs.append(demo_image(500 + i, SIZES[3]))
        out.append(Outcome(i, f"Chaos request {i}: describe what you see.", imgs))
    return out


async def _stats(c: AsyncClient) -> dict:
    return await c.stats(timeout=5.0)


async def _wait_for(c: AsyncClient, pred, timeout: float) -> dict | None:
    """Poll stats until pred(stats) holds; None when it did not within timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = await _stats(c)
        if pred(s):
            return s
        await asyncio.sleep(0.02)
    return None


def _inflight(s: dict, worker_id: str) -> int:
    return next((int(w["inflight"]) for w in s["workers"] if w["worker_id"] == worker_id), 0)


async def test_chaos_kill_encoder_and_pd_mid_run(chaos_cluster):
    cluster = chaos_cluster
    addr = cluster.address
    reqs = make_requests()
    n_done = 0
    encoder_dead, pd_dead = asyncio.Event(), asyncio.Event()
    killed: dict[str, dict] = {}

    async with AsyncClient(addr, timeout=DEADLINE_S) as c, AsyncClient(addr) as admin:
        base = (await _stats(admin))["counters"]
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(o: Outcome) -> None:
            nonlocal n_done
            if o.index >= ENCODER_GATE:
                await encoder_dead.wait()
            if o.index >= PD_GATE:
                await pd_dead.wait()
            async with sem:
                o.start = time.monotonic()
                try:
                    o.result = await c.generate(o.prompt, images=o.images, max_tokens=MAX_TOKENS,
                                                temperature=0.0, timeout=DEADLINE_S, route="epd")  # fmt: skip
                except BaseException as e:  # noqa: BLE001 - classified below; anything untyped fails the test
                    o.error = e
                finally:
                    o.end = time.monotonic()
                    n_done += 1

        async def freeze(name: str) -> int:
            """SIGSTOP `name` now, then wait until the broker has given it work, which it cannot
            finish while frozen; returns the work the broker sees it holding (0 if none came within
            the time allowed: it is let go again).

            Freezing first makes "killed with work in flight" a fact rather than a race. Looking for
            a worker that holds work and then freezing it once lost the race in CI to an encoder
            whose jobs took milliseconds: it finished them between two looks until the requests
            that could give it work had all ended. The broker gives work round robin among the
            workers with credit, so a frozen worker gets its share while requests keep coming."""
            pid = cluster.child(name).proc.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                # under the broker's liveness (5 missed heartbeats of 1 s): a frozen worker is not yet lost
                s = await _wait_for(admin, lambda s: _inflight(s, name) > 0, timeout=4.0)
            except BaseException:
                os.kill(pid, signal.SIGCONT)  # never leave a frozen worker behind
                raise
            if s is None:
                os.kill(pid, signal.SIGCONT)
                return 0
            return _inflight(s, name)

        async def chaos() -> None:
            while n_done < 4:  # let the pipeline warm up: a few requests complete first
                await asyncio.sleep(0.02)
            held = await freeze("encoder-0")
            killed["encoder-0"] = {"inflight": held, "at_done": n_done}
            kill_child(cluster.child("encoder-0"))
            encoder_dead.set()
            # then the PD worker that has the most work in flight
            s = await _wait_for(admin, lambda s: any(w["role"] == "pd" and w["inflight"] for w in s["workers"]),
                                timeout=10.0)  # fmt: skip
            name = "pd-0"
            held = 0
            if s is not None:
                name = max((w for w in s["workers"] if w["role"] == "pd"), key=lambda w: w["inflight"])[
                    "worker_id"
                ]
                held = await freeze(name)
            killed[name] = {"inflight": held, "at_done": n_done}
            engine_cores.extend(_children(cluster.child(name).proc.pid))
            kill_child(cluster.child(name))
            pd_dead.set()

        t0 = time.monotonic()
        engine_cores: list[int] = []
        tasks = [asyncio.create_task(one(o)) for o in reqs]
        chaos_task = asyncio.create_task(chaos())
        try:
            async with asyncio.timeout(OVERALL_S):
                await asyncio.gather(*tasks, chaos_task)
        except TimeoutError:
            stuck = [o.index for o in reqs if not o.end]
            pytest.fail(f"chaos phase hung after {OVERALL_S}s: requests {stuck} never ended; "
                        f"killed {killed}; logs in {cluster.log_dir}")  # fmt: skip
        chaos_s = time.monotonic() - t0

        # the kills happened with work in flight, and the broker noticed both losses
        assert "encoder-0" in killed and len(killed) == 2, killed
        assert all(k["at_done"] < PD_GATE for k in killed.values()), f"a kill came too late: {killed}"
        after = await _wait_for(
            admin,
            lambda s: (
                s["counters"]["workers_lost"] - base["workers_lost"] >= 2
                and s["gauges"]["workers_encoder"] == 1
                and s["gauges"]["workers_pd"] == 1
            ),
            timeout=15.0,
        )
        assert after is not None, f"broker did not register both losses: {await _stats(admin)}"
        delta = {k: after["counters"][k] - base.get(k, 0) for k in after["counters"]}

        # every request ended; errors are typed and retryable; nobody outlived its deadline
        assert all(o.end for o in reqs)
        late = [(o.index, round(o.elapsed, 2)) for o in reqs if o.elapsed > DEADLINE_S + GRACE_S]
        assert not late, f"requests past their deadline: {late}"
        failed = [o for o in reqs if o.error is not None]
        untyped = [(o.index, repr(o.error)) for o in failed if not isinstance(o.error, EpdqError)]
        assert not untyped, f"untyped errors: {untyped}"
        fatal = [(o.index, repr(o.error)) for o in failed if not o.error.retryable]
        assert not fatal, f"non-retryable errors: {fatal}"
        for o in reqs:
            if o.result is not None:
                assert o.result.token_ids and o.result.timings.route == "epd", (o.index, o.result)

        # retried on the survivors, every failed request succeeds
        for o in failed:
            o.retried = await c.generate(o.prompt, images=o.images, max_tokens=MAX_TOKENS, temperature=0.0,
                                         timeout=DEADLINE_S, route="epd")  # fmt: skip
            assert o.retried.token_ids and o.retried.timings.route == "epd"

        # every successful E->PD output equals the colocated engine's, token for token
        mismatches = []
        for o in reqs:
            got = o.result or o.retried
            assert got is not None
            colo = await c.generate(o.prompt, images=o.images, max_tokens=MAX_TOKENS, temperature=0.0,
                                    timeout=DEADLINE_S, route="colocated")  # fmt: skip
            assert colo.timings.route == "colocated"
            if got.token_ids != colo.token_ids:
                mismatches.append((o.index, got.token_ids, colo.token_ids))
        assert not mismatches, f"E->PD differs from colocated: {mismatches}"

        # the killed PD worker's vLLM engine process did not outlive it (no orphaned ~1 GB cores)
        assert engine_cores, "the PD worker had no engine child process"
        assert await _all_exit(engine_cores, 20.0), f"orphaned engine processes: {engine_cores}"

        # both died holding work: the encoder's jobs were re-queued; the PD worker's sequences were
        # re-queued, or (those that had streamed) failed with WorkerLostError and succeeded on retry
        (pd_name,) = set(killed) - {"encoder-0"}
        assert killed["encoder-0"]["inflight"] > 0 and killed[pd_name]["inflight"] > 0, killed
        assert delta["encode_requeues"] >= killed["encoder-0"]["inflight"], (killed, delta)
        lost = sum(isinstance(o.error, WorkerLostError) for o in failed)
        assert delta["pd_requeues"] + lost >= killed[pd_name]["inflight"], (killed, delta, lost)
        print(
            f"\nchaos: {len(reqs)} requests in {chaos_s:.1f}s, {len(failed)} failed "
            f"({sorted({type(o.error).__name__ for o in failed})}), killed {killed}, "
            f"max latency {max(o.elapsed for o in reqs):.2f}s, counters "
            + str({k: v for k, v in delta.items() if v and k in (
                "workers_lost", "encode_requeues", "pd_requeues", "encodes_done", "cache_hits", "dedup_joins",
                "stale_reads", "deadline_exceeded")})
        )  # fmt: skip
