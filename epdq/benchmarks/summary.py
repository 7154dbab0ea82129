"""Every benchmark's targets in one table, read from the JSON files the runs wrote.

`epdq bench summary [DIR]` looks in DIR (default `bench-results`, where the benchmarks write) for
handoff.json, control.json, goodput.json (the cost model), goodput-real.json and scale.json, and
prints each target of issue 4 with its goal, the figure measured, PASS / MISS (or "shown" where
the issue asks for a figure and sets no bar), and when and how fast the machine was for that run:
the README's "targets at a glance", made from your own runs. `--json FILE` also writes it;
`--check` exits 1 when a judged target is missed (for CI).

The files are read as untrusted input: each at most MAX_FILE_BYTES, parsed as JSON, and checked
for the fields used; a file that is not a result of its benchmark is named with the reason and
the command exits 2, nothing half-printed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from epdq.benchmarks.report import table, vs_target

MAX_FILE_BYTES = 64 * 2**20  # the largest result here is ~100 KB; a 64 MiB one is not ours
GOODPUT_TARGET = 2.0  # EPD / colocated goodput with 4 images per request, cost model


class ResultError(ValueError):
    """A results file that cannot be read as its benchmark's output."""


@dataclass(slots=True)
class Row:
    benchmark: str
    target: str
    goal: str
    value: str
    result: str  # PASS, MISS or shown
    measured: str  # the run's time (UTC) and the machine's speed then


def summarize(folder: str | Path) -> dict[str, Any]:
    """{"rows": [Row...], "missing": [(file, command)...], "hosts": {benchmark: CPU},
    "reduced": {benchmark: how}} for the results in `folder` ("" where a run does not say its
    CPU; `reduced` names the runs smaller than README's).
    ResultError names the first file that is there but is not a result of its benchmark."""
    d = Path(folder)
    if not d.is_dir():
        raise ResultError(f"{folder}: not a directory (the benchmarks write to --out, default bench-results)")
    rows: list[Row] = []
    missing: list[tuple[str, str]] = []
    hosts: dict[str, str] = {}
    reduced: dict[str, str] = {}
    for name, src in SOURCES.items():
        path = d / name
        if not path.exists():
            missing.append((name, src.how))
            continue
        data = _load(path, src)
        when = _when(data)
        try:
            made = src.rows(data)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ResultError(f"{path}: not a {src.bench} result this version reads ({type(e).__name__}: {e})") from None
        label = src.bench if src.kind is None else f"{src.bench} ({src.kind})"
        small = src.reduced(data)
        if small:
            reduced[label] = small
            when = f"{when}, reduced size"
        rows.extend(Row(label, t, g, v, r, when) for t, g, v, r in made)
        hosts[label] = _cpu(_env(data).get("cpu_model"))
    return {"rows": rows, "missing": missing, "hosts": hosts, "reduced": reduced}


def mixed_hosts(hosts: dict[str, str]) -> str | None:
    """A warning when the runs come from machines with different CPUs, else None. The same VM
    has run on an Intel and an AMD host (2026-12-04) and the ratios moved with it: targets met on
    one machine and missed on another do not add up to either machine's count."""
    by_cpu: dict[str, list[str]] = {}
    for label, cpu in hosts.items():
        by_cpu.setdefault(cpu or "CPU not recorded", []).append(label)
    if len(by_cpu) < 2:
        return None
    parts = "; ".join(f"{cpu}: {', '.join(labels)}" for cpu, labels in by_cpu.items())
    return f"note: these runs come from {len(by_cpu)} different CPUs ({parts}); the count mixes machines"


def _load(path: Path, src: _Source) -> dict[str, Any]:
    try:
        if not path.is_file():
            raise ResultError(f"{path}: not a regular file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ResultError(f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB; not a benchmark result")
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise ResultError(f"{path}: cannot be read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: not JSON ({e})") from None
    except RecursionError:  # [[[[...]]]]: json gives up at the interpreter's depth limit
        raise ResultError(f"{path}: nested too deeply to be a benchmark result") from None
    if not isinstance(data, dict) or data.get("benchmark") != src.bench or (src.kind and data.get("kind") != src.kind):
        got = data.get("benchmark") if isinstance(data, dict) else type(data).__name__
        raise ResultError(f"{path}: not a result of `{src.how}` (benchmark: {got!r})")
    return data


def _env(data: dict[str, Any]) -> dict[str, Any]:
    env = data.get("environment")
    return env if isinstance(env, dict) else {}


def _when(data: dict[str, Any]) -> str:
    env = _env(data)
    t = env.get("time_utc")
    speed = env.get("speed") if isinstance(env.get("speed"), dict) else {}
    # both speeds: a slow Python loop and slow memory move different targets (2026-12-03)
    loop, copy = speed.get("python_loop_ns"), speed.get("memcpy_gb_s")
    parts = [_cpu(env.get("cpu_model")), f"loop {loop:.0f} ns" if _num(loop) else "",
             f"memcpy {copy:.1f} GB/s" if _num(copy) else ""]  # fmt: skip
    idle = env.get("idle") if isinstance(env.get("idle"), dict) else {}
    poll = idle.get("halt_poll_ns")
    if _num(poll) and poll > 0:  # idle CPUs that poll before they halt: cheaper wake-ups (bench/NOTES)
        parts.append(f"idle polling {poll / 1000:g} µs")
    cfg = data.get("config") if isinstance(data.get("config"), dict) else {}
    if cfg.get("pin") and isinstance(cfg.get("placement"), str):  # a placement the run was given (--pin)
        parts.append(f"pinned: {cfg['placement'][:80]}")
    credits = cfg.get("epdq_credits") if isinstance(cfg.get("epdq_credits"), dict) else {}
    if cfg.get("credits_set") and all(_num(credits.get(k)) for k in ("encoder", "encoder_max_batch", "pd")):
        # credits the run was given (--encoder-credit, --encoder-batch, --pd-credit), not the workers' own
        parts.append(f"credits set: encoder {credits['encoder']:g}/{credits['encoder_max_batch']:g}, "
                     f"pd {credits['pd']:g}")  # fmt: skip
    out = t.replace("T", " ").removesuffix("Z")[:16] if isinstance(t, str) else "?"
    shown = ", ".join(p for p in parts if p)
    return f"{out} ({shown})" if shown else out


_CPU_NOISE = re.compile(r"\((?:R|TM|tm)\)|\b(?:Processor|CPU)\b|@.*$")


def _cpu(model: Any) -> str:
    # The same VM has reported an Intel and an AMD host (2026-12-04): ratios move with it. The
    # file may come from anywhere: letters, digits and a little punctuation (no `|` to break
    # the table, no escapes), and short.
    if not isinstance(model, str):
        return ""
    text = " ".join(_CPU_NOISE.sub(" ", model).split())
    return "".join(c for c in text if c.isascii() and (c.isalnum() or c in " .-_/"))[:24].strip()


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _x(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}f}×" if _num(v) else "n/a"


def _vs(v: Any, target: float, *, at_most: bool, digits: int, unit: str = "×") -> str:
    """A judged figure, with the decimals it takes to fall on the same side of `target` as the
    value: with fixed decimals 1.302 against "≤ 1.3" printed "1.30× MISS" and 0.334 against "≤ ⅓"
    printed "0.33 MISS"."""
    return f"{vs_target(float(v), float(target), at_most=at_most, digits=digits)}{unit}" if _num(v) else "n/a"


def _judge(ok: Any) -> str:
    return "PASS" if ok is True else "MISS"


def _handoff(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = []
    for t in data["targets"]:
        size = f"{float(t['size_mib']):g} MiB"
        out.append((f"ring (view) ÷ one memcpy, {size}", f"≤ {t['ring_target']:g}×",
                    _vs(t["ring_over_memcpy"], t["ring_target"], at_most=True, digits=2),
                    _judge(t["ring_pass"])))  # fmt: skip
        # both sides end at the same point (handoff_report.summarise): the tensor in hand (load_file's
        # lazily mapped tensor against the view), and, where the run has it, the bytes copied into
        # the reader's own tensor (files written before that pair existed divided by the view alone)
        copied = t.get("safetensors_copy_over_ring_copy")
        hand = "to the tensor in hand" if copied is not None else "(ring view; run before the like-for-like pair)"
        out.append((f"safetensors path ÷ ring, {hand}, {size}", f"≥ {t['safetensors_target']:g}×",
                    _vs(t["safetensors_over_ring"], t["safetensors_target"], at_most=False, digits=1),
                    _judge(t["safetensors_pass"])))  # fmt: skip
        if copied is not None:
            out.append((f"the same, both ending in a copy, {size}", f"≥ {t['safetensors_target']:g}×",
                        _vs(copied, t["safetensors_target"], at_most=False, digits=1),
                        _judge(t.get("safetensors_copy_pass"))))  # fmt: skip
    return out


def _control(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = []
    for t in data["targets"]:
        v, limit, at_most = t["value"], float(t["limit"]), bool(t["at_most"])
        if limit >= 100:  # requests per second
            shown = _vs(v, limit, at_most=at_most, digits=0, unit=" req/s")
        elif at_most:  # a latency ratio
            shown = _vs(v, limit, at_most=True, digits=2, unit="")
        else:
            shown = _vs(v, limit, at_most=False, digits=2)
        out.append((str(t["target"]), str(t["goal"]), shown, _judge(t["pass"])))
    return out


def _goodput(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The target is judged at the benchmark's own scenario (--pd, 1E+3PD vs 4 by default): the
    best N of the topology table, picked after the fact, was judged before (2.72× at N = 2 passed
    while the scenario run missed). The best N is shown, naming N. A ratio with a side at the top
    of the load grid (`saturated_grid`) is a bound: judged only where the bound decides."""
    systems = data["systems"]
    images = data["workload"]["images_per_request"]
    topo = [t for t in data.get("topology") or [] if isinstance(t, dict)]
    main = next((t for t in topo if t["epd"] == systems["epd"]), None)
    if main is None:  # --topologies none: the scenario's figures are in "summary"
        s = data["summary"]
        main = {"epd": systems["epd"], "colocated": systems["colocated"], "ratio": data["epd_over_colocated_4img"],
                "epd_saturated_grid": s["epd_4img"].get("saturated_grid"),
                "colocated_saturated_grid": s["colocated_4img"].get("saturated_grid")}  # fmt: skip
    seeds = data.get("seeds")
    over = f"median of {len(seeds)} arrival seeds" if isinstance(seeds, list) and len(seeds) > 1 else "one arrival seed"
    judged = images == 4  # the target is set for 4 images per request
    figure, ok = _bounded(main, GOODPUT_TARGET)
    out = [(f"EPD ÷ colocated goodput, {images} images, cost model: {_short(main)} ({over})",
            f"≥ {GOODPUT_TARGET:g}×" if judged else "shown", figure + _spread(main),
            _judge(ok) if judged else "shown")]  # fmt: skip
    others = [t for t in topo if t is not main and _num(t["ratio"])]
    if others:
        best = max([main, *others], key=lambda t: t["ratio"] if _num(t["ratio"]) else -1.0)
        out.append((f"the same, best N of the topology table: {_short(best)}", "shown",
                    _bounded(best, GOODPUT_TARGET)[0] + _spread(best), "shown"))  # fmt: skip
    out.append(("cache gain, repeated images", "shown", _x(data["cache_gain"]), "shown"))
    return out


def _short(t: dict[str, Any]) -> str:
    """'1 encoder + 3 PD' vs '4 colocated' as '1E+3PD vs 4'."""
    epd = str(t["epd"]).replace(" encoder + ", "E+").replace(" PD", "PD")
    return f"{epd} vs {str(t['colocated']).removesuffix(' colocated')}"


def _bounded(t: dict[str, Any], target: float) -> tuple[str, bool | None]:
    """A topology row's ratio as text and whether it meets `target` (False where it cannot be
    told). EPD at the top of the grid: its goodput, so the ratio, is at least the figure; the
    colocated side: at most; both: unknown."""
    r = t["ratio"]
    lo, hi = bool(t.get("epd_saturated_grid")), bool(t.get("colocated_saturated_grid"))
    if not _num(r):
        return "n/a", False
    if lo and hi:
        return f"unknown (both sides met every load; {r:.2f}× at the grid's top)", False
    if lo:
        return f"≥ {_vs(r, target, at_most=False, digits=2)}", r >= target
    if hi:
        return f"≤ {_vs(r, target, at_most=False, digits=2)}", False
    return _vs(r, target, at_most=False, digits=2), r >= target


def _spread(t: dict[str, Any]) -> str:
    lo, hi = t.get("ratio_min"), t.get("ratio_max")
    return f" (seeds {lo:.2f}–{hi:.2f}×)" if _num(lo) and _num(hi) and len(t.get("ratio_seeds") or []) > 1 else ""


def _goodput_real(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    g = data["goodput_rps"]
    epd, col = g["epd"], g["colocated"]
    rates = f"EPD {epd:.1f}, colocated {col:.1f} req/s" if _num(epd) and _num(col) else "no load met the SLOs"
    return [("EPD ÷ colocated goodput, real tiny model on CPU", "shown",
             f"{_x(data['epd_over_colocated'])} ({rates})", "shown")]  # fmt: skip


def _scale(data: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    w = data["workers"]
    per = data["per_decision_us"]
    out = [(f"time per dispatch decision, {w['encoders'] + w['pds']:,} workers, {data['requests']:,} requests",
            "shown", f"encode {per['encode']:.1f} µs, prefill {per['prefill']:.1f} µs", "shown")]  # fmt: skip
    mem = data.get("memory")
    if isinstance(mem, dict) and _num(mem.get("bytes_per_queued_request")):
        out.append(("memory per queued request", "shown", f"{mem['bytes_per_queued_request']:,.0f} B", "shown"))
    return out


_Made = list[tuple[str, str, str, str]]  # (target, goal, figure, PASS / MISS / shown)


@dataclass(frozen=True, slots=True)
class _Source:
    bench: str  # the "benchmark" field its file must carry
    kind: str | None  # and its "kind", where two files come from one benchmark
    how: str  # the command that writes it (into --out, default bench-results)
    rows: Callable[[dict[str, Any]], _Made]
    reduced: Callable[[dict[str, Any]], str | None] = lambda data: None


def _below(value: Any, full: float, what: str) -> str | None:
    """'1,000 requests, not 8,000' where a run was smaller than README's (`epdq bench all`'s
    full sizes), else None. `epdq bench all --quick` writes the same files at small sizes, and a
    figure from one (a goodput ratio of 2.00x over 30 s windows) must not read as the judged run's."""
    if _num(value) and value < full:
        return f"{value:,.10g} {what}, not {full:,.10g}"
    return None


def _reduced_handoff(data: dict[str, Any]) -> str | None:
    return _below((data.get("config") or {}).get("repeats"), 40, "repeats")


def _reduced_control(data: dict[str, Any]) -> str | None:
    return _below((data.get("config") or {}).get("requests"), 8000, "requests")


def _reduced_goodput(data: dict[str, Any]) -> str | None:
    return _below(data.get("window_s"), 120, "s windows")


SOURCES: dict[str, _Source] = {
    "handoff.json": _Source("handoff", None, "epdq bench handoff --repeats 40", _handoff, _reduced_handoff),
    "control.json": _Source("control", None, "epdq bench control --requests 8000", _control, _reduced_control),
    "goodput.json": _Source("goodput", "cost", "epdq bench goodput", _goodput, _reduced_goodput),
    "goodput-real.json": _Source("goodput", "real", "epdq bench goodput --real", _goodput_real),
    "scale.json": _Source("scale", None, "epdq bench scale", _scale),
}


def main(argv: list[str] | None = None, prog: str = "python -m epdq.benchmarks.summary") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default="bench-results",
                    help="the folder the benchmarks wrote to (their --out; default bench-results)")  # fmt: skip
    ap.add_argument("--json", dest="json_out", metavar="FILE", default=None, help="also write the summary to this JSON file")
    ap.add_argument("--check", action="store_true", help="exit 1 if a judged target is missed")
    a = ap.parse_args(argv)
    try:
        res = summarize(a.dir)
    except ResultError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    rows: list[Row] = res["rows"]
    if not rows:
        print(f"{prog}: error: no benchmark results in {a.dir}; run, for instance, "
              f"`{SOURCES['handoff.json'].how} --out {a.dir}`", file=sys.stderr)  # fmt: skip
        return 2
    print(table(["benchmark", "target", "goal", "measured", "result", "run (UTC)"],
                [[r.benchmark, r.target, r.goal, r.value, r.result, r.measured] for r in rows],
                title=f"Targets, from the results in {a.dir}"))  # fmt: skip
    judged = [r for r in rows if r.result != "shown"]
    missed = [r for r in judged if r.result == "MISS"]
    print(f"\n{len(judged) - len(missed)} of {len(judged)} judged targets met")
    mixed = mixed_hosts(res["hosts"])
    if mixed:
        print(mixed)
    small = res["reduced"]
    if small:
        counted = sum(1 for r in judged if r.benchmark in small)
        print(f"note: {counted} of the {len(judged)} judged figures come from runs smaller than README's "
              f"({'; '.join(f'{b}: {how}' for b, how in small.items())}): a first look, noisier; "
              f"`epdq bench all` runs the full sizes")  # fmt: skip
    for name, how in res["missing"]:
        print(f"not run: {name} (`{how} --out {a.dir}`)")
    if a.json_out:
        body = {
            "benchmark": "summary", "dir": str(a.dir), "rows": [asdict(r) for r in rows],
            "missing": [n for n, _ in res["missing"]], "met": len(judged) - len(missed), "judged": len(judged),
            "hosts": res["hosts"], "mixed_hosts": mixed is not None, "reduced": small,
        }  # fmt: skip
        try:
            Path(a.json_out).write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            print(f"{prog}: error: cannot write {a.json_out}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote {a.json_out}")
    return 1 if a.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
