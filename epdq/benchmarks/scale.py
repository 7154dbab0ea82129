"""The pure scheduling logic at scale: 1,000 simulated workers and 100,000 queued requests.

Drives `epdq.scheduler.Scheduler` in-process (injected clock, no sockets): registers encoders and
PD workers, submits every request at once (a mix of text-only and 1-4 image requests, some
images repeated from a hot set), then completes work in a loop (`on_encoded`, first-token and
final `on_tokens`) until every request is done. Measured per call: submit, encode completion,
first token, final token (each call includes the dispatch decisions it triggers), and the cost per
decision (SendEncode / SendPrefill). A second pass under tracemalloc measures memory: peak,
and bytes per queued request. Probes time the operations suspected to be O(n) per call
(`gauges()`, `remove_worker` of an encoder with a large index, route "auto" at submit, completed
requests lingering in the deadline and lease heaps).

`python -m epdq.benchmarks.scale [--workers 1000 --requests 100000]` prints tables and writes
`bench-results/scale.json`.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from collections import deque
from pathlib import Path
from typing import Any

from epdq.benchmarks.report import Progress, check_out_dir, percentile, table, write_json
from epdq.jobs import Role, SendEncode, SendPrefill
from epdq.protocol import EmbedRef
from epdq.scheduler import Scheduler, SchedulerConfig

_IMAGE = b"\0" * 64  # the scheduler only keeps a reference and counts bytes


BROKER_TICK_S = 0.05  # how often the broker calls Scheduler.expire (epdq.broker: its _tick)


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _make_requests(
    n: int, seed: int, hot_set: int, repeat_fraction: float, text_only: float
) -> list[list[bytes]]:
    rng = random.Random(seed)
    out, fresh = [], 0
    for _ in range(n):
        if rng.random() < text_only:
            out.append([])
            continue
        keys = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < repeat_fraction:
                keys.append(b"hot-%06d" % rng.randrange(hot_set))
            else:
                keys.append(b"img-%08d" % fresh)
                fresh += 1
        out.append(keys)
    return out


def _ref(key: bytes, wid: str, node: str) -> EmbedRef:
    return EmbedRef(key, wid, node, "seg", 0, 1 << 20, 1, "bfloat16", [256, 2048], [1, 32, 32], "")


class _Driver:
    def __init__(self, encoders: int, pds: int, nodes: int, timed: bool) -> None:
        self.clock = _Clock()
        self.s = Scheduler(SchedulerConfig(max_queued_requests=10**8, max_held_image_bytes=2**62,
                                           max_timeout_s=10**6), clock=self.clock)  # fmt: skip
        self.timed = timed
        self.times: dict[str, list[float]] = {
            k: [] for k in ("add_worker", "submit", "encoded", "first_token", "finished", "tick")
        }
        self.decisions = {"encode": 0, "prefill": 0}
        self.decision_time = {"encode": 0.0, "prefill": 0.0}
        self.encodes: deque = deque()
        self.prefills: deque = deque()
        self.node_of: dict[str, str] = {}
        self.workers = [(f"enc-{i}", Role.ENCODER, 8) for i in range(encoders)]
        self.workers += [(f"pd-{i}", Role.PD, 16) for i in range(pds)]
        self.nodes = nodes

    def _call(self, kind: str, fn, *args) -> None:
        if self.timed:
            t0 = time.perf_counter()
            fn(*args)
            dt = time.perf_counter() - t0
            self.times[kind].append(dt)
        else:
            fn(*args)
            dt = 0.0
        n_enc = n_pf = 0
        for a in self.s.take_actions():
            if isinstance(a, SendEncode):
                self.encodes.append((a.worker_id, a.job))
                n_enc += 1
            elif isinstance(a, SendPrefill):
                self.prefills.append((a.worker_id, a.request.rid))
                n_pf += 1
        if n_enc + n_pf:  # attribute the call's time to the decisions it made, in proportion
            self.decisions["encode"] += n_enc
            self.decisions["prefill"] += n_pf
            self.decision_time["encode"] += dt * n_enc / (n_enc + n_pf)
            self.decision_time["prefill"] += dt * n_pf / (n_enc + n_pf)

    def add_workers(self) -> None:
        for i, (wid, role, cap) in enumerate(self.workers):
            node = f"node-{i % self.nodes}"
            self.node_of[wid] = node
            self._call("add_worker", self.s.add_worker, wid, role, node, cap)

    def submit_all(self, reqs: list[list[bytes]], bar: Progress | None) -> None:
        for i, keys in enumerate(reqs):
            self.clock.t += 1e-6
            self._call(
                "submit", self.s.submit, f"r{i}", b"client", keys, [_IMAGE] * len(keys), 3600.0, None, "epd"
            )
            if bar is not None and i % 1000 == 999:
                bar.advance(1000)

    def drain(self, total: int, bar: Progress | None) -> int:
        done = 0
        tick = self.clock.t
        while self.encodes or self.prefills:
            self.clock.t += 1e-5
            if self.clock.t >= tick + BROKER_TICK_S:  # as the broker's timer: expiries, lingering pins
                tick = self.clock.t
                self._call("tick", self.s.expire)
            if self.encodes:
                wid, job = self.encodes.popleft()
                self._call(
                    "encoded", self.s.on_encoded, wid, job.job_id, _ref(job.key, wid, self.node_of[wid])
                )
            if self.prefills:
                wid, rid = self.prefills.popleft()
                self._call("first_token", self.s.on_tokens, wid, rid, False)
                self._call("finished", self.s.on_tokens, wid, rid, True)
                done += 1
                if bar is not None and done % 1000 == 0:
                    bar.advance(1000)
        self.clock.t += BROKER_TICK_S  # and the broker's next tick: the last pins no request holds go
        self._call("tick", self.s.expire)
        return done


def _stats(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_us": percentile(xs, 50) * 1e6, "p99_us": percentile(xs, 99) * 1e6,
            "max_us": max(xs) * 1e6 if xs else float("nan"), "total_s": sum(xs)}  # fmt: skip


def _probe(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(
    *, workers: int = 1000, requests: int = 100_000, encoder_share: float = 0.2, nodes: int = 50, hot_set: int = 1000,
    repeat_fraction: float = 0.3, text_only: float = 0.2, seed: int = 0, memory: bool = True,
    out_dir: str = "bench-results", plot: bool = True, progress=None,
) -> dict[str, Any]:  # fmt: skip
    """Run the scale benchmark; print tables; write scale.json. `plot` is accepted for symmetry (no plot)."""
    del plot
    _check_args(workers, requests, encoder_share, nodes, hot_set, repeat_fraction, text_only)
    encoders, pds = split_workers(workers, encoder_share)
    reqs = _make_requests(requests, seed, hot_set, repeat_fraction, text_only)
    n_images = sum(len(k) for k in reqs)
    bar = (
        progress
        if progress is not None
        else Progress(2 * requests * (2 if memory else 1), "scheduler at scale")
    )

    # ---- pass 1: timing
    gc.collect()
    d = _Driver(encoders, pds, nodes, timed=True)
    t0 = time.perf_counter()
    d.add_workers()
    d.submit_all(reqs, bar)
    t_submit = time.perf_counter() - t0
    peak_queued = d.s.queued
    # probes at the peak: every request queued
    probes: dict[str, Any] = {}
    probes["gauges_at_peak_ms"] = _probe(d.s.gauges) * 1e3
    probes["expire_nothing_due_us"] = _probe(d.s.expire) * 1e6
    probes["resolve_route_auto_us"] = _probe(lambda: d.s._resolve_route("auto"), 50) * 1e6
    probes["resolve_route_epd_us"] = _probe(lambda: d.s._resolve_route("epd"), 50) * 1e6
    t1 = time.perf_counter()
    done = d.drain(requests, bar)
    t_drain = time.perf_counter() - t1
    index_entries = len(d.s.index)
    probes["index_entries_after"] = index_entries
    probes["deadline_heap_after"] = len(d.s._deadlines)
    probes["lease_heap_after"] = len(d.s._leases)
    probes["jobs_by_id_after"] = len(d.s._jobs_by_id)
    # an encoder owning 1/encoders of the index leaves: remove_worker drops the keys the scheduler
    # keeps for that encoder (it no longer scans the whole index)
    victim = "enc-0"
    owned = sum(1 for e in d.s.index.values() if e.ref.encoder_id == victim)
    t2 = time.perf_counter()
    d.s.remove_worker(victim)
    probes["remove_encoder_ms"] = (time.perf_counter() - t2) * 1e3
    probes["remove_encoder_owned_entries"] = owned
    probes["gauges_after_ms"] = _probe(d.s.gauges) * 1e3
    # remove_worker of a PD worker, for comparison (iterates only its own in-flight set)
    t3 = time.perf_counter()
    d.s.remove_worker("pd-0")
    probes["remove_pd_ms"] = (time.perf_counter() - t3) * 1e3
    # an encoder that owns no entry leaving a scheduler whose index holds 1,000 (another's)
    small = Scheduler(SchedulerConfig())
    small.add_worker("e", Role.ENCODER, "n", 8)
    small.add_worker("x", Role.ENCODER, "n", 8)
    for i in range(1000):
        small.index.add(_ref(b"k%d" % i, "x", "n"), pinned=False)
    probes["remove_encoder_index_1k_ms"] = _probe(lambda: (small.add_worker("e", Role.ENCODER, "n", 8),
                                                           small.remove_worker("e"))) * 1e3  # fmt: skip

    timing = {k: _stats(v) for k, v in d.times.items()}
    per_decision = {k: (d.decision_time[k] / d.decisions[k] * 1e6 if d.decisions[k] else float("nan"))
                    for k in d.decisions}  # fmt: skip
    decisions = dict(d.decisions)

    # ---- pass 2: memory
    mem: dict[str, Any] = {}
    if memory:
        del d
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        m = _Driver(encoders, pds, nodes, timed=False)
        m.add_workers()
        after_workers = tracemalloc.get_traced_memory()[0]
        m.submit_all(reqs, bar)
        after_submit = tracemalloc.get_traced_memory()[0]
        m.drain(requests, bar)
        after_drain, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        mem = {
            "workers_bytes": after_workers - base,
            "bytes_per_worker": (after_workers - base) / len(m.workers),
            "queued_bytes": after_submit - after_workers,
            "bytes_per_queued_request": (after_submit - after_workers) / requests,
            "peak_bytes": peak - base,
            "after_drain_bytes": after_drain - base,
            "after_drain_index_entries": len(m.s.index),
            "note": "includes the driver's own action queues; the index keeps every embedding (no eviction here)",
        }
        del m
        gc.collect()
    if progress is None:
        bar.advance(bar.total - bar.done)

    res = {
        "workers": {"encoders": encoders, "pds": pds, "nodes": nodes, "encoder_credit": 8, "pd_credit": 16,
                    "encoder_share": encoder_share},
        "seed": seed,
        "requests": requests, "images": n_images, "completed": done, "peak_queued": peak_queued,
        "workload": {"text_only": text_only, "images_per_request": "1-4 uniform", "repeat_fraction": repeat_fraction,
                     "hot_set": hot_set},
        "seconds": {"submit_all": t_submit, "drain_all": t_drain, "total": t_submit + t_drain},
        "per_call": timing,
        "per_decision_us": per_decision,
        "decisions": decisions,
        "probes": probes,
        "memory": mem,
    }  # fmt: skip
    _print(res)
    out = Path(out_dir) / "scale.json"
    write_json(out, "scale", res)
    print(f"\nwrote {out}")
    return res


def _print(res: dict[str, Any]) -> None:
    w = res["workers"]
    print(f"\nScheduler at scale: {w['encoders']} encoders + {w['pds']} PD workers on {w['nodes']} nodes, "
          f"{res['requests']:,} requests ({res['images']:,} images) submitted at once, then completed; "
          f"total {res['seconds']['total']:.1f} s")  # fmt: skip
    labels = {"add_worker": "add_worker", "submit": "submit (incl. dispatch)", "encoded": "on_encoded (incl. dispatch)",
              "first_token": "on_tokens, first", "finished": "on_tokens, finished (incl. dispatch)",
              "tick": "expire, every 50 ms (incl. unpins)"}  # fmt: skip
    rows = [
        [labels[k], v["n"], v["p50_us"], v["p99_us"], v["max_us"], v["total_s"]]
        for k, v in res["per_call"].items()
    ]
    print(table(["call", "calls", "p50 µs", "p99 µs", "max µs", "total s"], rows, title="Time per call"))
    pd = res["per_decision_us"]
    print(
        table(
            ["decision", "µs each (call time shared among the decisions it made)"],
            [["SendEncode", pd["encode"]], ["SendPrefill", pd["prefill"]]],
            title="Time per dispatch decision",
        )
    )
    p = res["probes"]
    rows = [
        [f"gauges() with {res['peak_queued']:,} queued", _ms(p["gauges_at_peak_ms"]), "O(1): counts kept at every state change"],
        ["gauges() after drain", _ms(p["gauges_after_ms"]), f"index holds {p['index_entries_after']:,} entries"],
        ["remove_worker(encoder)", _ms(p["remove_encoder_ms"]),
         f"drops its own {p['remove_encoder_owned_entries']:,} entries (keys kept per encoder), not a scan of the "
         f"index ({p['index_entries_after']:,})"],
        ["add+remove_worker(encoder owning none), 1k index", _ms(p["remove_encoder_index_1k_ms"]),
         "no scan: its cost does not grow with the index"],
        ["remove_worker(pd)", _ms(p["remove_pd_ms"]), "only its in-flight set"],
        ["_resolve_route('auto')", f"{p['resolve_route_auto_us']:.1f} µs", "O(1): workers counted by role"],
        ["_resolve_route('epd')", f"{p['resolve_route_epd_us']:.2f} µs", ""],
        ["expire(), nothing due", f"{p['expire_nothing_due_us']:.1f} µs", "heap top only (plus a dispatch)"],
        ["deadline heap after drain", f"{p['deadline_heap_after']:,}", "entries of finished requests linger to their deadline"],
        ["lease heap after drain", f"{p['lease_heap_after']:,}", "entries of finished encodes linger to their lease expiry"],
    ]  # fmt: skip
    print(table(["probe", "value", "why"], rows, title="Operations once suspected to be O(n) per call"))
    m = res["memory"]
    if m:
        rows = [["per worker", f"{m['bytes_per_worker']:,.0f} B"],
                ["per queued request (incl. its keys, job, users)", f"{m['bytes_per_queued_request']:,.0f} B"],
                [f"{res['requests']:,} queued, total", f"{m['queued_bytes'] / 2**20:,.1f} MiB"],
                ["peak (tracemalloc)", f"{m['peak_bytes'] / 2**20:,.1f} MiB"],
                ["after drain", f"{m['after_drain_bytes'] / 2**20:,.1f} MiB ({m['after_drain_index_entries']:,} index entries)"]]  # fmt: skip
        print(table(["memory", "value"], rows, title="Memory (tracemalloc)"))


def _ms(ms: float) -> str:
    """A probe's time in ms, or in µs below 1 ms (gauges() printed "0.0 ms")."""
    if ms >= 1:
        return f"{ms:.1f} ms"
    us = ms * 1e3
    return f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs" if us >= 1 else f"{us:.2f} µs"


def split_workers(workers: int, encoder_share: float) -> tuple[int, int]:
    """(encoders, PD workers): `encoder_share` of `workers`, rounded, with at least one of each and
    `workers` in all (2 workers at a share of 0.9 used to make 2 encoders + 1 PD)."""
    encoders = min(workers - 1, max(1, round(workers * encoder_share)))
    return encoders, workers - encoders


def _check_args(
    workers: int, requests: int, encoder_share: float, nodes: int, hot_set: int = 1, repeat_fraction: float = 0.0,
    text_only: float = 0.0,
) -> None:  # fmt: skip
    if not 2 <= workers <= 1_000_000:
        raise ValueError(f"workers must be 2..1000000 (at least one encoder and one PD), not {workers}")
    if not 1 <= requests <= 10_000_000:
        raise ValueError(f"requests must be 1..10000000, not {requests}")
    if not 0 < encoder_share < 1:
        raise ValueError(f"encoder_share must be between 0 and 1 (exclusive), not {encoder_share}")
    if not 1 <= nodes <= workers:
        raise ValueError(f"nodes must be 1..workers ({workers}), not {nodes}")
    if hot_set < 1:
        raise ValueError(f"hot_set must be >= 1, not {hot_set}")
    for name, v in (("repeat_fraction", repeat_fraction), ("text_only", text_only)):
        if not 0 <= v <= 1:
            raise ValueError(f"{name} must be in [0, 1], not {v}")


def main(argv: list[str] | None = None, prog: str = "python -m epdq.benchmarks.scale") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--encoder-share", type=float, default=0.2,
                    help="share of --workers that are encoders, rounded; at least one encoder and one PD worker")
    ap.add_argument("--nodes", type=int, default=None, help="nodes the workers spread over (default: 50, at most --workers)")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    ap.add_argument(
        "--out", "--out-dir", dest="out_dir", default="bench-results", help="directory for scale.json"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true", help="accepted as by the other benchmarks (this one draws none)")
    a = ap.parse_args(argv)
    nodes = min(50, a.workers) if a.nodes is None else a.nodes
    try:
        _check_args(a.workers, a.requests, a.encoder_share, nodes)
        check_out_dir(a.out_dir, ("scale.json",))
    except ValueError as e:
        ap.error(str(e))
    run(workers=a.workers, requests=a.requests, encoder_share=a.encoder_share, nodes=nodes,
        memory=not a.no_memory, out_dir=a.out_dir, seed=a.seed)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
