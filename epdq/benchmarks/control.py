"""Control-plane benchmark: epdq's broker + workers with no-op engines against an HTTP proxy.

Both systems get the same requests, side by side in one run: each cell (workload, concurrency)
is measured in rounds (`--rounds`, default 4), its systems taking turns in each round on the
same images, and a round's ratio compares runs seconds apart. Figures pool the rounds; the
ratio table also shows the spread of the per-round ratios.

- **epdq**: a real cluster (broker, one encoder, one PD worker as processes, no-op engines: the
  real worker, ring and broker code, no model) driven by one `AsyncClient`. Workloads: `miss`
  (a fresh 64x64 PNG per request: broker -> encoder -> ring -> PD), `hit` (one repeated image:
  the encoder is skipped), `text` (no image: no encoder hop).
- **http**: three uvicorn servers shaped like vLLM's disaggregated-encoder proxy (see
  `epdq.benchmarks.http_proxy`), driven by an aiohttp client posting OpenAI chat requests with
  the same image bytes as base64 `data:` URLs. Variants: `http-vllm` (a new upstream connection
  per call, as vLLM's proxy is configured) and `http-keepalive`. Workloads `image` (epdq's miss
  images), `image-repeat` (epdq's one hit image, in the hit cell's rounds: the proxy has no
  embedding cache, so a repeated image costs it what a fresh one does) and `text`.

Every request asks for max_tokens=1, so end-to-end latency is the latency the control plane
adds. Each phase also records the CPU time every process of the system used (user + system, all
threads, from /proc; the client is this process), per request: where a 2-core machine's time
goes. Targets (epdq vs the HTTP proxy): >= 5x throughput, <= 1/3 latency, >= 10,000 routed
requests per second.

`python -m epdq.benchmarks.control [--requests N] [--concurrency 1 32] [--out DIR]`
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdq.benchmarks.control_report import (
    BASELINE_WORKLOAD,
    EPDQ,
    HTTP_KEEPALIVE,
    HTTP_REPEAT,
    HTTP_VLLM,
    plot_png,
    print_tables,
    ratios_to_proxy,
    targets_judged,
)
from epdq.benchmarks.report import (
    Progress,
    check_out_dir,
    percentile,
    remove_stale,
    sigterm_unwinds,
    write_json,
)
from epdq.cpus import format_cpus, parse_cpu_list, pin_process

PIN_ROLES = ("client", "broker", "encoder", "pd")
SERVER_ROLES = PIN_ROLES[1:]  # the system's own processes (the client is this one)
HTTP_ROLE = {"broker": "proxy"}
IMAGE_SIZE = (64, 64)
PROMPT = "Describe this image."
MAX_CONCURRENCY = 1024  # the broker's default queue bound: beyond it requests are refused, not measured
MAX_REQUESTS = 1_000_000  # per phase (and warm-up requests per system and workload)
# fresh images are made before the run (~0.5 KB and ~0.1 ms each): warm-up + requests x levels
MAX_IMAGES = 2_000_000
IMAGE_CHUNK = 256  # images made between two yields to the event loop (Ctrl-C is handled there)
DEFAULT_ROUNDS = 4
MAX_ROUNDS = 1000


class _Images:
    """Distinct PNGs for 'miss' requests (every byte string unique), made ahead of time."""

    def __init__(self, n: int, items: list[bytes] | None = None):
        from epdq.demo import demo_image

        # demo_image stamps its seed into the pixels, so every seed gives a distinct picture
        self.items = [demo_image(seed, IMAGE_SIZE) for seed in range(1, n + 1)] if items is None else items
        self.hit = demo_image(0, IMAGE_SIZE)  # never among the fresh ones (seed 0)
        self._next = 0

    @classmethod
    async def make(cls, n: int) -> _Images:
        """The same images, made in chunks with a yield to the event loop between them: Ctrl-C
        (which cancels the main task) stops a large run here at once, not after the last image."""
        from epdq.demo import demo_image

        items: list[bytes] = []
        for start in range(1, n + 1, IMAGE_CHUNK):
            await asyncio.sleep(0)
            items.extend(demo_image(seed, IMAGE_SIZE) for seed in range(start, min(n + 1, start + IMAGE_CHUNK)))
        return cls(n, items)

    def take(self, n: int) -> list[bytes]:
        out = self.items[self._next : self._next + n]
        if len(out) < n:
            raise RuntimeError("image pool exhausted")
        self._next += n
        return out


@dataclass(slots=True)
class _Run:
    """One system's requests in one round of a cell: what `_summary` pools over the rounds."""

    requests: int
    wall_s: float
    lat: list[float]
    errors: list[str]
    cpu_s: dict[str, float | None] = field(default_factory=dict)  # CPU seconds per role in the round

    @property
    def rps(self) -> float:
        return len(self.lat) / self.wall_s if self.wall_s > 0 else float("nan")


async def _drive(
    send: Callable[[int], Awaitable[None]], count: int, concurrency: int, progress: Progress | None
) -> _Run:
    """`count` calls of send(i) with `concurrency` in flight; latencies and throughput."""
    lat: list[float] = []
    errors: list[str] = []
    counter = iter(range(count))
    perf = time.perf_counter

    async def lane() -> None:
        for i in counter:
            t = perf()
            try:
                await send(i)
            except Exception as e:  # counted and reported, never hidden
                errors.append(f"{type(e).__name__}: {e}"[:200])
            else:
                lat.append(perf() - t)
            if progress is not None:
                progress.advance()

    t0 = perf()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return _Run(count, perf() - t0, lat, errors)


def _summary(runs: list[_Run]) -> dict[str, Any]:
    """One system's figures for a cell: its rounds pooled (requests, wall time, every latency and
    CPU second), and each round's throughput on its own."""
    lat = [x for r in runs for x in r.lat]
    errors = [e for r in runs for e in r.errors]
    wall = sum(r.wall_s for r in runs)
    cpu_s: dict[str, float | None] = {}  # a role unknown in any round is unknown for the cell
    for r in runs:
        for role, v in r.cpu_s.items():
            prev = cpu_s.get(role, 0.0)
            cpu_s[role] = None if v is None or prev is None else prev + v
    return {
        "requests": sum(r.requests for r in runs),
        "ok": len(lat),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": wall,
        "rps": len(lat) / wall if wall > 0 else float("nan"),
        "p50_ms": percentile(lat, 50) * 1e3,
        "p90_ms": percentile(lat, 90) * 1e3,
        "p99_ms": percentile(lat, 99) * 1e3,
        "mean_ms": (sum(lat) / len(lat) * 1e3) if lat else float("nan"),
        "rounds": len(runs),
        "round_rps": [r.rps for r in runs],
        "cpu_us_per_request": _cpu_per_request_us(cpu_s, len(lat)),
    }


# ------------------------------------------------------------------ the two systems

_TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) a live process has used; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15)


def _cpu_snapshot(pids: dict[str, int]) -> dict[str, float | None]:
    return {role: _cpu_s(pid) for role, pid in pids.items()}


def _cpu_delta(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, float | None]:
    """CPU seconds each role used between two snapshots (None where either is unknown)."""
    return {role: None if t0 is None or b.get(role) is None else b[role] - t0 for role, t0 in a.items()}  # type: ignore[operator]


def _cpu_per_request_us(cpu_s: dict[str, float | None], n: int) -> dict[str, float]:
    out = {role: v / n * 1e6 for role, v in cpu_s.items() if v is not None and n > 0}
    if out:
        out["total"] = sum(out.values())
    return out


CREDIT_FLAGS = {"encoder": "--encoder-credit", "encoder_max_batch": "--encoder-batch", "pd": "--pd-credit"}


def credit_options(credits: dict[str, int] | None) -> dict[str, dict[str, int]]:
    """{"encoder": credit, "encoder_max_batch": images a forward, "pd": credit}, any of them left
    out for the workers' default, as ClusterSpec.role_options; ValueError naming the flag for a
    value the worker would refuse."""
    from epdq.worker.runner import WorkerConfig

    credits = credits or {}
    unknown = set(credits) - set(CREDIT_FLAGS)
    if unknown:
        raise ValueError(f"credits: {', '.join(sorted(unknown))} is not one of {', '.join(CREDIT_FLAGS)}")
    for k, v in credits.items():
        if type(v) is not int or not 1 <= v <= 4096:
            raise ValueError(f"{CREDIT_FLAGS[k]} must be 1..4096, not {v!r}")
    enc = {f: credits[k] for k, f in (("encoder", "capacity"), ("encoder_max_batch", "max_batch")) if k in credits}
    out = {"encoder": enc} if enc else {}
    if "pd" in credits:
        out["pd"] = {"capacity": credits["pd"]}
    try:
        WorkerConfig(role="encoder", **out.get("encoder", {}))
    except ValueError as e:
        raise ValueError(str(e).replace("max_batch", "--encoder-batch").replace("capacity", "--encoder-credit")) from None
    return out


def _credits(options: dict[str, dict[str, int]]) -> dict[str, int]:
    """The workers' credits and the encoder's batch as the benchmark's cluster runs them: they
    decide how requests move through the stages at concurrency 32."""
    from epdq.worker.runner import WorkerConfig

    enc = WorkerConfig(role="encoder", **options.get("encoder", {}))
    pd = WorkerConfig(role="pd", **options.get("pd", {}))
    return {"encoder": enc.capacity, "encoder_max_batch": enc.max_batch, "pd": pd.capacity}


class _EpdqSystem:
    def __init__(self, tmp: Path, cpus: dict[str, tuple[int, ...]] | None = None, role_options: dict | None = None):
        self.tmp = tmp
        self.role_options = role_options or {}
        self.cpus = {r: c for r, c in (cpus or {}).items() if r in SERVER_ROLES}
        self.cluster = None
        self.client = None

    async def start(self) -> None:
        from epdq.broker import BrokerConfig
        from epdq.cluster import Cluster, ClusterSpec

        spec = ClusterSpec(
            address=f"ipc://{self.tmp}/b.sock", encoders=1, pds=1, worker_defaults={"engine": "noop"},
            log_dir=str(self.tmp / "epdq-logs"), start_timeout_s=120,
            broker=BrokerConfig(log_requests=False),  # as vLLM benchmarks run with --disable-log-requests
            cpus=self.cpus, role_options=self.role_options,
        )  # fmt: skip
        self.cluster = Cluster(spec)
        await self.cluster.start()
        self.client = self.cluster.client()
        await self.client.connect()

    async def phase(self, workload: str, images: list[bytes], hit: bytes, n: int, conc: int, prog) -> _Run:
        c = self.client
        assert c is not None

        if workload == "miss":

            async def send(i: int) -> None:
                await c.generate(PROMPT, images=[images[i]], max_tokens=1)
        elif workload == "hit":

            async def send(i: int) -> None:
                await c.generate(PROMPT, images=[hit], max_tokens=1)
        else:

            async def send(i: int) -> None:
                await c.generate(PROMPT, max_tokens=1)

        return await _drive(send, n, conc, prog)

    async def stats(self) -> dict:
        return await self.client.stats() if self.client is not None else {}

    def pids(self) -> dict[str, int]:
        roles = {"broker": "broker", "encoder-0": "encoder", "pd-0": "pd"}
        out = {roles[c.name]: c.proc.pid for c in self.cluster.children if c.name in roles} if self.cluster else {}
        return out | {"client": os.getpid()}

    async def stop(self) -> None:
        try:
            if self.client is not None:
                await self.client.close()
        finally:
            self.client = None
            if self.cluster is not None:
                await asyncio.to_thread(self.cluster.stop)
                self.cluster = None


class _HttpSystem:
    def __init__(self, tmp: Path, cpus: dict[str, tuple[int, ...]] | None = None):
        from epdq.benchmarks.http_proxy import HttpBaseline

        self.baseline = HttpBaseline(tmp / "http-logs")
        self.session = None
        # the proxy stands where epdq's broker does
        self.cpus = {HTTP_ROLE.get(r, r): c for r, c in (cpus or {}).items() if r in SERVER_ROLES}

    async def start(self) -> None:
        import aiohttp

        await self.baseline.start()
        for role, cpus in self.cpus.items():  # uvicorn servers: pinned from outside, as taskset -a -p
            pin_process(cpus, self.baseline.procs[role].pid)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
        )

    async def phase(
        self, keepalive: bool, workload: str, images: list[bytes], n: int, conc: int, prog
    ) -> _Run:
        s = self.session
        assert s is not None
        url = self.baseline.proxy_url(keepalive)
        headers = {"content-type": "application/json"}

        async def send(i: int) -> None:
            # what an OpenAI client does per request: base64 the image, JSON the body
            if workload == "image":
                url_ = "data:image/png;base64," + base64.b64encode(images[i]).decode()
                content: Any = [
                    {"type": "image_url", "image_url": {"url": url_}},
                    {"type": "text", "text": PROMPT},
                ]
            else:
                content = PROMPT
            body = {"model": "noop", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
            async with s.post(url, data=json.dumps(body), headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:100]}")
                json.loads(await r.read())

        return await _drive(send, n, conc, prog)

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.baseline.procs.items()} | {"client": os.getpid()}

    async def stop(self) -> None:
        try:
            if self.session is not None:
                await self.session.close()
        finally:
            self.session = None
            await asyncio.to_thread(self.baseline.stop)


# ------------------------------------------------------------------ run


def run(
    *,
    concurrency: Sequence[int] = (1, 32),
    requests: int = 2000,
    out_dir: str = "bench-results",
    plot: bool = True,
    progress: Progress | bool | None = None,
    http: bool = True,
    warmup: int | None = None,
    rounds: int | None = None,
    pin: dict[str, tuple[int, ...]] | None = None,
    credits: dict[str, int] | None = None,
) -> dict:
    """Run the benchmark, print the tables, write control.json (and control.png). Returns the data.

    `progress`: None shows a bar when stderr is a terminal, True always, False never (or pass a
    `Progress`). `warmup`: requests per system and workload before measuring (default
    max(20, requests // 10)). `rounds`: each cell's requests are measured in this many rounds, its
    systems taking turns in each (default min(4, requests)): the machine's speed drifts within a
    run, and a drift between two long phases would be taken for a difference between systems.
    `pin`: role (client, broker, encoder, pd) -> CPUs, the same placement for both systems (the
    HTTP proxy takes the broker's), see `parse_pin`; roles not named run where the kernel puts them.
    `credits`: epdq's worker credits, see `credit_options` (default: the workers' own)."""
    conc = [int(c) for c in concurrency]
    _check_args(conc, requests, warmup, rounds)
    warm = max(20, requests // 10) if warmup is None else int(warmup)
    rounds = min(DEFAULT_ROUNDS, requests) if rounds is None else int(rounds)
    pin = check_pin(pin or {})
    options = credit_options(credits)
    return _run_loop(_main(conc, requests, warm, rounds, Path(out_dir), plot, progress, http, pin, options))


def _check_args(conc: list[int], requests: int, warmup: int | None, rounds: int | None = None) -> None:
    if not conc or min(conc) < 1 or max(conc) > MAX_CONCURRENCY:
        raise ValueError(f"concurrency values must be 1..{MAX_CONCURRENCY}, not {conc}")
    if not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests must be >= 1 and at most {MAX_REQUESTS:,} per phase, not {requests}")
    if warmup is not None and not 0 <= warmup <= MAX_REQUESTS:
        raise ValueError(f"warmup must be >= 0 and at most {MAX_REQUESTS:,}, not {warmup}")
    if rounds is not None and (type(rounds) is not int or not 1 <= rounds <= min(requests, MAX_ROUNDS)):
        raise ValueError(f"rounds must be 1..{MAX_ROUNDS:,} and at most the requests per phase ({requests:,}), not {rounds}")
    warm = max(20, requests // 10) if warmup is None else warmup
    n = warm + requests * len(conc)
    if n > MAX_IMAGES:
        raise ValueError(f"at most {MAX_IMAGES:,} fresh images per run (warm-up + requests x concurrency levels: "
                         f"{warm:,} + {requests:,} x {len(conc)} = {n:,}), made before it starts; "
                         "lower --requests or give fewer levels")  # fmt: skip


def parse_pin(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`--pin` values: ROLE=CPUS (roles client, broker, encoder, pd, or all for every role not
    named; CPUS as `taskset -c`) -> role -> CPUs. ValueError for anything else."""
    out: dict[str, tuple[int, ...]] = {}
    rest: tuple[int, ...] | None = None
    for item in items:
        role, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--pin takes ROLE=CPUS (e.g. all=0 or broker=1), got {item!r}")
        if role != "all" and role not in PIN_ROLES:
            raise ValueError(f"--pin: {role!r} is not a role ({', '.join(PIN_ROLES)} or all)")
        if role in out or (role == "all" and rest is not None):
            raise ValueError(f"--pin names {role} twice")
        cpus = parse_cpu_list(value)
        if role == "all":
            rest = cpus
        else:
            out[role] = cpus
    if rest is not None:
        out = {r: out.get(r, rest) for r in PIN_ROLES}
    return check_pin(out)


def check_pin(pin: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    allowed = os.sched_getaffinity(0)
    for role, cpus in pin.items():
        if role not in PIN_ROLES:
            raise ValueError(f"pin: {role!r} is not a role ({', '.join(PIN_ROLES)})")
        if not cpus:
            raise ValueError(f"pin: give the {role} at least one CPU (or leave it out)")
        if set(cpus) - allowed:
            raise ValueError(f"pin: cpus {format_cpus(set(cpus) - allowed)} for the {role} not available "
                             f"here (this process may use {format_cpus(allowed)})")  # fmt: skip
    return {r: tuple(sorted(pin[r])) for r in PIN_ROLES if r in pin}


def placement(pin: dict[str, tuple[int, ...]]) -> str:
    """One line for the tables and the JSON: where each role ran."""
    if not pin:
        return "wherever the kernel put them (no --pin)"
    return ", ".join(f"{r} {format_cpus(pin[r])}" if r in pin else f"{r} free" for r in PIN_ROLES)


def _run_loop(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        return r.run(coro)


def _cells(conc: list[int], http: bool) -> list[tuple[int, list[tuple[str, str]]]]:
    """(concurrency, [(system, workload), ...]) in measuring order: each cell's systems carry
    the same requests and are compared with each other."""
    out = []
    for c in conc:
        for wl in ("miss", "hit", "text"):
            systems = [(EPDQ, wl)]
            if http:  # the hit cell too: its ratios were divided by image phases up to a minute away
                hw = BASELINE_WORKLOAD[wl]
                systems += [(HTTP_VLLM, hw), (HTTP_KEEPALIVE, hw)]
            out.append((c, systems))
    return out


def _split(n: int, rounds: int) -> list[int]:
    """`n` requests in `rounds` rounds as equal as they come (the first ones take the rest)."""
    q, r = divmod(n, rounds)
    return [q + (i < r) for i in range(rounds)]


def _turns(systems: list[tuple[str, str]], k: int) -> list[tuple[str, str]]:
    """Round `k`'s order: each system goes first in turn, so none always runs on the heels of
    the same neighbour (or always first, on caches the previous cell left)."""
    k %= len(systems)
    return systems[k:] + systems[:k]


async def _main(conc, requests, warm, rounds, out_dir: Path, plot, progress, http, pin=None, options=None) -> dict:
    pin, options = pin or {}, options or {}
    n_phases = sum(len(systems) for _, systems in _cells(conc, http))
    n_warm_phases = 3 + (4 if http else 0)  # epdq miss/hit/text, 2 variants x image/text
    total = n_phases * requests + n_warm_phases * warm
    if isinstance(progress, Progress):
        prog: Progress | None = progress
    elif progress is False:
        prog = None
    else:
        prog = Progress(total, "control-plane benchmark", force=bool(progress))

    images = await _Images.make(warm + requests * len(conc))
    miss_warm = images.take(warm)
    miss_by_conc = {c: images.take(requests) for c in conc}
    results: list[dict] = []
    info: dict[str, Any] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="epdq-bench-control-") as td:
        tmp = Path(td)
        ep = _EpdqSystem(tmp, pin, options)
        hp = _HttpSystem(tmp, pin) if http else None
        own_cpus = os.sched_getaffinity(0)
        try:
            await ep.start()
            if hp is not None:
                await hp.start()
            # the client last: the servers started before it would have inherited its set
            pin_process(pin.get("client", ()))
            top = max(conc)
            # warm-up: every system and workload, at the highest concurrency, before measuring
            for wl in ("miss", "hit", "text"):
                await ep.phase(wl, miss_warm, images.hit, warm, top, prog)
            if hp is not None:
                for ka in (False, True):
                    for wl in ("image", "text"):
                        await hp.phase(ka, wl, miss_warm, warm, top, prog)
            before = await ep.stats()
            for c, systems in _cells(conc, http):
                runs: dict[tuple[str, str], list[_Run]] = {s: [] for s in systems}
                start = 0
                for k, m in enumerate(_split(requests, rounds)):
                    # every system of the round gets the same images (epdq's misses: fresh ones)
                    imgs, start = miss_by_conc[c][start : start + m], start + m
                    for system, wl in _turns(systems, k):
                        pids = ep.pids() if system == EPDQ else hp.pids()  # type: ignore[union-attr]
                        cpu0 = _cpu_snapshot(pids)
                        if system == EPDQ:
                            run_ = await ep.phase(wl, imgs, images.hit, m, c, prog)
                        else:
                            assert hp is not None
                            repeat = wl == HTTP_REPEAT
                            run_ = await hp.phase(system == HTTP_KEEPALIVE, "image" if repeat else wl,
                                                  [images.hit] * m if repeat else imgs, m, c, prog)  # fmt: skip
                        run_.cpu_s = _cpu_delta(cpu0, _cpu_snapshot(pids))
                        runs[(system, wl)].append(run_)
                for system, wl in systems:
                    results.append({"system": system, "workload": wl, "concurrency": c, **_summary(runs[(system, wl)])})
            after = await ep.stats()
            info["epdq_broker_counters"] = _delta(before.get("counters", {}), after.get("counters", {}))
            # the credits as the broker has them from each worker's REGISTER
            info["epdq_workers"] = {w.get("worker_id", "?"): w.get("capacity") for w in after.get("workers", [])}
        finally:
            try:
                await ep.stop()
            finally:
                if pin.get("client"):
                    pin_process(tuple(own_cpus), widen=True)  # this process may go on to other work (a test run)
                if hp is not None:
                    await hp.stop()
    info["elapsed_s"] = time.perf_counter() - t_start

    ratios = ratios_to_proxy(results) if http else []
    targets = targets_judged(results, ratios, conc)
    print_tables(results, ratios, targets, requests)
    print(f"\nplacement: {placement(pin)}")

    data = {
        "config": {
            "concurrency": conc, "requests": requests, "warmup": warm, "rounds": rounds, "image": f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} PNG",
            "image_bytes_mean": sum(map(len, images.items)) / max(1, len(images.items)), "max_tokens": 1,
            "http": http, "epdq": "broker + 1 encoder + 1 PD worker (processes, no-op engines), ipc, one AsyncClient",
            "epdq_credits": _credits(options), "credits_set": options,
            "http_baseline": "uvicorn: no-op encoder, no-op PD, FastAPI+aiohttp proxy (3 processes); aiohttp client",
            "pin": {r: list(c) for r, c in pin.items()}, "placement": placement(pin),
        },
        "results": results,
        "ratios": ratios,
        "targets": targets,
        **info,
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale(out_dir / "control.png")  # an older run's plot must not stand beside this run's JSON
    path = write_json(out_dir / "control.json", "control", data)
    data["json_path"] = str(path)
    if plot:
        data["png_path"] = str(plot_png(results, out_dir / "control.png"))
    for r in results:
        if r["errors"]:
            print(
                f"WARNING: {r['system']} {r['workload']} at {r['concurrency']}: {r['errors']} errors, e.g. "
                f"{r['error_samples'][0]}"
            )
    print(f"\nwrote {path}" + (f" and {data['png_path']}" if plot else ""))
    return data


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0) for k in b if isinstance(b[k], (int, float))}


def main(argv: list[str] | None = None, prog: str = "python -m epdq.benchmarks.control") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32],
                    help="concurrency levels, each measured in turn (default: 1 32)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=2000,
                    help=f"measured requests per phase (at most {MAX_REQUESTS:,}; warm-up + requests x levels "
                    f"at most {MAX_IMAGES:,})")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up requests per system and workload (default max(20, requests / 10))")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"rounds per phase, the systems taking turns in each (default min({DEFAULT_ROUNDS}, requests))")

    ap.add_argument(
        "--out", "--out-dir", dest="out", default="bench-results", help="directory for control.json and control.png"
    )
    ap.add_argument("--no-plot", action="store_true", help="no control.png (an older one in --out is removed)")
    ap.add_argument("--no-http", action="store_true", help="epdq only (no HTTP baseline)")
    ap.add_argument("--progress", action="store_true", help="show the progress bar even when not a terminal")
    ap.add_argument("--pin", nargs="+", default=[], metavar="ROLE=CPUS",
                    help="run each role's processes on these CPUs, the same for both systems (roles client, broker "
                    "-- the HTTP proxy for the baseline --, encoder, pd, or all; CPUS as taskset -c), e.g. --pin all=0 "
                    "or --pin client=0 broker=1 encoder=0 pd=1; default: wherever the kernel puts them")  # fmt: skip
    ap.add_argument("--encoder-credit", type=int, default=None, metavar="N",
                    help="epdq's encoder holds this many jobs (default: the worker's, twice its batch)")
    ap.add_argument("--encoder-batch", type=int, default=None, metavar="N",
                    help="images one forward of epdq's encoder takes at most (default: the worker's, 8)")
    ap.add_argument("--pd-credit", type=int, default=None, metavar="N",
                    help="requests epdq's PD worker holds (default: the worker's, 16)")
    a = ap.parse_args(argv)
    # a level given twice would run its "miss" phase on the images of the first: all cache hits
    a.concurrency = list(dict.fromkeys(a.concurrency))
    try:
        _check_args(a.concurrency, a.requests, a.warmup, a.rounds)
        pin = parse_pin(a.pin)
        given = {"encoder": a.encoder_credit, "encoder_max_batch": a.encoder_batch, "pd": a.pd_credit}
        credits = {k: v for k, v in given.items() if v is not None}
        credit_options(credits)
        check_out_dir(a.out, ("control.json", "control.png"))
    except ValueError as e:
        ap.error(str(e))
    with sigterm_unwinds():  # the cluster and the HTTP servers stopped, the temporary directory removed
        run(concurrency=a.concurrency, requests=a.requests, out_dir=a.out, plot=not a.no_plot,
            progress=True if a.progress else None, http=not a.no_http, warmup=a.warmup, rounds=a.rounds, pin=pin,
            credits=credits)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
