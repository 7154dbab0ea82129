"""Hand-off benchmark: an embedding from the encoder's write to a tensor in the PD worker's hand.

Four ways to move the same bytes, measured side by side in one run:

- **memcpy**: one `dst.copy_(src)` into a preallocated tensor in one process (the physical limit);
- **ring** (view, and copy out): what the encoder and a PD worker on the same node do. The
  encoder-side process places the entry (`RingWriter.reserve`), announces it over a pipe (the
  note stands for the completion event) and copies the bytes in (`fill`) while the note travels;
  the PD-side process makes its view (`RingReader.view_early`; or reads with `read(..., out=...)`),
  waits for the bytes if it got there first (as `RingReader.wait_published`), and checks the
  header. The two processes are pinned to different cores, as an encoder and a PD worker have
  cores of their own: on a 2-core machine a process woken through a pipe is otherwise queued on
  the waker's core (a "sync" wake-up) until the waker sleeps, and nothing overlaps;
- **fetch tcp** (and **fetch tcp+CURVE** with `curve=True`): the cross-node path. The writer
  places, announces and fills the ring entry as above and serves `Fetch` with a real `EncoderWorker` fetch socket on
  tcp://127.0.0.1; the reader fetches with a real `RemoteFetcher` and copies the frame into its
  destination as `PDWorker._gather` does;
- **safetensors**: the path of vLLM's example EC connector: `save_file` into
  `<dir on /dev/shm>/<hash>/encoder_cache.safetensors`, a wake-up, `os.path.exists`, `load_file`.

On a machine with CUDA (`cuda=None`, the default, means: when `torch.cuda.is_available()`), a
second pair of processes measures the same hand-off between GPU tensors, side by side:

- **d2d**: one device-to-device `copy_` in one process (the physical limit);
- **cuda ring**: `CudaRingWriter.write` from a GPU tensor (device-to-device, synchronised), a
  wake-up, `CudaRingReader.read` in the other process through the CUDA IPC mapping into a GPU
  tensor (device-to-device, then the header check);
- **shm ring from GPU**: the shared-memory ring fed a GPU tensor (device-to-host into the
  segment), `RingReader.read` to host memory and one host-to-device copy (what a GPU PD worker
  does with a shared-memory entry);
- **safetensors from GPU**: vLLM's connector path: `save_file({"ec_cache": t.cpu()})` on
  /dev/shm, `load_file(path, device="cuda")`.

Without CUDA the table says "skipped: no CUDA" for each of them.

Every transfer is timed from just before the writer's first call to the tensor being in the
reader's hand (`time.perf_counter_ns` is CLOCK_MONOTONIC, one clock for both processes). Methods
are interleaved within every repeat, in a fresh (seeded) random order each time, and sources,
destinations and ring slots cycle through pools larger than the last-level cache so that no
method reads warm bytes. (A fixed rotation kept each method's predecessor fixed: the ring-view
transfer always came right after the memcpy baseline, whose 16 MiB of traffic at 8 MiB had just
flushed the shared cache, and its write took ~40 us longer than the same write after another
method.)

`run()` prints the tables, writes `handoff.json` (and `handoff.png`) and returns the results;
`python -m epdq.benchmarks.handoff --sizes 1,8,32 --repeats 20` does the same from a shell.
The two processes are children of the caller (which keeps its own torch settings); every child,
segment, socket, file and key directory is removed on the way out, also after an error.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from epdq.benchmarks import handoff_report
from epdq.benchmarks.handoff_common import (
    HIDDEN,
    METHODS,
    MIB,
    SHM_ROOT,
    HandoffResourceError,
    _align,
    _run_children,
    row_bytes,
)
from epdq.benchmarks.handoff_gpu import _cuda_available, render_cuda, run_cuda
from epdq.benchmarks.handoff_report import render, summarise
from epdq.benchmarks.report import Progress, check_out_dir, remove_stale, sigterm_unwinds, write_json

__all__ = ["SHM_ROOT", "main", "render", "render_cuda", "run"]

# ------------------------------------------------------------------ public API


def run(
    *,
    sizes_mib: tuple[float, ...] | list[float] = (1, 8, 32),
    repeats: int = 20,
    out_dir: str | os.PathLike = "bench-results",
    plot: bool = True,
    progress: bool | None = None,
    curve: bool = False,
    dtype: str = "bfloat16",
    warmup: int = 2,
    pool_mib: int = 256,
    ring_mib: int = 256,
    timeout_s: float = 120.0,
    cuda: bool | None = None,
    device: str = "cuda:0",
) -> dict[str, Any]:
    """Measure the hand-off paths; print the tables, write handoff.json (+ .png), return the data.

    `progress`: None draws the bar when stderr is a terminal, True always, False never.
    `pool_mib`: size of each pool that sources, destinations (and `ring_mib` the ring) cycle
    through; keep both well above the last-level cache. `timeout_s`: longest silence from the
    child processes before the run is abandoned. `cuda`: also measure the GPU hand-offs on
    `device` (None: when CUDA is available; without it they are reported as skipped).
    """
    sizes = [float(s) for s in sizes_mib]
    _check_args(sizes, repeats, warmup, dtype, pool_mib, ring_mib)
    # before the CPU part runs: a bad --device, or --cuda without CUDA, used to surface after it
    device = check_cuda(cuda, device)
    rows, pool_bytes, ring_bytes = _sizes(sizes, dtype, pool_mib, ring_mib)
    check_memory(pool_bytes, ring_bytes, pool_mib, ring_mib)
    methods = [m for m in METHODS if curve or m != "fetch_curve"]
    cfg: dict[str, Any] = {
        "sizes_mib": sizes,
        "rows": rows,
        "hidden": HIDDEN,
        "dtype": dtype,
        "repeats": repeats,
        "warmup": warmup,
        "methods": methods,
        "pool_bytes": pool_bytes,
        "ring_bytes": ring_bytes,
        "seed": secrets.randbits(32),
    }
    for name, asked in (("pool", pool_mib), ("ring", ring_mib)):
        got = cfg[f"{name}_bytes"]
        if got > asked * MIB:  # said, so that the figures are read with the size they were taken at
            print(f"(--{name}-mib {asked} is too small for {max(sizes):g} MiB transfers: using {got / MIB:,.0f} MiB, "
                  "which holds 4 of the largest so every transfer moves cold bytes)")  # fmt: skip
    for note in size_notes(sizes, rows, dtype):
        print(note)
    bar = Progress((warmup + repeats) * len(sizes), "hand-off benchmark", force=bool(progress))
    if progress is False:
        bar.enabled = False
    raw = _run_children(cfg, bar, timeout_s)
    data = summarise(cfg, raw)
    data["cuda"] = run_cuda(cfg, cuda, device, timeout_s)
    print(render(data), flush=True)
    print(render_cuda(data["cuda"], cfg), flush=True)
    out = Path(out_dir)
    remove_stale(out / "handoff.png")  # an older run's plot must not stand beside this run's JSON
    path = write_json(out / "handoff.json", "handoff", data)
    if plot:
        handoff_report.plot(data, out / "handoff.png")
    return json.loads(path.read_text())


def size_notes(sizes: list[float], rows: list[int], dtype: str) -> list[str]:
    """What is moved where it is not the size asked for: the tables label rows by that size, but
    an embedding is whole rows (0.001 MiB is one row, 7 KiB in bfloat16)."""
    notes = []
    for size, n in zip(sizes, rows, strict=True):
        moved = n * row_bytes(dtype)
        if abs(moved - size * MIB) > 0.02 * size * MIB:
            notes.append(f"({size:g} MiB is moved as {n:,} row{'s' * (n != 1)} of {HIDDEN} {dtype}: {_bytes(moved)})")
    return notes


def _bytes(n: int) -> str:
    return f"{n / MIB:.3g} MiB" if n >= MIB else f"{n / 1024:.3g} KiB"


def _sizes(sizes: list[float], dtype: str, pool_mib: int, ring_mib: int) -> tuple[list[int], int, int]:
    """(rows per size, pool bytes, ring bytes) as the children allocate them."""
    rows = [max(1, round(s * MIB / row_bytes(dtype))) for s in sizes]
    biggest = max(rows) * row_bytes(dtype)
    # pools and the ring hold at least 4 of the biggest entries, so every transfer moves cold bytes
    return rows, max(pool_mib * MIB, 4 * _align(biggest)), max(ring_mib * MIB, 4 * (_align(biggest) + 4096))


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _shm_free() -> int | None:
    try:
        st = os.statvfs(SHM_ROOT)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_memory(pool_bytes: int, ring_bytes: int, pool_mib: int, ring_mib: int) -> None:
    """ValueError when the children's pools and ring cannot fit: the writer holds two pools (sources,
    memcpy destinations) and the ring (on /dev/shm), the reader one pool; the GPU rows, run after
    them, hold less host memory. (40000 MiB pools on a 23 GiB machine ended in a child's traceback.)"""
    need = 3 * pool_bytes + ring_bytes
    avail = _available_memory()
    if avail is not None and need > avail:
        raise ValueError(
            f"--pool-mib {pool_mib} and --ring-mib {ring_mib} need about {need / MIB:,.0f} MiB of memory (3 pools of "
            f"{pool_bytes / MIB:,.0f} MiB and a {ring_bytes / MIB:,.0f} MiB ring), but only {avail / MIB:,.0f} MiB "
            "is available (MemAvailable)"
        )  # fmt: skip
    shm = _shm_free()
    if shm is not None and ring_bytes > shm:
        raise ValueError(f"--ring-mib {ring_mib}: the {ring_bytes / MIB:,.0f} MiB ring does not fit in {SHM_ROOT} "
                         f"({shm / MIB:,.0f} MiB free)")  # fmt: skip


def check_cuda(cuda: bool | None, device: str) -> str:
    """The canonical device for the GPU rows; ValueError for a malformed device, for --cuda asked
    for on a machine without CUDA, or for a CUDA device that is not there. `cuda=None` without CUDA
    passes: the GPU rows are reported as skipped."""
    from epdq.worker.devices import check_device, parse_device

    try:
        device = parse_device(device)
    except ValueError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, not {device!r}") from None
    if cuda is False or device == "cpu":  # "cpu": a dry run of the GPU rows' processes (tests)
        return device
    ok, why = _cuda_available()
    if not ok:
        if cuda:
            raise ValueError(f"--cuda was asked for, but this machine has {why}: leave --cuda out (the GPU rows are "
                             "then reported as skipped) or give --no-cuda")  # fmt: skip
        return device
    return check_device(device)  # DeviceUnavailableError (a ValueError): cuda:N beyond the visible devices


def _check_args(sizes: list[float], repeats: int, warmup: int, dtype: str, pool_mib: int, ring_mib: int) -> None:
    if not sizes:
        raise ValueError("sizes: give at least one size in MiB, e.g. 1,8,32")
    if any(not 0 < s <= 1024 for s in sizes):
        raise ValueError(f"sizes must be in (0, 1024] MiB, got {sizes}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, not {dtype!r}")
    if not (1 <= pool_mib <= 65536 and 1 <= ring_mib <= 65536):
        raise ValueError(f"pool and ring sizes must be 1..65536 MiB, not {pool_mib} and {ring_mib}")


def main(argv: list[str] | None = None, prog: str = "python -m epdq.benchmarks.handoff") -> int:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Embedding hand-off: shared-memory ring vs remote fetch vs safetensors files vs one memcpy.",
    )
    ap.add_argument(
        "--sizes", default="1,8,32", help="embedding sizes in MiB, comma-separated (default 1,8,32)"
    )
    ap.add_argument(
        "--repeats", type=int, default=20, help="measured repeats per size and method (default 20)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first (default 2)")
    ap.add_argument(
        "--out", "--out-dir", dest="out", default="bench-results", help="directory for handoff.json / handoff.png"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--curve", action="store_true", help="also measure the fetch path with CURVE encryption")
    ap.add_argument("--pool-mib", type=int, default=256, help="pool that sources/destinations cycle through")
    ap.add_argument("--ring-mib", type=int, default=256, help="ring capacity")
    ap.add_argument("--no-plot", action="store_true", help="skip handoff.png (an older one in --out is removed)")
    ap.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU hand-offs too (default: when CUDA is available, else reported as skipped; "
                    "--cuda without CUDA is an error)")  # fmt: skip
    ap.add_argument("--device", default="cuda:0", help="GPU for the CUDA hand-offs: cuda or cuda:N (default cuda:0)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar (default: when stderr is a terminal)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        sizes = tuple(dict.fromkeys(float(s) for s in args.sizes.split(",") if s.strip()))  # once each
    except ValueError:
        ap.error(f"--sizes must be numbers separated by commas, not {args.sizes!r}")
    try:
        _check_args(list(sizes), args.repeats, args.warmup, args.dtype, args.pool_mib, args.ring_mib)
        check_cuda(args.cuda, args.device)
        _, pool_bytes, ring_bytes = _sizes(list(sizes), args.dtype, args.pool_mib, args.ring_mib)
        check_memory(pool_bytes, ring_bytes, args.pool_mib, args.ring_mib)
        check_out_dir(args.out, ("handoff.json", "handoff.png"))
    except ValueError as e:
        ap.error(str(e))
    try:
        with sigterm_unwinds():  # the children stopped, the key and /dev/shm directories removed
            run(
                sizes_mib=sizes, repeats=args.repeats, out_dir=args.out, plot=not args.no_plot,
                progress=args.progress, curve=args.curve, dtype=args.dtype, warmup=args.warmup,
                pool_mib=args.pool_mib, ring_mib=args.ring_mib, cuda=args.cuda, device=args.device,
            )  # fmt: skip
    except HandoffResourceError as e:  # memory ran out in a child after all: one line, not a traceback
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
