"""A PD worker whose vLLM engine core dies leaves the broker and exits non-zero: the broker stops
routing to it (no black hole failing a share of all requests), and requests go to the other PD
worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from epdq import AsyncClient
from epdq.cluster import Cluster, ClusterSpec
from epdq.demo import demo_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


async def test_pd_worker_with_a_dead_engine_leaves_and_requests_go_elsewhere(tmp_path, model_dir):
    spec = ClusterSpec(address=f"ipc://{tmp_path}/sock/broker", encoders=1, pds=2, model=model_dir,
                       log_dir=str(tmp_path / "logs"), start_timeout_s=400)  # fmt: skip
    async with Cluster(spec) as cluster, AsyncClient(cluster.address, timeout=60) as c:
        img = demo_image(7, (112, 112))
        before = await c.generate("Before.", images=[img], max_tokens=4)
        victim = cluster.child("pd-0").proc
        cores = _children(victim.pid)
        assert cores, "the vLLM engine core runs in a child process of the worker"
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        # the worker notices without a request, says BYE and exits non-zero
        end = time.monotonic() + 60
        while victim.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.2)
        assert victim.returncode == 1, victim.returncode  # README: status 1, for its supervisor
        log = (tmp_path / "logs" / "pd-0.log").read_text()
        assert "engine dead" in log and "worker stopped: the engine died" in log
        stats = await c.stats()
        assert stats["gauges"]["workers_pd"] == 1
        # every request now goes to pd-1, and gets the same tokens as before
        outs = await asyncio.gather(*(c.generate("Before.", images=[img], max_tokens=4) for _ in range(4)))
        assert all(o.token_ids == before.token_ids for o in outs)
