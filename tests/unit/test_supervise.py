"""`Cluster.supervise`'s restart policy (what `epdq up` does when a process exits), driven with
short-lived `sh` processes in place of epdq's own children."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from epdq.cluster import Child, Cluster, ClusterSpec
from tests.procs import alive, readline

pytestmark = pytest.mark.timeout(30)


def crashing_cluster(tmp_path, script: str = "exit 3") -> tuple[Cluster, list[float]]:
    cluster = Cluster(ClusterSpec(address=f"ipc://{tmp_path}/b.sock", log_dir=str(tmp_path)))
    starts: list[float] = []

    def spawn(name: str, kind: str, cfg: object) -> Child:
        starts.append(time.monotonic())
        log = tmp_path / f"{name}.log"
        with open(log, "ab") as out:
            offset = out.tell()
            proc = subprocess.Popen(["sh", "-c", f"echo run {len(starts)}; {script}"], stdout=out)
        child = Child(name, proc, log, offset, kind, cfg)
        cluster.children.append(child)
        return child

    cluster._spawn = spawn  # type: ignore[method-assign]
    spawn("pd-0", "worker", None)
    return cluster, starts


async def test_crashes_in_a_row_back_off_then_stop_with_the_last_runs_log(tmp_path):
    cluster, starts = crashing_cluster(tmp_path)
    said: list[str] = []
    try:
        with pytest.raises(RuntimeError, match="pd-0 exited with code 3 after 3 restarts in a row") as ei:
            await asyncio.wait_for(
                cluster.supervise(max_restarts=3, say=said.append, interval_s=0.01, backoff_s=0.1), 20
            )
    finally:
        cluster.stop()
    assert len(starts) == 4
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # a port briefly taken used to be retried 5 times in 2.5 s, then the whole cluster stopped
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2 and gaps[2] >= 0.4, gaps
    assert said[0].startswith("pd-0 exited with code 3; restarting it in 0.1 s (1/3")
    assert said[2].startswith("pd-0 exited with code 3; restarting it in 0.4 s (3/3")
    # the log lines of the run that failed, not its predecessors' in the same file
    assert ei.value.args[0].endswith("its last log lines:\nrun 4")


async def test_a_crash_after_a_long_run_starts_the_count_again(tmp_path):
    cluster, starts = crashing_cluster(tmp_path, "sleep 0.3; exit 3")
    said: list[str] = []
    task = asyncio.create_task(
        cluster.supervise(max_restarts=1, say=said.append, interval_s=0.01, backoff_s=0.01, stable_s=0.2)
    )
    try:
        while len(starts) < 4:  # max_restarts=1 would have stopped at the second crash
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
        assert all("(1/1" in m for m in said)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        cluster.stop()


def test_how_it_ended_names_signals():
    from epdq.cluster import how_it_ended

    assert how_it_ended(1) == "exited with code 1"
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(-15) == "was killed by SIGTERM"


def test_a_child_that_outstays_its_stop_is_killed_with_the_processes_it_started(tmp_path):
    # a worker still loading, killed alone, left its vLLM EngineCore behind (waiting 5 minutes for
    # a handshake); a child leads a process group of its own, and the group goes with it
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    try:
        grandchild = int(readline(proc))
        cluster = Cluster(ClusterSpec(address=f"ipc://{tmp_path}/b.sock", log_dir=str(tmp_path)))
        cluster.children.append(Child("pd-0", proc, tmp_path / "pd-0.log", 0, "worker"))
        cluster.stop(timeout=0.1, now=True)  # SIGINT, ignored: killed after the 5 s floor
        assert proc.returncode == -signal.SIGKILL
        end = time.monotonic() + 10
        while alive(grandchild) and time.monotonic() < end:
            time.sleep(0.05)
        assert not alive(grandchild)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        proc.stdout.close()


async def test_what_a_crashed_child_started_goes_before_it_is_started_again(tmp_path):
    # a worker SIGKILLed (the OOM killer) leaves its engine processes; the restarted worker starts
    # its own, and the old ones must not hold their memory meanwhile
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    grandchildren: list[int] = []
    cluster = Cluster(ClusterSpec(address=f"ipc://{tmp_path}/b.sock", log_dir=str(tmp_path)))

    def spawn(name: str, kind: str, cfg: object) -> Child:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
        grandchildren.append(int(readline(proc)))
        proc.stdout.close()
        child = Child(name, proc, tmp_path / f"{name}.log", 0, kind, cfg)
        cluster.children.append(child)
        return child

    cluster._spawn = spawn  # type: ignore[method-assign]
    first = spawn("pd-0", "worker", None)
    task = asyncio.create_task(cluster.supervise(interval_s=0.01, backoff_s=0.2))
    try:
        os.kill(first.proc.pid, signal.SIGKILL)
        while len(grandchildren) < 2:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
        end = time.monotonic() + 5  # SIGKILLed before the restart; gone once the kernel is done
        while alive(grandchildren[0]) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        assert not alive(grandchildren[0]), "the crashed child's process outlived its restart"
        assert alive(grandchildren[1])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for ch in list(cluster.children):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(ch.proc.pid, signal.SIGKILL)
            ch.proc.wait(5)
        for pid in grandchildren:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
