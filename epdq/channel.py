"""A callback-driven channel: one ZeroMQ socket read and written from the asyncio loop.

`Channel` reads a plain (non-asyncio) ZeroMQ socket from the event loop's reader callback and
drains every ready message per wake-up, then hands each one to a synchronous handler. That avoids
a Future per message, and sends are NOBLOCK calls that cannot stall the loop. Messages to one peer
may be coalesced into one BATCH message per loop turn (`coalesce=True`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from epdq.errors import ProtocolError
from epdq.protocol import BATCH_TYPE, MAX_BATCH, pack_batch, split_batch
from epdq.security import peer_key
from epdq.transport import close_socket

log = logging.getLogger(__name__)

# The Cython socket methods with plain-int flags: pyzmq's send_multipart/recv_multipart spend
# most of their time in Python (a type check per frame, IntFlag arithmetic per frame, a sugar
# layer per call): ~3 us vs ~0.5 us to send three frames here.
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


class PeerUnreachable(Exception):
    """A ROUTER send found no connected peer with that identity."""


# A BATCH is cut once it holds this many bytes, every frame counted (types and headers too):
# ZeroMQ bounds a peer's send queue in messages (the broker's PEER_SEND_HWM), so what a peer
# that reads nothing can make the broker hold is that many messages of at most this size. With
# only payloads counted, 4,096 header-only replies (STATS answers) went in one message and a
# client that sent 3-byte requests without reading grew the broker by ~300 times that.
BATCH_BYTES = 256 * 2**10


def _batches(msgs: list[tuple[list[Any], bool]]) -> list[list[tuple[list[Any], bool]]]:
    """`msgs` cut into BATCH messages the receiver accepts (at most MAX_BATCH messages) and that
    stay small: ZeroMQ hands a message over only once all of it arrived, so one BATCH of large
    payloads would hold back everything behind it (pings included) and be refused whole."""
    if len(msgs) <= 1:
        return [msgs]
    out: list[list[tuple[list[Any], bool]]] = []
    chunk: list[tuple[list[Any], bool]] = []
    nbytes = 0
    for m in msgs:
        if chunk and (len(chunk) == MAX_BATCH or nbytes >= BATCH_BYTES):
            out.append(chunk)
            chunk, nbytes = [], 0
        chunk.append(m)
        for f in m[0]:
            nbytes += len(f) if type(f) is bytes else memoryview(f).nbytes
    out.append(chunk)
    return out


def _is_batch(type_frame: Any) -> bool:
    mv = memoryview(type_frame)
    return mv.nbytes == 1 and mv[0] == BATCH_TYPE[0]


class Channel:
    """Drive one socket from the running loop: `handler(frames)` for every message received."""

    def __init__(
        self,
        sock: zmq.Socket,
        handler: Callable[[list[Any]], None],
        *,
        batch: int = 512,
        on_error: Callable[[BaseException], None] | None = None,
        copy: bool = False,
        coalesce: bool = False,
        on_unreachable: Callable[[bytes], None] | None = None,
        peer_keys: bool = False,
    ) -> None:
        """`copy=False` receives zmq.Frames (zero-copy: for peers that send large payloads);
        `copy=True` receives bytes, cheaper for small messages.

        `coalesce=True` defers sends to the end of the loop turn and packs the messages for one
        peer into one BATCH message: one ZeroMQ send and one peer wake-up instead of dozens. A
        ROUTER peer found gone at that point is reported to `on_unreachable(identity)`.

        `peer_keys=True` (a CURVE ROUTER): while the handler runs, `peer_key` is the z85 public key
        the message's sender authenticated with (ZeroMQ's User-Id), or None."""
        self.sock = sock
        self._handler = handler
        self._batch = batch
        self._on_error = on_error
        self._copy = copy
        self._coalesce = coalesce
        self._on_unreachable = on_unreachable
        self._routed = sock.type == zmq.ROUTER
        self._peer_keys = peer_keys and self._routed
        self.peer_key: str | None = None
        self._out: dict[bytes, list[tuple[list[Any], bool]]] = {}
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = sock.getsockopt(zmq.FD)
        self._check_scheduled = False
        self.closed = False
        self.received = 0
        self.sent = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_check()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that drives this channel (None before `start`)."""
        return self._loop

    def _schedule_check(self) -> None:
        # the ZeroMQ FD is edge-like: any socket call may consume the wake-up, so look again soon
        if not self._check_scheduled and self._loop is not None and not self.closed:
            self._check_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._check_scheduled = False
        if self.closed:
            return
        sock, copy = self.sock, self._copy
        for _ in range(self._batch):
            try:
                # Asking costs ~0.9 us; a receive that finds nothing ~2.3 us (pyzmq raises Again,
                # and the loop looks at an idle socket after every flush).
                if not _raw_get(sock, _EVENTS) & _POLLIN:
                    return
                if self._peer_keys:
                    # only a Frame carries the User-Id; the identity frame is small, so copy it out
                    first = _raw_recv(sock, _NOBLOCK, False)
                    self.peer_key = peer_key(first)
                    frames = [first.bytes]
                else:
                    frames = [_raw_recv(sock, _NOBLOCK, copy)]
                while _raw_get(sock, _RCVMORE):
                    frames.append(_raw_recv(sock, _NOBLOCK, copy))
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                if self.closed or e.errno == zmq.ENOTSOCK:
                    return
                raise
            self.received += 1
            tf = frames[1] if self._routed else frames[0]
            if len(frames) > 1 + self._routed and _is_batch(tf):
                self._deliver_batch(frames)
            else:
                self._deliver(frames)
            if self.closed:
                return
        self._schedule_check()  # batch exhausted: yield to other tasks, then continue

    def _deliver(self, frames: list[Any]) -> None:
        try:
            self._handler(frames)
        except Exception as e:  # one bad message must never stop the loop
            if self._on_error is not None:
                self._on_error(e)
            else:
                log.exception("message handler failed")

    def _deliver_batch(self, frames: list[Any]) -> None:
        head = frames[:1] if self._routed else []
        try:
            parts = split_batch(frames[len(head) :])
        except ProtocolError as e:
            self._deliver(head + [frames[len(head)], b""])  # the handler counts it as malformed
            log.debug("bad batch: %s", e)
            return
        for part in parts:
            self._deliver(head + part)
            if self.closed:
                return

    def send(self, frames: list[Any], *, copy: bool = True) -> None:
        if self._coalesce:
            dest = bytes(frames[0]) if self._routed else b""
            self._out.setdefault(dest, []).append((frames[1:] if self._routed else frames, copy))
            if not self._flush_scheduled and self._loop is not None:
                self._flush_scheduled = True
                self._loop.call_soon(self.flush)
            return
        self._send_now(frames, copy)

    def flush(self) -> None:
        """Send everything deferred by `coalesce` (also called on close)."""
        self._flush_scheduled = False
        out, self._out = self._out, {}
        for dest, msgs in out.items():
            if self.closed:
                return
            head = [dest] if self._routed else []
            for chunk in _batches(msgs):
                packed = 0
                if len(chunk) == 1:
                    body, copy = chunk[0]
                else:
                    # type, header and the packed small frames are new bytes: always copied
                    body, copy, packed = (
                        pack_batch([m for m, _ in chunk]),
                        all(c for _, c in chunk),
                        len(head) + 3,
                    )
                try:
                    self._send_now(head + body, copy, check=False, copied=packed)
                except PeerUnreachable:
                    if self._on_unreachable is not None:
                        self._on_unreachable(dest)
                    break
                except zmq.Again:  # its send queue is at the high-water mark: it stopped reading
                    log.warning("peer %r does not read what it is sent: cut off", dest[:16])
                    if self._on_unreachable is not None:
                        self._on_unreachable(dest)
                    break
                except zmq.ZMQError as e:
                    log.warning("send to %r failed: %s", dest[:16], e)
                    break
        self._schedule_check()  # a send may have consumed the socket's read edge

    def _send_now(self, frames: list[Any], copy: bool, *, check: bool = True, copied: int = 0) -> None:
        """Send one message; `copy` applies to its frames from index `copied` on (before it: copied)."""
        sock = self.sock
        last = len(frames) - 1
        try:
            # ROUTER_MANDATORY fails an unknown identity (or, with a send_hwm, a full peer) on the
            # first frame, before anything is queued; the later frames of a message always go
            for i, f in enumerate(frames):
                _raw_send(sock, f, _MORE if i < last else _NOBLOCK, copy or i < copied)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(str(e)) from None
            raise
        finally:
            if check:
                self._schedule_check()
        self.sent += 1

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 gives a last message (a BYE) time to leave."""
        if self.closed:
            return
        if self._out:
            self.flush()
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._fd)
            except (ValueError, OSError):
                pass
        close_socket(self.sock, linger_ms)
