"""`epdq status`: the broker's workers, queues, rings and cache as a table (or JSON)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from epdq.client import AsyncClient
from epdq.errors import BrokerUnavailableError


def summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The stats a person watches, with derived rates (JSON-friendly)."""
    k, g = stats["counters"], stats["gauges"]
    # misses: images that needed a new encode when a request arrived (re-encodes after an
    # eviction or a stale read are not lookups)
    lookups = k.get("cache_misses", 0) + k.get("cache_hits", 0) + k.get("dedup_joins", 0)
    workers = stats["workers"]
    return {
        "workers": workers,
        "workers_by_role": {r: sum(1 for w in workers if w["role"] == r) for r in ("encoder", "pd", "both")},
        "queues": {
            "waiting_for_encode": g.get("requests_waiting", 0),
            "ready_for_pd": g.get("requests_ready", 0),
            "running": g.get("requests_running", 0),
            "encode_queue": g.get("encode_queue", 0),
            "encodes_inflight": g.get("encodes_inflight", 0),
        },
        "ring": {
            "capacity_bytes": sum(w.get("ring_capacity", 0) for w in workers),
            "used_bytes": sum(w.get("ring_used", 0) for w in workers),
            "pinned_bytes": sum(w.get("ring_pinned", 0) for w in workers),
        },
        "cache": {
            "hit_rate": (k.get("cache_hits", 0) + k.get("dedup_joins", 0)) / lookups if lookups else 0.0,
            "hits": k.get("cache_hits", 0),
            "dedup_joins": k.get("dedup_joins", 0),
            "misses": k.get("cache_misses", 0),
            "encodes": k.get("encodes_done", 0),
            "evictions": k.get("evictions", 0),
        },
        "requests": {
            "completed": k.get("requests_completed", 0),
            "failed": k.get("requests_failed", 0),
            "cancelled": k.get("cancelled", 0),
            "busy_rejections": k.get("busy_rejections", 0),
            "share_preemptions": k.get("share_preemptions", 0),
            "protocol_errors": k.get("protocol_errors", 0),
            "refused_registrations": k.get("refused_registrations", 0),
        },
        "uptime_s": g.get("uptime_s", 0.0),
        "draining": bool(g.get("broker_draining", 0.0)),
    }


def render(s: dict[str, Any], address: str) -> str:
    mib = 2**20
    lines = [
        f"epdq broker {address}   up {s['uptime_s']:.0f}s   {time.strftime('%H:%M:%S')}"
        + ("   DRAINING: new requests are refused" if s.get("draining") else ""),
        "",
        f"{'worker':<28} {'role':<8} {'node':<14} {'inflight':>9} {'ring used/cap MiB':>18} {'pinned MiB':>10}",
    ]
    for w in sorted(s["workers"], key=lambda w: (w["role"], w["worker_id"])):
        ring = f"{w.get('ring_used', 0) / mib:.1f}/{w.get('ring_capacity', 0) / mib:.0f}" if w.get("ring_capacity") else "-"
        pinned = f"{w.get('ring_pinned', 0) / mib:.1f}" if w.get("ring_capacity") else "-"
        lines.append(
            f"{w['worker_id'][:28]:<28} {w['role'] + ('*' if w.get('draining') else ''):<8} {w['node'][:14]:<14} "
            f"{w['inflight']:>4}/{w['capacity']:<4} {ring:>18} {pinned:>10}"
        )
    q, c, r = s["queues"], s["cache"], s["requests"]
    if any(w.get("draining") for w in s["workers"]):
        lines.append("(* draining: finishing its work before it leaves; nothing new is sent to it)")
    lines += [
        "",
        f"queues: waiting for encode {q['waiting_for_encode']:.0f}, ready for PD {q['ready_for_pd']:.0f}, "
        f"running {q['running']:.0f}, encode queue {q['encode_queue']:.0f}, encoding {q['encodes_inflight']:.0f}",
        f"cache: hit rate {c['hit_rate']:.1%} ({c['hits']} hits, {c['dedup_joins']} joined, {c['encodes']} encoded, "
        f"{c['evictions']} evicted)",
        f"requests: {r['completed']} completed, {r['failed']} failed, {r.get('cancelled', 0)} cancelled, "
        f"{r['busy_rejections']} busy, "
        # queued requests of a client over its share, turned away for another client's
        + (f"{r['share_preemptions']} made room, " if r.get("share_preemptions") else "")
        + f"{r['protocol_errors']} malformed messages"
        # a client key trying to join as a worker, or a worker started with the wrong key
        + (f", {r['refused_registrations']} refused worker registrations" if r.get("refused_registrations") else ""),
    ]
    return "\n".join(lines)


async def show(address: str, *, once: bool, as_json: bool, interval: float = 1.0, **client_kw: Any) -> None:
    """Print the summary once, or every `interval` seconds. The live view outlasts the broker: while
    it does not answer (a restart, a rolling upgrade) it says since when, and resumes when it does."""
    async with AsyncClient(address, **client_kw) as c:
        down_since: float | None = None
        while True:
            try:
                s = summary(await c.stats(timeout=5.0 if once else min(5.0, max(1.0, 2 * interval))))
            except BrokerUnavailableError as e:
                if once:
                    raise
                down_since = down_since or time.time()
                _emit(json.dumps({"error": e.code, "message": e.message, "since": down_since}) if as_json else
                      f"epdq broker {address}   UNREACHABLE since {time.strftime('%H:%M:%S', time.localtime(down_since))} "
                      f"({time.time() - down_since:.0f}s): {e.message}; retrying", as_json)  # fmt: skip
                await asyncio.sleep(interval)
                continue
            down_since = None
            _emit(json.dumps(s) if as_json else render(s, address), as_json, redraw=not once)
            if once:
                return
            await asyncio.sleep(interval)


def _emit(text: str, as_json: bool, redraw: bool = True) -> None:
    if not as_json and redraw and sys.stdout.isatty():
        sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
    print(text, flush=True)
