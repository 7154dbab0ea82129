"""Sockets, endpoints and key files refused with a ConfigError that says why, and nothing left
open when a socket cannot be made: each case here once escaped as a raw ZeroMQ or struct error, was
silently accepted, or left a monitor socket that kept ctx.term() from returning."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
from types import SimpleNamespace

import pytest
import zmq

from epdq import AsyncClient
from epdq.errors import ConfigError
from epdq.handshake import HandshakeWatch
from epdq.keys import ensure_cluster_keys
from epdq.security import SecurityConfig, _z85_key, load_allowed_keys, load_public_key, load_worker_keys
from epdq.transport import _prepare_ipc, close_socket, endpoint_problem, make_socket

# 40 z85 characters, one of whose 5-character groups decodes past 2**32 (pyzmq: struct.error)
BAD_Z85 = b"Ob<eT*1UiuM-XX@]Q=S?s^Sk)ADdPf#no]?D&oJS"
# passes endpoint_problem, but ZeroMQ's connect refuses it (EINVAL)
UNCONNECTABLE = "tcp://a b:7700"


def terminates(ctx: zmq.Context, within_s: float = 5.0) -> bool:
    """Whether ctx.term() returns: it waits for every socket of the context to close."""
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(within_s)
    return not t.is_alive()


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="epdq-tc-", dir="/tmp")  # ipc paths: at most 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ connect endpoints


@pytest.mark.parametrize("address", ["tcp://*:7700", "tcp://127.0.0.1:*", "tcp://127.0.0.1:0", "tcp://10.0.0.1;*:7700"])
def test_a_wildcard_is_no_address_to_connect_to(address):
    assert endpoint_problem(address) is None  # to bind on, fine
    assert "wildcard" in endpoint_problem(address, connect=True)
    ctx = zmq.Context()
    try:
        with pytest.raises(ConfigError, match="wildcard"):
            make_socket(ctx, zmq.DEALER, connect=address)
    finally:
        assert terminates(ctx)


def test_the_client_refuses_a_wildcard_at_construction():
    with pytest.raises(ConfigError, match="wildcard"):
        AsyncClient("tcp://*:7700", insecure=True)


async def test_a_failed_connect_is_a_config_error_and_closes_the_watch():
    ctx = zmq.Context()
    watches: list[HandshakeWatch] = []
    try:
        with pytest.raises(ConfigError, match="cannot connect to"):
            make_socket(ctx, zmq.DEALER, connect=UNCONNECTABLE,
                        before_connect=lambda s: watches.append(HandshakeWatch(s, "client")))  # fmt: skip
        assert len(watches) == 1 and watches[0]._channel.sock.closed
    finally:
        assert terminates(ctx)


async def test_a_client_whose_connect_failed_leaves_nothing_open(tmp_path):
    keys = str(ensure_cluster_keys(tmp_path / "keys"))
    ctx = zmq.Context()
    client = AsyncClient(UNCONNECTABLE, keys_dir=keys, ctx=ctx)
    try:
        for _ in range(2):
            with pytest.raises(ConfigError, match="cannot connect to"):
                await client.connect()
            assert client._handshakes is None and client._channel is None
        await client.close()
    finally:
        assert terminates(ctx)


async def test_close_releases_a_watch_left_without_a_channel():
    ctx = zmq.Context()
    client = AsyncClient("ipc:///nonexistent/epdq-test.sock", ctx=ctx)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        client._handshakes = watch = HandshakeWatch(sock, "client")
        await client.close()  # returned early without a channel: the watch's PAIR stayed open
        assert watch._channel.sock.closed and client._handshakes is None
    finally:
        sock.close(0)
        assert terminates(ctx)


# ------------------------------------------------------------------ IPv6


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback (::1) to bind")
def test_ipv6_loopback_bind_and_connect():
    # ZeroMQ sockets are IPv4-only unless told: the bind failed with "No such device" and the
    # connect never connected
    ctx = zmq.Context()
    sec = SecurityConfig(mode="none", insecure_ok=True)
    server = client = None
    try:
        server = make_socket(ctx, zmq.ROUTER, bind="tcp://[::1]:0", security=sec)
        endpoint = server.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert endpoint.startswith("tcp://[::1]:")
        client = make_socket(ctx, zmq.DEALER, connect=endpoint, security=sec)
        client.send(b"over ipv6")
        assert server.poll(5000), "nothing arrived over [::1]"
        assert server.recv_multipart()[1] == b"over ipv6"
    finally:
        for s in (client, server):
            if s is not None:
                close_socket(s)
        ctx.term()


def test_ipv4_endpoints_are_reported_as_before():
    # the IPv6 option only where the address is IPv6: with it, an IPv4 bind reports ::ffff:127.0.0.1
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:0", security=SecurityConfig(insecure_ok=True))
    try:
        assert sock.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://127.0.0.1:")
    finally:
        close_socket(sock)
        ctx.term()


# ------------------------------------------------------------------ ipc endpoints


def test_a_live_ipc_endpoint_with_a_full_backlog_is_not_taken_over(short_dir):
    path = os.path.join(short_dir, "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fillers: list[socket.socket] = []
    try:
        listener.bind(path)
        listener.listen(0)
        for _ in range(64):  # never accepted: the backlog fills, and a blocking connect then waits
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
        else:
            pytest.fail("the listener's backlog never filled")
        # the old probe timed out here, took that for stale, and ZeroMQ's bind replaced the endpoint
        with pytest.raises(ConfigError, match="another process is listening"):
            _prepare_ipc(f"ipc://{path}")
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_a_stale_ipc_endpoint_is_replaced(short_dir):
    path = os.path.join(short_dir, "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # its file stays: connections to it are refused
    _prepare_ipc(f"ipc://{path}")


def test_an_ipc_endpoint_that_cannot_be_probed_is_kept(short_dir, monkeypatch):
    # EACCES and the like say nothing of whether someone listens (as root here, faked)
    path = os.path.join(short_dir, "unknown.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        monkeypatch.setattr("epdq.transport._listening", lambda p: None)
        with pytest.raises(ConfigError, match="cannot tell whether a process listens"):
            _prepare_ipc(f"ipc://{path}")
    finally:
        s.close()


# ------------------------------------------------------------------ key files


def _write_key(path: str, key: bytes, mode: int = 0o644) -> None:
    with open(path, "wb") as f:
        f.write(b'curve\n    public-key = "' + key + b'"\n')
    os.chmod(path, mode)


def test_a_z85_key_decoding_past_32_bits_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not a 40-character z85 CURVE key"):
        _z85_key(BAD_Z85, "key")
    _write_key(str(tmp_path / "typo.key"), BAD_Z85)
    with pytest.raises(ConfigError, match="typo.key is not a 40-character z85"):
        load_public_key(tmp_path / "typo.key")


def test_a_bad_worker_key_costs_only_its_own_key(tmp_path, caplog):
    keys = ensure_cluster_keys(tmp_path / "keys")
    allowed = keys / "allowed"
    good = load_public_key(allowed / "worker.key")
    _write_key(str(allowed / "worker-typo.key"), BAD_Z85)
    with caplog.at_level(logging.ERROR, logger="epdq.security"):
        assert load_worker_keys(allowed) == {good}
    assert "worker-typo.key" in caplog.text
    # the broker's check, which reads the worker keys at each registration, cannot crash on it
    from epdq.broker import Broker

    fake = SimpleNamespace(_allow_dir=allowed)
    assert Broker._is_worker_key(fake, good.decode()) is True
    assert Broker._is_worker_key(fake, "x" * 40) is False


def _allow_dir(tmp_path) -> tuple[str, str]:
    keys = ensure_cluster_keys(tmp_path / "keys")
    return str(keys / "allowed"), str(keys / "client.key")


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664])
def test_an_allowed_key_file_others_can_write_is_refused(tmp_path, mode):
    allowed, _ = _allow_dir(tmp_path)
    target = os.path.join(allowed, "client.key")
    os.chmod(target, mode)
    with pytest.raises(ConfigError, match=r"client.key is writable by group or others .*chmod go-w"):
        load_allowed_keys(allowed)
    os.chmod(target, 0o644)
    assert len(load_allowed_keys(allowed)) == 2


def test_an_allowed_key_that_is_a_symlink_is_refused(tmp_path):
    allowed, client_key = _allow_dir(tmp_path)
    os.unlink(os.path.join(allowed, "client.key"))
    os.symlink(client_key, os.path.join(allowed, "client.key"))  # out of the allow directory
    with pytest.raises(ConfigError, match="client.key is a symlink"):
        load_allowed_keys(allowed)
    os.symlink(client_key, os.path.join(allowed, "worker-x.key"))
    assert load_worker_keys(allowed) == {load_public_key(os.path.join(allowed, "worker.key"))}


def test_an_allowed_key_file_of_another_user_is_refused(tmp_path):
    allowed, _ = _allow_dir(tmp_path)
    target = os.path.join(allowed, "worker.key")
    other = 4242 if os.getuid() != 4242 else 4243
    try:
        os.chown(target, other, -1)
    except PermissionError:
        pytest.skip("only root can give a file to another user here")
    with pytest.raises(ConfigError, match=f"worker.key belongs to uid {other}"):
        load_allowed_keys(allowed)
    assert load_worker_keys(allowed) == frozenset()  # refused at a registration too, not a crash


def test_an_ipc_endpoint_in_a_directory_others_can_write_is_warned_of(short_dir, caplog):
    # the 0600 socket keeps others from connecting while it listens; once it stops, another user
    # could listen on the same path in a shared directory and get what its peers send
    shared = os.path.join(short_dir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    private = os.path.join(short_dir, "private")
    with caplog.at_level(logging.WARNING, logger="epdq.transport"):
        _prepare_ipc(f"ipc://{private}/b.sock")  # created 0700: nothing to say
        assert not caplog.records
        _prepare_ipc(f"ipc://{shared}/b.sock")
    (rec,) = caplog.records
    assert "other users can write" in rec.getMessage() and shared in rec.getMessage()
