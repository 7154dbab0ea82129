"""`epdq bench all`: every benchmark, one after another, into one folder, then their targets in one
table (`epdq bench summary`).

At the sizes README's tables use (about 3 minutes here; `--real` adds the real tiny model's
goodput, about 3 more), or with `--quick` at small sizes for a first look (about 30 s here; its
figures are noisier and the hand-off ratios at small repeat counts lean high). A benchmark that
fails stops the run with its exit code; the files written so far stay in `--out`.
"""

from __future__ import annotations

import argparse
import importlib
import time

from epdq.benchmarks import summary
from epdq.benchmarks.report import check_out_dir

# (benchmark, its arguments): README's sizes, and --quick's
FULL: list[tuple[str, list[str]]] = [
    ("handoff", ["--repeats", "40", "--curve"]),
    ("control", ["--requests", "8000"]),
    ("scale", []),
    ("goodput", []),
]
QUICK: list[tuple[str, list[str]]] = [
    ("handoff", ["--repeats", "5", "--warmup", "1"]),
    ("control", ["--requests", "1000", "--rounds", "2"]),
    ("scale", ["--workers", "200", "--requests", "10000"]),
    ("goodput", ["--quick"]),
]
REAL = ("goodput", ["--real"])


def steps(quick: bool, real: bool) -> list[tuple[str, list[str]]]:
    return [*(QUICK if quick else FULL), *([REAL] if real else [])]


def run_one(name: str, argv: list[str], command: str | None = None) -> int:
    """A benchmark module's `main`, as `epdq bench COMMAND ARGV...` runs it (COMMAND defaults to
    the module's name); its exit code."""
    module = importlib.import_module(f"epdq.benchmarks.{name}")
    try:
        rc = module.main(argv, prog=f"epdq bench {command or name}")
    except SystemExit as e:  # argparse's usage errors
        return e.code if isinstance(e.code, int) else 2
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None, prog: str = "python -m epdq.benchmarks.suite") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", "--out-dir", dest="out", default="bench-results",
                    help="directory every benchmark writes its JSON and plot to (default bench-results)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="small sizes: about 30 s, noisier figures")
    ap.add_argument("--real", action="store_true", help="also the goodput of the real tiny model (about 3 minutes)")
    ap.add_argument("--no-plot", action="store_true", help="no PNG plots (older ones in --out are removed)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a judged target is missed")
    a = ap.parse_args(argv)
    try:
        check_out_dir(a.out)
    except ValueError as e:
        ap.error(str(e))
    plan = steps(a.quick, a.real)
    extra = ["--out", a.out, *(["--no-plot"] if a.no_plot else [])]
    t0 = time.monotonic()
    for i, (name, args) in enumerate(plan, 1):
        cmd = [*args, *extra]
        print(f"\n=== [{i}/{len(plan)}] epdq bench {name} {' '.join(cmd)}", flush=True)
        t = time.monotonic()
        rc = run_one(name, cmd)
        if rc != 0:
            print(f"\n{prog}: epdq bench {name} exited {rc}: stopped; the results so far are in {a.out}", flush=True)
            return rc
        print(f"=== epdq bench {name}: {time.monotonic() - t:.0f} s", flush=True)
    print(f"\n=== all {len(plan)} benchmarks in {time.monotonic() - t0:.0f} s; their targets:", flush=True)
    return summary.main([a.out, *(["--check"] if a.check else [])], prog="epdq bench summary")


if __name__ == "__main__":
    raise SystemExit(main())
