"""The goodput benchmark's `real` kind: the tiny random Qwen2-VL on CPU in real processes.

One cluster (`epdq.cluster.Cluster`) holds both systems on the same engine: 1 encoder + N PD
workers (route "epd") and N+1 colocated workers (route "colocated"). Each offered load runs a
window of Poisson arrivals on one route, then the same arrivals (fresh images) on the other; the
idle system's processes sleep meanwhile. A system that misses the SLOs at a load is not offered
higher ones. A load point meets the SLOs when every request
finished and P99 TTFT and P99 TPOT are within them; a system's goodput is its within-SLO rate at
the highest offered load that meets them. The tiny model's vision tower is cheap, so this kind
shows the pipeline working end to end under load rather than a large EPD gain.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdq.benchmarks.report import percentile, table

ROUTES = ("epd", "colocated")


@dataclass(frozen=True, slots=True)
class RealConfig:
    n_pd: int = 1  # EPD: 1 encoder + n_pd PD workers; colocated: n_pd + 1 workers
    qps: tuple[float, ...] = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
    window_s: float = 8.0  # seconds of Poisson arrivals per load point (at least 3 requests)
    refine: int = 2  # bisection steps between the highest load met and the lowest missed
    images_per_request: int = 2
    image_size: tuple[int, int] = (224, 224)
    max_tokens: int = 16
    ttft_slo_s: float = 1.0  # vLLM's 20 s x 0.05 for the tiny CPU model
    tpot_slo_s: float = 0.05  # vLLM's 100 ms x 0.5
    model: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.n_pd, int) and 1 <= self.n_pd <= 8):
            raise ValueError(f"pd workers must be 1..8 for the real kind (one machine), not {self.n_pd!r}")
        if not self.qps or not all(q > 0 for q in self.qps):
            raise ValueError(f"offered loads must be > 0, not {self.qps!r}")
        # ascending, each once: a route that misses the SLOs at a load is offered no higher one, so
        # an unsorted list skipped the loads after a high one and took a low load for its goodput
        object.__setattr__(self, "qps", tuple(sorted(set(self.qps))))
        if not (isinstance(self.refine, int) and 0 <= self.refine <= 8):
            raise ValueError(f"refine must be 0..8 steps, not {self.refine!r}")
        if not 0 < self.window_s <= 600:
            raise ValueError(f"window must be in (0, 600] seconds, not {self.window_s!r}")
        if max(self.qps) * self.window_s > 20_000:
            raise ValueError("at most 20,000 requests per load point (offered load x window)")
        if not 0 <= self.images_per_request <= 8:
            raise ValueError(f"images per request must be 0..8 (the broker's default limit), not {self.images_per_request!r}")
        if not all(14 <= v <= 4096 for v in self.image_size):
            raise ValueError(f"image size must be 14..4096 px a side, not {self.image_size!r}")
        if not 1 <= self.max_tokens <= 4096:
            raise ValueError(f"output tokens must be 1..4096, not {self.max_tokens!r}")
        if not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise ValueError("SLOs must be > 0 seconds")

    def requests(self, qps: float) -> int:
        return max(3, round(qps * self.window_s))


async def run_real(cfg: RealConfig, log=lambda _m: None) -> dict[str, Any]:
    from epdq.cluster import Cluster, ClusterSpec
    from epdq.demo import demo_image

    with tempfile.TemporaryDirectory(prefix="epdq-goodput-") as d:
        spec = ClusterSpec(address=f"ipc://{d}/broker.sock", encoders=1, pds=cfg.n_pd, both=cfg.n_pd + 1,
                           model=cfg.model, log_dir=f"{d}/logs", start_timeout_s=600)  # fmt: skip
        cluster = Cluster(spec)
        t0 = time.perf_counter()
        try:
            await cluster.start(progress=log)
            startup = time.perf_counter() - t0
            points = []
            async with cluster.client(timeout=120) as c:
                for i, route in enumerate(ROUTES):  # first compilations and caches out of the way
                    imgs = [demo_image(1 + i, cfg.image_size)] if cfg.images_per_request else []
                    await c.generate("warm up", images=imgs, max_tokens=2, route=route)
                seeds = iter(range(1000, 1 << 62, max(1, cfg.images_per_request)))

                async def point(route: str, qps: float) -> dict[str, Any]:
                    imgs = []
                    for _ in range(cfg.requests(qps)):
                        base = next(seeds)  # fresh images: every point is all cache misses
                        imgs.append([demo_image(base + j, cfg.image_size) for j in range(cfg.images_per_request)])
                    # the same arrival times for both routes at this load
                    p = await _point(c, cfg, route, qps, random.Random(cfg.seed + int(qps * 1000)), imgs)
                    log(f"real: {route} at {qps:g} QPS: TTFT p50 {p['ttft_p50']:.3f} s, "
                        f"within SLO {p['within_slo']}/{p['requests']}")  # fmt: skip
                    points.append(p)
                    return p

                missed: dict[str, float] = {}  # route -> lowest load that missed (none higher is offered)
                for qps in cfg.qps:
                    for route in ROUTES:
                        if route not in missed and not (await point(route, qps))["meets_slo"]:
                            missed[route] = qps
                for route, hi in missed.items():  # bisect (geometrically) between the grid's bracket
                    lo = max((p["offered_qps"] for p in points if p["route"] == route and p["meets_slo"]), default=0.0)
                    for _ in range(cfg.refine if lo else 0):
                        mid = bisect_load(lo, hi)
                        if mid is None:  # no load of 2 decimals left between them
                            break
                        if (await point(route, mid))["meets_slo"]:
                            lo = mid
                        else:
                            hi = mid
                stats = await c.stats()
        finally:
            await asyncio.to_thread(cluster.stop)
    goodput = {route: _goodput([p for p in points if p["route"] == route]) for route in ROUTES}
    return {
        "kind": "real", "startup_s": startup, "points": points, "counters": stats["counters"],
        "goodput_rps": goodput,
        # a route that met the SLOs at every offered load: its goodput is a lower bound
        "saturated_grid": {route: route not in missed for route in ROUTES},
        "seed": cfg.seed,
        "units": {"ttft_*": "s", "tpot_*": "s", "encode_*": "s", "*_s": "s", "offered_qps": "requests/s",
                  "goodput_rps": "requests/s"},
        "epd_over_colocated": goodput["epd"] / goodput["colocated"] if goodput["colocated"] else None,
        "workload": {"images_per_request": cfg.images_per_request, "image_size": list(cfg.image_size),
                     "max_tokens": cfg.max_tokens, "window_s": cfg.window_s, "offered_qps": list(cfg.qps)},
        "systems": {"epd": f"1 encoder + {cfg.n_pd} PD (route epd)",
                    "colocated": f"{cfg.n_pd + 1} colocated (route colocated)"},
        "slo": {"ttft_p99_s": cfg.ttft_slo_s, "tpot_p99_s": cfg.tpot_slo_s,
                "rule": "vLLM's 20 s / 100 ms scaled down for the tiny CPU model (x0.05 TTFT, x0.5 TPOT)"},
    }  # fmt: skip


def bisect_load(lo: float, hi: float) -> float | None:
    """The next load to offer between `lo` (met the SLOs) and `hi` (missed them): their geometric
    mean to 2 decimals, or None where that is `lo` or `hi` again (loads 1 and 1.01 ran 1 again,
    a second row for the same load)."""
    mid = round((lo * hi) ** 0.5, 2)
    return mid if lo < mid < hi else None


async def measure_point(
    c, route: str, qps: float, imgs: list[list[bytes]], rng: random.Random, *, max_tokens: int,
    ttft_slo_s: float, tpot_slo_s: float,
) -> tuple[dict[str, Any], list[Any]]:  # fmt: skip
    """One load point: a request per entry of `imgs` (its images) on `route`, Poisson arrivals at
    `qps` drawn from `rng`. Returns its figures and the raw results (timings, or the exception)."""
    results: list[Any] = []

    async def one(i: int, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            r = await c.generate(f"Describe picture set {i}.", images=imgs[i], max_tokens=max_tokens,
                                 ignore_eos=True, route=route)  # fmt: skip
            results.append(r.timings)
        except Exception as e:  # noqa: BLE001 - counted as a failure of this point
            results.append(e)

    n = len(imgs)
    t, delays = 0.0, []
    for _ in range(n):
        t += rng.expovariate(qps)
        delays.append(t)
    start = time.perf_counter()
    await asyncio.gather(*(one(i, dl) for i, dl in enumerate(delays)))
    elapsed = time.perf_counter() - start
    ok = [r for r in results if not isinstance(r, Exception)]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok]
    within = sum(1 for r in ok if r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s)
    return {
        "route": route, "offered_qps": qps, "requests": n, "completed": len(ok), "errors": n - len(ok),
        "elapsed_s": elapsed, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "encode_p50": percentile([r.encode_s for r in ok], 50), "within_slo": within,
        "meets_slo": len(ok) == n and percentile(ttft, 99) <= ttft_slo_s and percentile(tpot, 99) <= tpot_slo_s,
    }, results  # fmt: skip


async def _point(c, cfg: RealConfig, route: str, qps: float, rng: random.Random, imgs: list) -> dict[str, Any]:
    p, results = await measure_point(c, route, qps, imgs, rng, max_tokens=cfg.max_tokens,
                                     ttft_slo_s=cfg.ttft_slo_s, tpot_slo_s=cfg.tpot_slo_s)  # fmt: skip
    p["goodput_rps"] = goodput_rps(p)
    p["first_error"] = next((f"{type(r).__name__}: {r}" for r in results if isinstance(r, Exception)), None)
    return p


def goodput_rps(p: dict[str, Any]) -> float:
    """A load point's goodput: the offered load times the share of its requests finished within
    both SLOs, as the cost model's (`costmodel.simulate_point`). The one definition for
    `goodput_rps` in every result: within-SLO requests over the wall time (gpu_check's) counts
    the drain after the last arrival, so it fell with the run's tail, not the system's rate."""
    return p["offered_qps"] * p["within_slo"] / p["requests"] if p["requests"] else 0.0


SATURATED_NOTE = ("≥: met the SLOs at every offered load up to the highest: a lower bound, not a measured "
                  "goodput (and a ratio with it is a bound, or unknown); offer higher loads (--qps) to measure it")


def bounded_ratio(ratio: float, num_bound: bool, den_bound: bool) -> str:
    """`ratio` as text, marked when a side is only a lower bound (the load grid topped out)."""
    if num_bound and den_bound:
        return "unknown (both ≥)"
    return ("≥ " if num_bound else "≤ " if den_bound else "") + f"{ratio:.2f}x"


def _goodput(points: list[dict[str, Any]]) -> float:
    meeting = [p for p in points if p["meets_slo"]]
    return max(meeting, key=lambda p: p["offered_qps"])["goodput_rps"] if meeting else 0.0


def print_real(res: dict[str, Any]) -> None:
    order = sorted(res["points"], key=lambda p: (p["offered_qps"], ROUTES.index(p["route"])))
    rows = [[p["route"], p["offered_qps"], f"{p['completed']}/{p['requests']}", p["ttft_p50"], p["ttft_p99"],
             p["tpot_p50"] * 1e3, p["tpot_p99"] * 1e3, p["encode_p50"] * 1e3 if p["route"] == "epd" else "-",
             p["goodput_rps"],
             "yes" if p["meets_slo"] else "no"] for p in order]  # fmt: skip
    slo = res["slo"]
    sysn = {k: v.split(" (")[0] for k, v in res["systems"].items()}
    print(table(["route", "offered QPS", "done", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
                 "encode p50 ms", "goodput req/s", "SLO"], rows,
                title=f"Real tiny model on CPU ({sysn['epd']} vs {sysn['colocated']}, one cluster; start "
                f"{res['startup_s']:.0f} s); SLO P99 TTFT <= {slo['ttft_p99_s']} s, TPOT <= {slo['tpot_p99_s'] * 1e3:.3g} ms"))  # fmt: skip
    g = res["goodput_rps"]
    ratio = res["epd_over_colocated"]
    sat = res.get("saturated_grid") or {}
    ge = {route: "≥ " if sat.get(route) else "" for route in ROUTES}
    if ratio is None:
        rtxt = "n/a (colocated met the SLOs at no offered load)"
    else:
        rtxt = bounded_ratio(ratio, sat.get("epd", False), sat.get("colocated", False))
    print(f"\ngoodput (within-SLO rate at the highest offered load meeting the SLOs): EPD {ge['epd']}{g['epd']:.2f} "
          f"req/s, colocated {ge['colocated']}{g['colocated']:.2f} req/s, EPD / colocated {rtxt}")  # fmt: skip
    if any(sat.values()):
        print(SATURATED_NOTE)
    for p in res["points"]:
        if p["first_error"]:
            print(f"  {p['route']} at {p['offered_qps']:g} QPS: {p['errors']} failed, first: {p['first_error']}")


def plot_real(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    for route, color in (("epd", "C0"), ("colocated", "C1")):
        pts = sorted((p for p in res["points"] if p["route"] == route), key=lambda p: p["offered_qps"])
        q = [p["offered_qps"] for p in pts]
        label = res["systems"][route].split(" (")[0]
        ax[0].plot(q, [p["goodput_rps"] for p in pts], "-o", color=color, label=label)
        ax[1].plot(q, [p["ttft_p50"] for p in pts], "-o", color=color, label=f"{label} p50")
        ax[1].plot(q, [p["ttft_p99"] for p in pts], "--o", color=color, label=f"{label} p99")
        ax[2].plot(q, [p["tpot_p50"] * 1e3 for p in pts], "-o", color=color, label=f"{label} p50")
        ax[2].plot(q, [p["tpot_p99"] * 1e3 for p in pts], "--o", color=color, label=f"{label} p99")
    ax[0].set_title("within-SLO completions (req/s)")
    ax[1].axhline(res["slo"]["ttft_p99_s"], color="grey", ls=":", label="SLO")
    ax[1].set_title("TTFT (s)")
    ax[2].axhline(res["slo"]["tpot_p99_s"] * 1e3, color="grey", ls=":", label="SLO")
    ax[2].set_title("TPOT (ms)")
    for a in ax:
        a.set_xlabel("offered load (requests/s)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("epdq, real tiny model on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
