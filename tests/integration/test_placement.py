"""CPU placement with real processes: a cluster's roles run where `cpus` says, every thread of
them (the ZeroMQ I/O thread, the engine's) included, and still serve; the control-plane
benchmark places both of its systems alike and gives the test process its CPUs back."""

import json
import os

import pytest

from epdq import AsyncClient
from epdq.cluster import Cluster
from epdq.demo import demo_image

from .helpers import noop_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CPUS = sorted(os.sched_getaffinity(0))
FIRST, LAST = CPUS[0], CPUS[-1]


def thread_sets(pid: int) -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass
    return out


async def test_each_role_runs_on_its_cpus_and_serves(tmp_path):
    spec = noop_spec(tmp_path, cpus={"broker": str(FIRST), "encoder": [LAST]})
    async with Cluster(spec) as cluster:
        procs = {c.name: c.proc.pid for c in cluster.children}
        assert set(procs) == {"broker", "encoder-0", "pd-0"}
        for name, want in (("broker", {FIRST}), ("encoder-0", {LAST}), ("pd-0", set(CPUS))):
            sets = thread_sets(procs[name])
            assert len(sets) >= 2, (name, sets)  # the Python thread and ZeroMQ's I/O thread at least
            assert all(s == want for s in sets.values()), (name, sets)
        async with AsyncClient(cluster.address, timeout=30) as c:
            out = await c.generate("Describe this.", images=[demo_image(3, (64, 64))], max_tokens=4)
        assert len(out.token_ids) == 4
        logs = {c.name: c.tail(200) for c in cluster.children}
    assert f"broker runs on cpus {FIRST}" in logs["broker"]
    assert f"encoder worker runs on cpus {LAST}" in logs["encoder-0"]
    assert "runs on cpus" not in logs["pd-0"]


async def test_the_gateway_runs_on_its_cpus(tmp_path, unused_tcp_port):
    pytest.importorskip("fastapi")
    spec = noop_spec(tmp_path, http=f"127.0.0.1:{unused_tcp_port}", cpus={"gateway": str(LAST)})
    async with Cluster(spec) as cluster:
        gateway = next(c for c in cluster.children if c.name == "gateway")
        sets = thread_sets(gateway.proc.pid)
        assert len(sets) >= 2 and all(s == {LAST} for s in sets.values()), sets
        broker = next(c for c in cluster.children if c.name == "broker")
        assert all(s == set(CPUS) for s in thread_sets(broker.proc.pid).values())


def test_the_control_benchmark_places_both_systems_alike(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    from epdq.benchmarks import control

    seen: dict[str, dict[int, set[int]]] = {}
    real_phase = control._HttpSystem.phase

    async def phase(self, *a, **kw):  # look at the servers while they run
        for role, p in self.baseline.procs.items():
            seen.setdefault(f"http-{role}", thread_sets(p.pid))
        return await real_phase(self, *a, **kw)

    real_epdq_phase = control._EpdqSystem.phase

    async def epdq_phase(self, *a, **kw):
        for name, pid in self.pids().items():
            seen.setdefault(f"epdq-{name}", thread_sets(pid))
        return await real_epdq_phase(self, *a, **kw)

    monkeypatch.setattr(control._HttpSystem, "phase", phase)
    monkeypatch.setattr(control._EpdqSystem, "phase", epdq_phase)
    before = {tid: s for tid, s in thread_sets(os.getpid()).items()}
    pin = f"{FIRST}"
    argv = ["--requests", "6", "--concurrency", "2", "--rounds", "1", "--no-plot", "--out", str(tmp_path),
            "--pin", f"all={LAST}", f"broker={pin}"]  # fmt: skip
    assert control.main(argv) == 0
    saved = json.loads((tmp_path / "control.json").read_text())
    assert saved["config"]["pin"] == {"client": [LAST], "broker": [FIRST], "encoder": [LAST], "pd": [LAST]}
    assert all(r["ok"] == r["requests"] == 6 for r in saved["results"])
    want = {"epdq-broker": {FIRST}, "http-proxy": {FIRST}, "epdq-client": {LAST}, "epdq-encoder": {LAST},
            "epdq-pd": {LAST}, "http-encoder": {LAST}, "http-pd": {LAST}}  # fmt: skip
    for name, cpus in want.items():
        assert seen[name] and all(s == cpus for s in seen[name].values()), (name, seen[name])
    # the test process has its CPUs back (its threads alive before the run, at least)
    now = thread_sets(os.getpid())
    assert all(now[tid] == s for tid, s in before.items() if tid in now)
