"""`Cluster.supervise`: a clean exit under `--restarts 0`, and what a crashed child left behind,
driven with short-lived processes in place of epdq's own children."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

import epdq.cluster as cluster_mod
from epdq.cluster import Child, Cluster, ClusterSpec
from tests.procs import alive

pytestmark = pytest.mark.timeout(60)


def make_cluster(tmp_path, argv: list[str]) -> tuple[Cluster, list[Child]]:
    """A cluster whose every (re)start runs `argv` as the leader of a new session, as _spawn does."""
    cluster = Cluster(ClusterSpec(address=f"ipc://{tmp_path}/b.sock", log_dir=str(tmp_path)))
    started: list[Child] = []

    def spawn(name: str, kind: str, cfg: object) -> Child:
        log = tmp_path / f"{name}.log"
        with open(log, "ab") as out:
            offset = out.tell()
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, proc, log, offset, kind, cfg)
        cluster.children.append(child)
        started.append(child)
        return child

    cluster._spawn = spawn  # type: ignore[method-assign]
    spawn("pd-0", "worker", None)
    return cluster, started


async def _stop(task: asyncio.Task, started: list[Child]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for ch in started:
        if ch.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(ch.proc.pid, signal.SIGKILL)
        ch.proc.wait(5)


async def test_a_clean_exit_is_started_again_even_with_restarts_0(tmp_path):
    # README: one that stops cleanly (exit 0 after a drain, a rolling restart) "is started again
    # without counting"; with --restarts 0 it stopped the whole cluster
    cluster, started = make_cluster(tmp_path, ["sh", "-c", "sleep 0.05; exit 0"])
    said: list[str] = []
    task = asyncio.create_task(cluster.supervise(max_restarts=0, say=said.append, interval_s=0.01))
    try:
        end = time.monotonic() + 20
        while len(started) < 4:
            assert not task.done(), task.exception()
            assert time.monotonic() < end, said
            await asyncio.sleep(0.02)
        assert all("exited with code 0 (told to stop" in m for m in said), said
    finally:
        await _stop(task, started)


async def test_a_crash_still_stops_everything_with_restarts_0(tmp_path):
    cluster, started = make_cluster(tmp_path, ["sh", "-c", "exit 3"])
    with pytest.raises(RuntimeError, match="pd-0 exited with code 3"):
        await asyncio.wait_for(cluster.supervise(max_restarts=0, interval_s=0.01), 20)
    assert len(started) == 1
    started[0].proc.wait(5)


LEAVES_A_STUBBORN_CHILD = (
    "import subprocess, sys\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
    "p.stdout.readline()\n"  # its SIGTERM handler is in place
    "print(p.pid, flush=True)\n"
    "sys.exit(3)\n"
)


async def test_what_a_crashed_child_left_is_killed_soon_not_when_its_restart_comes_due(tmp_path):
    # it was SIGKILLed only at the restart, up to 30 s later: an engine that ignores SIGTERM held
    # its memory that long, and by then its group's id could be someone else's
    cluster, started = make_cluster(tmp_path, [sys.executable, "-c", LEAVES_A_STUBBORN_CHILD])
    log = started[0].log_path
    task = asyncio.create_task(cluster.supervise(interval_s=0.02, backoff_s=30.0))
    grandchild = 0
    try:
        end = time.monotonic() + 10
        while not log.read_text().strip():
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        grandchild = int(log.read_text().split()[0])
        end = time.monotonic() + 10  # the default grace after SIGTERM is 3 s
        while alive(grandchild):
            assert not task.done(), task.exception()
            assert time.monotonic() < end, "what the crashed child left outlived its SIGTERM by 10 s"
            await asyncio.sleep(0.05)
        assert len(started) == 1  # its restart is not due for 30 s
    finally:
        await _stop(task, started)
        if grandchild and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


async def test_the_group_of_a_child_that_left_nothing_is_never_signalled(tmp_path, monkeypatch):
    # once a reaped child's group is empty its id may be given to a new session: no killpg then
    calls: list[tuple[int, int]] = []

    def killpg(pgid: int, sig: int) -> None:
        calls.append((pgid, sig))
        raise ProcessLookupError

    cluster, started = make_cluster(tmp_path, ["sh", "-c", "exit 3"])
    monkeypatch.setattr(cluster_mod.os, "killpg", killpg)
    task = asyncio.create_task(cluster.supervise(interval_s=0.01, backoff_s=0.05))
    try:
        end = time.monotonic() + 20
        while len(started) < 3:
            assert not task.done(), task.exception()
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        old = {ch.proc.pid for ch in started[:2]}
        assert not [c for c in calls if c[0] in old], calls
    finally:
        monkeypatch.undo()
        await _stop(task, started)


def test_group_members_lists_a_group_and_its_members_start_times():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        members = cluster_mod.group_members(proc.pid)
        assert list(members) == [proc.pid] and members[proc.pid] > 0
        assert cluster_mod.group_members(os.getpgrp()).get(os.getpid()) is not None
        # a member seen before with another start time (its pid reused) does not count
        assert not cluster_mod.signal_members(proc.pid, {proc.pid: members[proc.pid] + 1}, 0)
        assert cluster_mod.signal_members(proc.pid, members, 0)
    finally:
        proc.kill()
        proc.wait(5)
    assert cluster_mod.group_members(proc.pid) == {}
    assert not cluster_mod.signal_members(proc.pid, members, signal.SIGKILL)
