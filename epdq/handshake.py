"""What became of a client socket's handshakes with the broker.

A broker that refuses a key, a client holding the wrong broker public key, or a client and a
broker of which one uses CURVE and the other plaintext (--insecure) all look from the client like a
broker that never answers: ZeroMQ drops the connection inside its I/O thread. Its socket monitor
does say why, and `HandshakeWatch` turns that into a sentence, so a key problem is reported as one
instead of as "broker silent".

What libzmq 4.3 reports to the connecting side (tests/integration/test_auth*.py check these):
key not in the allow-list: HANDSHAKE_FAILED_AUTH, and it does not reconnect; wrong broker public
key: HANDSHAKE_FAILED_NO_DETAIL (EPIPE: the broker hung up), reconnecting every 100 ms; CURVE client
and plaintext broker, or the other way round: HANDSHAKE_FAILED_PROTOCOL with ZMTP_MECHANISM_MISMATCH,
and it does not reconnect. That last one is a race, though: when the broker hangs up before the
client has read its greeting, the client sees the same NO_DETAIL as for a wrong key, reconnects, and
reports the mismatch only on a later try. So a NO_DETAIL sentence names both causes.
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
    "probably not the broker's (broker.key must come from the broker's keys directory), or the broker "
    "does not use CURVE (it runs with --insecure)"
)
BROKER_PLAINTEXT = (
    "the broker does not use CURVE (it runs with --insecure, in plaintext) while this {who} does: "
    "give this {who} --insecure too (loopback only), or start the broker with the cluster's keys (--keys-dir)"
)


def is_curve_client(sock: zmq.Socket) -> bool:
    return sock.getsockopt(zmq.MECHANISM) == zmq.CURVE and not sock.getsockopt(zmq.CURVE_SERVER)


class HandshakeWatch:
    """Follows a CURVE client socket's handshakes. Attach before the socket connects (events are
    not replayed); `problem` is "" while the last handshake succeeded (or none has ended yet)."""

    def __init__(self, sock: zmq.Socket, who: str, on_refused: Callable[[str], None] | None = None):
        self.who = who
        self.problem = ""
        # ZeroMQ gave this connection up, for a reason retrying will not fix: the broker refused our
        # key, or it does not use CURVE
        self.refused = False
        self._on_refused = on_refused
        addr = f"inproc://epdq-handshake-{next(_ids)}-{id(self):x}"
        sock.monitor(addr, _EVENTS)
        pair = sock.context.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(addr)
        self._channel = Channel(pair, self._on_event, copy=True)
        self._channel.start()

    def _on_event(self, frames: list[Any]) -> None:
        msg = parse_monitor_message(frames)
        event = msg["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.problem, self.refused = "", False
            return
        mismatch = (
            event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and msg["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        )
        if mismatch:
            problem = BROKER_PLAINTEXT.format(who=self.who)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            problem = REFUSED.format(who=self.who)
        else:
            problem = FAILED.format(who=self.who)
        self.refused = mismatch or event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        if problem != self.problem:
            # a refusal handed to on_refused reaches the caller as an error: logged again, it printed
            # twice on a CLI client's terminal
            told = self.refused and self._on_refused is not None
            log.log(logging.INFO if told else logging.ERROR, "%s", problem, extra={"event": "curve_handshake_failed"})
        self.problem = problem
        if self.refused and self._on_refused is not None:
            self._on_refused(problem)

    def close(self) -> None:
        """Close the monitor's end (after, or instead of, closing the watched socket)."""
        self._channel.close()


def watch_client(
    sock: zmq.Socket, who: str, on_refused: Callable[[str], None] | None = None
) -> HandshakeWatch | None:
    """A watch on `sock` when it connects to a broker as a CURVE client, else None. Plaintext
    clients are not watched: a monitor on every ipc socket of a process (a worker reconnecting
    with short heartbeats) intermittently left its next connection without any traffic."""
    return HandshakeWatch(sock, who, on_refused) if is_curve_client(sock) else None


