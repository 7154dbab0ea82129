"""A worker's connection to the broker: registration, heartbeats, typed sends.

Messages from the broker reach `handler(msg, payload)` on the loop. A BYE from the broker (it
restarted and does not know us, or it is shutting down) triggers re-registration; a broker that
stays silent for `liveness` heartbeats is treated as gone and the link reconnects with backoff.

Registering again ends the old registration: the broker drops whatever it had sent us when it
reads the REGISTER (and re-queues it, possibly to us again under the same ids), and takes
everything we send after the REGISTER for the new registration. So, before any REGISTER but the
first leaves, `on_register_again()` runs: the worker must drop its work in hand and make sure
nothing about it is ever sent again. Work that arrives between that REGISTER and its REGISTERED
was sent to the old registration and is dropped here. The hook runs again at every REGISTERED but
the first: where a slow broker answered an earlier REGISTER after we had sent the next one, the
work that came with that answer is the ended registration's too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import zmq

from epdq import protocol as P
from epdq.channel import Channel
from epdq.errors import ProtocolError
from epdq.handshake import HandshakeWatch, watch_client
from epdq.security import SecurityConfig
from epdq.transport import MAX_MESSAGE_BYTES_DEFAULT, make_socket

log = logging.getLogger("epdq.worker")


class BrokerLink:
    def __init__(
        self,
        address: str,
        register: P.Register,
        handler: Callable[[Any, list[Any]], None],
        *,
        heartbeat_s: float = 1.0,
        liveness: int = 5,
        ctx: zmq.Context | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES_DEFAULT,
        heartbeat: Callable[[], P.Heartbeat] | None = None,
        security: SecurityConfig | None = None,
        copy: bool = False,
        on_refused: Callable[[str], None] | None = None,
        on_register_again: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self.register = register
        self._handler = handler
        self._on_refused = on_refused  # called once the broker refuses this worker for good
        # The broker sends this worker's jobs (prompts, images) to this ZeroMQ identity, and a
        # connection presenting it takes the link over (ROUTER_HANDOVER, so a reconnect works): it
        # must not be guessable from the worker_id that `epdq status` shows to every client.
        self._routing_id = f"w-{secrets.token_hex(16)}".encode()
        # called just before every REGISTER but the first: the worker abandons its work in hand
        self._on_register_again = on_register_again
        self._registers_sent = 0
        # a REGISTER is out and its REGISTERED has not arrived: work now is the old registration's
        self._superseded = False
        self.stale_dropped = 0  # such work messages, dropped
        self.refused = ""
        self.registrations = 0
        self._security = security
        self._copy = copy  # receive bytes (small messages) instead of zero-copy frames
        self._make_heartbeat = heartbeat or P.Heartbeat
        self.rejected = 0  # malformed messages received
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self._ctx = ctx or zmq.Context.instance()
        self._max_bytes = max_message_bytes
        self._channel: Channel | None = None
        self._handshakes: HandshakeWatch | None = None
        self._last_heard = 0.0
        self._heard = False  # anything from the broker since the last (re)connect
        self._register_sent = -1e9  # monotonic time of the last REGISTER
        self._task: asyncio.Task | None = None
        self.registered = asyncio.Event()
        self._beat_now = asyncio.Event()
        self.closed = False
        self.reconnects = 0
        self.draining = ""  # the reason given to the broker; said again after a re-registration
        self.drain_acked = asyncio.Event()  # everything the broker sent before it knew has arrived

    def start(self) -> None:
        self._connect()
        self._task = asyncio.create_task(self._beat())

    def _connect(self) -> None:
        def watch(s: zmq.Socket) -> None:
            self._handshakes = watch_client(s, "worker")  # it logs a refused key or a wrong broker key

        sock = make_socket(
            self._ctx, zmq.DEALER, identity=self._routing_id, connect=self.address,
            max_message_bytes=self._max_bytes, security=self._security, before_connect=watch,
        )  # fmt: skip
        self._channel = Channel(sock, self._on_frames, copy=self._copy, coalesce=True)
        self._channel.start()
        self._last_heard = time.monotonic()
        self._heard = False
        self.registered.clear()
        self._send_register()

    def _send_register(self) -> None:
        if self._registers_sent:
            self._abandon_work()
        self._registers_sent += 1
        self.register.attempt = self._registers_sent
        self._superseded = True
        self._register_sent = time.monotonic()
        self.send(self.register)

    def _abandon_work(self) -> None:
        """Before a REGISTER other than the first (and before a reconnect): the broker treats what
        we send after it as the new registration's, so the old work must be gone, and silent, first."""
        if self._on_register_again is not None:
            try:
                self._on_register_again()
            except Exception:  # the REGISTER must still leave
                log.exception("failed to drop the work of the previous registration")

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            msg, payload = P.decode(frames, max_payload_frames=64)
        except ProtocolError as e:
            self.rejected += 1
            log.warning("ignored a malformed message from the broker: %s", e)
            return
        self._last_heard = time.monotonic()
        self._heard = True
        if isinstance(msg, P.Registered) and msg.attempt and msg.attempt != self._registers_sent:
            # a late answer to an earlier REGISTER: the registration it opened ends when the broker
            # reads our later one (it re-queues what it sent with it); the work in between is dropped
            log.debug("ignored the answer to REGISTER #%d (#%d is out)", msg.attempt, self._registers_sent)
        elif isinstance(msg, P.Registered):
            # NaN/inf/absurd intervals would kill or stall _beat (or make it spin/reconnect in a loop)
            if 0.01 <= msg.heartbeat_s <= 600.0:
                if msg.heartbeat_s < self.heartbeat_s:
                    self._beat_now.set()  # the beat loop sleeps the old, longer interval: cut it short
                self.heartbeat_s = msg.heartbeat_s
            else:
                self.rejected += 1
                log.warning(
                    "ignored heartbeat interval %r s from the broker; keeping %.3g s",
                    msg.heartbeat_s,
                    self.heartbeat_s,
                )
            if self.registrations and not msg.attempt:
                # nothing in hand as a rule (dropped at the REGISTER, and nothing taken since); but a
                # broker that does not say which REGISTER it answers may have answered an earlier one
                self._abandon_work()
            self.registered.set()
            self._superseded = False
            self.registrations += 1
            log.info("registered with broker %s as %s", self.address, self.register.worker_id)
            if self.draining:
                self.send(P.Drain(self.draining))
        elif isinstance(msg, P.Drain):
            self.drain_acked.set()
        elif isinstance(msg, P.Bye) and msg.refused:
            # another model, another release, a bad setting: registering again cannot help
            log.error("the broker refused this worker: %s", msg.reason, extra={"event": "refused"})
            self.registered.clear()
            self.refused = msg.reason or "refused"
            if self._on_refused is not None:
                self._on_refused(self.refused)
        elif isinstance(msg, P.Bye):
            if self.refused:
                return
            if msg.reason == P.BYE_SHUTTING_DOWN:
                # A REGISTER now would reach only the broker that is leaving, and then hold back the
                # one its successor asks for by up to 5 heartbeats (below): wait for that one.
                log.warning("the broker is shutting down; registering again with the next one")
                self.registered.clear()
                self._register_sent = -1e9
                return
            # Heartbeats queued while the broker was down reach a new broker together, and each
            # gets a BYE: one REGISTER answers them all (each further one would make the broker
            # drop this worker, and what it had just sent it, and register it again).
            if self.registered.is_set() or time.monotonic() - self._register_sent > self.heartbeat_s * self.liveness:
                log.warning("broker said bye (%s); registering again", msg.reason)
                self.registered.clear()
                self._send_register()
        elif isinstance(msg, P.Heartbeat):
            pass
        elif self._superseded:
            # sent before the broker read our REGISTER: to the registration it ended (it re-queued
            # this work, or failed it); doing it now would answer for the new one
            self.stale_dropped += 1
            log.debug("dropped %s sent to the previous registration", type(msg).__name__)
        else:
            try:
                self._handler(msg, payload)
            except Exception:
                self.rejected += 1
                log.exception("failed to handle %s from the broker", type(msg).__name__)

    async def _beat(self) -> None:
        backoff = self.heartbeat_s
        while not self.closed and not self.refused:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.heartbeat_s)
            self._beat_now.clear()
            if time.monotonic() - self._last_heard > self.heartbeat_s * self.liveness:
                why = self._handshakes.problem if self._handshakes is not None else ""
                log.warning("broker silent for %.1fs%s; reconnecting", time.monotonic() - self._last_heard,
                            f" ({why})" if why else "")  # fmt: skip
                self._close_channel()
                if self._registers_sent:
                    self._abandon_work()  # not after the backoff: it may take 32 s
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 32.0)
                self.reconnects += 1
                self._connect()
                continue
            if self._heard:  # reset only by an answer: a reconnect alone must not (it doubles)
                backoff = self.heartbeat_s
            self.send(self._make_heartbeat())

    def _close_channel(self, linger_ms: int = 0) -> None:
        if self._channel is not None:
            self._channel.close(linger_ms=linger_ms)
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None

    def drain(self, reason: str) -> None:
        """Ask the broker to send nothing new. Its answer (`drain_acked`) comes after everything
        it had already sent, so once it is here no more work can arrive."""
        self.draining = reason[:200] or "draining"
        self.drain_acked.clear()
        self.send(P.Drain(self.draining))

    def send(self, msg: Any, payload: list[Any] = (), *, copy: bool = True) -> None:
        if self._channel is None or self._channel.closed:
            return
        if self._handshakes is not None and self._handshakes.refused:
            return  # ZeroMQ gave this connection up: nothing would leave (the next reconnect retries)
        self._channel.send(P.encode(msg) + list(payload), copy=copy)

    def flush(self) -> None:
        """Send what is queued now instead of at the end of this loop turn."""
        if self._channel is not None and not self._channel.closed:
            self._channel.flush()

    def close(self, reason: str = "shutdown") -> None:
        if self.closed:
            return
        self.closed = True
        if self._task is not None:
            self._task.cancel()
        if self._channel is not None:
            try:
                self.send(P.Bye(reason))
            except zmq.ZMQError:
                pass
            self._close_channel(linger_ms=200)
