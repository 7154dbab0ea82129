"""The hand-off benchmark's summary of the raw samples, its tables and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epdq.benchmarks.handoff_common import LABELS, PARTS, RING_TARGET, SAFETENSORS_TARGET, row_bytes
from epdq.benchmarks.report import percentile, table, vs_target


def summarise(cfg: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    for si, (size, rows) in enumerate(zip(cfg["sizes_mib"], cfg["rows"], strict=True)):
        nbytes = rows * row_bytes(cfg["dtype"])
        ms = {m: [v / 1e6 for v in raw[m][str(si)]["total"]] for m in cfg["methods"]}
        base = percentile(ms["memcpy"], 50)
        for m in cfg["methods"]:
            p50 = percentile(ms[m], 50)
            rec = raw[m][str(si)]
            results.append({
                "size_mib": size, "nbytes": nbytes, "rows": rows, "method": m, "label": LABELS[m],
                "p50_ms": p50, "p90_ms": percentile(ms[m], 90), "min_ms": min(ms[m]),
                "gb_per_s": nbytes / (p50 / 1e3) / 1e9 if p50 > 0 else float("nan"),
                "x_memcpy": p50 / base if base > 0 else float("nan"),
                "samples_ms": ms[m],
                # minor page faults during one transfer (p50), in the writer and in the reader
                "faults_writer": percentile(rec["faults_w"], 50),
                "faults_reader": percentile(rec["faults_r"], 50),
                "parts": {
                    p: {"p50_ms": percentile([v / 1e6 for v in rec[p]], 50),
                        "p90_ms": percentile([v / 1e6 for v in rec[p]], 90),
                        "samples_ms": [v / 1e6 for v in rec[p]]}
                    for p in PARTS[m]
                },
            })  # fmt: skip
        ring, copy, st = ms["ring_view"], ms["memcpy"], ms["safetensors"]
        ring_x = percentile(ring, 50) / percentile(copy, 50)
        # The safetensors path against the ring, both ending at the same point. As the issue
        # defines them: the writer's first call to the tensor in the reader's hand, i.e. the view,
        # and load_file's tensor (the file mapped lazily: its page faults come later, in whoever
        # reads it, so this side is undercharged). And both ending with the bytes copied into the
        # reader's own tensor (the safetensors path's timed copy; the ring's copy-out path). The
        # ratio used to divide safetensors *with* its copy by the view *without* one: 9.1x at 32 MiB
        # on the committed run, where these give 7.0x and 4.7x (an audit).
        st_load = [t - c / 1e6 for t, c in zip(st, raw["safetensors"][str(si)]["copy"], strict=True)]
        ring_copy = ms["ring"]
        st_x = percentile(st_load, 50) / percentile(ring, 50)
        st_copy_x = percentile(st, 50) / percentile(ring_copy, 50)
        targets.append({
            "size_mib": size,
            "ring_over_memcpy": ring_x,
            # interleaved runs: the ratio within each repeat, then its median (less noise-prone)
            "ring_over_memcpy_paired": percentile([a / b for a, b in zip(ring, copy, strict=True)], 50),
            "ring_target": RING_TARGET, "ring_pass": ring_x <= RING_TARGET,
            "safetensors_over_ring": st_x,
            "safetensors_over_ring_paired": percentile([a / b for a, b in zip(st_load, ring, strict=True)], 50),
            "safetensors_target": SAFETENSORS_TARGET, "safetensors_pass": st_x >= SAFETENSORS_TARGET,
            "safetensors_copy_over_ring_copy": st_copy_x,
            "safetensors_copy_pass": st_copy_x >= SAFETENSORS_TARGET,
        })  # fmt: skip
    cfg_out = {k: v for k, v in cfg.items() if k not in ("seed",)}
    return {
        "config": cfg_out,
        "results": results,
        "targets": targets,
        "all_targets_met": all(t["ring_pass"] and t["safetensors_pass"] and t["safetensors_copy_pass"] for t in targets),
    }


def _size_label(size: float) -> str:
    return f"{size:g} MiB"


def render(data: dict[str, Any]) -> str:
    cfg = data["config"]
    main_rows = [
        (
            _size_label(r["size_mib"]),
            r["label"],
            r["p50_ms"],
            r["p90_ms"],
            r["gb_per_s"],
            f"{r['x_memcpy']:.2f}×",
        )
        for r in data["results"]
    ]
    parts_rows = [
        (
            _size_label(r["size_mib"]),
            r["label"],
            " + ".join(f"{p} {v['p50_ms']:.3f}" for p, v in r["parts"].items()),
            f"{r['faults_writer']:.0f} / {r['faults_reader']:.0f}",
        )  # fmt: skip
        for r in data["results"]
    ]
    target_rows = [
        (
            _size_label(t["size_mib"]),
            # as many decimals as it takes for the mark to follow from the figure (1.302 was "1.30×", MISS)
            f"{vs_target(t['ring_over_memcpy'], t['ring_target'], at_most=True, digits=2)}×",
            f"≤ {t['ring_target']:g}×",
            "PASS" if t["ring_pass"] else "MISS",
            f"{vs_target(t['safetensors_over_ring'], t['safetensors_target'], at_most=False, digits=1)}×",
            "PASS" if t["safetensors_pass"] else "MISS",
            f"{vs_target(t['safetensors_copy_over_ring_copy'], t['safetensors_target'], at_most=False, digits=1)}×",
            "PASS" if t["safetensors_copy_pass"] else "MISS",
        )  # fmt: skip
        for t in data["targets"]
    ]
    n = cfg["repeats"]
    return "\n".join([
        table(["size", "method", "p50 ms", "p90 ms", "GB/s", "× memcpy"], main_rows,
              title=f"Embedding hand-off, {cfg['dtype']} [rows, {cfg['hidden']}], {n} interleaved repeats "
                    f"(writer's first call → tensor in the reader's hand)"),
        table(["size", "method", "p50 ms of each part", "page faults writer / reader"], parts_rows,
              title="Where the time goes (p50 of each part; they need not add up to the p50 total)"),
        table(["size", "ring (view) ÷ memcpy", "target", "", "safetensors ÷ ring, to the tensor in hand", "",
               "the same, both ending in a copy", ""], target_rows,
              title=f"Targets (ratios of p50s measured side by side; safetensors ≥ {SAFETENSORS_TARGET:g}×: to the tensor "
                    "in hand is load_file's lazily mapped tensor against the view, both ending in a copy is safetensors "
                    "with its copy against the ring's copy-out)"),
    ])  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    sizes = data["config"]["sizes_mib"]
    methods = data["config"]["methods"]
    by = {(r["method"], r["size_mib"]): r for r in data["results"]}
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    width = 0.8 / len(methods)
    xs = list(range(len(sizes)))
    for i, m in enumerate(methods):
        pos = [x - 0.4 + width * (i + 0.5) for x in xs]
        p50 = [by[m, s]["p50_ms"] for s in sizes]
        p90 = [by[m, s]["p90_ms"] for s in sizes]
        ax1.bar(pos, p50, width, yerr=[[0] * len(sizes), [b - a for a, b in zip(p50, p90, strict=True)]],
                capsize=2, label=LABELS[m])  # fmt: skip
        ax2.bar(pos, [by[m, s]["x_memcpy"] for s in sizes], width, label=LABELS[m])
    for ax in (ax1, ax2):
        ax.set_xticks(xs, [_size_label(s) for s in sizes])
        ax.set_yscale("log")
        ax.grid(axis="y", which="both", alpha=0.3)
    ax1.set_ylabel("ms (bar: p50, whisker: p90)")
    ax1.set_title("Encoder write → tensor in the PD worker's hand")
    ax1.legend(fontsize=8)
    ax2.axhline(RING_TARGET, color="k", linestyle="--", linewidth=1, label=f"ring target ≤ {RING_TARGET:g}×")
    ax2.set_ylabel("× one memcpy (p50)")
    ax2.set_title("Relative to one memory copy")
    ax2.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
