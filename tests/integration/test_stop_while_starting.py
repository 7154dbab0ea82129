"""A PD worker told to stop while vLLM starts (10-20 s here, minutes for a large model on a GPU)
stops then, not once the engine is up, and leaves nothing behind: vLLM's EngineCore process, which
before its handshake does not notice that its worker is gone (it waited 5 minutes), and the
worker's private RPC directory."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from epdq.engines import rpc_dirs
from epdq.worker.runner import WorkerConfig
from tests.procs import alive, children, cmdline

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def short_tmp():
    """The worker's TMPDIR, where it makes its RPC directory (tempfile honours TMPDIR). Short:
    vLLM's socket paths in it must fit in 107 characters, and pytest's tmp_path is too long to
    be used as it is (the worker would use /tmp then)."""
    path = Path(tempfile.mkdtemp(prefix="epdq-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start_worker(tmp_path, tmp: Path, model_dir: str, worker_id: str) -> tuple[subprocess.Popen, Path]:
    """A PD worker as `epdq up` starts one, with `tmp` as its TMPDIR; (process, its log)."""
    cfg = WorkerConfig(role="pd", broker=f"ipc://{tmp_path}/broker.sock", model=model_dir, worker_id=worker_id)
    log_path = tmp_path / f"{worker_id}.log"
    # without conftest's shared VLLM_RPC_BASE_PATH, as a user runs it: the worker makes its own
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    env |= {"TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epdq.launch", "worker", msgspec.json.encode(cfg).decode()],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
    return proc, log_path


def _engine_cores(proc: subprocess.Popen, log_path: Path) -> list[int]:
    """vLLM's EngineCore processes, as soon as the worker has spawned one (its start is under way)."""
    end = time.monotonic() + 120
    cores: list[int] = []
    while not cores and proc.poll() is None and time.monotonic() < end:
        cores = [c for c in children(proc.pid) if "spawn_main" in cmdline(c)]
        time.sleep(0.01)
    assert cores, f"no EngineCore was started:\n{log_path.read_text()[-3000:]}"
    return cores


def test_a_pd_worker_told_to_stop_while_vllm_starts_stops_then_and_leaves_nothing(tmp_path, short_tmp, model_dir):
    tmp = short_tmp
    proc, log_path = _start_worker(tmp_path, tmp, model_dir, "pd-x")
    try:
        cores = _engine_cores(proc, log_path)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        text = log_path.read_text()
        assert "told to stop while starting" in text
        assert "worker pd-x up" not in text  # before: it loaded, said it was up, then stopped
        end = time.monotonic() + 15
        while any(map(alive, cores)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(map(alive, cores)), "the EngineCore outlived its worker"
        assert not list(tmp.glob("epdq-vllm-rpc-*"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_an_engine_core_whose_worker_is_killed_before_the_handshake_exits_soon(tmp_path, short_tmp, model_dir):
    """SIGKILL (the OOM killer, `kill -9`) gives the worker no chance to stop its EngineCore, and
    vLLM loads epdq's plugin (whose thread watches the parent) only after the core's handshake
    with its worker, which a dead worker never answers: the core waited 5 minutes. Killed as soon
    as the core appears, so the worker is often gone before the core's first line of Python."""
    tmp = short_tmp
    proc, log_path = _start_worker(tmp_path, tmp, model_dir, "pd-k")
    cores: list[int] = []
    try:
        cores = _engine_cores(proc, log_path)
        proc.kill()
        proc.wait(10)
        end = time.monotonic() + 15  # the watch looks once a second
        while any(map(alive, cores)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not any(map(alive, cores)), "the EngineCore outlived its SIGKILLed worker"
        # its RPC directory stays; the next engine to start on this host removes it
        left = list(tmp.glob("epdq-vllm-rpc-*"))
        assert len(left) == 1
        assert rpc_dirs.remove_stale(str(tmp)) == [str(left[0])]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for c in cores:
            try:
                os.kill(c, signal.SIGKILL)
            except ProcessLookupError:
                pass
