"""`AsyncClient`: submit requests to a broker and receive results or token streams.

The client never imports worker or engine code. Images may be paths, bytes or PIL images; they
travel as the original file bytes (PIL images as PNG) in out-of-band frames.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from epdq import protocol as P
from epdq.channel import Channel
from epdq.client_input import build_messages, input_loads_slowly, is_number, make_sampling, shown
from epdq.errors import (
    BrokerUnavailableError,
    ConfigError,
    DeadlineExceededError,
    EpdqError,
    InvalidInputError,
    ProtocolError,
    error_from_code,
)
from epdq.handshake import HandshakeWatch, watch_client
from epdq.keys import security_for
from epdq.security import SecurityConfig, curve_required
from epdq.transport import endpoint_problem, make_socket

log = logging.getLogger("epdq.client")

# how long past the request deadline the client waits for the broker's own deadline error
_GRACE_S = 2.0
# A broker counts as silent only once the images sent to it could have arrived at this rate (a
# slow CURVE link): a large upload queues this client's pings behind it for as long as it takes.
_SLOWEST_LINK_BPS = 20e6
_ZERO_COPY_BYTES = 64 * 1024
MAX_TIMEOUT_S = 3600.0  # the broker refuses longer deadlines
ROUTES = ("auto", "epd", "colocated")  # below this, ZeroMQ copies anyway and Frame objects only cost


@dataclass(slots=True)
class Timings:
    ttft_s: float = 0.0  # submit -> first token, seen by the client
    tpot_s: float = 0.0  # mean time per output token after the first
    total_s: float = 0.0
    encode_s: float = 0.0  # broker: admitted -> every image embedding resident
    queue_s: float = 0.0  # broker: ready -> handed to a PD worker
    images: int = 0
    cache_hits: int = 0
    route: str = ""


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    request_id: str = ""  # the broker's id of the request (as in its logs)
    prompt_tokens: int = 0  # on the last delta: the prompt's length in the engine (images expanded)
    timings: Timings | None = None  # on the last delta: as `GenerateResult.timings`


@dataclass(slots=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    timings: Timings = field(default_factory=Timings)
    prompt_tokens: int = 0  # the prompt's length in the engine, image tokens included


class AsyncClient:
    """`async with AsyncClient("tcp://127.0.0.1:7700") as c: r = await c.generate("hi")`."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        heartbeat_s: float = 1.0,
        liveness: int = 5,
        keys_dir: str = "",
        insecure: bool = False,
        security: SecurityConfig | None = None,
        ctx: zmq.Context | None = None,
    ):
        """tcp links use CURVE with the client keys in `keys_dir` (default: `$EPDQ_HOME/keys`,
        made by `epdq up` or `epdq keygen`), or `security`; `insecure=True` allows plaintext on
        loopback only. ipc:// needs neither."""
        # shown(): an int of over 4,300 digits cannot even be repr'd (ValueError), nor one past
        # ~1e308 be compared as seconds (OverflowError): each gets this ValueError, bounded
        if timeout is not None and not (is_number(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], not {shown(timeout)}")
        if not (is_number(heartbeat_s) and heartbeat_s > 0):
            raise ValueError(f"heartbeat_s must be a number of seconds > 0, not {shown(heartbeat_s)}")
        # is_number: heartbeat_s * liveness, the silence allowed, must be a float
        if isinstance(liveness, bool) or not isinstance(liveness, int) or liveness < 1 or not is_number(liveness):
            raise ValueError(f"liveness must be an integer >= 1 (missed heartbeats), not {shown(liveness)}")
        problem = (endpoint_problem(address, connect=True) if isinstance(address, str)
                   else f"address must be a string, not {shown(address)}")  # fmt: skip
        if problem:  # said now, not at the first request
            raise ConfigError(problem)
        self.address = address
        self.timeout = timeout
        self._ctx = ctx or zmq.Context.instance()
        self._channel: Channel | None = None
        self._streams: dict[str, asyncio.Queue | _Collector] = {}  # by request id
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count(1)
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self._last_heard = 0.0
        self._upload_until = 0.0  # monotonic time by which the images sent so far should be through
        self._broker_id: str | None = None
        self._incompatible: ProtocolError | None = None  # the last PONG came from another protocol version
        self._handshakes: HandshakeWatch | None = None
        self._pinger: asyncio.Task | None = None
        # connect() was called and close() not since: a connection that could not be reopened is
        # opened again (by the watcher, or by the next request) instead of staying gone
        self._wanted = False
        self._reopen_failing = False
        self.reconnects = 0
        self._rid_prefix = uuid.uuid4().hex[:16] + "-"  # unique per client; a counter after it
        self._rids = itertools.count(1)
        try:
            self._security = security or security_for("client", keys_dir=keys_dir, insecure=insecure)
            if curve_required(address, self._security):  # plaintext off loopback: said now, not at connect
                self._security.client()  # the key files read and checked now too (mode, format)
        except EpdqError as e:  # the client's own settings (keys), not a request's input
            raise ConfigError(e.message) from None

    def __del__(self, _warn: Any = warnings.warn) -> None:
        # As asyncio's transports and aiohttp's sessions do: a client dropped while connected kept
        # its socket (and any requests on it) open until now, which the caller should hear about.
        ch = getattr(self, "_channel", None)
        if ch is not None and not ch.closed:
            _warn(
                f"unclosed AsyncClient for {self.address}: use `async with AsyncClient(...)` or "
                "`await client.close()`", ResourceWarning, source=self,
            )  # fmt: skip

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._channel is not None:
            if self._channel.loop is not asyncio.get_running_loop():
                self._follow_running_loop()
            return
        self._open()
        self._wanted = True
        self._ping()  # learn the broker's instance id now, so a restart is recognised later
        self._ensure_pinger()

    def _ensure_pinger(self) -> None:
        """A watcher on this loop; the one that outlived a failed reopen is kept, not doubled."""
        p = self._pinger
        if p is None or p.done() or p.get_loop() is not asyncio.get_running_loop():
            self._pinger = asyncio.create_task(self._watch_broker())

    def _ping(self) -> None:
        if self._channel is not None:
            # the oldest requests first: after a restart each ping finds up to MAX_PING_IDS more lost ones
            ids = list(itertools.islice(self._streams, P.MAX_PING_IDS))
            try:
                self._channel.send(P.encode(P.Ping(next(self._nonce), ids)))
            except zmq.ZMQError:
                pass

    def _open(self) -> None:
        watches: list[HandshakeWatch | None] = []

        def watch(s: zmq.Socket) -> None:
            watches.append(watch_client(s, "client", self._on_refused))

        # keys and plaintext rules were checked at construction (ConfigError)
        # A random identity per socket. Without one the broker's ROUTER numbers us from a counter,
        # and whoever connected under our number took our link over (ROUTER_HANDOVER) and read our
        # tokens; that counter, and other clients' numbers, were predictable.
        # A failed make_socket has closed the watch with its socket: only a socket's is kept.
        sock = make_socket(self._ctx, zmq.DEALER, identity=f"c-{secrets.token_hex(16)}".encode(), connect=self.address,
                           security=self._security, before_connect=watch)  # fmt: skip
        self._handshakes = watches[0] if watches else None
        # token messages are small: receive bytes; batch what we send per loop turn
        self._channel = Channel(sock, self._on_frames, copy=True, coalesce=True)
        self._channel.start()
        self._last_heard = time.monotonic()

    def _close_channel(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()
        if self._handshakes is not None:
            self._handshakes.close()
            self._handshakes = None

    def _reopen(self) -> None:
        """A fresh socket. When it cannot be made (EMFILE, a key file being replaced...), the
        client is left without one: the watcher tries again at its next beat, a request at once."""
        self._close_channel()
        self._open()
        self.reconnects += 1

    def _try_reopen(self) -> bool:
        try:
            self._reopen()
        except Exception as e:  # whatever it was, the next beat tries again: the client must not die of it
            # once per streak at warning level: it is tried again every heartbeat
            level = logging.DEBUG if self._reopen_failing else logging.WARNING
            self._reopen_failing = True
            log.log(level, "cannot reconnect to the broker %s (trying again every %gs): %s", self.address,
                    self.heartbeat_s, getattr(e, "message", None) or e)  # fmt: skip
            return False
        if self._reopen_failing:
            self._reopen_failing = False
            log.info("reconnected to the broker %s", self.address)
        return True

    def _follow_running_loop(self) -> None:
        """A client connected under one `asyncio.run` and used under the next: its socket and
        pinger belong to a loop that is gone, and so does everything that was in flight there.
        Connect again on this loop. Two loops running at once cannot share one client."""
        old = self._channel.loop if self._channel is not None else None
        if old is not None and not old.is_closed():
            raise RuntimeError(
                "this AsyncClient is connected in another event loop that is still open; "
                "use one client per event loop"
            )
        self._streams.clear()  # their futures and queues died with their loop
        self._stats_waiters.clear()
        # the watcher first: should the reopen fail, it tries again
        self._pinger = asyncio.create_task(self._watch_broker())
        self._reopen()
        self._ping()

    def _on_refused(self, problem: str) -> None:
        """The broker refused our key; ZeroMQ will not retry. Everything in flight fails now."""
        self._fail_all(ConfigError(problem))

    def _handshake_problem(self) -> str:
        return f" ({self._handshakes.problem})" if self._handshakes is not None and self._handshakes.problem else ""

    async def _watch_broker(self) -> None:
        """While requests are in flight, ping; a silent or restarted broker fails them (typed)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            ch = self._channel
            if ch is None:
                if not self._wanted:
                    return
                # the last reopen failed: requests meanwhile failed (or reopened it themselves)
                if self._try_reopen():
                    self._ping()
                continue
            if not self._streams:
                self._last_heard = time.monotonic()
                continue
            silent = time.monotonic() - max(self._last_heard, self._upload_until)
            if silent > self.heartbeat_s * self.liveness:
                self._fail_all(BrokerUnavailableError(
                    f"broker {self.address} silent for {silent:.1f}s{self._handshake_problem()}"
                ))  # fmt: skip
                self._try_reopen()  # a fresh socket (new identity) for later requests
                continue
            self._ping()

    def _fail_all(self, err: EpdqError) -> None:
        for rid, q in list(self._streams.items()):
            q.put_nowait(type(err)(err.message, request_id=rid))
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(type(err)(err.message))

    async def close(self) -> None:
        ch = self._channel
        if ch is not None and ch.loop is not asyncio.get_running_loop():
            old = ch.loop
            if old is not None and not old.is_closed():
                raise RuntimeError("close this AsyncClient in the event loop it is connected in")
            # its loop is gone, and so is everything that was in flight there: only the socket is left
            self._wanted = False
            self._streams.clear()
            self._stats_waiters.clear()
            self._pinger = None
            self._close_channel()
            return
        self._wanted = False
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None
        if ch is not None:
            for rid in list(self._streams):
                try:
                    ch.send(P.encode(P.Cancel(rid)))
                except zmq.ZMQError:
                    pass
        self._fail_all(BrokerUnavailableError("client closed"))
        # also without a channel: a handshake watch may remain, whose socket keeps ctx.term() waiting
        self._close_channel()

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            msg, _ = P.decode(frames)
        except ProtocolError as e:
            # Only a broker of another epdq release (or a bug) sends what we cannot read. The
            # request it was for cannot be told, and would wait for its deadline: fail them all now.
            log.warning("undecodable message from the broker: %s", e.message)
            self._fail_all(ProtocolError(
                f"the broker sent a message this client cannot decode ({e.message}); does it run another "
                f"epdq release? This client speaks protocol version {P.PROTOCOL_VERSION}."
            ))  # fmt: skip
            return
        self._last_heard = time.monotonic()
        if isinstance(msg, P.Pong):
            if msg.protocol_version != P.PROTOCOL_VERSION:
                # its messages and ours differ (a BATCH of ours it would drop unread): fail now, and
                # refuse new requests until a broker of this release answers
                self._incompatible = ProtocolError(
                    f"the broker runs another epdq release (protocol version {msg.protocol_version or '5 or older'}); "
                    f"this client speaks protocol version {P.PROTOCOL_VERSION}: run one release across the cluster"
                )
                log.warning("%s", self._incompatible.message)
                self._fail_all(self._incompatible)
                return
            self._incompatible = None
            # Only the requests the broker says it does not hold are lost. A new broker_id alone
            # says nothing about them: a broker that restarted while this client was idle holds
            # every request sent since, and answers them.
            restarted = self._broker_id is not None and msg.broker_id != self._broker_id
            self._broker_id = msg.broker_id
            for rid in msg.unknown:
                q = self._streams.get(rid)
                if q is not None:  # (its answer may have arrived just before: then this is ignored)
                    why = "restarted" if restarted else "holds no such request (restarted, or dropped the message)"
                    q.put_nowait(BrokerUnavailableError(f"the broker {why}: the request was lost", request_id=rid))
        elif isinstance(msg, (P.Tokens, P.Error)):
            q = self._streams.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)
        elif isinstance(msg, P.Stats):
            # The broker answers a connection's STATS at most every ~50 ms: one reply for several
            # requests, with the nonce of the latest. Those sent before it (lower nonces: one
            # counter, increasing) were received before its snapshot was taken, so it answers them too.
            for nonce in [n for n in self._stats_waiters if n <= msg.nonce]:
                fut = self._stats_waiters.pop(nonce)
                if not fut.done():
                    fut.set_result(msg)

    # ------------------------------------------------------------ API

    async def generate(
        self,
        prompt: str | None = None,
        *,
        images: Sequence[Any] = (),
        messages: list[dict] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Iterable[str] | None = None,
        ignore_eos: bool = False,
        timeout: float | None = None,
        route: str = "auto",
    ) -> GenerateResult:
        """Run one request to completion. Arguments as in `stream`.

        Token messages are collected as they arrive into one future (no queue, no generator):
        the same messages, errors and deadline as `stream`, for less work per request."""
        self._require_channel()  # a closed client fails before any image is loaded
        rid, frames, copy, timeout = await self._prepare_async(
            prompt, images, messages, max_tokens, temperature, top_p, seed, stop, ignore_eos, timeout, route
        )
        ch = self._require_channel()  # again: loading the images may have awaited
        loop = asyncio.get_running_loop()
        sink = _Collector(rid, loop.create_future())
        self._streams[rid] = sink
        sink.t0 = time.perf_counter()
        expiry = None
        try:
            ch.send(frames, copy=copy)
            expiry = loop.call_at(loop.time() + timeout + _GRACE_S, sink.expire, timeout)
            final = await sink.fut
        finally:
            if expiry is not None:
                expiry.cancel()
            self._streams.pop(rid, None)
            if not sink.finished and self._channel is not None:
                try:
                    self._channel.send(P.encode(P.Cancel(rid)))
                except zmq.ZMQError:
                    pass
        tim = _timings(final.timings, sink.t0, sink.first, sink.last, sink.end, sink.n_tokens)
        return GenerateResult(rid, "".join(sink.text), sink.ids, final.finish_reason, tim, final.prompt_tokens)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        images: Sequence[Any] = (),
        messages: list[dict] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Iterable[str] | None = None,
        ignore_eos: bool = False,
        timeout: float | None = None,
        route: str = "auto",
    ) -> AsyncIterator[Delta]:
        """Yield deltas (`text`, `token_ids`) as tokens arrive; the last has `finish_reason`,
        `prompt_tokens` and `timings`.

        `images`: paths, bytes, base64 `data:` URLs or PIL images (or `messages`, OpenAI-style
        content parts, instead of prompt and images). `stop`: a string or strings. `timeout`:
        seconds (None: the broker's --timeout). `route`: "auto" | "epd" | "colocated". Breaking
        out of the loop or cancelling the task cancels the request on the broker and the PD worker.
        """
        self._require_channel()  # a closed client fails before any image is loaded
        rid, frames, copy, timeout = await self._prepare_async(
            prompt, images, messages, max_tokens, temperature, top_p, seed, stop, ignore_eos, timeout, route
        )
        ch = self._require_channel()  # again: loading the images may have awaited
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._streams[rid] = q
        t0 = time.perf_counter()
        first = last = 0.0
        n_tokens = 0
        done = False
        try:
            ch.send(frames, copy=copy)
            deadline = time.monotonic() + timeout + _GRACE_S
            while True:
                try:
                    if q.empty():
                        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                        # that races with the queue item arriving, and the request would run on
                        async with asyncio.timeout_at(loop.time() + max(0.0, deadline - time.monotonic())):
                            msg = await q.get()
                    else:
                        msg = q.get_nowait()
                except TimeoutError:
                    raise DeadlineExceededError(
                        f"no result within {timeout}s (+{_GRACE_S}s grace)", request_id=rid
                    ) from None
                if isinstance(msg, EpdqError):
                    done = True
                    raise msg
                if isinstance(msg, P.Error):
                    done = True
                    raise error_from_code(msg.code, msg.message, request_id=rid, retry_after=msg.retry_after)
                now = time.perf_counter()
                if msg.token_ids:
                    if n_tokens == 0:
                        first = now
                    n_tokens += len(msg.token_ids)
                    last = now
                if msg.finish_reason is None:
                    yield Delta(msg.text, list(msg.token_ids), None, rid)
                    continue
                done = True
                tim = _timings(msg.timings, t0, first, last, now, n_tokens)
                yield Delta(msg.text, list(msg.token_ids), msg.finish_reason, rid, msg.prompt_tokens, tim)
                return
        finally:
            self._streams.pop(rid, None)
            if not done and self._channel is not None:
                try:
                    self._channel.send(P.encode(P.Cancel(rid)))
                except zmq.ZMQError:
                    pass

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The broker's counters, gauges and workers."""
        if not (is_number(timeout) and timeout > 0):
            raise InvalidInputError(f"timeout must be a number of seconds > 0, not {shown(timeout)}")
        ch = self._require_channel()
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        ch.send(P.encode(P.StatsRequest(nonce)))
        try:
            async with asyncio.timeout(timeout):
                s: P.Stats = await fut
        except TimeoutError:
            raise BrokerUnavailableError(
                f"no answer from {self.address} within {timeout}s{self._handshake_problem()}"
            ) from None
        finally:
            self._stats_waiters.pop(nonce, None)
        workers = [{f: getattr(w, f) for f in w.__struct_fields__} for w in s.workers]
        return {"counters": dict(s.counters), "gauges": dict(s.gauges), "workers": workers}

    # ------------------------------------------------------------ internals

    def _require_channel(self) -> Channel:
        if self._channel is None and not self._wanted:
            raise BrokerUnavailableError("client is not connected: use `async with AsyncClient(...)`")
        if self._incompatible is not None:
            raise ProtocolError(self._incompatible.message)
        try:
            if self._channel is None:
                # a reopen failed and the watcher has not retried yet: try now, for this request
                self._reopen()
                self._ping()
                self._ensure_pinger()  # (the watcher is another loop's when asyncio.run came between)
            elif self._channel.loop is not asyncio.get_running_loop():
                self._follow_running_loop()
            elif self._handshakes is not None and self._handshakes.refused:
                # ZeroMQ gave up on this connection: try afresh (the allow-list may have been fixed);
                # if the key is still refused, the request fails at once with the reason
                self._reopen()
        except (EpdqError, zmq.ZMQError, OSError) as e:  # not the RuntimeError of two live loops
            raise BrokerUnavailableError(f"cannot reconnect to the broker {self.address}: "
                                         f"{getattr(e, 'message', None) or e}") from None  # fmt: skip
        if self._channel is None:  # (every reopen above either made one or raised)
            raise BrokerUnavailableError("client is not connected: use `async with AsyncClient(...)`")
        return self._channel

    async def _prepare_async(
        self, prompt: Any, images: Any, messages: Any, *args: Any
    ) -> tuple[str, list[Any], bool, float]:
        """`_prepare`, with the images turned into bytes on a worker thread where that may take a
        while (a PIL image to encode, a file to read, a large data: URL to decode), so that this
        event loop keeps serving every other request meanwhile; small bytes stay on it (a thread
        hop would cost more than the work)."""
        if not input_loads_slowly(images, messages):
            return self._prepare(prompt, images, messages, *args)
        self._check_args(*args)  # a bad argument fails before a large image is encoded
        built = await asyncio.to_thread(build_messages, prompt, images, messages)
        return self._prepare(prompt, images, messages, *args, built=built)

    def _check_args(
        self, max_tokens: Any, temperature: Any, top_p: Any, seed: Any, stop: Any, ignore_eos: Any, timeout: Any,
        route: Any,
    ) -> tuple[P.Sampling, float | None]:  # fmt: skip
        if timeout is None:
            timeout = self.timeout
        elif not is_number(timeout):
            raise InvalidInputError("timeout must be a number of seconds")
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
            raise InvalidInputError(f"timeout must be in (0, {MAX_TIMEOUT_S:g}] s (the broker's limit)")
        if route not in ROUTES:  # also a non-string, which the broker would drop as malformed
            raise InvalidInputError(f"route must be one of {', '.join(ROUTES)}, not {shown(route)}")
        return make_sampling(max_tokens, temperature, top_p, seed, stop, ignore_eos), timeout

    def _prepare(
        self,
        prompt: str | None,
        images: Any,
        messages: Any,
        max_tokens: Any,
        temperature: Any,
        top_p: Any,
        seed: Any,
        stop: Any,
        ignore_eos: Any,
        timeout: Any,
        route: Any,
        built: tuple[list[P.ChatMessage], list[bytes]] | None = None,
    ) -> tuple[str, list[Any], bool, float]:
        """Validate arguments; (request id, SUBMIT frames, copy flag, timeout). `built`: what
        `build_messages` made of (prompt, images, messages) already.

        Types and value ranges are checked here, so that nothing the broker would refuse is sent
        (a refused request would have uploaded its images first)."""
        sampling, timeout = self._check_args(max_tokens, temperature, top_p, seed, stop, ignore_eos, timeout, route)
        chat, blobs = build_messages(prompt, images, messages) if built is None else built
        if len(blobs) > P.MAX_PAYLOAD_FRAMES:
            raise InvalidInputError(f"{len(blobs)} images; the protocol carries at most {P.MAX_PAYLOAD_FRAMES}")
        try:
            P.validate_messages(chat, len(blobs))
        except ProtocolError as e:
            raise InvalidInputError(e.message) from None
        rid = f"{self._rid_prefix}{next(self._rids):x}"
        # 0: the broker applies its own --timeout; this client then waits as long as the broker may
        sub = P.Submit(rid, chat, sampling, 0.0 if timeout is None else float(timeout), len(blobs), route)
        try:
            head = P.encode(sub)
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") in some text
            raise InvalidInputError(f"text is not valid Unicode: {e.reason} at position {e.start}") from None
        if len(head[1]) > P.MAX_HEADER_BYTES:  # the broker would drop it as malformed
            raise InvalidInputError(
                f"the request's text is {len(head[1])} bytes encoded; at most {P.MAX_HEADER_BYTES} go in one request"
            )
        nbytes = sum(len(b) for b in blobs)
        if nbytes:
            # the broker reads our messages in order: its PONGs wait behind these bytes
            self._upload_until = max(self._upload_until, time.monotonic()) + nbytes / _SLOWEST_LINK_BPS
        return rid, head + blobs, nbytes < _ZERO_COPY_BYTES, MAX_TIMEOUT_S if timeout is None else float(timeout)

class _Collector:
    """Where `generate` receives its request's messages (`put_nowait`, like the stream queue)."""

    __slots__ = ("rid", "fut", "text", "ids", "n_tokens", "t0", "first", "last", "end", "finished")

    def __init__(self, rid: str, fut: asyncio.Future):
        self.rid = rid
        self.fut = fut
        self.text: list[str] = []
        self.ids: list[int] = []
        self.n_tokens = 0
        self.t0 = self.first = self.last = self.end = 0.0
        self.finished = False  # the broker has ended the request (tokens done or an error)

    def put_nowait(self, msg: Any) -> None:
        fut = self.fut
        if fut.done():
            return
        if isinstance(msg, EpdqError):  # the client's own verdict (broker gone, client closed)
            self.finished = True
            fut.set_exception(msg)
            return
        if isinstance(msg, P.Error):
            self.finished = True
            fut.set_exception(
                error_from_code(msg.code, msg.message, request_id=self.rid, retry_after=msg.retry_after)
            )
            return
        now = time.perf_counter()
        if msg.token_ids:
            if not self.n_tokens:
                self.first = now
            self.n_tokens += len(msg.token_ids)
            self.last = now
            self.ids.extend(msg.token_ids)
        self.text.append(msg.text)
        if msg.finish_reason is not None:
            self.finished = True
            self.end = now
            fut.set_result(msg)

    def expire(self, timeout: float) -> None:
        if not self.fut.done():
            self.fut.set_exception(
                DeadlineExceededError(f"no result within {timeout}s (+{_GRACE_S}s grace)", request_id=self.rid)
            )


def _timings(bt: P.Timings | None, t0: float, first: float, last: float, end: float, n_tokens: int) -> Timings:
    """The client's clock (ttft, tpot, total) and the broker's (encode, queue, images, cache hits)."""
    bt = bt or P.Timings()
    return Timings(
        ttft_s=(first - t0) if n_tokens else 0.0,
        tpot_s=(last - first) / (n_tokens - 1) if n_tokens > 1 else 0.0,
        total_s=end - t0,
        encode_s=bt.encode_s, queue_s=bt.queue_s, images=bt.images, cache_hits=bt.cache_hits, route=bt.route,
    )  # fmt: skip
