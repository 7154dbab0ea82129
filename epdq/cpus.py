"""CPU placement: pin an epdq process, its ZeroMQ I/O thread included, to chosen cores.

Every ZeroMQ message crosses two more threads than the Python ones that send and receive it:
each process's I/O thread. Where waking a thread on another core is dear (a VM whose idle
virtual CPUs halt: bench/NOTES.md measured it on this one), a process whose threads share one
core, and processes that talk to each other sharing one, answer sooner at low load. At high
load the kernel's own spreading may do better: placement is the operator's choice, off unless
asked for, like `taskset`.

A process is pinned before it starts any thread of its own (its ZeroMQ context comes later), so
every thread it makes, and every process it starts (vLLM's engine core), inherits the set.
"""

from __future__ import annotations

import logging
import os
import re

from epdq.errors import ConfigError

log = logging.getLogger("epdq.cpus")

MAX_CPU = 4095  # the highest CPU number accepted (Linux's default NR_CPUS is lower)
MAX_TEXT = 256  # characters of a CPU list
_PART = re.compile(r"(\d{1,4})(?:-(\d{1,4}))?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`taskset -c` syntax: "0", "0-3", "0,2,4-7" -> sorted CPU numbers. ValueError otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a CPU list must name at least one CPU (e.g. 0, 0-3 or 0,2,4-7)")
    if len(text) > MAX_TEXT:
        raise ValueError(f"a CPU list is at most {MAX_TEXT} characters")
    out: set[int] = set()
    for part in text.split(","):
        m = _PART.fullmatch(part.strip())
        if m is None:
            raise ValueError(f"{part.strip()!r} in CPU list {text!r} is not a CPU number or range (e.g. 0, 0-3 or 0,2,4-7)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"CPU range {part.strip()!r} runs backwards")
        out.update(range(lo, hi + 1))
    return check_cpus(tuple(out))


def check_cpus(cpus: tuple[int, ...] | list[int], name: str = "cpus") -> tuple[int, ...]:
    """A config's CPU set, validated and sorted (empty = not pinned). ValueError if malformed."""
    if not isinstance(cpus, (tuple, list)):
        raise ValueError(f"{name} must be a list of CPU numbers")
    for c in cpus:
        if type(c) is not int or not 0 <= c <= MAX_CPU:
            raise ValueError(f"{name}: {c!r} is not a CPU number in [0, {MAX_CPU}]")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{name} lists a CPU twice")
    return tuple(sorted(cpus))


def format_cpus(cpus: tuple[int, ...] | set[int] | frozenset[int]) -> str:
    """The shortest `taskset -c` form: (0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin_process(cpus: tuple[int, ...], pid: int = 0, *, widen: bool = False) -> None:
    """Restrict every thread of process `pid` (0: this one) to `cpus`; nothing when empty.

    ConfigError when a CPU is outside the set the process was started with (offline, outside
    its cgroup or container, or not there at all): said before anything runs, not found out as
    slowness. `widen` skips that check: to give a pinned process its old set back."""
    if not cpus:
        return
    allowed = os.sched_getaffinity(pid)
    missing = set(cpus) - allowed
    if missing and not widen:
        raise ConfigError(f"cpus {format_cpus(missing)} not available to this process "
                          f"(it may use {format_cpus(allowed)})")  # fmt: skip
    want = set(cpus)
    task_dir = f"/proc/{pid or os.getpid()}/task"
    try:
        tids = [int(t) for t in os.listdir(task_dir)]
    except OSError:
        tids = [pid]  # no /proc: the calling thread (pid 0) or the process's main thread
    for tid in tids:
        try:
            os.sched_setaffinity(tid, want)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
        except OSError as e:
            raise ConfigError(f"cannot pin to cpus {format_cpus(want)}: {e.strerror or e}") from None


def place_this_process(cpus: tuple[int, ...], name: str) -> None:
    """`pin_process` for this process at its start, said in its log (nothing when `cpus` is empty)."""
    pin_process(cpus)
    if cpus:
        log.info("%s runs on cpus %s", name, format_cpus(cpus), extra={"event": "placed", "cpus": format_cpus(cpus)})
