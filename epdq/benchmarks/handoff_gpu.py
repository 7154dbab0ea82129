"""The hand-off benchmark's GPU rows (CUDA ring & co.): the parent's side (`run_cuda`,
`render_cuda`) and the two processes that move embeddings between GPU tensors."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import struct
import sys
import time
import traceback
from typing import Any

from epdq.benchmarks.handoff_common import (
    _ACK,
    _CUDA_CODE,
    _FAILED,
    _NOTE,
    _OK,
    _READY,
    _STOP,
    CUDA_LABELS,
    CUDA_METHODS,
    CUDA_PARTS,
    HIDDEN,
    _emit,
    _notes,
    _order,
    _Pool,
    _read_exact,
    _read_setup,
    _run_children,
    _write_frame,
    row_bytes,
)
from epdq.benchmarks.handoff_report import _size_label
from epdq.benchmarks.report import Progress, percentile, table


def _cuda_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "no torch"
    if not torch.cuda.is_available():
        return False, "no CUDA"
    return True, ""


def run_cuda(cfg: dict[str, Any], cuda: bool | None, device: str, timeout_s: float) -> dict[str, Any]:
    """The GPU rows: {"status": "ok", ...} or {"status": "skipped: ..."} / {"status": "failed: ..."}."""
    if cuda is False:
        return {"status": "skipped: not asked for", "methods": list(CUDA_METHODS)}
    if device != "cpu":  # device "cpu" (tests): the same two processes and protocol, without a GPU
        ok, why = _cuda_available()
        if not ok:
            return {"status": f"skipped: {why}", "methods": list(CUDA_METHODS)}
    import torch

    from epdq.worker.devices import check_device

    device = check_device(device)
    ccfg = {**cfg, "methods": list(CUDA_METHODS), "device": device}
    bar = Progress(
        (cfg["warmup"] + cfg["repeats"]) * len(cfg["rows"]), "hand-off benchmark (GPU)", force=False
    )
    bar.enabled = False
    try:
        raw = _run_children(ccfg, bar, timeout_s, prefix="cuda-")
    except (RuntimeError, TimeoutError) as e:
        return {"status": f"failed: {str(e)[:3000]}", "methods": list(CUDA_METHODS)}
    failed = set(raw.pop("failed", []))
    stderr = raw.pop("reader_stderr", "")
    results = []
    for si, (size, rows) in enumerate(zip(cfg["sizes_mib"], cfg["rows"], strict=True)):
        nbytes = rows * row_bytes(cfg["dtype"])
        ms = {m: [v / 1e6 for v in raw[m][str(si)]["total"]] for m in CUDA_METHODS if m not in failed}
        base = percentile(ms["cuda_d2d"], 50) if ms.get("cuda_d2d") else float("nan")
        for m in CUDA_METHODS:
            if m in failed or not ms[m]:
                results.append({"size_mib": size, "nbytes": nbytes, "method": m, "label": CUDA_LABELS[m],
                                "status": "failed"})  # fmt: skip
                continue
            p50 = percentile(ms[m], 50)
            rec = raw[m][str(si)]
            results.append({
                "size_mib": size, "nbytes": nbytes, "rows": rows, "method": m, "label": CUDA_LABELS[m],
                "status": "ok", "p50_ms": p50, "p90_ms": percentile(ms[m], 90), "min_ms": min(ms[m]),
                "gb_per_s": nbytes / (p50 / 1e3) / 1e9 if p50 > 0 else float("nan"),
                "x_d2d": p50 / base if base > 0 else float("nan"), "samples_ms": ms[m],
                "parts": {p: {"p50_ms": percentile([v / 1e6 for v in rec[p]], 50)} for p in CUDA_PARTS[m]},
            })  # fmt: skip
    gpu = torch.cuda.get_device_name(torch.device(device)) if device != "cpu" else "cpu (no GPU: a dry run)"
    out = {"status": "ok", "device": device, "gpu": gpu,
           "methods": list(CUDA_METHODS), "results": results}  # fmt: skip
    if failed:
        out["failed"] = sorted(failed)
        out["reader_stderr"] = stderr
    return out


def render_cuda(c: dict[str, Any], cfg: dict[str, Any]) -> str:
    title = f"Embedding hand-off between GPU tensors, {cfg['dtype']} [rows, {cfg['hidden']}]"
    if c["status"] != "ok":
        rows = [("all sizes", CUDA_LABELS[m], c["status"]) for m in c["methods"]]
        return table(["size", "method", "result"], rows, title=title)
    rows = []
    for r in c["results"]:
        if r["status"] != "ok":
            rows.append((_size_label(r["size_mib"]), r["label"], "failed", "", "", "", ""))
            continue
        parts = " + ".join(f"{p} {v['p50_ms']:.3f}" for p, v in r["parts"].items())
        x = r["x_d2d"]  # NaN (None once through JSON) when the d2d row failed: nothing to compare with
        rows.append((_size_label(r["size_mib"]), r["label"], r["p50_ms"], r["p90_ms"], r["gb_per_s"],
                     f"{x:.2f}×" if x is not None and math.isfinite(x) else "n/a (d2d failed)", parts))  # fmt: skip
    text = table(["size", "method", "p50 ms", "p90 ms", "GB/s", "× d2d", "p50 ms of each part"], rows,
                 title=f"{title} on {c['gpu']} ({c['device']}), {cfg['repeats']} interleaved repeats")  # fmt: skip
    if c.get("failed"):
        text += f"\nfailed methods: {', '.join(c['failed'])}; writer/reader stderr:\n{c.get('reader_stderr', '')[-3000:]}"
    return text


def _cuda_writer_main(cfg: dict[str, Any], note_fd: int, ack_fd: int) -> None:
    """The encoder side on the GPU: sources on the device, a CUDA ring and a shm ring."""
    import msgspec
    import safetensors.torch
    import torch

    from epdq.ring import RingWriter
    from epdq.ring_cuda import CudaRingWriter

    dev = torch.device(cfg["device"])
    sync = _device_sync(torch, dev)
    now = time.perf_counter_ns
    src, dst = _Pool(cfg, 0.5, str(dev)), _Pool(cfg, 0.25, str(dev))
    cring = CudaRingWriter(cfg["ring_bytes"], device=dev, owner_tag="bench")
    sring = RingWriter(cfg["ring_bytes"], owner_tag="bench")
    salt, seq = secrets.token_bytes(8), 0
    slots = [0] * len(cfg["rows"])
    failed: set[str] = set()
    methods = list(CUDA_METHODS)
    out: dict[str, Any] = {
        m: {str(i): {"total": [], **{p: [] for p in CUDA_PARTS[m]}} for i in range(len(cfg["rows"]))} for m in methods
    }  # fmt: skip

    def ack() -> tuple[int, int, int, int, int]:
        raw = _read_exact(ack_fd, _ACK.size)
        if not raw:
            raise RuntimeError("the reader exited")
        return _ACK.unpack(raw)

    try:
        _emit("SEG", sring.name)
        try:
            shared = msgspec.msgpack.encode(cring.export()).hex()
        except Exception:  # noqa: BLE001 - no CUDA IPC here: the other methods are still measured
            traceback.print_exc()
            shared = ""
            failed.add("cuda_ring")
        setup = json.dumps({"segment": sring.name, "cuda_name": cring.name, "cuda_ring": shared}).encode()
        _write_frame(note_fd, struct.pack("<I", len(setup)) + setup)
        if ack()[0] != _READY:
            raise RuntimeError("the reader did not start")
        for r in range(cfg["warmup"] + cfg["repeats"]):
            for size in range(len(cfg["rows"])):
                for m in _order(methods, r, size):
                    if m in failed:
                        continue
                    i = slots[size]
                    slots[size] += 1
                    s = src.slot(size, i)
                    seq += 1
                    stamp = 1 + seq % 250
                    s[0, 0] = stamp
                    s[-1, -1] = stamp
                    sync()
                    key = struct.pack("<Q", seq) + salt
                    nbytes = s.numel() * s.element_size()
                    if m == "cuda_d2d":
                        d = dst.slot(size, i)
                        t0 = now()
                        d.copy_(s)
                        sync()
                        t1 = now()
                        if d[0, 0].item() != stamp or d[-1, -1].item() != stamp:
                            raise RuntimeError("the d2d baseline copied the wrong bytes")
                        res = {"total": t1 - t0, "copy": t1 - t0}
                    elif m == "safetensors_gpu":
                        folder = os.path.join(cfg["st_dir"], key.hex())
                        t0 = now()
                        os.makedirs(folder, exist_ok=True)
                        safetensors.torch.save_file(
                            {"ec_cache": s.detach().cpu()}, os.path.join(folder, "encoder_cache.safetensors")
                        )
                        t1 = now()
                        _write_frame(note_fd, _NOTE.pack(_CUDA_CODE[m], size, i, 0, nbytes, 1, key, stamp))
                        status, woke, mid, done, _ = ack()
                        shutil.rmtree(folder, ignore_errors=True)
                        res = {"total": done - t0, "save": t1 - t0, "wake": woke - t1, "load": done - woke}
                    else:
                        ring = cring if m == "cuda_ring" else sring
                        t0 = now()
                        loc = ring.write(key, s)  # both return once the bytes are in place
                        t1 = now()
                        if loc is None:
                            raise RuntimeError("ring full of pinned entries")
                        _write_frame(note_fd, _NOTE.pack(_CUDA_CODE[m], size, i, loc.offset, loc.nbytes,
                                                         loc.generation, key, stamp))  # fmt: skip
                        status, woke, mid, done, _ = ack()
                        ring.unpin(key, loc.generation)
                        ring.drain_evicted()
                        res = {"total": done - t0, "write": t1 - t0, "wake": woke - t1, "read": mid - woke}
                        if m == "shm_ring_gpu":
                            res["copy"] = done - mid
                    if m != "cuda_d2d" and status != _OK:
                        failed.add(m)  # the reader printed why; the other methods go on
                        continue
                    if r >= cfg["warmup"]:
                        for name, v in res.items():
                            out[m][str(size)][name].append(v)
                _emit("P")
        _write_frame(note_fd, _NOTE.pack(_STOP, 0, 0, 0, 0, 0, bytes(16), 0))
        _emit("RESULT", json.dumps({**out, "failed": sorted(failed)}))
    finally:
        cring.close()
        sring.close()


def _cuda_reader_main(cfg: dict[str, Any], note_fd: int, ack_fd: int) -> None:
    """The PD side on the same GPU: maps the CUDA ring once, reads each entry into a GPU tensor."""
    import safetensors.torch
    import torch

    from epdq import protocol as P
    from epdq.ring_cuda import CudaRingReader
    from epdq.ring_reader import RingReader

    now = time.perf_counter_ns
    setup = _read_setup(note_fd)
    if setup is None:
        return
    dev = torch.device(cfg["device"])
    sync = _device_sync(torch, dev)
    dtype = getattr(torch, cfg["dtype"])
    ring = _decode_cuda_ring(bytes.fromhex(setup["cuda_ring"])) if setup["cuda_ring"] else None
    pool, host = _Pool(cfg, 0.125, str(dev)), _Pool(cfg, 0.0625)
    creader, sreader = CudaRingReader(dev), RingReader()
    try:
        _write_frame(ack_fd, _ACK.pack(_READY, 0, 0, 0, 0))
        for _, woke, method, size, slot, offset, nbytes, generation, key, stamp in _notes(note_fd, _CUDA_CODE):
            shape = (cfg["rows"][size], HIDDEN)
            try:
                if method == "cuda_ring":
                    ref = P.EmbedRef(key, "bench", "bench-node", setup["cuda_name"], offset, nbytes, generation,
                                     cfg["dtype"], list(shape), [1, 2, 2], "", "cuda", ring)  # fmt: skip
                    out = creader.read(ref, dtype, out=pool.slot(size, slot))  # synchronised by its check
                    mid = done = now()
                elif method == "shm_ring_gpu":
                    h = sreader.read(setup["segment"], offset, nbytes, key, generation, dtype, shape,
                                     out=host.slot(size, slot))  # fmt: skip
                    mid = now()
                    out = pool.slot(size, slot)
                    out.copy_(h)
                    sync()
                    done = now()
                else:
                    path = os.path.join(cfg["st_dir"], key.hex(), "encoder_cache.safetensors")
                    if not os.path.exists(path):
                        raise RuntimeError(f"{path} is not there")
                    out = safetensors.torch.load_file(path, device=str(dev))["ec_cache"]
                    sync()
                    mid = done = now()
                if out[0, 0].item() != stamp or out[-1, -1].item() != stamp or tuple(out.shape) != shape:
                    raise RuntimeError(f"{method} delivered the wrong bytes")
                del out
                status = _OK
            except Exception:
                print(f"--- {method} failed:", file=sys.stderr)
                traceback.print_exc()
                status, mid, done = _FAILED, 0, 0
            _write_frame(ack_fd, _ACK.pack(status, woke, mid, done, 0))
    finally:
        creader.close()
        sreader.close()


def _device_sync(torch: Any, dev: Any):
    """Make `dev` current; the returned function waits for its queued work (nothing on a CPU)."""
    if dev.type != "cuda":
        return lambda: None
    torch.cuda.set_device(dev)
    return lambda: torch.cuda.synchronize(dev)


def _decode_cuda_ring(raw: bytes):
    import msgspec

    from epdq import protocol as P

    return msgspec.msgpack.decode(raw, type=P.CudaRing)
