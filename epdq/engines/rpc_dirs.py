"""Private directories for vLLM's ipc sockets (VLLM_RPC_BASE_PATH), one per engine.

vLLM leaves its socket files behind, so each engine gets a directory of its own that it removes
when it closes. A worker that is SIGKILLed cannot; the next engine started by this user removes
such leftovers. A directory is stale when nobody holds the lock on its `.owner` file, which its
engine holds for as long as it runs: a pid would not do (reused, or from another pid namespace
sharing /tmp).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile

PREFIX = "epdq-vllm-rpc-"
_OWNER = ".owner"
# vLLM names its sockets with a uuid4 (36 characters) in this directory (mkdtemp adds 8 to the
# prefix), and a unix socket path has at most 107: a longer TMPDIR made vLLM's bind fail
_MAX_BASE = 107 - (1 + len(PREFIX) + 8 + 1 + 36)


def bases() -> list[str]:
    """Where engine directories go: the temp dir if its paths are short enough, else /tmp."""
    base = tempfile.gettempdir()
    return [base] if len(base) <= _MAX_BASE or base == "/tmp" else [base, "/tmp"]


def make() -> tuple[str, int]:
    """A new 0700 directory and the fd that holds its lock (close it only with `release`)."""
    base = bases()[-1]
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # 0700
    # locked under another name, then renamed: `remove_stale` must never find `.owner` unlocked
    tmp = os.path.join(path, _OWNER + ".new")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, os.path.join(path, _OWNER))
    except BaseException:
        release(path, fd)
        raise
    return path, fd


def release(path: str, fd: int) -> None:
    """Remove a directory `make` returned, then let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


def remove_stale(base: str | None = None) -> list[str]:
    """Remove this user's engine directories in `base` (default: where `make` puts them) whose
    engine is gone; returns their paths. Anything else there (another user's, a link, a file) is
    left alone."""
    uid = os.getuid()
    removed: list[str] = []
    paths = []
    for b in bases() if base is None else [base]:
        try:
            paths += [os.path.join(b, n) for n in os.listdir(b) if n.startswith(PREFIX)]
        except OSError:
            pass
    for path in paths:
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            fd = os.open(os.path.join(path, _OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # no lock file: not made by `make` (or being made right now)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its engine runs
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
