"""vLLM's ipc socket directories: a SIGKILLed worker's is removed by the next engine's start,
a running engine's never (epdq/engines/rpc_dirs.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from epdq.engines import rpc_dirs


@pytest.fixture
def short_tmp(monkeypatch):
    """TMPDIR short enough for vLLM's socket paths (pytest's tmp_path is not)."""
    path = tempfile.mkdtemp(prefix="epdq-t-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", path)
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_directory_whose_engine_is_gone_is_removed_and_a_live_one_is_kept(short_tmp):
    tmp_path = short_tmp
    # a worker that made its directory, then was SIGKILLed (its lock goes with it)
    code = "from epdq.engines import rpc_dirs; import os, signal; print(rpc_dirs.make()[0], flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=os.environ, timeout=60)
    dead = out.stdout.decode().strip()
    assert dead.startswith(os.path.join(tmp_path, rpc_dirs.PREFIX)) and os.path.isdir(dead)
    open(os.path.join(dead, "engine_core.sock"), "w").close()  # what vLLM leaves
    live, fd = rpc_dirs.make()
    try:
        assert rpc_dirs.remove_stale() == [dead]
        assert not os.path.exists(dead)
        assert os.path.isdir(live) and oct(os.stat(live).st_mode & 0o777) == "0o700"
        assert rpc_dirs.remove_stale() == []
    finally:
        rpc_dirs.release(live, fd)
    assert not os.path.exists(live)


def test_what_make_did_not_create_is_left_alone(tmp_path):
    (tmp_path / f"{rpc_dirs.PREFIX}no-lock").mkdir()  # an older epdq's, or one being made
    (tmp_path / f"{rpc_dirs.PREFIX}a-file").write_text("x")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ".owner").write_text("")
    (tmp_path / f"{rpc_dirs.PREFIX}a-link").symlink_to(target)
    assert rpc_dirs.remove_stale(str(tmp_path)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{rpc_dirs.PREFIX}no-lock", f"{rpc_dirs.PREFIX}a-file", f"{rpc_dirs.PREFIX}a-link", "elsewhere"]
    )
    assert (target / ".owner").exists()


def test_a_long_tmpdir_puts_the_directory_in_tmp(tmp_path, monkeypatch):
    # vLLM's socket path (directory + a uuid4) must fit in 107 characters, or its bind fails
    long = tmp_path / ("x" * 60)
    long.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(long))
    path, fd = rpc_dirs.make()
    try:
        assert os.path.dirname(path) == "/tmp"
        assert len(os.path.join(path, str(uuid.uuid4()))) <= 107
    finally:
        rpc_dirs.release(path, fd)
