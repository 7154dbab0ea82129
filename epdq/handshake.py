"""What became of a CURVE client socket's handshakes with the broker.

A broker that refuses a key, or a client holding the wrong broker public key, looks from the
client like a broker that never answers: ZeroMQ drops the connection inside its I/O thread and
retries. Its socket monitor does say why, and `HandshakeWatch` turns that into a sentence, so a
key problem is reported as one instead of as "broker silent".
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from epdq.transport import Channel

log = logging.getLogger(__name__)

_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_ids = itertools.count(1)

REFUSED = (
    "the broker refused this {who}'s CURVE key: its public key is not in the broker's allow "
    "directory (add this {who}'s {who}.key there, or use the keys directory of the broker's cluster)"
)
FAILED = (
    "the CURVE handshake with the broker failed: the broker's public key this {who} holds is "
    "probably not the broker's (broker.key must come from the broker's keys directory)"
)


def is_curve_client(sock: zmq.Socket) -> bool:
    return sock.getsockopt(zmq.MECHANISM) == zmq.CURVE and not sock.getsockopt(zmq.CURVE_SERVER)


class HandshakeWatch:
    """Follows `sock`'s handshakes. Attach before the socket connects (events are not replayed);
    `problem` is "" while the last handshake succeeded (or none has ended yet)."""

    def __init__(self, sock: zmq.Socket, who: str, on_refused: Callable[[str], None] | None = None):
        self.who = who
        self.problem = ""
        self.refused = False  # the broker said no to our key (it will not change by retrying)
        self._on_refused = on_refused
        addr = f"inproc://epdq-handshake-{next(_ids)}-{id(self):x}"
        sock.monitor(addr, _EVENTS)
        pair = sock.context.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(addr)
        self._channel = Channel(pair, self._on_event, copy=True)
        self._channel.start()

    def _on_event(self, frames: list[Any]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.problem, self.refused = "", False
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            problem = REFUSED.format(who=self.who)
        else:
            problem = FAILED.format(who=self.who)
        if problem != self.problem:
            log.error("%s", problem, extra={"event": "curve_handshake_failed"})
        self.problem, self.refused = problem, event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        if self.refused and self._on_refused is not None:
            self._on_refused(problem)

    def close(self) -> None:
        """Close the monitor's end (after, or instead of, closing the watched socket)."""
        self._channel.close()


def watch_if_curve(sock: zmq.Socket, who: str, on_refused: Callable[[str], None] | None = None) -> HandshakeWatch | None:
    """A watch on `sock` when it is a CURVE client (tcp to a broker), else None."""
    return HandshakeWatch(sock, who, on_refused) if is_curve_client(sock) else None
