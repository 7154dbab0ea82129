"""Output shared by the benchmarks: aligned tables, JSON files, PNG plots, a progress bar."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str = "") -> str:
    """A plain-text table (also valid Markdown) with right-aligned numbers."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(_is_num(r[i]) for r in cells) if cells else False for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, numeric, strict=True)) + " |"

    out = [f"\n{title}"] if title else []
    out.append(line(headers))
    out.append("|" + "|".join(("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric, strict=True)) + "|")
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:,.{_digits(v)}f}"
    return str(v)


def _digits(v: float) -> int:
    """Decimals a table shows for `v`: 3 significant figures or so, whole numbers from 100."""
    a = abs(v)
    return 0 if a >= 100 else 1 if a >= 10 else 2 if a >= 0.1 else 3


def vs_target(value: float, target: float, *, at_most: bool, digits: int | None = None) -> str:
    """`value` as a table prints it (`digits` decimals, by default those of `table`), with as many
    more as it takes for the printed figure to fall on the same side of `target` as the value
    itself: a PASS/MISS mark must follow from the figure beside it (1.302 against "≤ 1.3" was
    printed "1.30" and marked MISS)."""
    if not math.isfinite(value):
        return "n/a" if value != value else f"{value}"
    d = _digits(value) if digits is None else digits
    met = value <= target if at_most else value >= target
    for extra in range(12):
        text = f"{value:,.{d + extra}f}"
        shown = float(text.replace(",", ""))
        if (shown <= target if at_most else shown >= target) == met:
            return text
    return repr(value)


def _is_num(s: str) -> bool:
    try:
        float(s.replace(",", "").rstrip("x×").lstrip("≥≤ "))
        return True
    except ValueError:
        return s == "n/a"


def environment() -> dict[str, Any]:
    """What a result was measured with: versions, the machine, the command line."""
    from epdq import __version__

    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "epdq": __version__,
        "torch": _dist_version("torch"),  # from the installed metadata: importing torch takes seconds
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "argv": list(sys.argv),
        "speed": machine_speed(),
        "idle": idle_policy(),
    }


def machine_speed() -> dict[str, float]:
    """Two quick readings (~0.2 s) of how fast this machine runs right now, taken as a run's JSON
    is written: a shared VM's speed varies, up to 3x between days here, so absolute figures of two
    runs compare only together with these. `python_loop_ns`: one iteration of a pure-Python
    add loop; `memcpy_gb_s`: copying 64 MiB once."""
    n = 1_000_000
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    loop_ns = (time.perf_counter() - t) / n * 1e9
    src, dst = bytearray(b"\1") * (64 << 20), bytearray(64 << 20)
    dst[:] = src  # every page touched before the timed copies
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t)
    return {"python_loop_ns": round(loop_ns, 2), "memcpy_gb_s": round(len(src) / best / 1e9, 2)}


_CPUIDLE = "/sys/devices/system/cpu/cpuidle"
_HALT_POLL_NS = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"


def idle_policy(cpuidle: str = _CPUIDLE, halt_poll: str = _HALT_POLL_NS) -> dict[str, Any]:
    """How this machine's idle CPUs wait, which decides what a wake-up that crosses cores costs:
    with `haltpoll` and `guest_halt_poll_ns` 0 (this VM's setting) an idle virtual CPU halts at
    once and every wake-up of it is an interrupt into the hypervisor, most of the cost of a
    request at concurrency 1 (bench/NOTES, 2026-12-04). `halt_poll_ns`: how long an idle CPU
    polls before it halts, None where the guest has no haltpoll driver. Each value is None
    where it cannot be read (no Linux sysfs)."""
    return {
        "driver": _sys_word(os.path.join(cpuidle, "current_driver")),
        "governor": _sys_word(os.path.join(cpuidle, "current_governor"))
        or _sys_word(os.path.join(cpuidle, "current_governor_ro")),
        "halt_poll_ns": _sys_int(halt_poll),
    }


def _sys_word(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return text if text and len(text) < 64 and text.isprintable() else None


def _sys_int(path: str) -> int | None:
    text = _sys_word(path)
    return int(text) if text is not None and text.isdigit() else None


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    """The CPU's name from /proc/cpuinfo (Linux; "model name" on x86, "Model"/"Hardware" on ARM)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While a benchmark runs from its command line, SIGTERM (`kill`, `timeout`, a service
    manager) unwinds it like Ctrl-C instead of ending the process on the spot: every `finally`
    and `with` runs, so its child processes are stopped and its temporary directories (log
    files, CURVE keys, safetensors files on /dev/shm) removed; it then exits with 128 + 15 = 143,
    as a process killed by SIGTERM does. A second SIGTERM during that cleanup ends it at once.
    Outside the main thread (where signals cannot be handled) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, _frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def remove_stale(path: str | os.PathLike) -> None:
    """Remove an output a run will not write this time (a plot under --no-plot): a file left from
    an older run beside the new JSON would be read as this run's."""
    Path(path).unlink(missing_ok=True)


def check_out_dir(path: str | os.PathLike, writes: tuple[str, ...] = ()) -> None:
    """Create `--out` and prove it writable BEFORE a benchmark runs, so that a long run never
    ends in a traceback with its results lost; `writes`: the files the run will write there,
    which must be files it may overwrite if they exist. Raises ValueError with a one-line reason."""
    import tempfile

    if not os.fspath(path).strip():  # Path("") is ".": the results would land wherever the shell stands
        raise ValueError("--out must name a directory, not an empty string")
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        if isinstance(e, FileExistsError):  # mkdir's "File exists" for a file named like the directory
            why = "it is a file"
        elif isinstance(e, NotADirectoryError):
            why = "a part of the path is a file"
        else:
            why = e.strerror or str(e)
        raise ValueError(f"--out {os.fspath(path)!r} is not a writable directory: {why}") from None
    for name in writes:
        f = p / name
        if f.exists() and not f.is_file():
            kind = "a directory" if f.is_dir() else "not a regular file"
            raise ValueError(f"--out {os.fspath(path)!r}: {name} is there and is {kind}; the run writes "
                             f"its results to that name (move it away or choose another --out)")  # fmt: skip
        if f.exists() and not os.access(f, os.W_OK):
            raise ValueError(f"--out {os.fspath(path)!r}: {name} is there and may not be written")


def write_json(path: str | os.PathLike, name: str, data: dict[str, Any]) -> Path:
    """Standard JSON: a figure that does not exist (NaN: no load met the SLOs) is written as null,
    which every parser reads (NaN is Python's extension)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = _finite({"benchmark": name, "environment": environment(), **data})
    p.write_text(json.dumps(body, indent=2, allow_nan=False))
    return p


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or when forced)."""

    def __init__(self, total: int, label: str, *, force: bool = False, stream=None):
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._finished = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and not self._finished and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 30)
            eta = (now - self.t0) / frac * (1 - frac) if frac > 0 else 0.0
            self.stream.write(f"\r{self.label:<28} [{bar:<30}] {min(self.done, self.total)}/{self.total} eta {eta:5.1f}s")
            if self.done >= self.total:  # the line is finished once: later calls draw nothing
                self.stream.write("\n")
                self._finished = True
            self.stream.flush()

    def iter(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            yield item
            self.advance()


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
