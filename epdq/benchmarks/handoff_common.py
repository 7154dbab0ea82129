"""The hand-off benchmark's two processes: constants, their pipe protocol, and the parent's side
(start the writer and reader children, follow the writer's progress lines, clean up).

The writer (encoder side) and reader (PD side) are fresh interpreters started by
`_run_children`; `_child` is their entry point and dispatches to `epdq.benchmarks.handoff_cpu`
or `epdq.benchmarks.handoff_gpu` by role.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epdq.benchmarks.report import Progress
from epdq.cluster import die_with_parent
from epdq.launch import keep_large_buffers

HIDDEN = 3584  # Qwen2.5-VL-7B hidden size
MIB = 1 << 20


def row_bytes(dtype: str) -> int:
    """Bytes of one embedding row ([1, HIDDEN]) in the dtypes the benchmark takes."""
    return HIDDEN * (4 if dtype == "float32" else 2)
SHM_ROOT = "/dev/shm"
RING_TARGET = 1.3  # ring p50 at most this many times one memcpy
SAFETENSORS_TARGET = 5.0  # ring at least this many times faster than the safetensors path

METHODS = ("memcpy", "ring_view", "ring", "fetch_tcp", "fetch_curve", "safetensors")
CUDA_METHODS = ("cuda_d2d", "cuda_ring", "shm_ring_gpu", "safetensors_gpu")
CUDA_LABELS = {
    "cuda_d2d": "one device-to-device copy (limit)",
    "cuda_ring": "CUDA ring, same GPU (IPC)",
    "shm_ring_gpu": "shm ring from/to GPU",
    "safetensors_gpu": "safetensors on /dev/shm from/to GPU",
}
CUDA_PARTS = {
    "cuda_d2d": ("copy",),
    "cuda_ring": ("write", "wake", "read"),
    "shm_ring_gpu": ("write", "wake", "read", "copy"),
    "safetensors_gpu": ("save", "wake", "load"),
}
_CUDA_CODE = {m: 16 + i for i, m in enumerate(CUDA_METHODS)}
LABELS = {
    "memcpy": "memcpy (limit)",
    "ring_view": "ring, same node (view)",
    "ring": "ring, same node (copy out)",
    "fetch_tcp": "remote fetch, tcp",
    "fetch_curve": "remote fetch, tcp+CURVE",
    "safetensors": "safetensors on /dev/shm",
}
PARTS = {  # what each method's time is made of, in order (see handoff_cpu: _Writer, _reader_main)
    "memcpy": ("copy",),
    # the writer places the entry (reserve), announces it, copies it in (fill); the reader's wake
    # and view/read/fetch run meanwhile (a view or read waits for the copy if it gets there first)
    "ring_view": ("reserve", "announce", "fill", "wake", "view"),
    "ring": ("reserve", "announce", "fill", "wake", "read"),
    "fetch_tcp": ("reserve", "announce", "fill", "wake", "fetch", "copy"),
    "fetch_curve": ("reserve", "announce", "fill", "wake", "fetch", "copy"),
    "safetensors": ("save", "wake", "load", "copy"),
}
_CODE = {m: i + 1 for i, m in enumerate(METHODS)}
_STOP = 0xFF

# writer -> reader: method, size index, reader slot, offset, nbytes, generation, key, stamp
_NOTE = struct.Struct("<BBxxIQQQ16sI")
# reader -> writer: status, woken, middle (fetched), done (perf_counter_ns), reader's page faults
_ACK = struct.Struct("<Iqqqq")
_OK, _READY, _FAILED = 0, 1, 2
_LINE = b"@@handoff "  # prefix of the writer's protocol lines on its stdout
_NO_MEMORY = 75  # a child's exit status when it could not allocate its pools or ring
_NO_MEMORY_LINE = "@@handoff-no-memory "  # its one-line reason, on its stderr


class HandoffResourceError(RuntimeError):
    """A child could not get the memory it needs (its pools, the ring): one line, no traceback."""


# ------------------------------------------------------------------ the parent: start, watch, clean up


def _run_children(cfg: dict[str, Any], bar: Progress, timeout_s: float, prefix: str = "") -> dict[str, Any]:
    tmp: list[str] = []
    procs: list[subprocess.Popen] = []
    fds: list[int] = []
    logs: list[Any] = []
    segment = ""
    try:
        st_dir = tempfile.mkdtemp(prefix="epdq-bench-handoff-", dir=SHM_ROOT)
        tmp.append(st_dir)
        cfg = {**cfg, "st_dir": st_dir, "keys_dir": ""}
        if "fetch_curve" in cfg["methods"]:
            from epdq.keys import ensure_cluster_keys

            keys_dir = tempfile.mkdtemp(prefix="epdq-bench-keys-")
            tmp.append(keys_dir)
            cfg["keys_dir"] = str(ensure_cluster_keys(keys_dir))
        note_r, note_w = os.pipe()
        fds += [note_r, note_w]
        ack_r, ack_w = os.pipe()
        fds += [ack_r, ack_w]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        root = str(Path(__file__).resolve().parents[2])  # the directory that holds epdq/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        code = "from epdq.benchmarks.handoff_common import _child; _child()"
        spec = json.dumps(cfg)
        for role, mine, stdout in (
            (f"{prefix}writer", (note_w, ack_r), subprocess.PIPE),
            (f"{prefix}reader", (note_r, ack_w), subprocess.DEVNULL),
        ):
            log = tempfile.TemporaryFile()
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, role, spec, *map(str, mine)],
                    pass_fds=mine,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=log,
                    preexec_fn=die_with_parent,
                )
            )
        for fd in fds:  # the children hold their ends: a dead peer now reads as EOF
            os.close(fd)
        fds.clear()
        writer, reader = procs
        result = None
        for kind, value in _lines(writer, timeout_s):
            if kind == "SEG":
                segment = value
            elif kind == "P":
                bar.advance()
            elif kind == "RESULT":
                result = json.loads(value)
        for p in procs:
            p.wait(timeout=timeout_s)
        _raise_if_out_of_memory(procs, logs, prefix)
        if result is None or writer.returncode or reader.returncode:
            raise RuntimeError(
                f"hand-off benchmark children failed (writer rc={writer.returncode}, reader rc="
                f"{reader.returncode})\n--- writer stderr ---\n{_tail(logs[0])}\n--- reader stderr ---\n"
                f"{_tail(logs[1])}"
            )
        if result.get("failed"):  # methods the reader could not complete (the others are measured)
            result["reader_stderr"] = f"{_tail(logs[0], 1500)}\n--- reader ---\n{_tail(logs[1], 2500)}"
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        for fd in fds:
            os.close(fd)
        for log in logs:
            log.close()
        if segment:  # normally the writer unlinked it; not if it was killed
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_ROOT, segment))
        for d in tmp:
            shutil.rmtree(d, ignore_errors=True)


def _raise_if_out_of_memory(procs: list[subprocess.Popen], logs: list[Any], prefix: str) -> None:
    for role, p, log in zip((f"{prefix}writer", f"{prefix}reader"), procs, logs, strict=True):
        if p.returncode == _NO_MEMORY:
            why = next((line.split(_NO_MEMORY_LINE, 1)[1] for line in _tail(log).splitlines()
                        if _NO_MEMORY_LINE in line), "out of memory")  # fmt: skip
            raise HandoffResourceError(f"the hand-off benchmark's {role} could not allocate memory ({why}); "
                                       "lower --pool-mib, --ring-mib or --sizes")  # fmt: skip
        if p.returncode == -signal.SIGKILL:
            raise HandoffResourceError(f"the hand-off benchmark's {role} was killed (SIGKILL: out of memory?); "
                                       "lower --pool-mib, --ring-mib or --sizes")  # fmt: skip


def _lines(proc: subprocess.Popen, timeout_s: float):
    """(kind, rest) for each protocol line the writer prints, until its stdout closes."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            if not sel.select(timeout_s):
                raise TimeoutError(f"the hand-off benchmark writer was silent for {timeout_s:.0f} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(_LINE):
                    kind, _, rest = line[len(_LINE) :].decode().partition(" ")
                    yield kind, rest


def _tail(f: Any, n: int = 4000) -> str:
    f.flush()
    f.seek(0)
    return f.read().decode(errors="replace")[-n:]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _align(n: int, to: int = 4096) -> int:
    return -(-n // to) * to


# ------------------------------------------------------------------ children


def _child() -> None:
    role, spec, a, b = sys.argv[1:5]
    cfg = json.loads(spec)
    die_with_parent()
    # SIGTERM (from the parent, or its death) unwinds normally, so the ring's segment is unlinked
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    torch.set_num_threads(1)  # a 2-thread pool made copies ~25x slower on a busy 2-core machine
    keep_large_buffers()  # as the encoder and PD worker processes do (epdq.launch)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2 and role in ("writer", "reader"):
        os.sched_setaffinity(0, {cpus[0] if role == "writer" else cpus[1]})
    if role in ("writer", "reader"):
        from epdq.benchmarks import handoff_cpu as side
    else:
        from epdq.benchmarks import handoff_gpu as side
    try:
        if role == "writer":
            _run_loop(side._Writer(cfg, int(a), int(b)).main())
        elif role == "reader":
            side._reader_main(cfg, int(a), int(b))
        elif role == "cuda-writer":
            side._cuda_writer_main(cfg, int(a), int(b))
        else:
            side._cuda_reader_main(cfg, int(a), int(b))
    except (MemoryError, RuntimeError, OSError) as e:
        if not _out_of_memory(e):
            raise
        # one line for the parent to report, not a traceback from each child
        sys.stderr.write(f"{_NO_MEMORY_LINE}{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500] + "\n")
        sys.stderr.flush()
        sys.exit(_NO_MEMORY)


def _out_of_memory(e: BaseException) -> bool:
    """torch's allocators raise RuntimeError ("can't allocate memory", CUDA "out of memory"); a
    shared-memory segment too big for /dev/shm raises OSError ENOMEM or ENOSPC."""
    import errno

    if isinstance(e, MemoryError):
        return True
    if isinstance(e, OSError):
        return e.errno in (errno.ENOMEM, errno.ENOSPC)
    text = str(e).lower()
    return "can't allocate memory" in text or "out of memory" in text


def _run_loop(coro: Any) -> None:
    try:
        import uvloop  # what epdq's workers run on (epdq.launch)
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _Pool:
    """Slots of `rows x HIDDEN` carved out of one big tensor, used round-robin (cold every time)."""

    def __init__(self, cfg: dict[str, Any], fill: float, device: str = "cpu"):
        import torch

        self.dtype = getattr(torch, cfg["dtype"])
        item = self.dtype.itemsize
        self.buf = torch.empty(cfg["pool_bytes"] // item, dtype=self.dtype, device=device)
        self.buf.fill_(fill)  # touch every page now, not during a measurement
        self.shapes = [(r, HIDDEN) for r in cfg["rows"]]
        self.strides = [_align(r * HIDDEN * item) // item for r in cfg["rows"]]
        self.counts = [
            max(1, (self.buf.numel() - r * HIDDEN) // s + 1)
            for r, s in zip(cfg["rows"], self.strides, strict=True)
        ]

    def slot(self, size: int, i: int):
        n = self.shapes[size][0] * HIDDEN
        start = (i % self.counts[size]) * self.strides[size]
        return self.buf[start : start + n].view(self.shapes[size])


def _order(methods: list[str], repeat: int, size: int) -> list[str]:
    """The methods of one repeat in a random order that is the same in every run."""
    return random.Random(repeat * 1009 + size).sample(methods, len(methods))


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_setup(fd: int) -> dict | None:
    """The writer's first frame (length-prefixed JSON); None if it closed the pipe first."""
    head = _read_exact(fd, 4)
    return json.loads(_read_exact(fd, struct.unpack("<I", head)[0])) if head else None


def _read_exact(fd: int, n: int) -> bytes:
    """n bytes from a blocking fd; b"" at EOF."""
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def _notes(note_fd: int, codes: dict[str, int]) -> Iterator[tuple[int, int, str, int, int, int, int, int, bytes, int]]:
    """The reader's loop over the writer's notes, until STOP or EOF: (page faults so far, woken
    at (perf_counter_ns, right after the note arrived), method, size index, slot, offset, nbytes,
    generation, key, stamp)."""
    names = {v: k for k, v in codes.items()}
    while True:
        faults = _faults()
        msg = _read_exact(note_fd, _NOTE.size)
        woke = time.perf_counter_ns()
        if not msg:
            return
        code, size, slot, offset, nbytes, generation, key, stamp = _NOTE.unpack(msg)
        if code == _STOP:
            return
        yield faults, woke, names[code], size, slot, offset, nbytes, generation, key, stamp


def _emit(kind: str, rest: str = "") -> None:
    """One protocol line on the writer's stdout (progress, the segment name, the result)."""
    sys.stdout.write(f"{_LINE.decode()}{kind} {rest}\n")
    sys.stdout.flush()
