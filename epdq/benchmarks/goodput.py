"""Goodput of EPD (1 encoder + N PD workers) against N+1 colocated workers, under latency SLOs.

Workload: Poisson arrivals, images per request, prompt and output lengths, a fraction of images
drawn from a small hot set (repeats). Measured per offered load: TTFT and TPOT p50/p99, and the
rate of requests that finished within BOTH SLOs. A load point "meets the SLOs" when every request
finished and P99 TTFT and P99 TPOT are within them. **Goodput** is the within-SLO completion rate
at the highest offered load that meets the SLOs (found on a grid, then refined by bisection).

Two kinds:

* `cost` (default): a discrete-event simulation (`epdq.benchmarks.costmodel`) in which the REAL
  scheduler (`epdq.scheduler.Scheduler`, injected clock) takes every dispatch decision and the
  workers' service times come from a documented cost model (no model, no sleeping). The colocated
  engine pays the vision encoder inside its steps; EPD's encoder runs on its own accelerator.
  Scenarios: `--images` per request (4 by default), EPD 1E+3PD vs 4 colocated (vLLM's setup); and a
  repeated-image workload (half the images from a hot set of 32) with the embedding cache vs the
  cache disabled (every image unique), plus the colocated baseline for context.
  SLOs: vLLM's EPD evaluation uses P99 TTFT <= 20 s and P99 TPOT <= 100 ms for a 4B model; they
  are scaled for the small model of the cost model: TPOT SLO = `tpot_slack` x its unloaded TPOT,
  TTFT SLO = 20 s x (TPOT SLO / 100 ms). A sensitivity table shows the EPD/colocated ratio as the
  TPOT slack varies (the ratio is a tail-latency isolation effect; see the notes in the output),
  and a topology table the same ratio for 1 encoder + N PD against N+1 colocated over several N
  (`--topologies`), with the encoder's use and EPD's TPOT at its goodput: which stage limits it.
  The goodput is found at the edge of a stage's capacity, where one Poisson arrival sequence moves
  it (1E+3PD vs 4 colocated: 1.60-2.02x over arrival seeds 0-5), so the main scenario and every
  topology are run over `--seeds` arrival sequences (3 by default: seeds --seed, --seed+1, ...);
  each topology row is the seed whose EPD/colocated ratio is the median (the lower middle one for
  an even count), with the ratios' min-max beside it. The sensitivity and repeated-image tables
  run on the first seed only (shown, not judged). A load above `costmodel.capacity_rps` (the
  most the system can sustain) never meets the SLOs, whatever its finite window shows.
* `real` (`--real`, `epdq.benchmarks.goodput_real`): the tiny random Qwen2-VL on CPU, real
  processes in one cluster: 1 encoder + N PD workers (route "epd") and N+1 colocated workers
  (route "colocated"), a short Poisson run per offered load on each. The tiny model's vision
  tower is cheap, so no large EPD gain is expected.

`python -m epdq.benchmarks.goodput [--real] [--quick]` prints the tables and writes
`bench-results/goodput.json` and `goodput.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from epdq.benchmarks.costmodel import CostModel, PointResult, Workload, simulate_point
from epdq.benchmarks.goodput_real import RealConfig, plot_real, print_real, run_real
from epdq.benchmarks.goodput_report import plot_cost, print_cost
from epdq.benchmarks.report import Progress, check_out_dir, remove_stale, sigterm_unwinds, table, write_json

VLLM_TTFT_SLO_S = 20.0
VLLM_TPOT_SLO_S = 0.100
DEFAULT_TOPOLOGIES = (1, 2, 3, 4)  # N in "1 encoder + N PD vs N+1 colocated"
DEFAULT_SEEDS = 3  # arrival sequences per topology; each one adds ~6 s to the default run here
MAX_SEEDS = 50
DEFAULT_QPS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40)
MIN_QPS = 0.001  # load points are keyed by the load rounded to 3 decimals
# one simulated request holds a few KiB while its point runs (and takes ~0.3 ms to simulate)
MAX_SIM_REQUESTS = 100_000
# what the JSON's figures are measured in (keys keep their historical names)
UNITS = {"ttft_*": "s", "tpot_*": "s", "encode_*": "s", "*_slo_s": "s", "*_s": "s", "offered_qps": "requests/s",
         "max_qps_meeting_slo": "requests/s", "goodput_rps": "requests/s", "*_goodput": "requests/s",
         "throughput_rps": "requests/s", "*_util*": "fraction of the time busy (0..1)"}  # fmt: skip


def normalise_loads(loads) -> list[float]:
    """Offered loads as the sweeps use them: rounded to 3 decimals, ascending, each once (the
    sweep stops at the first load that misses the SLOs: an unsorted grid stopped early)."""
    return sorted({round(float(q), 3) for q in loads})


def scaled_slos(cm: CostModel, tpot_slack: float) -> tuple[float, float]:
    """(TTFT SLO, TPOT SLO) for the cost model: vLLM's SLOs scaled to this model's decode speed."""
    unloaded_tpot = cm.step_s + cm.decode_s_per_seq
    tpot = tpot_slack * unloaded_tpot
    return VLLM_TTFT_SLO_S * tpot / VLLM_TPOT_SLO_S, tpot


# ---------------------------------------------------------------- cost kind


class _Sweep:
    """Load sweep of one system + scenario, with a bisection for the highest load meeting the SLOs."""

    def __init__(self, name: str, system: str, cm: CostModel, wl: Workload, *, ttft_slo: float, tpot_slo: float,
                 window_s: float, min_requests: int, unique_keys: bool = False, sizes: dict | None = None,
                 tick=lambda: None) -> None:  # fmt: skip
        self.name, self.system, self.cm, self.wl = name, system, cm, wl
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.window_s, self.min_requests = window_s, min_requests
        self.unique_keys = unique_keys
        self.sizes = sizes or {}
        self.points: dict[float, PointResult] = {}
        self.tick = tick

    def point(self, qps: float) -> PointResult:
        qps = round(qps, 3)
        if qps not in self.points:
            n = max(self.min_requests, int(qps * self.window_s))
            self.points[qps] = simulate_point(
                self.system, self.cm, self.wl, qps, n, ttft_slo=self.ttft_slo, tpot_slo=self.tpot_slo,
                unique_keys=self.unique_keys, **self.sizes,
            )  # fmt: skip
            self.tick()
        return self.points[qps]

    def goodput(self, grid: list[float], refine: int) -> dict[str, Any]:
        best, fail = None, None
        for q in normalise_loads(grid):
            if self.point(q).meets_slo:
                best = q
            else:
                fail = q
                break
        if best is not None and fail is not None:
            lo, hi = best, fail
            for _ in range(refine):
                mid = (lo + hi) / 2
                if self.point(mid).meets_slo:
                    lo = mid
                else:
                    hi = mid
            best = round(lo, 3)
        if best is None:
            return {"max_qps_meeting_slo": 0.0, "goodput_rps": 0.0, "saturated_grid": False}
        p = self.points[round(best, 3)]
        return {"max_qps_meeting_slo": best, "goodput_rps": p.goodput_rps, "saturated_grid": fail is None}

    def curve(self) -> list[dict[str, Any]]:
        out = []
        for q in sorted(self.points):
            d = asdict(self.points[q])
            extra = d.pop("extra")
            d["engine_util_mean"] = _mean(extra["engine_util"].values())
            d["engine_encode_share_mean"] = _mean(extra["engine_encode_share"].values())
            d["encoder_util"] = _mean(extra["encoder_util"].values()) if extra["encoder_util"] else None
            d["encoder_mean_batch"] = (
                _mean(extra["encoder_mean_batch"].values()) if extra["encoder_mean_batch"] else None
            )
            d["cache_hits"] = extra["counters"]["cache_hits"]
            d["dedup_joins"] = extra["counters"]["dedup_joins"]
            d["encodes_done"] = extra["counters"]["encodes_done"]
            out.append(d)
        return out


def _mean(vals) -> float:
    vals = list(vals)
    return sum(vals) / len(vals) if vals else 0.0


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _check_cost_args(
    *, n_pd: int, tpot_slack: float, ttft_slo: float | None, tpot_slo: float | None, qps_grid: list[float] | None,
    window_s: float, min_requests: int, refine: int, sensitivity: list[float] | None,
    topologies: list[int] | None = None, seeds: int = 1,
) -> None:  # fmt: skip
    """ValueError naming the first bad argument (the workload's own fields are checked by Workload)."""
    if not (isinstance(seeds, int) and not isinstance(seeds, bool) and 1 <= seeds <= MAX_SEEDS):
        raise ValueError(f"the number of arrival seeds must be 1..{MAX_SEEDS}, not {seeds!r}")
    if not (isinstance(n_pd, int) and 1 <= n_pd <= 1024):
        raise ValueError(f"the number of PD workers must be 1..1024, not {n_pd!r}")
    if not (_positive(tpot_slack) and tpot_slack >= 1):
        raise ValueError(f"tpot_slack must be >= 1 (a multiple of the unloaded TPOT), not {tpot_slack!r}")
    for name, v in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
        if v is not None and not _positive(v):
            raise ValueError(f"{name} must be > 0 seconds, not {v!r}")
    if qps_grid is not None and not (qps_grid and all(_positive(q) for q in qps_grid)):
        raise ValueError(f"offered loads must be > 0 requests/s, not {qps_grid!r}")
    if qps_grid is not None and min(round(q, 3) for q in qps_grid) <= 0:  # 0.000: no arrivals, a division by 0
        raise ValueError(f"offered loads must be at least {MIN_QPS} requests/s (loads are rounded to 3 decimals), "
                         f"not {min(qps_grid)!r}")  # fmt: skip
    if not _positive(window_s):
        raise ValueError(f"window_s must be > 0 seconds, not {window_s!r}")
    top = max(qps_grid or DEFAULT_QPS)
    if top * window_s > MAX_SIM_REQUESTS:
        raise ValueError(f"at most {MAX_SIM_REQUESTS:,} simulated requests per load point (offered load x window: "
                         f"{top:,.10g} x {window_s:,.10g} s = {top * window_s:,.0f}); lower the loads or the window")  # fmt: skip
    if not (isinstance(min_requests, int) and 1 <= min_requests <= MAX_SIM_REQUESTS
            and isinstance(refine, int) and refine >= 0):  # fmt: skip
        raise ValueError(f"min_requests must be 1..{MAX_SIM_REQUESTS:,} and refine >= 0")
    if sensitivity is not None and not all(_positive(x) and x >= 1 for x in sensitivity):
        raise ValueError(f"sensitivity TPOT slacks must be >= 1, not {sensitivity!r}")
    if topologies is not None and not all(isinstance(n, int) and 1 <= n <= 64 for n in topologies):
        raise ValueError(f"topology PD counts must be integers in 1..64, not {topologies!r}")


def run_cost(
    *, n_pd: int = 3, images_per_request: int = 4, image_size: tuple[int, int] = (512, 512), text_tokens: int = 128,
    output_tokens: int = 128, repeat_fraction: float = 0.5, hot_set: int = 32, tpot_slack: float = 1.5,
    ttft_slo: float | None = None, tpot_slo: float | None = None, qps_grid: list[float] | None = None,
    window_s: float = 120.0, min_requests: int = 200, refine: int = 4, sensitivity: list[float] | None = None,
    topologies: list[int] | None = None, cost: CostModel | None = None, seed: int = 0,
    seeds: int = DEFAULT_SEEDS, progress=None,
) -> dict[str, Any]:  # fmt: skip
    _check_cost_args(n_pd=n_pd, tpot_slack=tpot_slack, ttft_slo=ttft_slo, tpot_slo=tpot_slo, qps_grid=qps_grid,
                     window_s=window_s, min_requests=min_requests, refine=refine, sensitivity=sensitivity,
                     topologies=topologies, seeds=seeds)  # fmt: skip
    arrival_seeds = [seed + i for i in range(seeds)]
    cm = cost or CostModel()
    t_slo, p_slo = scaled_slos(cm, tpot_slack)
    ttft_slo = ttft_slo if ttft_slo is not None else t_slo
    tpot_slo = tpot_slo if tpot_slo is not None else p_slo
    grid = normalise_loads(qps_grid or DEFAULT_QPS)
    sensitivity = (
        [1.25, 1.5, 2.0, 3.0, VLLM_TPOT_SLO_S / (cm.step_s + cm.decode_s_per_seq)]
        if sensitivity is None
        else sensitivity
    )
    wl4 = Workload(images_per_request, image_size, text_tokens, output_tokens, 0.0, hot_set, seed)
    wlr = replace(wl4, repeat_fraction=repeat_fraction)
    # N = n_pd is the main scenario; the others only change how many PD workers share the one encoder
    topologies = sorted(set(DEFAULT_TOPOLOGIES if topologies is None else topologies) - {n_pd})
    sizes = {"encoders": 1, "pds": n_pd, "both": n_pd + 1}
    n_sweeps = 3 + 2 * len(sensitivity) + 2 * (1 + len(topologies)) * seeds
    # the most load points a sweep can run (the grid up to its first miss, then the bisection): a
    # bound, so the count never runs past the bar's end (half the grid + refine did: "71/55")
    bar = (
        progress
        if progress is not None
        else Progress(n_sweeps * (len(grid) + refine), "goodput (cost model)")
    )
    common = dict(window_s=window_s, min_requests=min_requests, sizes=sizes, tick=bar.advance)
    topo, main = [], None
    for n in sorted({n_pd, *topologies}):
        kw = common | {"sizes": {"encoders": 1, "pds": n, "both": n + 1}}
        runs = []
        for s in arrival_seeds:
            wl = replace(wl4, seed=s)
            epd = _Sweep(f"epd_{n}pd", "epd", cm, wl, ttft_slo=ttft_slo, tpot_slo=tpot_slo, **kw)
            col = _Sweep(f"colocated_{n + 1}", "colocated", cm, wl, ttft_slo=ttft_slo, tpot_slo=tpot_slo, **kw)
            e, c = epd.goodput(grid, refine), col.goodput(grid, refine)
            runs.append((s, e, c, epd, col))
        row, median = _over_seeds(n, runs)
        topo.append(row)
        if n == n_pd:
            main = median
    assert main is not None
    sweeps = {
        "epd_4img": main[3],
        "colocated_4img": main[4],
        "epd_repeat_cache": _Sweep(
            "epd_repeat_cache", "epd", cm, wlr, ttft_slo=ttft_slo, tpot_slo=tpot_slo, **common
        ),
        "epd_repeat_nocache": _Sweep(
            "epd_repeat_nocache",
            "epd",
            cm,
            wlr,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
            unique_keys=True,
            **common,
        ),  # fmt: skip
        "colocated_repeat": _Sweep(
            "colocated_repeat", "colocated", cm, wlr, ttft_slo=ttft_slo, tpot_slo=tpot_slo, **common
        ),
    }
    summary = {"epd_4img": main[1], "colocated_4img": main[2]} | {
        name: s.goodput(grid, refine) for name, s in sweeps.items() if not name.endswith("_4img")
    }
    sens = []
    for slack in sensitivity:
        ts, ps = scaled_slos(cm, slack)
        g, sat = {}, {}
        for system in ("epd", "colocated"):
            s = _Sweep(f"{system}_slack", system, cm, wl4, ttft_slo=ts, tpot_slo=ps, **common)
            r = s.goodput(grid, refine)
            g[system], sat[system] = r["goodput_rps"], r["saturated_grid"]
        sens.append({"tpot_slack": round(slack, 2), "ttft_slo_s": ts, "tpot_slo_s": ps, "epd_goodput": g["epd"],
                     "colocated_goodput": g["colocated"], "ratio": _ratio(g["epd"], g["colocated"]),
                     "epd_saturated_grid": sat["epd"], "colocated_saturated_grid": sat["colocated"]})  # fmt: skip
    if progress is None:
        bar.advance(max(0, bar.total - bar.done))
    e4, c4 = summary["epd_4img"]["goodput_rps"], summary["colocated_4img"]["goodput_rps"]
    rc, rn = summary["epd_repeat_cache"]["goodput_rps"], summary["epd_repeat_nocache"]["goodput_rps"]
    sz = [image_size] * images_per_request
    return {
        "kind": "cost",
        "method": "discrete-event simulation; every dispatch decision by the real epdq.scheduler.Scheduler "
        "(injected clock); worker service times from the cost model (no model, no sleeping)",
        "cost_model": cm.describe(),
        "unloaded": {
            "encode_request_s": cm.encode_s(sz),
            "prefill_request_s": (sum(cm.image_tokens(*s) for s in sz) + text_tokens)
            * cm.prefill_s_per_token,
            "tpot_s": cm.step_s + cm.decode_s_per_seq,
        },
        "workload": asdict(wl4) | {"repeat_workload": asdict(wlr)},
        "systems": {"epd": f"1 encoder + {n_pd} PD", "colocated": f"{n_pd + 1} colocated"},
        "slo": {
            "ttft_p99_s": ttft_slo,
            "tpot_p99_s": tpot_slo,
            "tpot_slack": tpot_slack,
            "rule": "TPOT SLO = tpot_slack x unloaded TPOT; TTFT SLO = 20 s x TPOT SLO / 100 ms (vLLM's SLOs scaled)",
        },  # fmt: skip
        "summary": summary,
        "epd_over_colocated_4img": _ratio(e4, c4),  # of the median seed, as the row of N = n_pd
        "epd_over_colocated_4img_min": next(r["ratio_min"] for r in topo if r["n_pd"] == n_pd),
        "epd_over_colocated_4img_max": next(r["ratio_max"] for r in topo if r["n_pd"] == n_pd),
        "cache_gain": _ratio(rc, rn),
        "sensitivity_tpot_slack": sens,
        "topology": topo,
        "curves": {name: s.curve() for name, s in sweeps.items()},
        "window_s": window_s,
        "offered_qps": grid,
        "seed": seed,
        "seeds": arrival_seeds,
        "seeds_note": "the main scenario and each topology row: the arrival seed whose EPD/colocated ratio is the "
        "median over `seeds` (the lower middle one for an even count; `median_seed`), with the ratios' min-max; "
        "the repeated-image and sensitivity tables: the first seed only",
        "capacity_note": "a load above a point's capacity_rps (the most the system can sustain, costmodel."
        "capacity_rps) does not meet the SLOs, whatever its finite window's percentiles",
        "units": UNITS,
        "saturated_grid_note": "saturated_grid: every offered load of the grid met the SLOs, so the goodput is a "
        "lower bound (offer higher loads to measure it)",
    }


def _over_seeds(n: int, runs: list[tuple]) -> tuple[dict[str, Any], tuple]:
    """The topology row of N over its arrival seeds, and the (seed, epd, colocated, sweeps) run
    whose ratio is the median. A whole run, not a median per column: its goodputs, encoder use and
    TPOT are of one arrival sequence, and its ratio is their quotient."""
    ratios = [_ratio(e["goodput_rps"], c["goodput_rps"]) for _s, e, c, _es, _cs in runs]
    # NaN (neither side met a load) sorts last; a ratio over a side that met no load (inf) above all others
    order = sorted(range(len(runs)), key=lambda i: (ratios[i] != ratios[i], ratios[i] if ratios[i] == ratios[i] else 0))
    m = order[(len(order) - 1) // 2]
    s, e, c, es, _cs = runs[m]
    finite = [r for r in ratios if math.isfinite(r)]
    row = _topology_row(n, e, c, es) | {
        "median_seed": s, "seeds": [r[0] for r in runs], "ratio_seeds": ratios,
        "ratio_min": min(finite) if finite else math.nan, "ratio_max": max(finite) if finite else math.nan,
        # a ratio with a side at the top of the grid is a bound, not a figure
        "seeds_with_a_bound": sum(1 for _s, e2, c2, _a, _b in runs if e2["saturated_grid"] or c2["saturated_grid"]),
    }  # fmt: skip
    return row, runs[m]


def _topology_row(n: int, epd: dict[str, Any], col: dict[str, Any], epd_sweep: _Sweep) -> dict[str, Any]:
    """One row of the topology table: 1E+nPD against n+1 colocated, and which EPD stage is the limit."""
    p = epd_sweep.points.get(round(epd["max_qps_meeting_slo"], 3))
    enc = _mean(p.extra["encoder_util"].values()) if p is not None else None
    tpot = p.tpot_p99 if p is not None else None
    return {"n_pd": n, "epd": f"1 encoder + {n} PD", "colocated": f"{n + 1} colocated",
            "epd_goodput": epd["goodput_rps"], "colocated_goodput": col["goodput_rps"],
            "ratio": _ratio(epd["goodput_rps"], col["goodput_rps"]),
            "epd_saturated_grid": epd["saturated_grid"], "colocated_saturated_grid": col["saturated_grid"],
            "encoder_util_at_goodput": enc, "epd_tpot_p99_at_goodput": tpot}  # fmt: skip


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else math.nan)


# ---------------------------------------------------------------- entry points


def run(
    *, kind: str = "cost", out_dir: str = "bench-results", plot: bool = True, progress=None, quick: bool = False,
    real: RealConfig | None = None, **cost_kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """Run the goodput benchmark; print tables; write goodput.json (+ goodput.png), or
    goodput-real.json (+ goodput-real.png) for the real kind. Returns the result."""
    if kind not in ("cost", "real"):
        raise ValueError("kind must be cost or real")
    if kind == "cost":
        if quick:
            cost_kw = {"window_s": 30.0, "min_requests": 60, "refine": 2, "sensitivity": [1.5, 3.0]} | cost_kw
        res = run_cost(progress=progress, **cost_kw)
        print_cost(res)
        print_seeds(res)
    else:
        say = (lambda m: print(m, file=sys.stderr)) if progress is None else (lambda _m: progress.advance(0))
        res = asyncio.run(run_real(real or RealConfig(), log=say))
        print_real(res)
    out = Path(out_dir)
    name = "goodput.json" if kind == "cost" else "goodput-real.json"
    png = out / ("goodput.png" if kind == "cost" else "goodput-real.png")
    remove_stale(png)  # an older run's plot beside this run's JSON (--no-plot, no matplotlib) would mislead
    if plot:
        try:
            (plot_cost if kind == "cost" else plot_real)(res, png)
            res["plot"] = str(png)
        except ImportError as e:  # matplotlib is the bench extra
            print(f"no plot: {e}", file=sys.stderr)
    write_json(out / name, "goodput", res)
    print(f"\nwrote {out / name}" + (f" and {png}" if "plot" in res else ""))
    return res


def print_seeds(res: dict[str, Any]) -> None:
    """How far the arrival sequence alone moves each topology's ratio (the tables above show the
    median seed's run)."""
    topo = res.get("topology") or []
    if len(res.get("seeds") or []) < 2 or not topo:
        return
    rows = [[r["epd"], r["colocated"], _xs(r["ratio"]), f"{_xs(r['ratio_min'])}–{_xs(r['ratio_max'])}",
             r["median_seed"], " ".join(_xs(x) for x in r["ratio_seeds"]), r["seeds_with_a_bound"] or "-"]
            for r in topo]  # fmt: skip
    print(table(["EPD", "colocated", "median EPD/colocated", "min–max", "median seed", "per seed",
                 "seeds with a lower-bound side"], rows,
                title=f"EPD/colocated over arrival seeds {', '.join(map(str, res['seeds']))} (the goodput sits at "
                "a stage's capacity, where one arrival sequence moves it)"))  # fmt: skip


def _xs(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, float) and math.isfinite(v) else "n/a"


# options of the cost model that the real kind has no use for: refused with --real, not ignored
COST_ONLY = {"text_tokens": "--text-tokens", "repeat_fraction": "--repeat-fraction", "hot_set": "--hot-set",
             "tpot_slack": "--tpot-slack", "topologies": "--topologies", "seeds": "--seeds"}  # fmt: skip


def main(argv: list[str] | None = None, prog: str = "python -m epdq.benchmarks.goodput") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--real", action="store_true", help="the real tiny model on CPU instead of the cost model"
    )
    ap.add_argument("--quick", action="store_true", help="short windows and fewer bisection steps (cost model only)")
    ap.add_argument("--out", "--out-dir", dest="out_dir", default="bench-results",
                    help="directory for goodput.json (goodput-real.json with --real) and the plot")  # fmt: skip
    ap.add_argument("--no-plot", action="store_true", help="no plot (an older one in --out is removed)")
    ap.add_argument("--pd", type=int, default=None,
                    help="N: EPD is 1 encoder + N PD, colocated is N+1 workers (default 3; --real: 1)")
    ap.add_argument("--images", type=int, default=None, help="images per request (default 4; --real: 2)")
    ap.add_argument("--image-size", default=None, help="WIDTHxHEIGHT (default 512x512; --real: 224x224)")
    ap.add_argument("--text-tokens", type=int, default=None, help="prompt tokens (cost model only; default 128)")
    ap.add_argument("--output-tokens", type=int, default=None, help="default 128; --real: 16")
    ap.add_argument("--repeat-fraction", type=float, default=None,
                    help="share of images from the hot set in the repeated-image scenario (cost model only; "
                    "default 0.5)")  # fmt: skip
    ap.add_argument("--hot-set", type=int, default=None, help="distinct repeated images (cost model only; default 32)")
    ap.add_argument("--tpot-slack", type=float, default=None,
                    help="TPOT SLO as a multiple of the unloaded TPOT (cost model only; default 1.5)")  # fmt: skip
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (overrides the scaled default)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="seconds (overrides the scaled default)")
    ap.add_argument("--window", type=float, default=None,
                    help="seconds of arrivals per load point (default 120 simulated, 30 with --quick; --real: 8 "
                    f"real); offered load x window is at most {MAX_SIM_REQUESTS:,} requests (--real: 20,000)")  # fmt: skip
    ap.add_argument("--qps", default=None,
                    help=f"comma-separated offered loads in requests/s, each at least {MIN_QPS:g}; they are run in "
                    "ascending order, each once, whatever order they are given in")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=None,
                    help=f"arrival sequences per topology, seeds --seed, --seed+1, ...; each row shows the median "
                    f"seed's ratio and the min-max (cost model only; default {DEFAULT_SEEDS}, 1..{MAX_SEEDS})")  # fmt: skip
    ap.add_argument("--topologies", default=None,
                    help="values of N for the topology table, comma-separated, or 'none' (cost model only; "
                    f"default {','.join(map(str, DEFAULT_TOPOLOGIES))})")  # fmt: skip
    a = ap.parse_args(argv)
    if a.real:
        given = [flag for key, flag in COST_ONLY.items() if getattr(a, key) is not None] + ["--quick"] * a.quick
        if given:
            ap.error(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the cost model only, not --real")
    try:
        qps = None if a.qps is None else [float(x) for x in a.qps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--qps must be numbers separated by commas, not {a.qps!r}")
    if qps == []:  # `--qps ""` (an unset shell variable) used to run the whole default grid
        ap.error("--qps: give at least one load in requests/s, e.g. 2,4,8 (or leave it out for the default grid)")
    if qps is not None and not all(_positive(q) for q in qps):
        ap.error(f"--qps values must be > 0, not {a.qps!r}")
    if qps is not None and min(round(q, 3) for q in qps) <= 0:
        ap.error(f"--qps values must be at least {MIN_QPS:g} requests/s (loads are rounded to 3 decimals), "
                 f"not {a.qps!r}")  # fmt: skip
    if qps is not None:
        qps = normalise_loads(qps)
    for flag, v in (("--ttft-slo", a.ttft_slo), ("--tpot-slo", a.tpot_slo)):
        if v is not None and not _positive(v):
            ap.error(f"{flag} must be > 0 seconds, not {v!r}")
    size = a.image_size or ("224x224" if a.real else "512x512")
    try:
        w, h = (int(v) for v in size.lower().split("x"))
    except ValueError:
        ap.error(f"--image-size must be WIDTHxHEIGHT in pixels, e.g. 512x512, not {size!r}")
    if a.real:
        d = RealConfig()
        try:
            real = RealConfig(
                n_pd=d.n_pd if a.pd is None else a.pd, qps=tuple(qps or d.qps), window_s=d.window_s if a.window is None else a.window,
                images_per_request=d.images_per_request if a.images is None else a.images, image_size=(w, h),
                max_tokens=d.max_tokens if a.output_tokens is None else a.output_tokens,
                ttft_slo_s=a.ttft_slo or d.ttft_slo_s, tpot_slo_s=a.tpot_slo or d.tpot_slo_s, seed=a.seed,
            )  # fmt: skip
            check_out_dir(a.out_dir, ("goodput-real.json", "goodput-real.png"))  # last: a refused command leaves no directory behind
        except ValueError as e:
            ap.error(str(e))
        with sigterm_unwinds():  # the cluster stopped (its workers killed if they hang), its directory removed
            run(kind="real", out_dir=a.out_dir, plot=not a.no_plot, real=real)
        return 0
    n_pd = 3 if a.pd is None else a.pd
    topo_arg = ",".join(map(str, DEFAULT_TOPOLOGIES)) if a.topologies is None else a.topologies
    try:
        topologies = [] if topo_arg.strip().lower() == "none" else [int(x) for x in topo_arg.split(",")]
    except ValueError:
        ap.error(f"--topologies must be integers separated by commas, or none, not {a.topologies!r}")
    images = 4 if a.images is None else a.images
    output_tokens = 128 if a.output_tokens is None else a.output_tokens
    text_tokens = 128 if a.text_tokens is None else a.text_tokens
    repeat_fraction = 0.5 if a.repeat_fraction is None else a.repeat_fraction
    hot_set = 32 if a.hot_set is None else a.hot_set
    tpot_slack = 1.5 if a.tpot_slack is None else a.tpot_slack
    kw: dict[str, Any] = dict(n_pd=n_pd, images_per_request=images, image_size=(w, h), text_tokens=text_tokens,
                              output_tokens=output_tokens, repeat_fraction=repeat_fraction, hot_set=hot_set,
                              tpot_slack=tpot_slack, ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo, seed=a.seed,
                              qps_grid=qps, topologies=topologies,
                              seeds=DEFAULT_SEEDS if a.seeds is None else a.seeds)  # fmt: skip
    # --quick shortens the default window (to 30 s), not one given
    window = (30.0 if a.quick else 120.0) if a.window is None else a.window
    if not a.quick or a.window is not None:
        kw["window_s"] = window
    try:  # checked before anything runs, so a ValueError later is a bug, not a usage error
        Workload(images, (w, h), text_tokens, output_tokens, repeat_fraction, hot_set, a.seed)
        _check_cost_args(n_pd=n_pd, tpot_slack=tpot_slack, ttft_slo=a.ttft_slo, tpot_slo=a.tpot_slo, qps_grid=qps,
                         window_s=window, min_requests=1, refine=0, sensitivity=None,
                         topologies=topologies, seeds=kw["seeds"])  # fmt: skip
        check_out_dir(a.out_dir, ("goodput.json", "goodput.png"))  # last: a refused command leaves no directory behind
    except ValueError as e:
        ap.error(str(e))
    with sigterm_unwinds():
        run(kind="cost", out_dir=a.out_dir, plot=not a.no_plot, quick=a.quick, **kw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
