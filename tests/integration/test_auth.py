"""CURVE handshakes over real tcp on 127.0.0.1: who gets in, who is refused, and reloading the allow-list."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from epdq.errors import ConfigError, InternalError
from epdq.security import (
    Authenticator,
    CurveClient,
    CurveServer,
    KeyPair,
    apply_client,
    apply_server,
    authenticator_for,
    ensure_authenticator,
    generate_keypair,
    load_keypair,
    peer_key,
)

pytestmark = pytest.mark.integration

WAIT_MS = 1000  # a refused message must not arrive within this; an admitted one arrives far sooner


class Rig:
    """One private context, a CURVE ROUTER server, and DEALER clients; everything closed at the end."""

    def __init__(self, tmp_path):
        self.ctx = zmq.Context()
        self.keys = tmp_path / "keys"
        self.allow = tmp_path / "allow"
        self.allow.mkdir(mode=0o700)
        self.server_pair = load_keypair(generate_keypair(self.keys, "server")[1])
        self.server = CurveServer(self.server_pair, self.allow)
        self.auth = Authenticator()
        self.sockets: list[zmq.Socket] = []
        self.monitored: list[zmq.Socket] = []
        self.router: zmq.Socket | None = None
        self.port = 0

    def key(self, name: str, *, allowed: bool) -> KeyPair:
        pub, sec = generate_keypair(self.keys, name)
        if allowed:
            (self.allow / pub.name).write_bytes(pub.read_bytes())
        return load_keypair(sec)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def serve(self) -> None:
        self.auth.start(self.ctx, self.allow)  # before the server binds
        self.router = self._socket(zmq.ROUTER)
        apply_server(self.router, self.server)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")

    def client(
        self, pair: KeyPair | None, server_public: bytes | None = None
    ) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER (CURVE with `pair`, plaintext when None) and a monitor socket watching it."""
        sock = self._socket(zmq.DEALER)
        if pair is not None:
            apply_client(sock, CurveClient(pair, server_public or self.server_pair.public))
        monitor = sock.get_monitor_socket()
        self.monitored.append(sock)
        self.sockets.append(monitor)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        return sock, monitor

    def roundtrip(self, sock: zmq.Socket, body: bytes) -> str | None:
        """Send `body`; if the server gets it within WAIT_MS, echo it back and return the sender's key."""
        try:
            # a refused handshake can leave the DEALER with no pipe, where a blocking send hangs
            sock.send(body, zmq.NOBLOCK)
        except zmq.Again:
            return None
        assert self.router is not None
        if not self.router.poll(WAIT_MS):
            return None
        ident, frame = self.router.recv_multipart(copy=False)
        assert frame.bytes == body
        key = peer_key(frame)
        self.router.send_multipart([ident.bytes, b"echo:" + body])
        assert sock.poll(WAIT_MS), "reply never came back"
        assert sock.recv() == b"echo:" + body
        return key

    def close(self) -> None:
        for sock in self.monitored:
            if not sock.closed:
                sock.disable_monitor()
        for sock in reversed(self.sockets):
            sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()


def wait_event(monitor: zmq.Socket, wanted: int, timeout_s: float = 2.0) -> list[int]:
    """Monitor events seen until `wanted` shows up (or the timeout); returns them all."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while wanted not in seen:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not monitor.poll(left_ms):
            break
        seen.append(recv_monitor_message(monitor)["event"])
    return seen


@pytest.fixture()
def rig(tmp_path):
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def test_allowed_key_round_trips_and_is_attributed(rig):
    good = rig.key("worker-1", allowed=True)
    rig.serve()
    sock, monitor = rig.client(good)
    assert rig.roundtrip(sock, b"hello") == good.public.decode()
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED in wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)


def test_unknown_key_is_refused(rig):
    rig.key("worker-1", allowed=True)
    stranger = rig.key("stranger", allowed=False)
    rig.serve()
    sock, monitor = rig.client(stranger)
    events = wait_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
    assert rig.roundtrip(sock, b"let me in") is None


def test_wrong_server_key_is_refused(rig):
    good = rig.key("worker-1", allowed=True)
    rig.serve()
    impostor_view = KeyPair(*zmq.curve_keypair()).public  # the client expects some other server
    sock, monitor = rig.client(good, server_public=impostor_view)
    events = wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED, timeout_s=1.0)
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
    assert rig.roundtrip(sock, b"hello") is None


def test_plaintext_client_is_refused(rig):
    rig.key("worker-1", allowed=True)
    rig.serve()
    sock, monitor = rig.client(None)
    events = wait_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    assert zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in events
    assert rig.roundtrip(sock, b"plain") is None


def test_reload_admits_a_key_added_later(rig):
    rig.serve()
    late = rig.key("late", allowed=False)
    sock, monitor = rig.client(late)
    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in wait_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    (rig.allow / "late.key").write_bytes((rig.keys / "late.key").read_bytes())
    assert rig.auth.reload() == {"epdq": 1}
    fresh, _ = rig.client(late)
    assert rig.roundtrip(fresh, b"now") == late.public.decode()
    # and removing it again locks the next connection out
    (rig.allow / "late.key").unlink()
    assert rig.auth.reload() == {"epdq": 0}
    locked, monitor = rig.client(late)
    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in wait_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def test_bad_reload_keeps_the_old_list(rig):
    good = rig.key("worker-1", allowed=True)
    rig.serve()
    (rig.allow / "broken.key").write_text("public-key = garbage\n")
    with pytest.raises(ConfigError):
        rig.auth.reload()
    sock, _ = rig.client(good)
    assert rig.roundtrip(sock, b"still") == good.public.decode()


def test_authenticator_lifecycle_guards(rig, tmp_path):
    rig.serve()
    assert authenticator_for(rig.ctx) is rig.auth
    with pytest.raises(InternalError, match="one per context"):
        Authenticator().start(rig.ctx, rig.allow)
    assert ensure_authenticator(rig.ctx, rig.server) is rig.auth
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    with pytest.raises(ConfigError, match="already uses allow directory"):
        ensure_authenticator(rig.ctx, CurveServer(rig.server_pair, other_dir))
    # a second server in the same context with its own allow-list gets its own ZAP domain
    assert ensure_authenticator(rig.ctx, CurveServer(rig.server_pair, other_dir, domain="fetch")) is rig.auth
    assert rig.auth.guards("fetch") == other_dir
    late = rig._socket(zmq.ROUTER)
    late.bind("tcp://127.0.0.1:*")
    with pytest.raises(InternalError, match="before the socket binds"):
        apply_server(late, rig.server)
    with pytest.raises(InternalError, match="close 1 CURVE server"):
        rig.auth.stop()  # the router is still open: stopping now would let anyone in
    assert rig.router is not None
    rig.router.close(linger=0)
    rig.auth.stop()
    assert authenticator_for(rig.ctx) is None


async def test_handshakes_do_not_need_the_event_loop(rig):
    """The ZAP handler runs on its own thread: a blocked loop (as in a long handler) still admits peers."""
    good = rig.key("worker-1", allowed=True)
    rig.serve()
    sock, _ = rig.client(good)
    assert asyncio.get_running_loop().is_running()
    assert rig.roundtrip(sock, b"blocking") == good.public.decode()  # blocking polls inside the loop
