"""Prometheus text exposition without dependencies: histograms and a tiny /metrics server.

The broker keeps counters and gauges already; this adds latency histograms and serves all of
them over plain HTTP (GET /metrics, GET /health) from the broker's own event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epdq.protocol import Stats

log = logging.getLogger("epdq.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    __slots__ = ("name", "help", "buckets", "counts", "sum", "count")

    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if value != value or value < 0:  # NaN or negative: a clock glitch, not a latency
            return
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for le, c in zip(self.buckets, self.counts, strict=True):
            acc += c
            out.append(f'{self.name}_bucket{{le="{_num(le)}"}} {acc}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.count}"]  # fmt: skip
        return out


def render_family(name: str, kind: str, help: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    out = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{lab}}} {_num(value)}" if lab else f"{name} {_num(value)}")
    return out


def render_broker_metrics(s: Stats, histograms: Iterable[Histogram]) -> str:
    """The broker's /metrics page: its counters and gauges (`Broker.stats`), workers by role and
    state, each encoder's ring, and the latency histograms."""
    out: list[str] = []
    for name, value in sorted(s.counters.items()):
        out += render_family(f"epdq_{name}_total", "counter", name.replace("_", " "), [({}, value)])
    for name, value in sorted(s.gauges.items()):
        if not name.startswith("workers_"):
            metric = name.removesuffix("_s") + "_seconds" if name.endswith("_s") else name  # Prometheus units
            out += render_family(f"epdq_{metric}", "gauge", name.replace("_", " "), [({}, value)])
    roles = ("encoder", "pd", "both")
    states = {(r, st): 0 for r in roles for st in ("idle", "busy", "full", "draining")}
    for w in s.workers:
        st = "idle" if w.inflight == 0 else ("full" if w.inflight >= w.capacity else "busy")
        st = "draining" if w.draining else st
        states[(w.role, st)] += 1
    out += render_family("epdq_workers", "gauge", "registered workers by role and state",
                         [({"role": r, "state": st}, v) for (r, st), v in states.items()])  # fmt: skip
    rings = [w for w in s.workers if w.ring_capacity]
    for metric, field in (("ring_used_bytes", "ring_used"), ("ring_pinned_bytes", "ring_pinned"),
                          ("ring_capacity_bytes", "ring_capacity")):  # fmt: skip
        out += render_family(f"epdq_{metric}", "gauge", f"bytes {field.removeprefix('ring_')} in each encoder's ring",
                             [({"worker": w.worker_id}, getattr(w, field)) for w in rings])  # fmt: skip
    for h in histograms:
        out += h.render()
    return "\n".join(out) + "\n"


def _num(value: float) -> str:
    """A sample value in full: `:g` kept 6 digits, so a counter past 1e6 seemed to stand still."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class MetricsServer:
    """GET /metrics (Prometheus text) and GET /health on host:port; anything else is 404.

    `health` returns None when ready, else the reason (the 503's body)."""

    MAX_CONNECTIONS = 64  # scrapers need a few; idle sockets beyond this must not eat the broker's fds

    def __init__(self, render: Callable[[], str], health: Callable[[], str | None] = lambda: None):
        self._render = render
        self._health = health
        self._server: asyncio.base_events.Server | None = None
        self._open = 0
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=8192)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            method, _, rest = request.partition(b" ")
            path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
            if method != b"GET":
                status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
            elif path == b"/metrics":
                status, body, ctype = "200 OK", self._render().encode(), "text/plain; version=0.0.4"
            elif path == b"/health":
                problem = self._health()
                status, body, ctype = ("200 OK", b"ok\n", "text/plain") if problem is None else (
                    "503 Service Unavailable", f"{problem}\n".encode(), "text/plain")  # fmt: skip
            else:
                status, body, ctype = "404 Not Found", b"not found\n", "text/plain"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a scraper that hung up or sent junk
        finally:
            self._open -= 1
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


class GatewayMetrics:
    """What the HTTP gateway itself sees: requests by status, in flight, latency as users feel it.

    The broker's /metrics has the pipeline's view (queues, encoders, ring); this is the edge's
    view, so a dashboard can tell time spent in HTTP handling from time spent in the pipeline.
    """

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (status code, "stream"|"unary") -> count
        self.in_flight = 0
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.images = 0
        self.ttft = Histogram("epdq_gateway_ttft_seconds", "request received -> first token sent")
        self.tpot = Histogram("epdq_gateway_tpot_seconds", "mean time per output token after the first",
                              (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))  # fmt: skip
        self.e2e = Histogram("epdq_gateway_request_seconds", "request received -> response finished")

    def finished(self, code: int, stream: bool, *, tokens: int = 0, prompt_tokens: int = 0, images: int = 0,
                 ttft_s: float | None = None, tpot_s: float | None = None, e2e_s: float | None = None) -> None:  # fmt: skip
        key = (str(code), "stream" if stream else "unary")
        self.requests[key] = self.requests.get(key, 0) + 1
        self.completion_tokens += tokens
        self.prompt_tokens += prompt_tokens
        self.images += images
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None and tokens > 1:
            self.tpot.observe(tpot_s)
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def render(self) -> str:
        out = render_family(
            "epdq_gateway_requests_total", "counter", "chat completion requests by HTTP status",
            [({"code": c, "mode": m}, v) for (c, m), v in sorted(self.requests.items())],
        )  # fmt: skip
        out += render_family("epdq_gateway_in_flight", "gauge", "requests being served", [({}, self.in_flight)])
        out += render_family("epdq_gateway_completion_tokens_total", "counter", "tokens sent to clients",
                             [({}, self.completion_tokens)])  # fmt: skip
        out += render_family("epdq_gateway_prompt_tokens_total", "counter",
                             "prompt tokens of the requests served (image tokens included)",
                             [({}, self.prompt_tokens)])  # fmt: skip
        out += render_family("epdq_gateway_images_total", "counter", "images received in requests",
                             [({}, self.images)])  # fmt: skip
        for h in (self.ttft, self.tpot, self.e2e):
            out += h.render()
        return "\n".join(out) + "\n"
