"""A PD worker paused past the broker's liveness (SIGSTOP), then resumed (SIGCONT), with real
processes and no-op engines.

The broker drops the paused worker and re-queues the requests it held (nothing had streamed).
The resumed worker registers again under the same id, and the broker sends the same requests
back to it, in the same batch as REGISTERED. The worker used to keep its old runs of those
requests until their cancellation landed: the re-sent PREFILLs were dropped as duplicates, and
what the old runs sent (their tokens, then a PdFailed "cancelled") was taken by the broker for
the new dispatch. Every request failed with EngineError, or the client got the old run's tokens
from the middle of the sequence, or a short output that looked complete. Now the worker abandons
its old runs, silently, before its REGISTER leaves; each re-queued request runs again from its
first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest

from epdq import AsyncClient
from epdq.broker import BrokerConfig
from epdq.cluster import Cluster
from epdq.demo import demo_image
from tests.integration.helpers import noop_spec, wait_stats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

N = 8
HEARTBEAT_S = 0.2  # the broker drops a worker after 5 missed heartbeats: 1 s here


@pytest.mark.parametrize(
    ("prefill_s", "token_s", "max_tokens", "pause_s"),
    [
        # the old runs are still in their prefill when the worker registers again
        pytest.param(4.0, 0.0, 12, 0.0, id="old-runs-in-prefill"),
        # their prefill ended during the pause: they stream on resume, through the re-registration
        pytest.param(2.0, 0.1, 40, 2.6, id="old-runs-streaming"),
    ],
)
async def test_a_paused_pd_worker_reruns_its_requeued_requests_from_the_start(
    tmp_path, prefill_s, token_s, max_tokens, pause_s
):
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(heartbeat_s=HEARTBEAT_S),
        worker_defaults={"engine": "noop", "noop_prefill_s": prefill_s, "noop_token_s": token_s},
    )  # fmt: skip
    prompts = [f"stalled request {i}" for i in range(N)]
    images = [demo_image(40 + i, (64, 64)) for i in range(N)]
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        tasks = [
            asyncio.create_task(c.generate(p, images=[im], max_tokens=max_tokens))
            for p, im in zip(prompts, images, strict=True)
        ]
        try:
            # all N on the PD worker, in their prefill (nothing streamed: the broker re-queues them)
            before = await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == N)
            pd = cluster.child("pd-0").proc
            pd.send_signal(signal.SIGSTOP)
            paused = time.monotonic()
            try:
                # paused until the broker has given up on it and taken its requests back
                await wait_stats(
                    cluster.address,
                    lambda s: s["counters"]["pd_requeues"] - before["counters"]["pd_requeues"] == N,
                    timeout=30,
                )
                await asyncio.sleep(max(0.0, paused + pause_s - time.monotonic()))
            finally:
                pd.send_signal(signal.SIGCONT)  # never leave a frozen worker behind
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)}/{N} failed: {failed[:3]}; logs in {tmp_path / 'logs'}"
        assert time.monotonic() - t0 < 40
        # the same prompts again, on a worker nobody paused: the no-op engine is deterministic
        fresh = await asyncio.wait_for(
            asyncio.gather(*(c.generate(p, images=[im], max_tokens=max_tokens) for p, im in zip(prompts, images, strict=True))),
            60,
        )  # fmt: skip
        for i, (r, f) in enumerate(zip(results, fresh, strict=True)):
            assert len(f.token_ids) == max_tokens
            assert r.token_ids == f.token_ids, f"request {i}: {len(r.token_ids)} tokens, not the fresh run's"
            assert r.text == f.text and r.finish_reason == f.finish_reason == "length"
        s = await c.stats()
        assert s["counters"]["pd_requeues"] - before["counters"]["pd_requeues"] == N
        assert s["gauges"]["workers_pd"] == 1 and s["counters"]["requests_failed"] == 0
