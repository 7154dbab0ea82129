"""Where the CUDA ring's fixed cost goes: its write and read timed whole, and the calls they are
made of timed one by one, in one process on one GPU.

On an H200 (bench/results/gpu/2026-12-04T1521-h200) a hand-off through the CUDA ring took
0.8-1.0 ms at every size from 1 to 32 MiB, against 0.04-0.07 ms for one device-to-device copy of
the same bytes: write 0.30-0.39 ms, read 0.39-0.42 ms, whatever the size. So the cost is in the
calls around the copy, not in the bytes. This measures each of them with the same tensors the ring
uses, and the ring's read with each way of copying the header back (`CudaRingReader.header_copy`).

    python -m epdq.benchmarks.ring_cuda_costs --device cuda:0 [--out DIR]

Without a GPU (`--device cpu`, the tests) the calls that need one are left out.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epdq.benchmarks.handoff_common import HIDDEN
from epdq.benchmarks.report import table


def _time(op: Callable[[], Any], after: Callable[[], Any], repeats: int, warmup: int = 20) -> float:
    """p50 µs of `op`; `after` (untimed) runs after each call, so queued work never piles up."""
    samples = []
    for i in range(warmup + repeats):
        t = time.perf_counter_ns()
        op()
        dt = time.perf_counter_ns() - t
        after()
        if i >= warmup:
            samples.append(dt / 1e3)
    return statistics.median(samples)


def measure(device: str = "cuda:0", sizes_mib: tuple[int, ...] = (1, 32), repeats: int = 200) -> dict[str, Any]:
    import torch

    from epdq import protocol as P
    from epdq.ring_cuda import _HDR, HEADER_COPIES, CudaRingReader, CudaRingWriter
    from epdq.ring_space import HEADER_BYTES

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    ring_bytes = 4 * max(sizes_mib) * 2**20 + 2**20
    writer = CudaRingWriter(ring_bytes, device=dev, owner_tag="costs")
    readers = {h: CudaRingReader(dev, header_copy=h) for h in HEADER_COPIES}
    for r in readers.values():
        r.attach_local(writer.name, writer.buffer)
    buf, stream = writer.buffer, writer._stream
    producer = torch.cuda.current_stream(dev) if cuda else None
    hdr_pinned = torch.zeros(HEADER_BYTES, dtype=torch.uint8, pin_memory=cuda)
    src1 = torch.ones(2**20 // 2 // HIDDEN, HIDDEN, dtype=torch.bfloat16, device=dev)
    dst1 = torch.empty_like(src1)
    nb1 = src1.numel() * 2
    nothing = lambda: None  # noqa: E731

    def in_stream(fn):
        if stream is None:
            return fn

        def run():
            with torch.cuda.stream(stream):
                fn()

        return run

    ops: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("slice + view + view: a ring window as the entry's tensor",
         lambda: buf[4096 : 4096 + nb1].view(torch.bfloat16).view(src1.shape), nothing),
        ("D2D copy of 1 MiB, launch only", lambda: dst1.copy_(src1, non_blocking=True), sync),
        ("D2D copy of 1 MiB, launched and waited for", lambda: (dst1.copy_(src1, non_blocking=True), sync()), nothing),
        ("pack the 64 B header into the pinned staging",
         lambda: _HDR.pack_into(hdr_pinned.numpy(), 0, b"EPDQCRG1", bytes(16), 1, 2), nothing),
        ("64 B header H2D from pinned, launch only",
         in_stream(lambda: buf[0:HEADER_BYTES].copy_(hdr_pinned, non_blocking=True)), sync),
        ("64 B header D2H, pageable (.to('cpu'), waits)", lambda: buf[0:HEADER_BYTES].to("cpu"), nothing),
        ("64 B header D2H into pinned + stream synchronize",
         in_stream(lambda: (hdr_pinned.copy_(buf[0:HEADER_BYTES], non_blocking=True),
                            stream.synchronize() if stream is not None else None)), nothing),
        ("zero 8 B (an eviction's invalidation), launch only", in_stream(lambda: buf[24:32].zero_()), sync),
    ]  # fmt: skip
    if cuda:
        ops += [
            ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(dev), nothing),
            ("enter + leave torch.cuda.stream(ring stream)", in_stream(nothing), nothing),
            ("ring stream.wait_stream(producer)", lambda: stream.wait_stream(producer), sync),
            ("ring stream.synchronize(), nothing queued", lambda: stream.synchronize(), nothing),
            ("torch.cuda.synchronize()", sync, nothing),
        ]
    micro = [{"op": name, "p50_us": _time(op, after, repeats)} for name, op, after in ops]

    salt, seq = secrets.token_bytes(8), 0
    whole = []
    for size in sizes_mib:
        rows = max(1, size * 2**20 // 2 // HIDDEN)
        src = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=dev)
        outs = {h: torch.empty_like(src) for h in HEADER_COPIES}
        w_us: list[float] = []
        r_us: dict[str, list[float]] = {h: [] for h in HEADER_COPIES}
        for i in range(20 + repeats):
            for h in HEADER_COPIES if i % 2 else reversed(HEADER_COPIES):  # interleaved, alternating order
                seq += 1
                key = struct.pack("<Q", seq) + salt
                sync()
                t = time.perf_counter_ns()
                loc = writer.write(key, src)
                t1 = time.perf_counter_ns()
                if loc is None:
                    raise RuntimeError("ring full of pinned entries")
                ref = P.EmbedRef(key, "costs", "node", writer.name, loc.offset, loc.nbytes, loc.generation,
                                 "bfloat16", [rows, HIDDEN], [1, 2, 2], "", "cuda", None)  # fmt: skip
                t2 = time.perf_counter_ns()
                readers[h].read(ref, torch.bfloat16, out=outs[h])
                t3 = time.perf_counter_ns()
                writer.unpin(key, loc.generation)
                writer.drain_evicted()
                if i >= 20:
                    w_us.append((t1 - t) / 1e3)
                    r_us[h].append((t3 - t2) / 1e3)
        if not all(bool(torch.equal(o, src)) for o in outs.values()):
            raise RuntimeError("a CUDA ring read returned the wrong bytes")
        whole.append({"size_mib": size, "write_p50_us": statistics.median(w_us),
                      **{f"read_{h}_p50_us": statistics.median(v) for h, v in r_us.items()}})  # fmt: skip
    writer.close()
    for r in readers.values():
        r.close()
    name = torch.cuda.get_device_name(dev) if cuda else "cpu (no GPU: a dry run)"
    return {"device": str(dev), "gpu": name, "torch": torch.__version__, "repeats": repeats,
            "micro": micro, "whole": whole}  # fmt: skip


def render(d: dict[str, Any]) -> str:
    whole = table(
        ["size", "write p50 µs", "read p50 µs, header via pinned", "read p50 µs, header via .to('cpu')"],
        [(f"{w['size_mib']} MiB", w["write_p50_us"], w["read_pinned_p50_us"], w["read_pageable_p50_us"])
         for w in d["whole"]],
        title=f"CUDA ring write and read, one process, {d['gpu']} ({d['device']}), p50 of {d['repeats']}",
    )  # fmt: skip
    micro = table(["call", "p50 µs"], [(m["op"], m["p50_us"]) for m in d["micro"]],
                  title="The calls a write and a read are made of, one at a time")  # fmt: skip
    return whole + "\n\n" + micro


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--sizes", default="1,32", help="MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="", help="a folder for ring_cuda_costs.json and .md")
    a = ap.parse_args(argv)
    sizes = tuple(int(s) for s in a.sizes.split(","))
    if not sizes or any(not 1 <= s <= 256 for s in sizes) or not 1 <= a.repeats <= 100_000:
        ap.error("sizes must be 1..256 MiB and repeats 1..100000")
    d = measure(a.device, sizes, a.repeats)
    text = render(d)
    print(text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ring_cuda_costs.json").write_text(json.dumps(d, indent=1))
        (out / "ring_cuda_costs.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
