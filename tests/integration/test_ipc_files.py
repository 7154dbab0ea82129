"""ipc:// socket files: none left behind by a clean shutdown, none piling up from killed encoders,
and every directory made for them private to the user."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import zmq

from epdq.channel import Channel
from epdq.transport import close_socket, make_socket, remove_stale_ipc_sockets
from epdq.worker.encoder import FETCH_SOCKET_NAME

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EPDQ = [sys.executable, "-m", "cli.main"]


@pytest.fixture
def short_dir():
    # a Unix socket path is at most 107 bytes: pytest's tmp_path can be too long for one
    d = tempfile.mkdtemp(prefix="epdq-ipc-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reused within this test only if the pid space wraps: not in practice


def _stale_socket(path: str) -> None:
    """A socket file nobody listens on, as a SIGKILLed process leaves it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()


def _fetch_name(pid: int) -> str:
    return f"fetch-{pid}-{uuid.uuid4().hex[:8]}"


def test_every_directory_made_for_an_ipc_socket_is_private(short_dir, ctx):
    """Only the socket's own directory used to be 0700; those made on the way were 0755."""
    path = os.path.join(short_dir, "a", "b", "c", "s.sock")
    with _umask(0o022):
        sock = make_socket(ctx, zmq.ROUTER, bind=f"ipc://{path}")
    try:
        for d in ("a", "a/b", "a/b/c"):
            assert stat.S_IMODE(os.stat(os.path.join(short_dir, d)).st_mode) == 0o700, d
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        close_socket(sock)


def test_closing_the_channel_removes_its_ipc_file(short_dir, ctx):
    """ZeroMQ does not unlink an ipc file at close: the broker's stayed after a clean SIGTERM."""
    path = os.path.join(short_dir, "ipc", "b.sock")
    ch = Channel(make_socket(ctx, zmq.ROUTER, bind=f"ipc://{path}"), lambda frames: None)
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    ch.close(linger_ms=0)
    assert not os.path.lexists(path)


def test_close_leaves_a_file_that_replaced_ours_alone(short_dir, ctx):
    path = os.path.join(short_dir, "b.sock")
    sock = make_socket(ctx, zmq.ROUTER, bind=f"ipc://{path}")
    os.unlink(path)
    _stale_socket(path)  # as another process binding the path meanwhile would
    close_socket(sock)
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_cleanup_removes_only_dead_processes_unreachable_sockets(short_dir):
    dead = _dead_pid()
    d = short_dir
    stale = _fetch_name(dead)
    _stale_socket(os.path.join(d, stale))
    alive_pid = _fetch_name(os.getpid())  # a live pid may be between bind and listen
    _stale_socket(os.path.join(d, alive_pid))
    listening = _fetch_name(dead)  # e.g. an encoder in another pid namespace
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(os.path.join(d, listening))
    srv.listen(1)
    not_a_socket = _fetch_name(dead)
    with open(os.path.join(d, not_a_socket), "w") as f:
        f.write("keep me")
    link = _fetch_name(dead)
    target = os.path.join(d, "target.sock")
    _stale_socket(target)
    os.symlink(target, os.path.join(d, link))
    other_name = f"other-{dead}-{uuid.uuid4().hex[:8]}"
    _stale_socket(os.path.join(d, other_name))
    huge_pid = f"fetch-9999999999-{uuid.uuid4().hex[:8]}"  # more than any pid: dead, not an error
    _stale_socket(os.path.join(d, huge_pid))
    try:
        removed = remove_stale_ipc_sockets(d, FETCH_SOCKET_NAME)
    finally:
        srv.close()
    assert sorted(removed) == sorted([stale, huge_pid])
    left = set(os.listdir(d))
    assert {alive_pid, listening, not_a_socket, link, other_name, "target.sock"} <= left
    assert stale not in left and huge_pid not in left
    assert stat.S_ISSOCK(os.lstat(target).st_mode)  # a symlink is never followed


def test_the_default_fetch_socket_name_is_the_one_cleaned_up(monkeypatch, short_dir):
    from epdq.security import SecurityConfig
    from epdq.worker.runner import default_fetch_bind

    monkeypatch.setenv("TMPDIR", short_dir)
    tempfile.tempdir = None  # gettempdir caches its answer
    try:
        bind = default_fetch_bind(SecurityConfig())
    finally:
        tempfile.tempdir = None
    assert bind.startswith(f"ipc://{short_dir}/epdq-{os.getuid()}/")
    m = FETCH_SOCKET_NAME.fullmatch(os.path.basename(bind))
    assert m is not None and int(m.group(1)) == os.getpid()


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.05)


def _fetch_sockets(d: str) -> set[str]:
    try:
        return {n for n in os.listdir(d) if FETCH_SOCKET_NAME.fullmatch(n)}
    except FileNotFoundError:
        return set()


def test_real_processes_leave_no_ipc_files(short_dir):
    """A SIGTERMed broker left its socket file; each SIGKILLed encoder left its fetch socket for
    good (115 of them had piled up in /tmp/epdq-0). Now the broker removes its own and the next
    encoder removes those of dead ones."""
    env = {**os.environ, "EPDQ_HOME": os.path.join(short_dir, "home"), "HF_HUB_OFFLINE": "1",
           "TMPDIR": short_dir}  # fmt: skip  # no keys: encoders default to an ipc fetch socket
    broker_path = os.path.join(short_dir, "a", "ipc", "b.sock")
    addr = f"ipc://{broker_path}"
    fetch_dir = os.path.join(short_dir, f"epdq-{os.getuid()}")
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        log = open(os.path.join(short_dir, f"log-{len(procs)}"), "w")
        p = subprocess.Popen([*EPDQ, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        procs.append(p)
        return p

    def logs() -> str:
        return "".join(open(os.path.join(short_dir, n)).read() for n in sorted(os.listdir(short_dir))
                       if n.startswith("log-"))  # fmt: skip

    def encoder() -> tuple[subprocess.Popen, str]:
        p = start("worker", "--role", "encoder", "--engine", "noop", "--broker", addr)
        _wait(lambda: any(n.startswith(f"fetch-{p.pid}-") for n in _fetch_sockets(fetch_dir)) or p.poll() is not None,
              60, "no fetch socket")  # fmt: skip
        assert p.poll() is None, logs()
        return p, next(n for n in _fetch_sockets(fetch_dir) if n.startswith(f"fetch-{p.pid}-"))

    try:
        broker = start("broker", "--address", addr)
        _wait(lambda: os.path.exists(broker_path) or broker.poll() is not None, 60, "no broker socket")
        assert broker.poll() is None, logs()

        first, first_sock = encoder()
        first.kill()
        first.wait(30)
        assert first_sock in _fetch_sockets(fetch_dir)  # nobody could remove it

        second, second_sock = encoder()
        assert _fetch_sockets(fetch_dir) == {second_sock}, logs()

        second.terminate()
        assert second.wait(60) == 0, logs()
        assert _fetch_sockets(fetch_dir) == set(), logs()

        broker.terminate()
        assert broker.wait(60) == 0, logs()
        assert not os.path.lexists(broker_path), logs()
        assert stat.S_IMODE(os.stat(os.path.join(short_dir, "a")).st_mode) == 0o700  # made on the way
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_the_default_socket_directory_must_be_this_users_own(tmp_path, monkeypatch):
    # another local user could create $TMPDIR/epdq-<uid> first (open to all, or a symlink to theirs)
    # and swap our fetch sockets: ipc links carry no keys
    import tempfile

    from epdq.errors import ConfigError
    from epdq.security import SecurityConfig
    from epdq.worker.runner import default_fetch_bind

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    d = tmp_path / f"epdq-{os.getuid()}"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    assert default_fetch_bind(SecurityConfig()).startswith(f"ipc://{d}/fetch-")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700  # ours but open: closed
    d.rmdir()
    (tmp_path / "elsewhere").mkdir()
    d.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="not a directory"):
        default_fetch_bind(SecurityConfig())
