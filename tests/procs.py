"""Process facts the tests check from /proc (Linux), and a bounded read of a child's line."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
from typing import Any


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for its parent (or init) to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The children of every thread of `pid` (vLLM starts its EngineCore from a worker thread)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def readline(proc: subprocess.Popen, timeout_s: float = 60.0) -> Any:
    """`proc.stdout.readline()`, bounded: a child that hangs before its line is killed and the
    test fails with a clear message, instead of waiting for pytest's per-test timeout. A thread
    reads (not select on the fd): a text-mode pipe may hold the line in its buffer already."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        line = pool.submit(proc.stdout.readline)
        try:
            return line.result(timeout_s)
        except concurrent.futures.TimeoutError:
            proc.kill()  # the read then ends (EOF), so the pool's shutdown does not wait on it
            raise AssertionError(f"no line from pid {proc.pid} within {timeout_s:g} s") from None
