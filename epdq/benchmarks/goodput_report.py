"""Printing and plotting the goodput benchmark's cost-model results (`epdq.benchmarks.goodput`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from epdq.benchmarks.goodput_real import SATURATED_NOTE, bounded_ratio
from epdq.benchmarks.report import table


def _images_label(res: dict[str, Any]) -> str:
    # the "_4img" keys of the JSON name the main scenario, which runs at --images per request
    n = res["workload"]["images_per_request"]
    return f"{n} image" + ("" if n == 1 else "s")


def _repeat_label(res: dict[str, Any]) -> str:
    """The repeated-image scenario's share of hot-set images, as given (--repeat-fraction)."""
    fraction = (res["workload"].get("repeat_workload") or {}).get("repeat_fraction", 0.5)
    return f"{fraction * 100:.3g}% repeated images"


def print_cost(res: dict[str, Any]) -> None:
    s = res["summary"]
    slo = res["slo"]
    u = res["unloaded"]
    k = _images_label(res)
    rep = _repeat_label(res)
    print(f"\nCost model (simulated, real scheduler): encode {k} {u['encode_request_s'] * 1e3:.0f} ms, "
          f"prefill {u['prefill_request_s'] * 1e3:.0f} ms, unloaded TPOT {u['tpot_s'] * 1e3:.1f} ms; "
          f"SLO P99 TTFT <= {slo['ttft_p99_s']:.3g} s, P99 TPOT <= {slo['tpot_p99_s'] * 1e3:.1f} ms")  # fmt: skip
    labels = {
        "epd_4img": f"EPD {res['systems']['epd']}, {k}/req",
        "colocated_4img": f"{res['systems']['colocated']}, {k}/req",
        "epd_repeat_cache": f"EPD, {rep}, cache",
        "epd_repeat_nocache": f"EPD, {rep}, no cache",
        "colocated_repeat": f"colocated, {rep}",
    }
    rows = []
    marked = False
    for name, label in labels.items():
        g = s[name]
        sat = g.get("saturated_grid", False)
        marked |= sat
        p = next((c for c in res["curves"][name] if c["offered_qps"] == g["max_qps_meeting_slo"]), None)
        rows.append([label, _lb(g["max_qps_meeting_slo"], sat), _lb(g["goodput_rps"], sat),
                     p["ttft_p50"] if p else math.nan, p["ttft_p99"] if p else math.nan,
                     p["tpot_p50"] * 1e3 if p else math.nan, p["tpot_p99"] * 1e3 if p else math.nan])  # fmt: skip
    print(table(["system", "max QPS in SLO", "goodput req/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms",
                 "TPOT p99 ms"], rows, title="Goodput (at the highest offered load meeting both P99 SLOs)"))  # fmt: skip
    print(
        f"EPD / colocated goodput, {k} per request: "
        f"{_xb(res['epd_over_colocated_4img'], _sat(s, 'epd_4img'), _sat(s, 'colocated_4img'))}; "
        f"cache gain on the repeated-image workload: "
        f"{_xb(res['cache_gain'], _sat(s, 'epd_repeat_cache'), _sat(s, 'epd_repeat_nocache'), 'no cache')}"
    )
    if marked:
        print(_note(res))
    for name in ("epd_4img", "colocated_4img"):
        rows = [[c["offered_qps"], c["goodput_rps"], c["ttft_p50"], c["ttft_p99"], c["tpot_p50"] * 1e3,
                 c["tpot_p99"] * 1e3, c["engine_util_mean"], c["engine_encode_share_mean"],
                 "yes" if c["meets_slo"] else "no"] for c in res["curves"][name]]  # fmt: skip
        print(table(["offered QPS", "goodput req/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
                     "engine busy", "encode share", "SLO"], rows, title=f"Load sweep: {labels[name]}"))  # fmt: skip
    sens = res["sensitivity_tpot_slack"]
    rows = [[r["tpot_slack"], r["tpot_slo_s"] * 1e3, r["ttft_slo_s"], *_pair(r)] for r in sens]
    print(table(["TPOT slack", "TPOT SLO ms", "TTFT SLO s", "EPD goodput", "colocated goodput", "EPD/colocated"],
                rows, title=f"Sensitivity: EPD/colocated goodput ({k}/req) vs how tight the TPOT SLO is"))  # fmt: skip
    if any(_row_sat(r) for r in sens):
        print(_note(res))
    topo = res.get("topology") or []
    if len(topo) > 1:
        rows = [[r["epd"], r["colocated"], *_pair(r), _pct(r["encoder_util_at_goodput"]),
                 "-" if r["epd_tpot_p99_at_goodput"] is None else r["epd_tpot_p99_at_goodput"] * 1e3]
                for r in topo]  # fmt: skip
        print(table(["EPD", "colocated", "EPD goodput", "colocated goodput", "EPD/colocated", "encoder busy",
                     "EPD TPOT p99 ms"], rows,
                    title=f"Topology: how many PD workers one encoder feeds ({k}/req, default SLO)"))  # fmt: skip
        if any(_row_sat(r) for r in topo):
            print(_note(res))
        best = max(topo, key=lambda r: r["ratio"] if math.isfinite(r["ratio"]) else -1.0)
        print(f"(at EPD's goodput point: an encoder near 100 % busy limits EPD; a TPOT p99 near the SLO, "
              f"{res['slo']['tpot_p99_s'] * 1e3:.1f} ms, means its PD workers do)\n"
              f"Best ratio in this table: {best['epd']} vs {best['colocated']}, {_pair(best)[2]}")  # fmt: skip


def _sat(summary: dict[str, Any], name: str) -> bool:
    return bool(summary[name].get("saturated_grid"))


def _row_sat(r: dict[str, Any]) -> bool:
    return bool(r.get("epd_saturated_grid") or r.get("colocated_saturated_grid"))


def _pair(r: dict[str, Any]) -> list[Any]:
    """EPD goodput, colocated goodput and their ratio, marked where the load grid topped out."""
    return [_lb(r["epd_goodput"], bool(r.get("epd_saturated_grid"))),
            _lb(r["colocated_goodput"], bool(r.get("colocated_saturated_grid"))), _ratio_label(r)]  # fmt: skip


def _ratio_label(r: dict[str, Any]) -> str:
    """A topology row's ratio as the table prints it (with ≥ or ≤ where a side is a bound)."""
    return _xb(r["ratio"], bool(r.get("epd_saturated_grid")), bool(r.get("colocated_saturated_grid")))


def _lb(v: float, saturated: bool) -> float | str:
    """A figure taken at the top of the load grid (every load met the SLOs) is a lower bound."""
    return f"≥ {v:.2f}" if saturated else v


def _xb(ratio: float | None, num_bound: bool, den_bound: bool, den: str = "colocated") -> str:
    if ratio is None or not math.isfinite(ratio):
        return _x(ratio, den)
    return bounded_ratio(ratio, num_bound, den_bound)


def _note(res: dict[str, Any]) -> str:
    top = max(res.get("offered_qps") or [0], default=0)
    return SATURATED_NOTE + (f" (the highest offered load was {top:g} requests/s)" if top else "")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f} %"


def plot_cost(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, grid = plt.subplots(2, 3, figsize=(17, 9))
    ax = [row[:2] for row in grid]
    slo = res["slo"]
    epd, col = res["systems"]["epd"].replace(" encoder + ", "E+").replace(" PD", "PD"), res["systems"]["colocated"]
    styles = {"epd_4img": (f"EPD {epd}", "C0", "-"), "colocated_4img": (col, "C1", "-"),
              "epd_repeat_cache": ("EPD, cache", "C0", "--"), "epd_repeat_nocache": ("EPD, no cache", "C2", "--"),
              "colocated_repeat": ("colocated", "C1", "--")}  # fmt: skip
    for name, (label, color, ls) in styles.items():
        c = res["curves"][name]
        q = [p["offered_qps"] for p in c]
        target = ax[0][0] if name.endswith("4img") else ax[1][1]
        target.plot(q, [p["goodput_rps"] for p in c], ls, color=color, marker="o", ms=3, label=label)
        if name.endswith("4img"):
            ax[0][1].plot(
                q, [p["tpot_p99"] * 1e3 for p in c], ls, color=color, marker="o", ms=3, label=label
            )
            ax[1][0].plot(q, [p["ttft_p99"] for p in c], ls, color=color, marker="o", ms=3, label=label)
    k = _images_label(res)
    ax[0][0].set_title(f"{k}/request: goodput (within both SLOs)")
    ax[1][1].set_title(f"{_repeat_label(res)}: goodput")
    ax[0][1].axhline(slo["tpot_p99_s"] * 1e3, color="grey", ls=":", label="SLO")
    ax[0][1].set_title(f"{k}/request: P99 TPOT (ms)")
    ax[1][0].axhline(slo["ttft_p99_s"], color="grey", ls=":", label="SLO")
    ax[1][0].set_yscale("log")
    ax[1][0].set_title(f"{k}/request: P99 TTFT (s)")
    for a in (ax[0][0], ax[0][1], ax[1][0], ax[1][1]):
        a.set_xlabel("offered load (requests/s)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    _plot_ratios(grid[0][2], grid[1][2], res, k)
    fig.suptitle("epdq goodput, cost model (simulated, real scheduler)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ratios(top: Any, bottom: Any, res: dict[str, Any], k: str) -> None:
    """Right-hand column: EPD/colocated goodput against the topology and against the TPOT SLO."""
    topo = res.get("topology") or []
    if topo:
        x = range(len(topo))
        top.bar([i - 0.2 for i in x], [r["epd_goodput"] for r in topo], 0.4, color="C0", label="EPD 1E + N PD")
        top.bar([i + 0.2 for i in x], [r["colocated_goodput"] for r in topo], 0.4, color="C1",
                label="N+1 colocated")  # fmt: skip
        for i, r in zip(x, topo, strict=True):
            top.annotate(_ratio_label(r).replace(" (", "\n("), (i, max(r["epd_goodput"], r["colocated_goodput"])),
                         ha="center", va="bottom", fontsize=9)  # fmt: skip
        top.set_xticks(list(x), [f"N={r['n_pd']}" for r in topo])
        top.set_ylim(0, 1.12 * max(max(r["epd_goodput"], r["colocated_goodput"]) for r in topo) or 1)
        top.legend(fontsize=8)
    top.set_title(f"{k}/request: goodput by topology (req/s)")
    top.grid(alpha=0.3, axis="y")
    sens = res.get("sensitivity_tpot_slack") or []
    bottom.plot([r["tpot_slo_s"] * 1e3 for r in sens], [r["ratio"] for r in sens], "-", color="C0")
    for r in sens:  # each point with the table's text: a ratio over a topped-out grid is a bound, or unknown
        if r["ratio"] is None or not math.isfinite(r["ratio"]):
            continue
        x, bound = r["tpot_slo_s"] * 1e3, _row_sat(r)
        bottom.plot([x], [r["ratio"]], "o", color="C0", mfc="none" if bound else "C0")
        bottom.annotate(_ratio_label(r).replace(" (", "\n("), (x, r["ratio"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    bottom.margins(x=0.12, y=0.2)  # room for the labels of the first and last points
    bottom.axhline(1.0, color="grey", ls=":")
    bottom.set_xscale("log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    bottom.xaxis.set_major_formatter(ScalarFormatter())
    bottom.xaxis.set_minor_formatter(NullFormatter())
    bottom.set_xticks([r["tpot_slo_s"] * 1e3 for r in sens], [f"{r['tpot_slo_s'] * 1e3:.3g}" for r in sens])
    bottom.tick_params(axis="x", labelrotation=45)  # 10.2 and 12.3 sit close together on a log axis
    bottom.set_xlabel("P99 TPOT SLO (ms)")
    bottom.set_title(f"{k}/request: EPD / colocated goodput vs TPOT SLO")
    bottom.grid(alpha=0.3)


def _x(ratio: float | None, den: str = "colocated") -> str:
    """A goodput ratio; none exists when the denominator's side met the SLOs at no offered load
    (infinite: the other side did; NaN: neither did)."""
    if ratio is not None and math.isfinite(ratio):
        return f"{ratio:.2f}x"
    if ratio is not None and ratio > 0:  # "no load met the SLOs" stood beside an EPD goodput of 3.00
        return f"n/a ({den} met the SLOs at no offered load)"
    return "n/a (no load met the SLOs)"
