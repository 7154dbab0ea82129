"""Processes a worker's engine spawns end with the worker, even when it is SIGKILLed while they
start (vllm_plugin.watch_parent, started by `epdq._watch_parent_early`). Real processes, no vLLM:
the real-engine case is tests/integration/test_stop_while_starting.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.procs import alive, readline

pytestmark = pytest.mark.timeout(60)

_WORKER = """
import multiprocessing, os, sys, time
import epdq  # as epdq.launch and the epdq script do: a spawned child imports it while prepared

if __name__ == "__main__":
    os.environ["EPDQ_DIE_WITH_PARENT"] = "1"
    os.environ["EPDQ_WORKER_PID"] = str(os.getpid())
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


def _wait_gone(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_spawned_child_with_no_plugin_loaded_ends_with_its_sigkilled_worker(tmp_path):
    # the child's target is time.sleep: only the watch started while it was prepared can end it
    (tmp_path / "fake_worker.py").write_text(_WORKER)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fake_worker"], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    child = 0
    try:
        assert proc.stdout is not None
        child = int(readline(proc))
        assert alive(child)
        proc.kill()
        proc.wait(10)
        assert _wait_gone(child, 10), "the spawned child outlived its SIGKILLed parent"
    finally:
        _end(proc)
        _kill(child)


def _watching(env: dict[str, str], *, started: bool = True) -> subprocess.Popen:
    code = textwrap.dedent("""
        import sys, time
        from epdq.engines.vllm_plugin import watch_parent
        assert watch_parent(interval_s=0.05, preparing=True)
        print("watching", flush=True)
        time.sleep(30)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, env=os.environ | env, start_new_session=True
    )
    assert proc.stdout is not None
    if started:
        assert readline(proc) == b"watching\n"
    return proc


def test_a_child_whose_worker_died_before_it_started_ends_at_once():
    # killed while the child started: init is its parent by then, and init never goes
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    proc = _watching({"EPDQ_DIE_WITH_PARENT": "1", "EPDQ_WORKER_PID": str(dead.pid)}, started=False)
    try:
        assert proc.wait(10) == -signal.SIGTERM
    finally:
        _end(proc)


def test_a_child_of_a_live_worker_keeps_running():
    # its parent is the worker, or (a process of vLLM's under its EngineCore) a child of it
    for worker in (os.getpid(), os.getppid()):
        proc = _watching({"EPDQ_DIE_WITH_PARENT": "1", "EPDQ_WORKER_PID": str(worker)})
        try:
            time.sleep(0.5)  # ten turns of the watch
            assert proc.poll() is None
        finally:
            _end(proc)


def test_nothing_is_watched_unless_the_worker_asked():
    code = "from epdq.engines.vllm_plugin import watch_parent; print(watch_parent(preparing=True))"
    env = {k: v for k, v in os.environ.items() if k != "EPDQ_DIE_WITH_PARENT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert out.stdout == b"False\n"
