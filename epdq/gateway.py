"""OpenAI-compatible HTTP gateway in front of a broker.

`/v1/chat/completions` (streaming SSE and not), `/v1/models` and `/health`, talking to the broker
through `epdq.AsyncClient`s, its users spread over a few of them (`epdq.gateway_clients`). Images
come as `image_url` parts: base64 `data:` URLs always; local files (`file://` URLs or plain paths)
only under `GatewayConfig.allow_dir`; remote http(s) URLs only when `allow_remote_urls` is set.

Typed epdq errors become HTTP statuses with an OpenAI-style body `{"error": {message, type, code}}`:
busy -> 429 (+ Retry-After), invalid input -> 400, deadline -> 504, broker unavailable -> 503,
worker lost -> 502, anything else -> 500. The request schema, image resolution and that mapping
live in `epdq.chat_request`; this module is the app, its streaming and its server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from epdq.chat_request import HTTPError, http_error, parse_request, sampling_kwargs, to_epdq_messages
from epdq.client import MAX_TIMEOUT_S
from epdq.cpus import check_cpus
from epdq.errors import BrokerUnavailableError, ConfigError, DeadlineExceededError, EpdqError
from epdq.gateway_clients import BrokerConnections, check_share
from epdq.media import MAX_IMAGE_BYTES_LIMIT
from epdq.metrics import GatewayMetrics
from epdq.protocol import MAX_TOKENS_LIMIT

log = logging.getLogger("epdq.gateway")


@dataclass(slots=True)
class GatewayConfig:
    broker_address: str
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "epdq"  # advertised by /v1/models; requests must name it
    allow_dir: str | None = None  # local image files are readable only under this directory
    allow_remote_urls: bool = False  # http(s) image URLs (fetched by the gateway) when True
    allow_private_urls: bool = False  # ... also from loopback, private and link-local addresses
    max_body_bytes: int = 32 * 2**20
    max_image_bytes: int = 20 * 2**20  # local files and remote downloads
    # image parts per request, counted before any is read or downloaded (the broker's --max-images
    # still applies; this keeps a request naming a file a thousand times from reading it a thousand times)
    max_images: int = 8
    request_timeout_s: float = 0.0  # the deadline handed to the broker per request; 0: the broker's --timeout
    # max_tokens for a request that names none; 0: as many as fit in the model's context (the
    # engine stops there), which is what vLLM's server does
    default_max_tokens: int = 0
    stream_prime_s: float = 2.0  # how long a stream waits for a first answer to give a real status
    remote_timeout_s: float = 10.0
    body_timeout_s: float = 60.0  # to receive a request's whole body (408 after)
    # a stream none of whose writes the connection can take for this long (the client reads nothing
    # and the socket buffers are full) is cancelled upstream (499) and its connection aborted
    stream_stall_s: float = 60.0
    keys_dir: str = ""
    insecure: bool = False
    # how HTTP users are spread over broker connections, each a client with its own share of a full
    # queue (gateway_clients.py): by the request's address, its OpenAI `user` field, or "none"
    share_by: str = "address"
    share_connections: int = 8
    log_level: str = "info"
    log_format: str = "text"  # or "json": one object per line (the CLI entry point sets logging up)
    cpus: tuple[int, ...] = ()  # CPUs this process runs on (epdq.cpus); empty: wherever the kernel puts it

    def __post_init__(self) -> None:
        self.cpus = check_cpus(self.cpus)
        if self.log_format not in ("text", "json"):
            raise ValueError("log_format must be text or json")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be > 0")
        if not 1 <= self.max_images <= 64:  # 64: the most one request's message carries
            raise ValueError("max_images must be in [1, 64]")
        if not 1 <= self.max_image_bytes <= MAX_IMAGE_BYTES_LIMIT:  # the most any broker takes
            raise ValueError(f"max_image_bytes must be in [1, {MAX_IMAGE_BYTES_LIMIT}]")
        if not (isinstance(self.request_timeout_s, (int, float)) and 0 <= self.request_timeout_s <= MAX_TIMEOUT_S):
            # the broker refuses longer deadlines: every request would fail
            raise ValueError(f"request_timeout_s must be in [0, {MAX_TIMEOUT_S:g}] s (0: the broker's --timeout)")
        if not (0 < self.remote_timeout_s <= 600 and 0 <= self.stream_prime_s <= 600):
            raise ValueError("remote_timeout_s must be in (0, 600] and stream_prime_s in [0, 600]")
        if not (0 < self.body_timeout_s <= 3600 and 0 < self.stream_stall_s <= 3600):
            raise ValueError("body_timeout_s and stream_stall_s must be in (0, 3600]")
        if not 0 <= self.default_max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"default_max_tokens must be in [0, {MAX_TOKENS_LIMIT}] (0: as many as fit)")
        if not 0 < self.port < 65536:  # uvicorn would bind port % 65536 and print the number given
            raise ValueError(f"port must be 1..65535, not {self.port}")
        if self.allow_private_urls and not self.allow_remote_urls:
            raise ValueError("allow_private_urls widens allow_remote_urls, which is off")
        check_share(self.share_by, self.share_connections)
        if self.allow_dir is not None and not os.path.isdir(self.allow_dir):
            # checked now: otherwise every local image would fail, one request at a time
            raise ValueError(f"allow_dir {self.allow_dir!r} does not exist or is not a directory")


# ---------------------------------------------------------------- app

_END = object()
PARSE_INLINE_BYTES = 1 << 20


@dataclass(slots=True)
class _Record:
    """One chat completion as the gateway saw it; finished exactly once, then logged and counted."""

    request_id: str
    t0: float
    stream: bool = False
    code: int = 500
    images: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    first_s: float | None = None  # first token, seconds after t0
    last_s: float | None = None
    upstream_id: str = ""
    error: str = ""
    done: bool = False

    def token(self, n: int) -> None:
        if n:
            now = time.perf_counter() - self.t0
            if self.first_s is None:
                self.first_s = now
            self.last_s = now
            self.tokens += n


def _finish_record(rec: _Record, metrics: GatewayMetrics) -> None:
    if rec.done:
        return
    rec.done = True
    e2e = time.perf_counter() - rec.t0
    tpot = (rec.last_s - rec.first_s) / (rec.tokens - 1) if rec.tokens > 1 and rec.first_s is not None else None
    metrics.in_flight -= 1
    metrics.finished(rec.code, rec.stream, tokens=rec.tokens, prompt_tokens=rec.prompt_tokens, images=rec.images,
                     ttft_s=rec.first_s, tpot_s=tpot, e2e_s=e2e)  # fmt: skip
    ttft = f"{rec.first_s:.3f}" if rec.first_s is not None else "-"
    log.info(
        "request %s %d %s images=%d prompt_tokens=%d tokens=%d ttft_s=%s total_s=%.3f%s%s", rec.request_id,
        rec.code, "stream" if rec.stream else "unary", rec.images, rec.prompt_tokens, rec.tokens, ttft, e2e,
        f" upstream={rec.upstream_id}" if rec.upstream_id else "", f" error={rec.error[:500]!r}" if rec.error else "",  # a client's text may be echoed in it
        extra={"request_id": rec.request_id, "event": "request_done", "status": rec.code,
               "upstream_request_id": rec.upstream_id or None, "tokens": rec.tokens,
               "prompt_tokens": rec.prompt_tokens, "images": rec.images, "ttft_s": rec.first_s,
               "total_s": round(e2e, 6)},
    )  # fmt: skip


_FINISH = {"stop", "length", "content_filter", "tool_calls"}


def _finish(reason: str | None) -> str:
    return reason if reason in _FINISH else "stop"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(
            413, f"request body larger than {limit} bytes", "invalid_request_error", "body_too_large"
        )
    buf = bytearray()
    try:
        # a client that trickles its body (or sends none of it) must not hold a connection for ever
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise HTTPError(
                        413, f"request body larger than {limit} bytes", "invalid_request_error", "body_too_large"
                    )
    except TimeoutError:
        raise HTTPError(408, f"request body not received within {timeout_s:g} s", "invalid_request_error",
                        "request_timeout") from None  # fmt: skip
    return bytes(buf)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _or_disconnect(request: Request, aw: Any, timeout: float | None = None) -> tuple[bool, Any]:
    """Await `aw` unless the client goes away first (then cancel it and raise CancelledError) or
    `timeout` passes (then return (False, the still-running task))."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
        with suppress(BaseException):
            await watch
    if task in done:
        return True, task.result()
    if watch in done:
        task.cancel()
        with suppress(BaseException):
            await task
        raise asyncio.CancelledError("client disconnected")
    return False, task


def create_app(config: GatewayConfig) -> FastAPI:
    from epdq.client import AsyncClient

    def new_client() -> AsyncClient:
        return AsyncClient(
            config.broker_address,
            timeout=config.request_timeout_s or None,
            keys_dir=config.keys_dir,
            insecure=config.insecure,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        conns = BrokerConnections(new_client, config.share_by, config.share_connections)
        app.state.connections = conns
        try:
            await conns.get()  # one connection from the start, as /health asks the broker over it
            yield
        finally:
            await conns.close()

    app = _App(title="epdq gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    metrics = app.state.metrics = GatewayMetrics()

    @app.exception_handler(HTTPError)
    async def _on_http_error(_request: Request, exc: HTTPError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_routing_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown path or method: the OpenAI error shape clients parse, not Starlette's {"detail"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return HTTPError(exc.status_code, str(exc.detail), "invalid_request_error", code, exc.headers).response()

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        try:
            s = await (await request.app.state.connections.get()).stats(timeout=1.0)
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            err = http_error(e if isinstance(e, EpdqError) else BrokerUnavailableError(str(e)))
            return JSONResponse({"status": "unavailable", "error": err.message}, status_code=503)
        roles: dict[str, int] = {}
        for w in s["workers"]:
            roles[w["role"]] = roles.get(w["role"], 0) + 1
        if s["gauges"].get("broker_draining"):  # it refuses every request: take this gateway out of rotation
            return JSONResponse(
                {"status": "draining", "error": "the broker is shutting down", "workers": roles}, status_code=503
            )
        # no gauges: this port faces API users, and the queue, clients and cache figures are the
        # operator's (the broker's --metrics)
        return JSONResponse({"status": "ok", "model": config.model_name, "workers": roles})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(config)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != config.model_name:
            raise HTTPError(404, f"model {model_id[:100]!r} not found", "invalid_request_error", "model_not_found")
        return _model_card(config)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        rec = _Record("chatcmpl-" + uuid.uuid4().hex, time.perf_counter())
        metrics.in_flight += 1
        try:
            response = await _chat(request, rec)
            if not isinstance(response, _EventStream):  # a live stream's status is its pump's to set
                rec.code = getattr(response, "status_code", 200)
            return response
        except HTTPError as e:
            rec.code, rec.error = e.status, e.detail
            raise
        except asyncio.CancelledError:
            rec.code = 499
            raise
        except BaseException as e:
            rec.code, rec.error = 500, type(e).__name__
            raise
        finally:
            if not rec.stream or rec.code != 200:  # a live stream is finished by its pump
                _finish_record(rec, metrics)

    async def _chat(request: Request, rec: _Record):
        try:
            raw = await _read_body(request, config.max_body_bytes, config.body_timeout_s)
        except ClientDisconnect:
            # gone mid-body: a 499 as any client that left (raised, it reached uvicorn, which logged
            # every such client with a traceback at ERROR)
            return JSONResponse({}, status_code=499)
        # a large body (data: URLs) takes ~0.6 ms per MiB to parse: not on the loop every stream shares
        req = parse_request(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(parse_request, raw)
        rec.stream = bool(req.stream)  # so a refused stream request is counted as one
        if req.model != config.model_name:
            raise HTTPError(404, f"model {req.model[:100]!r} not found", "invalid_request_error", "model_not_found")
        kw = sampling_kwargs(req, config)
        messages = await to_epdq_messages(req, config)
        rec.images = sum(
            1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] != "text"
        )
        conns = request.app.state.connections
        client = await conns.get(conns.tenant(request.client.host if request.client else None, req.user))
        rid = rec.request_id
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _stream(request, client, messages, kw, rec, created, include_usage)
        sent_s = time.perf_counter() - rec.t0  # the client's timings count from here; ours from receipt
        try:
            _, result = await _or_disconnect(request, client.generate(messages=messages, **kw))
        except asyncio.CancelledError:
            return JSONResponse({}, status_code=499)  # nobody is listening
        except Exception as e:  # noqa: BLE001 - mapped to a status
            raise http_error(e) from None
        n = len(result.token_ids)
        rec.upstream_id = result.request_id
        # as a stream's: from when the request arrived (its body, parsing and image fetches included)
        rec.tokens, rec.first_s = n, sent_s + result.timings.ttft_s if n else None
        rec.prompt_tokens = result.prompt_tokens
        rec.last_s = rec.first_s + result.timings.tpot_s * (n - 1) if n else None
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": config.model_name,
            "choices": [{
                "index": 0, "message": {"role": "assistant", "content": result.text},
                "logprobs": None, "finish_reason": _finish(result.finish_reason),
            }],
            "usage": _usage(result.prompt_tokens, n),
        }  # fmt: skip

    async def _stream(request, client, messages, kw, rec, created, include_usage):
        # bounded: a client that reads nothing must not make the gateway hold its whole answer
        q: asyncio.Queue = asyncio.Queue(STREAM_BUFFER)
        rid = rec.request_id

        async def hand(item: Any) -> None:
            async with asyncio.timeout(config.stream_stall_s):
                await q.put(item)

        async def pump() -> None:
            try:
                async for d in client.stream(messages=messages, **kw):  # leaving it cancels upstream
                    rec.upstream_id = d.request_id
                    rec.token(len(d.token_ids))
                    if d.finish_reason is not None:
                        rec.prompt_tokens = d.prompt_tokens
                    await hand(d)
                await hand(_END)
            except TimeoutError:  # nobody took a delta for stream_stall_s (_EventStream's limit mostly ends it first)
                rec.code, rec.error = 499, "client stopped reading"
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(DeadlineExceededError(
                    f"the client read nothing for {config.stream_stall_s:g} s: the request was cancelled"
                ))  # fmt: skip
            except asyncio.CancelledError:
                if rec.code == 200:  # the consumer went away mid-stream
                    rec.code, rec.error = 499, "client disconnected"
                raise
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                # the status line went out as 200; the record (metrics, log) says how it really ended
                rec.code, rec.error = http_error(e).status, str(e) or type(e).__name__
                while q.full():  # the error goes after what the client has not read yet, if room
                    q.get_nowait()
                q.put_nowait(e)

        # before the pump runs: an upstream that fails at once (even with a first delta) ends it
        # during the wait below, and the status it sets is the one the stream is counted under
        rec.code = 200
        task = asyncio.create_task(pump())
        # wait a little for the first answer, so that refusals (busy, bad input) get a real status
        try:
            got, first = await _or_disconnect(request, q.get(), timeout=config.stream_prime_s)
        except asyncio.CancelledError:
            task.cancel()
            return JSONResponse({}, status_code=499)
        except BaseException:
            task.cancel()
            raise
        if got and isinstance(first, BaseException):
            task.cancel()
            raise http_error(first)
        pending = None if got else first  # still waiting: a task running q.get()

        def chunk(
            delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True
        ) -> str:
            obj = {
                "id": rid, "object": "chat.completion.chunk", "created": created, "model": config.model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else [],
            }  # fmt: skip
            if include_usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        async def events() -> AsyncIterator[str]:
            n = n_prompt = 0
            try:
                yield chunk({"role": "assistant", "content": ""})
                item = first if got else await pending
                while True:
                    if item is _END:
                        break
                    if isinstance(item, BaseException):
                        yield f"data: {json.dumps(http_error(item).body())}\n\n"
                        yield "data: [DONE]\n\n"  # as vLLM ends a stream after an error event
                        return
                    n += len(item.token_ids)
                    if item.text:
                        yield chunk({"content": item.text})
                    if item.finish_reason is not None:
                        n_prompt = item.prompt_tokens
                        yield chunk({}, _finish(item.finish_reason))
                    item = await q.get()
                if include_usage:
                    yield chunk({}, usage=_usage(n_prompt, n), choices=False)
                yield "data: [DONE]\n\n"
            finally:  # also on client disconnect: Starlette cancels this generator
                if pending is not None:
                    pending.cancel()
                task.cancel()

        def stalled() -> None:
            if rec.code == 200:  # upstream still running: the client is why it ends (one that ended is counted already)
                rec.code, rec.error = 499, "client stopped reading"
            task.cancel()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        # the stream is counted and logged when its upstream ends (the pump always ends: done,
        # failed, or cancelled when the consumer goes away or stops reading)
        task.add_done_callback(lambda _t: _finish_record(rec, metrics))
        return _EventStream(events(), stall_s=config.stream_stall_s, on_stall=stalled, headers=headers)

    return app


class _Stalled(Exception):
    """A write to a stream's client was not taken within the stall limit (not an OSError, as the
    TimeoutError it comes from is: Starlette takes an OSError for the client's disconnect)."""


class _EventStream(StreamingResponse):
    """Server-sent events whose every write must be taken by the connection within `stall_s`.

    uvicorn's send waits, with no limit, while the connection's write buffer is over its high-water
    mark, which a client that reads nothing keeps it: the connection, its task and one of the
    MAX_CONCURRENCY slots were held until that client closed its socket, and enough such clients
    got everyone a 503. On expiry `on_stall` runs (it cancels upstream) and the connection is
    aborted: a graceful close waits to flush to the very client that reads nothing."""

    def __init__(self, content: AsyncIterator[str], *, stall_s: float, on_stall: Any, headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.stall_s, self.on_stall = stall_s, on_stall

    async def stream_response(self, send: Any) -> None:
        async def bounded(message: dict) -> None:
            try:
                async with asyncio.timeout(self.stall_s):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        await bounded({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await bounded({"type": "http.response.body", "body": chunk.encode(self.charset), "more_body": True})
        await bounded({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except _Stalled:
            self.on_stall()
            transport = scope.get(_TRANSPORT)
            if transport is None:  # not uvicorn's cycle (see _App): the server closes it, gracefully, when we return
                return
            transport.abort()
            # uvicorn hears of it on the loop's next turn; an app that returned before would be
            # logged as one that "returned without completing response"
            with suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    while (await receive())["type"] != "http.disconnect":
                        pass
        finally:
            # at once, not when the generator is collected: its `finally` cancels upstream
            await self.body_iterator.aclose()


_TRANSPORT = "epdq.transport"  # scope key: the connection's asyncio transport, where known


class _App(FastAPI):
    """FastAPI with each request's connection at hand (scope[_TRANSPORT]): ASGI gives an app no way
    to drop a connection, which a stalled stream must (_EventStream). uvicorn's `send` is a bound
    method of its request cycle, which holds the transport; under anything else (its trace-level
    message logger, another server) the key is absent and a stalled stream is only closed."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and callable(getattr(transport, "abort", None)):  # uvloop's are no BaseTransport
            scope[_TRANSPORT] = transport
        await super().__call__(scope, receive, send)


def _model_card(config: GatewayConfig) -> dict:
    return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "epdq"}


# ---------------------------------------------------------------- running it


# a stream still open this long after SIGTERM is cut: a stop must end, as a worker's drain does
GRACEFUL_SHUTDOWN_S = 30.0
STREAM_BUFFER = 256  # stream deltas the gateway holds for a client that has not read them yet
# connections and requests served at once; beyond them uvicorn answers 503 at once, so slow or
# idle clients cannot pile up until the process runs out of file descriptors or memory
MAX_CONCURRENCY = 2048


def build_server(config: GatewayConfig, **uvicorn_kw: Any):
    import uvicorn

    # uvicorn's loggers propagate to ours (one format for every line); its access log is replaced
    # by the gateway's own line per request, which carries the request id and timings
    uvicorn_kw.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    uvicorn_kw.setdefault("limit_concurrency", MAX_CONCURRENCY)
    ucfg = uvicorn.Config(
        create_app(config), host=config.host, port=config.port, log_level=config.log_level,
        lifespan="on", proxy_headers=False, log_config=None, access_log=False, **uvicorn_kw,
    )  # fmt: skip
    return uvicorn.Server(ucfg)


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The gateway's listening sockets, bound before uvicorn starts: a port already taken is a
    ConfigError (one line, exit 2) instead of uvicorn's log lines after "startup complete". A host
    name gets a socket per address it resolves to (localhost: 127.0.0.1 and ::1), as uvicorn did."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {e.strerror or e}") from None
    socks: list[socket.socket] = []
    seen: set = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin binds apart
            sock.bind(addr)
            sock.set_inheritable(True)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {e.strerror or e}") from None
    return socks


async def serve(config: GatewayConfig, *, sockets: list | None = None) -> None:
    """Run the gateway on the current event loop until it is stopped (SIGINT/SIGTERM)."""
    await build_server(config).serve(sockets=sockets)


def run(config: GatewayConfig) -> None:
    """Blocking entry point for the CLI: `serve` on a fresh event loop (uvloop when installed).

    SIGTERM stops the gateway gracefully and the process exits 0, as every epdq process does
    after a drain (`epdq up` restarts such a child without counting it as a crash)."""
    from epdq.cpus import place_this_process
    from epdq.launch import keep_large_buffers
    from epdq.logs import setup_logging

    setup_logging(config.log_level, config.log_format)
    place_this_process(config.cpus, "gateway")  # before the broker connections' ZeroMQ context and uvicorn start threads
    keep_large_buffers()  # request bodies and the images in them: up to tens of MiB each
    from epdq.client import AsyncClient

    # the broker address and keys, checked now: the app builds its client only once uvicorn runs,
    # where a ConfigError became a traceback and exit 3
    AsyncClient(config.broker_address, keys_dir=config.keys_dir, insecure=config.insecure)
    socks = bind_sockets(config.host, config.port)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    # uvicorn drains on SIGTERM, restores the handler it found and raises the signal again; with
    # the default handler found there, that re-raise killed the process (-15) after a clean stop.
    # Ours also stops a server that is still being built (uvicorn listens only once serving).
    state: dict[str, Any] = {"term": False, "server": None}

    def on_term(*_: Any) -> None:
        state["term"] = True
        if state["server"] is not None:
            state["server"].should_exit = True

    async def main() -> None:
        state["server"] = build_server(config)
        if not state["term"]:  # a SIGTERM while the app was being built: do not start at all
            await state["server"].serve(sockets=socks)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
    finally:
        signal.signal(signal.SIGTERM, previous)
        for sock in socks:
            sock.close()
