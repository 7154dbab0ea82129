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
reports the mismatch only on a later try. So a NO_DETAIL sentence names both causes, and the
watch then asks the broker itself (`broker_mechanism`: one plain tcp connection that reads the
mechanism its ZMTP greeting announces). A plaintext broker is then said at once; a CURVE broker
leaves the wrong broker key as the cause. Seen from a busy client, the mismatch often came only
after dozens of those retries (0.2 to over 5 s here), so it was told after the caller's timeout,
or as a silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from epdq.channel import Channel
from epdq.transport import close_with

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
WRONG_BROKER_KEY = (
    "the CURVE handshake with the broker failed: the broker uses CURVE but hung up on this {who}'s "
    "handshake, so the broker's public key this {who} holds is probably not the broker's (broker.key "
    "must come from the broker's keys directory)"
)
BROKER_PLAINTEXT = (
    "the broker does not use CURVE (it runs with --insecure, in plaintext) while this {who} does: "
    "give this {who} --insecure too (loopback only), or start the broker with the cluster's keys (--keys-dir)"
)


# The start of a ZMTP 3 greeting (rfc.zeromq.org/spec/23): the signature and the major version.
# libzmq answers it with its whole greeting (64 bytes: signature, version, mechanism, as-server,
# filler), then waits for the rest of ours. Sending ours whole would not do: a peer that reads a
# mechanism other than its own drops the connection before the rest of its greeting has left.
_GREETING_START = b"\xff" + bytes(8) + b"\x7f" + b"\x03"
_MECHANISMS = frozenset({"NULL", "PLAIN", "CURVE", "GSSAPI"})
PROBE_TIMEOUT_S = 2.0


async def broker_mechanism(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """The security mechanism ("NULL", "CURVE", ...) that the ZeroMQ peer listening on the tcp
    `endpoint` announces in its greeting; None when that cannot be told (not tcp, no answer within
    `timeout_s`, not ZMTP 3, or a mechanism this code does not know: whatever answers is untrusted)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_GREETING_START)
            await writer.drain()
            greeting = await reader.readexactly(64)
    except (OSError, ValueError, EOFError, TimeoutError):  # IncompleteReadError is an EOFError
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if greeting[0] != 0xFF or greeting[9] != 0x7F or greeting[10] < 3:
        return None
    mechanism = greeting[12:32].rstrip(b"\x00").decode("ascii", "replace")
    return mechanism if mechanism in _MECHANISMS else None


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
        self._probe: asyncio.Task | None = None  # broker_mechanism, asked once per socket
        self._mechanism: str | None = None  # what the broker's greeting announced, once asked
        self._closed = False
        addr = f"inproc://epdq-handshake-{next(_ids)}-{id(self):x}"
        sock.monitor(addr, _EVENTS)
        pair = sock.context.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(addr)
        self._channel = Channel(pair, self._on_event, copy=True)
        self._channel.start()
        # Closed with the socket too: when its connect failed, `make_socket` closed the socket and
        # its caller never got a watch to close, and this PAIR kept ctx.term() from returning.
        close_with(sock, self.close)

    def _on_event(self, frames: list[Any]) -> None:
        msg = parse_monitor_message(frames)
        event = msg["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.problem, self.refused = "", False
            # a later failure is news (a broker restarted with other settings): ask again then
            self._mechanism = None
            if self._probe is not None and self._probe.done():
                self._probe = None
            return
        mismatch = (
            event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and msg["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        )
        if mismatch:
            self._report(BROKER_PLAINTEXT.format(who=self.who), refused=True)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._report(REFUSED.format(who=self.who), refused=True)
        elif self._mechanism is not None:  # ZeroMQ retries; what the broker said stands
            self._from_mechanism()
        else:
            self._report(FAILED.format(who=self.who), refused=False)
            if self._probe is None:
                endpoint = msg["endpoint"].decode("utf-8", "replace")  # parse_monitor_message: bytes
                self._probe = asyncio.get_running_loop().create_task(self._ask_broker(endpoint))

    async def _ask_broker(self, endpoint: str) -> None:
        try:
            mechanism = await broker_mechanism(endpoint)
        except Exception:  # only a better sentence was at stake: ZeroMQ's reports still come
            log.debug("could not ask %s for its security mechanism", endpoint, exc_info=True)
            return
        if mechanism not in ("NULL", "CURVE") or self._closed or self.refused or not self.problem:
            return  # nothing to tell, or closed, or ZeroMQ has said meanwhile
        self._mechanism = mechanism
        self._from_mechanism()

    def _from_mechanism(self) -> None:
        if self._mechanism == "NULL":
            self._report(BROKER_PLAINTEXT.format(who=self.who), refused=True)
        else:  # a CURVE broker hung up on our handshake
            self._report(WRONG_BROKER_KEY.format(who=self.who), refused=False)

    def _report(self, problem: str, *, refused: bool) -> None:
        # ZeroMQ goes on retrying after the broker said it is plaintext: one refusal per socket
        new = problem != self.problem or refused != self.refused
        self.refused = refused
        if problem != self.problem:
            # a refusal handed to on_refused reaches the caller as an error: logged again, it printed
            # twice on a CLI client's terminal
            told = self.refused and self._on_refused is not None
            log.log(logging.INFO if told else logging.ERROR, "%s", problem, extra={"event": "curve_handshake_failed"})
        self.problem = problem
        if refused and new and self._on_refused is not None:
            self._on_refused(problem)

    def close(self) -> None:
        """Close the monitor's end (after, or instead of, closing the watched socket). Called
        again, it does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()  # its connection closes as it unwinds
        self._channel.close()


def watch_client(
    sock: zmq.Socket, who: str, on_refused: Callable[[str], None] | None = None
) -> HandshakeWatch | None:
    """A watch on `sock` when it connects to a broker as a CURVE client, else None. Plaintext
    clients are not watched: a monitor on every ipc socket of a process (a worker reconnecting
    with short heartbeats) intermittently left its next connection without any traffic."""
    return HandshakeWatch(sock, who, on_refused) if is_curve_client(sock) else None


