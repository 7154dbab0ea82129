"""The broker: one ROUTER socket for clients and workers, the scheduler behind it.

This module does the I/O: it decodes and validates messages, hashes image bytes, feeds events to
the pure `Scheduler` and turns its decisions into messages. It never imports torch, transformers
or vLLM; it handles bytes, hashes and references, never tensor contents.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from epdq import protocol as P
from epdq.channel import Channel, PeerUnreachable
from epdq.cpus import check_cpus
from epdq.errors import BusyError, ConfigError, EpdqError, InvalidInputError, ProtocolError
from epdq.jobs import Fail, Request, Role, SendAbort, SendEncode, SendPin, SendPrefill, SendUnpin
from epdq.keys import security_for
from epdq.media import MAX_IMAGE_BYTES_LIMIT, image_key, sniff_format
from epdq.metrics import Histogram, MetricsServer, render_broker_metrics
from epdq.scheduler import Scheduler, SchedulerConfig
from epdq.security import WORKER_KEY_GLOB, authenticator_for, curve_required, load_worker_keys
from epdq.transport import (
    MAX_MESSAGE_BYTES_DEFAULT,
    bound_endpoint,
    endpoint_problem,
    host_port_problem,
    make_socket,
)

log = logging.getLogger("epdq.broker")

_ZERO_COPY_BYTES = 64 * 1024  # smaller payloads are copied by ZeroMQ anyway
# Messages (one per peer per loop turn, batched) queued for a peer whose connection does not take
# them: a worker or client that stopped reading is cut off here, as if it had disconnected, rather
# than growing the broker's memory without end. A reading peer's ZeroMQ I/O thread keeps taking
# them even while its event loop is busy, so only a stopped or unreachable one ever gets near it.
PEER_SEND_HWM = 10_000
# Entries named in one PIN or UNPIN (an EntryId packs to ~25 bytes): a ring under pressure may release
# a great many at once, and one message must stay far below protocol.MAX_HEADER_BYTES.
ENTRIES_PER_MESSAGE = 4096
# Lost request ids a PONG names at most (the client learns of the others at its next pings): a PONG
# echoes what the PING listed, and the ids of a client that never reads would pile up here.
MAX_PONG_UNKNOWN = 256
# A connection's STATS requests are answered at most once per this interval; those that come
# sooner are answered together at the next tick, by one reply carrying the latest nonce (the
# client resolves every earlier request of that connection with it). A STATS reply is hundreds
# of times the size of its request: answered one for one, a client that sent requests without
# reading made the broker hold ~10,000 replies per message allowed in its send queue.
STATS_INTERVAL_S = 0.05
# The slowest link a client's upload is allowed for (the client's own allowance is the same; see
# client.py): a large request holds the client's pings back for as long as it takes to arrive.
SLOWEST_LINK_BPS = 20e6


@dataclass(slots=True)
class BrokerConfig:
    address: str = "tcp://127.0.0.1:7700"
    max_queued_requests: int = 1024
    max_held_image_bytes: int = 2**30  # image files held for live requests; beyond it: busy
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 2**20
    default_timeout_s: float = 120.0
    max_timeout_s: float = 3600.0
    heartbeat_s: float = 1.0
    liveness: int = 5  # heartbeats a worker may miss before it is declared dead
    busy_retry_after_s: float = 0.5
    client_liveness_s: float = 10.0  # a client with live requests silent this long is gone
    encode_lease_s: float = 60.0  # an encode job not finished in this time is re-queued
    # an encoder is told a ring entry is free this long after the last request that used it ends
    # (at the next tick): an image asked for again meanwhile costs the encoder no message
    unpin_delay_s: float = 0.05
    # cache-key scope; when empty, adopted from the first encoder (and from the next one once every
    # encoder of that scope has left); when set, encoders of any other scope are refused
    scope: str = ""
    metrics_address: str = ""  # HOST:PORT for Prometheus /metrics and /health; empty = off
    keys_dir: str = ""  # CURVE keys (see epdq.keys); empty = the default directory if it exists
    insecure: bool = False  # plaintext tcp, allowed on loopback only
    # one log line per request end (done or failed) with its id and timings; dispatch at debug
    # level. Off for benchmarks of the broker itself, as vLLM's --disable-log-requests.
    log_requests: bool = True
    # SIGTERM: refuse new requests (busy) and let those in flight finish, for at most this long
    drain_timeout_s: float = 30.0
    # CPUs this process (its ZeroMQ I/O thread included) runs on; empty: wherever the kernel puts
    # it (see epdq.cpus)
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.cpus = check_cpus(self.cpus)
        problem = endpoint_problem(self.address) or (
            host_port_problem(self.metrics_address, "metrics_address") if self.metrics_address else None
        )
        if problem:
            raise ValueError(problem)
        if not 1 <= self.max_images_per_request <= 64:
            raise ValueError("max_images_per_request must be in [1, 64]")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_held_image_bytes < 1:
            raise ValueError(f"max_held_image_bytes must be >= 1, got {self.max_held_image_bytes}")
        if not 1024 <= self.max_image_bytes <= MAX_IMAGE_BYTES_LIMIT:
            # the broker forwards images to workers, whose links take frames up to that size
            raise ValueError(f"max_image_bytes must be in [1024, {MAX_IMAGE_BYTES_LIMIT}] "
                             f"(images are forwarded to workers in frames of at most {MAX_MESSAGE_BYTES_DEFAULT >> 20} MiB)")  # fmt: skip
        # written as "not (valid)" so that NaN (from `--timeout nan`) fails too
        if not 0 < self.max_timeout_s <= 86400:
            raise ValueError("max_timeout_s must be in (0, 86400]")
        if not 0 < self.default_timeout_s <= self.max_timeout_s:
            raise ValueError(f"default_timeout_s must be in (0, {self.max_timeout_s:g}] s, got {self.default_timeout_s}")
        if not 0.01 <= self.heartbeat_s <= 600:
            raise ValueError(f"heartbeat_s must be in [0.01, 600] s, got {self.heartbeat_s}")
        if self.liveness < 1:
            raise ValueError(f"liveness must be >= 1 (missed heartbeats), got {self.liveness}")
        if not 0 < self.client_liveness_s <= 86400:
            raise ValueError(f"client_liveness_s must be in (0, 86400] s, got {self.client_liveness_s}")
        if not 0 < self.encode_lease_s <= 86400:
            raise ValueError(f"encode_lease_s must be in (0, 86400] s, got {self.encode_lease_s}")
        if not 0 <= self.unpin_delay_s <= 60:
            raise ValueError(f"unpin_delay_s must be in [0, 60] s, got {self.unpin_delay_s}")
        if not 0 <= self.busy_retry_after_s <= 3600:
            raise ValueError("busy_retry_after_s must be in [0, 3600]")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError("drain_timeout_s must be in [0, 3600]")


@dataclass(slots=True)
class _Peer:
    worker_id: str
    identity: bytes
    role: Role
    scope: str
    last_seen: float
    register: P.Register
    beat: P.Heartbeat | None = None


class Broker:
    def __init__(self, config: BrokerConfig | None = None, *, ctx: zmq.Context | None = None):
        self.cfg = config or BrokerConfig()
        self._ctx = ctx or zmq.Context.instance()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_queued_requests=self.cfg.max_queued_requests,
                max_held_image_bytes=self.cfg.max_held_image_bytes,
                busy_retry_after_s=self.cfg.busy_retry_after_s,
                max_timeout_s=self.cfg.max_timeout_s,
                encode_lease_s=self.cfg.encode_lease_s,
                unpin_delay_s=self.cfg.unpin_delay_s,
            )
        )
        self.broker_id = uuid.uuid4().hex
        self.hist = {
            "encode": Histogram("epdq_encode_seconds", "Vision encoder time per image (encoder-reported)."),
            "ttft": Histogram("epdq_ttft_seconds", "Admission to first token, at the broker."),
            "tpot": Histogram("epdq_tpot_seconds", "Mean time per output token after the first."),
            "queue": Histogram("epdq_queue_seconds", "Ready for prefill to handed to a PD worker."),
            "e2e": Histogram("epdq_request_seconds", "Admission to the last token."),
        }
        self._metrics: MetricsServer | None = None
        self.scope = self.cfg.scope
        self.workers: dict[bytes, _Peer] = {}  # by socket identity
        self._by_id: dict[str, _Peer] = {}
        # client identity -> live request ids, oldest first (insertion-ordered: a disconnect cancels
        # them in the order they came, the same from one run to the next)
        self._clients: dict[bytes, dict[str, None]] = {}
        self._client_seen: dict[bytes, float] = {}
        self.counters = {"protocol_errors": 0, "messages_in": 0, "refused_registrations": 0}
        self.channel: Channel | None = None
        self._allow_dir: Path | None = None  # CURVE: where the worker keys are
        self._refused_keys: set[str | None] = set()
        self._stats_due: dict[bytes, int] = {}  # identity -> latest nonce to answer at the next tick
        self._stats_at: dict[bytes, float] = {}  # identity -> when it was last answered
        self.endpoint = ""
        self._stop = asyncio.Event()
        self.started_at = time.monotonic()
        self.draining = False  # SIGTERM: new requests are refused while those in flight finish

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> str:
        security = security_for("broker", keys_dir=self.cfg.keys_dir, insecure=self.cfg.insecure)
        # A frame over ZeroMQ's cap drops the sender's connection, and its request is lost
        # without a word: the cap admits every image an epdq client sends (its own limit), so an
        # image over OUR limit gets a typed error from _validate_submit instead.
        frame_cap = MAX_IMAGE_BYTES_LIMIT + (1 << 20)
        sock = make_socket(
            self._ctx, zmq.ROUTER, bind=self.cfg.address, max_message_bytes=frame_cap, security=security,
            send_hwm=PEER_SEND_HWM,
        )  # fmt: skip
        # CURVE: every allowed key may send requests, only worker keys may register workers (a client
        # key that registered would be sent other clients' prompts and images, and could answer them)
        curve = curve_required(self.cfg.address, security)
        self._allow_dir = security.allow_dir if curve else None
        self.channel = Channel(
            sock, self._on_frames, on_error=self._on_handler_error, coalesce=True,
            on_unreachable=self._peer_unreachable, peer_keys=curve,
        )  # fmt: skip
        self.endpoint = bound_endpoint(sock)
        return self.endpoint

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        if self.channel is None:
            self.bind()
        assert self.channel is not None
        timer = None
        try:
            if self.cfg.metrics_address:  # before anyone is told we are ready: it can fail
                host, _, port = self.cfg.metrics_address.rpartition(":")
                # [::1]:9090 names an IPv6 host as URLs do; the socket wants it bare (as the gateway's --host)
                host = host[1:-1] if host.startswith("[") and host.endswith("]") else host or "127.0.0.1"
                # a draining broker is not ready: load balancers stop sending clients to it
                self._metrics = MetricsServer(self.render_metrics, self._unready_reason)
                try:
                    bound = await self._metrics.start(host, int(port))
                except (OSError, ValueError) as e:
                    raise ConfigError(f"cannot serve metrics on {self.cfg.metrics_address}: {e}") from None
                log.info("metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, bound)
            self.channel.start()
            log.info("broker listening on %s", self.endpoint)
            if ready is not None:
                ready.set()
            timer = asyncio.create_task(self._tick())
            await self._stop.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if self._metrics is not None:
                self._metrics.close()
            for peer in list(self.workers.values()):
                self._send(peer.identity, P.Bye(P.BYE_SHUTTING_DOWN))
            # linger: the BYEs must leave (a draining worker then stops waiting for us at once)
            self.channel.close(linger_ms=200)
            auth = authenticator_for(self._ctx)
            if auth is not None:
                auth.stop()

    def stop(self) -> None:
        self._stop.set()

    async def drain(self, timeout_s: float, stop_now: asyncio.Event) -> None:
        """Before a planned stop: refuse new requests (BusyError: a client retries, by then against
        the broker that replaces this one) and wait until those in flight have ended, for at most
        `timeout_s`; `stop_now` cuts it short. What is still in flight then is lost, as in a crash."""
        if timeout_s <= 0 or stop_now.is_set():
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        log.info("draining: new requests are refused (busy); waiting for the %d in flight (at most %.0f s; "
                 "a second signal stops at once)", len(self.scheduler.requests), timeout_s)  # fmt: skip
        while self.scheduler.requests:
            if stop_now.is_set():
                log.warning("drain cut short with %d requests in flight", len(self.scheduler.requests))
                return
            if loop.time() >= end:
                log.warning("drain timed out with %d requests in flight", len(self.scheduler.requests))
                return
            await asyncio.sleep(0.05)
        log.info("drained: no request in flight")

    async def _tick(self) -> None:
        hb = P.encode(P.Heartbeat())
        last_hb = 0.0
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(min(0.05, self.cfg.heartbeat_s / 4))
            now = time.monotonic()
            if now - last_tick > self.cfg.heartbeat_s:
                self._forgive_stall(now, now - last_tick)
            last_tick = now
            self.scheduler.expire()
            if self._stats_due:
                self._answer_stats_due(now)
            if now - last_hb >= self.cfg.heartbeat_s:
                last_hb = now
                dead = now - self.cfg.heartbeat_s * self.cfg.liveness
                self._expire_clients(now)
                for peer in list(self.workers.values()):
                    if peer.last_seen < dead:
                        log.warning("worker %s missed %d heartbeats", peer.worker_id, self.cfg.liveness)
                        self._drop_worker(peer, "missed heartbeats")
                    else:
                        self._send_raw(peer.identity, hb)  # a vanished worker is dropped on send
            self._flush()

    def _forgive_stall(self, now: float, stalled_s: float) -> None:
        """This process did not run for `stalled_s` (SIGSTOP, swapping, a debugger): what its peers
        sent meanwhile is still unread, so their silence says nothing. Judge them from now on."""
        log.warning("the broker did not run for %.1f s (paused or starved); peers are judged from now on",
                    stalled_s, extra={"event": "broker_stalled", "seconds": round(stalled_s, 3)})  # fmt: skip
        for peer in self.workers.values():
            peer.last_seen = max(peer.last_seen, now)
        for client in self._client_seen:
            self._client_seen[client] = max(self._client_seen[client], now)

    def client_silence_s(self) -> float:
        """How long a client with live requests may go unheard before it counts as gone: its
        pings queue behind a request it is still uploading (ZeroMQ hands a message over whole), so
        the largest request this broker accepts, at the slowest link a client allows for (a CURVE
        link at 20 MB/s), comes on top of `client_liveness_s`."""
        largest = self.cfg.max_images_per_request * self.cfg.max_image_bytes
        return self.cfg.client_liveness_s + largest / SLOWEST_LINK_BPS

    def _expire_clients(self, now: float) -> None:
        silence = self.client_silence_s()
        gone = now - silence
        for client in [c for c in self._clients if self._client_seen.get(c, now) < gone]:
            rids = self._clients.pop(client)
            self._client_seen.pop(client, None)
            log.warning("client silent for %.0fs: cancelling its %d requests", silence, len(rids))
            for rid in rids:
                self.scheduler.cancel(rid, client)

    # ------------------------------------------------------------ receive

    def _on_handler_error(self, exc: BaseException) -> None:
        self.counters["protocol_errors"] += 1
        log.exception("broker failed to handle a message", exc_info=exc)

    def _on_frames(self, frames: list[Any]) -> None:
        self.counters["messages_in"] += 1
        if len(frames) < 3:
            self.counters["protocol_errors"] += 1
            return
        identity = bytes(frames[0])
        try:
            # the frame cap is the protocol's hard limit; the configured image limit is a typed
            # answer to the client in _validate_submit
            msg, payload = P.decode(frames[1:], max_payload_frames=P.MAX_PAYLOAD_FRAMES)
        except ProtocolError as e:
            self.counters["protocol_errors"] += 1
            log.debug("rejected message from %r: %s", identity[:16], e)
            return
        peer = self.workers.get(identity)
        if peer is not None:
            peer.last_seen = time.monotonic()
        elif identity in self._clients:
            self._client_seen[identity] = time.monotonic()
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            self.counters["protocol_errors"] += 1
            return
        handler(self, identity, peer, msg, payload)
        if self.scheduler.has_actions():
            self._flush()

    # client messages

    def _on_submit(self, identity: bytes, peer: _Peer | None, msg: P.Submit, payload: list[Any]) -> None:
        rid = msg.request_id
        try:
            self._validate_submit(msg, payload)
            timeout = msg.timeout_s if msg.timeout_s > 0 else self.cfg.default_timeout_s
            keys = [image_key(self.scope, memoryview(f)) for f in payload] if msg.route != "colocated" else []
            self.scheduler.submit(rid, identity, keys, payload, timeout, msg, msg.route)
        except EpdqError as e:
            if isinstance(e, InvalidInputError):  # the scheduler counts those it fails later (bad images)
                self.scheduler.counters["invalid_requests"] += 1
            if self.cfg.log_requests:
                self._log_failed(rid[:128], e, None)
            self._send(identity, P.Error(rid, e.code, e.message, getattr(e, "retry_after", 0.0)))
            return
        self._clients.setdefault(identity, {})[rid] = None
        self._client_seen[identity] = time.monotonic()

    def _validate_submit(self, msg: P.Submit, payload: list[Any]) -> None:
        if self.draining:
            self.scheduler.counters["busy_rejections"] += 1  # as the scheduler counts its own refusals
            raise BusyError("the broker is shutting down", retry_after=max(1.0, self.cfg.busy_retry_after_s))
        if not 1 <= len(msg.request_id) <= 128:
            raise InvalidInputError("request_id must be 1..128 characters")
        if msg.n_images > self.cfg.max_images_per_request:
            raise InvalidInputError(f"{msg.n_images} images (limit {self.cfg.max_images_per_request} per request)")
        try:
            P.validate_messages(msg.messages, msg.n_images)
        except ProtocolError as e:
            raise InvalidInputError(e.message) from None
        try:
            P.validate_sampling(msg.sampling)
        except ProtocolError as e:
            raise InvalidInputError(e.message) from None
        if msg.timeout_s < 0:
            raise InvalidInputError("timeout must be >= 0 (0 = broker default)")
        for i, f in enumerate(payload):
            n = memoryview(f).nbytes
            if n == 0:
                raise InvalidInputError(f"image {i} is empty")
            if n > self.cfg.max_image_bytes:
                raise InvalidInputError(f"image {i} is {n} bytes (limit {self.cfg.max_image_bytes})")
            if sniff_format(memoryview(f)[:64]) is None:
                raise InvalidInputError(f"image {i} is not a supported image format")

    def _on_cancel(self, identity: bytes, peer: _Peer | None, msg: P.Cancel, payload: list[Any]) -> None:
        cancelled = self.scheduler.cancel(msg.request_id, identity)
        if cancelled:
            self._forget_client_request(identity, msg.request_id)  # no Fail follows a cancel
        if cancelled and self.cfg.log_requests:
            log.info("request %s cancelled by the client", msg.request_id,
                     extra={"request_id": msg.request_id, "event": "request_cancelled"})  # fmt: skip

    def _on_ping(self, identity: bytes, peer: _Peer | None, msg: P.Ping, payload: list[Any]) -> None:
        held = self._clients.get(identity, ())
        unknown = [rid for rid in msg.request_ids if rid not in held][:MAX_PONG_UNKNOWN]
        self._send(identity, P.Pong(msg.nonce, self.broker_id, unknown, P.PROTOCOL_VERSION))

    def _on_stats(self, identity: bytes, peer: _Peer | None, msg: P.StatsRequest, payload: list[Any]) -> None:
        now = time.monotonic()
        if identity in self._stats_due or now - self._stats_at.get(identity, -STATS_INTERVAL_S) < STATS_INTERVAL_S:
            self._stats_due[identity] = msg.nonce
            return
        if len(self._stats_at) >= 1024:  # only the last interval matters: forget the others
            self._stats_at = {i: t for i, t in self._stats_at.items() if now - t < STATS_INTERVAL_S}
        self._stats_at[identity] = now
        self._send(identity, self.stats(msg.nonce))

    def _answer_stats_due(self, now: float) -> None:
        due, self._stats_due = self._stats_due, {}
        for identity, nonce in due.items():
            self._stats_at[identity] = now
            self._send(identity, self.stats(nonce))

    def stats(self, nonce: int = 0) -> P.Stats:
        s = self.scheduler
        counters = dict(s.counters) | self.counters
        gauges = s.gauges()
        workers = []
        by_role = dict.fromkeys((r.value for r in Role), 0)
        for w in s.workers.values():
            by_role[w.role.value] += 1
            peer = self._by_id.get(w.worker_id)
            beat = peer.beat if peer is not None and peer.beat is not None else P.Heartbeat()
            workers.append(
                P.WorkerInfo(
                    w.worker_id, w.role.value, w.node, w.capacity, len(w.inflight), w.ring_capacity,
                    beat.ring_used, beat.ring_pinned, beat.ring_entries, w.draining,
                )
            )  # fmt: skip
        gauges |= {f"workers_{k}": float(v) for k, v in by_role.items()}
        gauges["workers_draining"] = float(sum(w.draining for w in workers))
        gauges["broker_draining"] = float(self.draining)
        gauges["uptime_s"] = time.monotonic() - self.started_at
        gauges["clients"] = float(len(self._clients))
        return P.Stats(nonce, counters, gauges, workers)

    def _unready_reason(self) -> str | None:
        if self.draining:
            return "draining: the broker is shutting down"
        return None if self.scheduler.workers else "no workers"

    def render_metrics(self) -> str:
        return render_broker_metrics(self.stats(), self.hist.values())

    # worker messages

    def _on_register(self, identity: bytes, peer: _Peer | None, msg: P.Register, payload: list[Any]) -> None:
        if self._allow_dir is not None and not self._is_worker_key(self.channel.peer_key):
            self.counters["refused_registrations"] += 1
            key = self.channel.peer_key
            if key not in self._refused_keys and len(self._refused_keys) < 1024:  # once per key: no log flood
                self._refused_keys.add(key)
                log.warning("refused to register %r: its CURVE key %s is not a worker key (%s/%s)",
                            msg.worker_id[:64], key, self._allow_dir, WORKER_KEY_GLOB)  # fmt: skip
            self._send(identity, P.Bye(
                f"this key may not register workers: only keys in the broker's {WORKER_KEY_GLOB} allow files "
                "may (start workers with the cluster's worker.key_secret)", refused=True,
            ))  # fmt: skip
            return
        try:
            role = Role(msg.role)
        except ValueError:
            self.counters["protocol_errors"] += 1
            self._send(identity, P.Bye(f"unknown role {msg.role[:16]!r}", refused=True))
            return
        if msg.protocol_version != P.PROTOCOL_VERSION:
            self._send(identity, P.Bye(f"protocol version {msg.protocol_version} != {P.PROTOCOL_VERSION}", refused=True))
            return
        if not 1 <= msg.capacity <= 4096 or not 1 <= len(msg.worker_id) <= 128 or not 1 <= len(msg.node) <= 128:
            self._send(identity, P.Bye("capacity must be in [1, 4096], worker_id and node 1..128 characters", refused=True))
            return
        if role is Role.ENCODER:
            if self.scope and not self.cfg.scope and msg.scope != self.scope and not any(
                p.role is Role.ENCODER and p.worker_id != msg.worker_id for p in self.workers.values()
            ):
                # every encoder of the old model is gone (a model upgrade): the new one sets the scope,
                # rather than a broker refusing every encoder until it is restarted
                log.warning("model scope changes from %s to %s (no encoder of the old one is left)", self.scope,
                            msg.scope, extra={"event": "scope_changed"})  # fmt: skip
                self.scope = msg.scope
            if not self.scope:
                self.scope = msg.scope
            elif msg.scope != self.scope:
                log.error(
                    "refusing encoder %s: scope %s differs from %s", msg.worker_id, msg.scope, self.scope
                )
                self._send(
                    identity, P.Bye(f"model scope {msg.scope!r} differs from the broker's {self.scope!r}", refused=True)
                )
                return
        old = self._by_id.get(msg.worker_id)
        if old is not None:
            self._drop_worker(old, "re-registered")
        if peer is not None:
            self._drop_worker(peer, "re-registered")
        p = _Peer(msg.worker_id, identity, role, msg.scope, time.monotonic(), msg)
        self.workers[identity] = p
        self._by_id[msg.worker_id] = p
        self._send(identity, P.Registered(msg.worker_id, self.cfg.heartbeat_s, msg.attempt))
        log.info(
            "worker %s registered: role=%s node=%s capacity=%d",
            msg.worker_id,
            role.value,
            msg.node,
            msg.capacity,
        )
        self.scheduler.add_worker(msg.worker_id, role, msg.node, msg.capacity, msg.ring_capacity)

    def _is_worker_key(self, key: str | None) -> bool:
        if key is None:
            return False
        try:  # read at each registration (rare), so a key added or removed counts at once
            return key.encode() in load_worker_keys(self._allow_dir)
        except ConfigError as e:
            log.error("cannot read the worker keys: %s", e)
            return False

    def _require_worker(self, identity: bytes, peer: _Peer | None) -> bool:
        if peer is None:
            # Majordomo-style: a worker we do not know (e.g. after a broker restart) must register
            self._send(identity, P.Bye("unknown worker: register again"))
            return False
        return True

    def _on_heartbeat(
        self, identity: bytes, peer: _Peer | None, msg: P.Heartbeat, payload: list[Any]
    ) -> None:
        if self._require_worker(identity, peer):
            peer.beat = msg  # encoders report their ring occupancy here

    def _on_bye(self, identity: bytes, peer: _Peer | None, msg: P.Bye, payload: list[Any]) -> None:
        if peer is not None:
            self._drop_worker(peer, f"left ({msg.reason[:64]})")

    def _on_drain(self, identity: bytes, peer: _Peer | None, msg: P.Drain, payload: list[Any]) -> None:
        if not self._require_worker(identity, peer):
            return
        # the answer follows everything already decided for this worker (one ordered connection)
        if self.scheduler.has_actions():
            self._flush()
        self._send(identity, P.Drain("ack"))
        if self.scheduler.drain_worker(peer.worker_id):
            w = self.scheduler.workers[peer.worker_id]
            log.info("worker %s draining (%s): %d in flight, nothing new is sent to it", peer.worker_id,
                     msg.reason[:64], len(w.inflight),
                     extra={"event": "worker_draining", "worker": peer.worker_id})  # fmt: skip

    def _on_encoded(self, identity: bytes, peer: _Peer | None, msg: P.Encoded, payload: list[Any]) -> None:
        if not self._require_worker(identity, peer):
            return
        ref = msg.ref
        # never trust where a worker claims its bytes live: they must be in its own ring
        reg = peer.register
        if (
            peer.role is not Role.ENCODER or ref.encoder_id != peer.worker_id or ref.segment != reg.ring_segment
            or ref.offset < 0 or ref.nbytes <= 0 or ref.offset + ref.nbytes > reg.ring_capacity
            or len(ref.grid) != 3 or len(ref.shape) != 2
        ):  # fmt: skip
            self.counters["protocol_errors"] += 1
            self.scheduler.on_encode_failed(
                peer.worker_id, msg.job_id, "internal", "encoder sent an invalid entry"
            )
            return
        # The registration's own objects, and one string per dtype name: the embedding index keeps
        # every ref for as long as its entry is resident (up to a ring's worth per encoder), and
        # decoded copies of these strings made up a third of an entry's memory.
        ref.encoder_id, ref.segment = peer.worker_id, reg.ring_segment
        ref.dtype = _DTYPE_NAMES.get(ref.dtype, ref.dtype)
        ref.node = reg.node
        ref.fetch_endpoint = reg.fetch_endpoint
        ref.ring_kind, ref.cuda_ring = reg.ring_kind, reg.cuda_ring  # a CUDA ring's IPC handle, from REGISTER
        self.hist["encode"].observe(msg.encode_s)
        self.scheduler.on_encoded(peer.worker_id, msg.job_id, ref)

    def _on_encode_failed(
        self, identity: bytes, peer: _Peer | None, msg: P.EncodeFailed, payload: list[Any]
    ) -> None:
        if self._require_worker(identity, peer):
            self.scheduler.on_encode_failed(peer.worker_id, msg.job_id, msg.code, msg.message)

    def _on_evicted(self, identity: bytes, peer: _Peer | None, msg: P.Evicted, payload: list[Any]) -> None:
        if self._require_worker(identity, peer):
            self.scheduler.on_evicted(peer.worker_id, msg.entries)

    def _on_ring_blocked(self, identity: bytes, peer: _Peer | None, msg: P.RingBlocked, payload: list[Any]) -> None:
        if self._require_worker(identity, peer):
            self.scheduler.on_ring_blocked(peer.worker_id, msg.job_id, msg.nbytes)

    def _on_tokens(self, identity: bytes, peer: _Peer | None, msg: P.Tokens, payload: list[Any]) -> None:
        if not self._require_worker(identity, peer):
            return
        finished = msg.finish_reason is not None
        req = self.scheduler.on_tokens(peer.worker_id, msg.request_id, finished)
        if req is None:
            return
        now = self.scheduler.clock()
        if msg.token_ids and not req.first_token_at:
            req.first_token_at = now
            self.hist["ttft"].observe(now - req.admitted_at)
        req.tokens += len(msg.token_ids)
        if finished:
            self.hist["e2e"].observe(now - req.admitted_at)
            self.hist["queue"].observe(req.dispatched_at - (req.ready_at or req.dispatched_at))
            if req.tokens > 1:
                self.hist["tpot"].observe((now - req.first_token_at) / (req.tokens - 1))
            msg.timings = _timings(req)
            self._forget_client_request(req.client, req.rid)
            if self.cfg.log_requests:
                self._log_done(req, msg, now)
        self._send(req.client, msg)

    def _on_pd_failed(self, identity: bytes, peer: _Peer | None, msg: P.PdFailed, payload: list[Any]) -> None:
        if self._require_worker(identity, peer):
            self.scheduler.on_pd_failed(peer.worker_id, msg.request_id, msg.code, msg.message, msg.stale)

    # ------------------------------------------------------------ send

    def _flush(self) -> None:
        for a in self.scheduler.take_actions():
            kind = type(a)
            if kind is SendEncode:
                self._send_worker(a.worker_id, P.Encode(a.job.job_id, a.job.key), [a.job.image])
            elif kind is SendPrefill:
                self._send_prefill(a.worker_id, a.request, a.refs)
            elif kind is SendPin or kind is SendUnpin:
                make = P.Pin if kind is SendPin else P.Unpin
                for i in range(0, len(a.entries), ENTRIES_PER_MESSAGE):
                    self._send_worker(a.worker_id, make(a.entries[i : i + ENTRIES_PER_MESSAGE]))
            elif isinstance(a, SendAbort):
                self._send_worker(a.worker_id, P.Abort(a.rid))
            elif isinstance(a, Fail):
                self._forget_client_request(a.client, a.rid)
                e = a.error
                if self.cfg.log_requests:
                    self._log_failed(a.rid, e, a.request)
                self._send(a.client, P.Error(a.rid, e.code, e.message, getattr(e, "retry_after", 0.0)))

    # ------------------------------------------------------------ request log

    def _log_done(self, req: Request, msg: P.Tokens, now: float) -> None:
        t = msg.timings
        ttft = req.first_token_at - req.admitted_at if req.first_token_at else -1.0
        log.info(
            "request %s done: %s, %d prompt + %d tokens (%s), %d images (%d cached), encode %.3f s, "
            "queue %.3f s, ttft %.3f s, total %.3f s, on %s", req.rid, req.route, msg.prompt_tokens, req.tokens,
            msg.finish_reason, t.images, t.cache_hits, t.encode_s, t.queue_s, ttft, now - req.admitted_at,
            req.worker,
            extra={"request_id": req.rid, "event": "request_done", "route": req.route, "tokens": req.tokens,
                   "prompt_tokens": msg.prompt_tokens, "finish_reason": msg.finish_reason, "images": t.images,
                   "cache_hits": t.cache_hits,
                   "encode_s": round(t.encode_s, 6), "queue_s": round(t.queue_s, 6),
                   "ttft_s": round(ttft, 6), "total_s": round(now - req.admitted_at, 6), "worker": req.worker},
        )  # fmt: skip

    def _log_failed(self, rid: str, e: EpdqError, req: Request | None) -> None:
        # the client's own doing (or load shedding, which can come in floods) is not a warning
        level = {"busy": logging.DEBUG, "invalid_input": logging.INFO, "cancelled": logging.INFO}.get(
            e.code, logging.WARNING
        )
        if not log.isEnabledFor(level):
            return
        age = self.scheduler.clock() - req.admitted_at if req is not None else 0.0
        log.log(
            level, "request %s failed: %s: %s (after %.3f s)", rid, e.code, e.message, age,
            extra={"request_id": rid, "event": "request_failed", "code": e.code, "seconds": round(age, 6),
                   "worker": req.worker if req is not None else None},
        )  # fmt: skip

    def _send_prefill(self, worker_id: str, req: Request, refs: list[P.EmbedRef]) -> None:
        if self.cfg.log_requests and log.isEnabledFor(logging.DEBUG):
            log.debug("request %s -> %s (%d embeddings)", req.rid, worker_id, len(refs),
                      extra={"request_id": req.rid, "event": "dispatched", "worker": worker_id})  # fmt: skip
        sub: P.Submit = req.payload
        remaining = max(0.001, req.deadline - self.scheduler.clock())
        images = req.images if req.route == "colocated" else []
        msg = P.Prefill(req.rid, sub.messages, sub.sampling, remaining, refs, len(images))
        self._send_worker(worker_id, msg, images)

    def _send_worker(self, worker_id: str, msg: Any, payload: list[Any] = ()) -> None:
        peer = self._by_id.get(worker_id)
        if peer is None:
            return
        self._send(peer.identity, msg, payload)

    def _send(self, identity: bytes, msg: Any, payload: list[Any] = ()) -> bool:
        return self._send_raw(identity, P.encode(msg), payload)

    def _send_raw(self, identity: bytes, frames: list[Any], payload: list[Any] = ()) -> bool:
        """Queue a message (sent, batched per peer, at the end of this loop turn)."""
        assert self.channel is not None
        big = False
        if payload:
            big = sum(memoryview(f).nbytes for f in payload) >= _ZERO_COPY_BYTES
        try:
            self.channel.send([identity, *frames, *payload], copy=not big)
        except PeerUnreachable:
            self._peer_unreachable(identity)
            return False
        return True

    def _peer_unreachable(self, identity: bytes) -> None:
        """ZeroMQ has no pipe to this peer any more: it disconnected (or died)."""
        peer = self.workers.get(identity)
        if peer is not None:
            self._drop_worker(peer, "unreachable (disconnected)")
        elif identity in self._clients:
            for rid in list(self._clients.pop(identity, ())):
                self.scheduler.cancel(rid, identity)  # client gone: its work is aborted
            self._client_seen.pop(identity, None)
        self._flush()

    def _drop_worker(self, peer: _Peer, reason: str) -> None:
        if self.workers.get(peer.identity) is peer:
            del self.workers[peer.identity]
        if self._by_id.get(peer.worker_id) is peer:
            del self._by_id[peer.worker_id]
            w = self.scheduler.workers.get(peer.worker_id)
            planned = w is not None and w.draining and not w.inflight  # a drain that ended as it should
            log.log(logging.INFO if planned else logging.WARNING, "worker %s removed: %s", peer.worker_id, reason)
            self.scheduler.remove_worker(peer.worker_id, reason)

    def _forget_client_request(self, client: bytes, rid: str) -> None:
        live = self._clients.get(client)
        if live is not None:
            live.pop(rid, None)
            if not live:
                del self._clients[client]
                self._client_seen.pop(client, None)


_DTYPE_NAMES = {n: n for n in ("float32", "bfloat16", "float16", "float64", "uint8", "int8")}


def _timings(req: Request) -> P.Timings:
    ready = req.ready_at or req.dispatched_at
    return P.Timings(
        encode_s=max(0.0, ready - req.admitted_at),
        queue_s=max(0.0, req.dispatched_at - ready),
        images=len(req.images),
        cache_hits=req.cache_hits,
        route=req.route,
    )


_HANDLERS = {
    P.Submit: Broker._on_submit,
    P.Cancel: Broker._on_cancel,
    P.StatsRequest: Broker._on_stats,
    P.Ping: Broker._on_ping,
    P.Register: Broker._on_register,
    P.Heartbeat: Broker._on_heartbeat,
    P.Bye: Broker._on_bye,
    P.Drain: Broker._on_drain,
    P.Encoded: Broker._on_encoded,
    P.EncodeFailed: Broker._on_encode_failed,
    P.Evicted: Broker._on_evicted,
    P.RingBlocked: Broker._on_ring_blocked,
    P.Tokens: Broker._on_tokens,
    P.PdFailed: Broker._on_pd_failed,
}


async def run_broker(config: BrokerConfig) -> None:
    """Serve until cancelled (the CLI maps Ctrl-C / SIGTERM to cancellation)."""
    broker = Broker(config)
    broker.bind()
    try:
        await broker.serve()
    finally:
        broker.stop()
