"""The hand-off benchmark's CPU processes: the encoder-side writer (ring, fetch server, the
memcpy baseline, safetensors files) and the PD-side reader that takes each entry the way its
method does and acks with its timestamps."""

from __future__ import annotations

import asyncio
import json
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
    _CODE,
    _FAILED,
    _NOTE,
    _OK,
    _READY,
    _STOP,
    HIDDEN,
    PARTS,
    _emit,
    _faults,
    _new_loop,
    _notes,
    _order,
    _Pool,
    _read_setup,
    _wake,
    _write_frame,
)


class _Writer:
    """The encoder side: owns the ring, the fetch sockets, the sources; drives every repeat."""

    def __init__(self, cfg: dict[str, Any], note_fd: int, ack_fd: int):
        self.cfg = cfg
        self.note_fd = note_fd
        self.ack_fd = ack_fd
        self.salt = secrets.token_bytes(8)
        self.seq = 0
        self.slot = [0] * len(cfg["rows"])

    async def main(self) -> None:
        import torch
        import zmq

        from epdq.ring import RingWriter
        from epdq.worker.encoder import EncoderWorker

        os.set_blocking(self.ack_fd, False)
        cfg = self.cfg
        self.src = _Pool(cfg, 0.5)
        self.dst = _Pool(cfg, 0.25)  # the memcpy baseline's destinations
        ctx = zmq.Context()
        encoders: list[EncoderWorker] = []
        auth = None
        self.ring = RingWriter(cfg["ring_bytes"], owner_tag="bench")
        try:
            _emit("SEG", self.ring.name)
            endpoints = {}
            kinds = [("fetch_tcp", None)]
            if "fetch_curve" in cfg["methods"]:
                from epdq.keys import security_for

                kinds.append(("fetch_curve", security_for("worker", keys_dir=cfg["keys_dir"])))
            for name, security in kinds:
                # the encoder's own fetch server; no engine or broker link: only _on_fetch runs
                enc = EncoderWorker(
                    None, self.ring, worker_id=f"bench-{name}", node="bench-encoder-node", max_image_bytes=1,
                    max_image_pixels=1, fetch_bind="tcp://127.0.0.1:*", ctx=ctx, security=security,
                )  # fmt: skip
                encoders.append(enc)
                endpoints[name] = enc.open_fetch_socket()
                enc.start()
            if len(kinds) > 1:
                from epdq.security import authenticator_for

                auth = authenticator_for(ctx)
            setup = json.dumps({"segment": self.ring.name, "endpoints": endpoints}).encode()
            _write_frame(self.note_fd, struct.pack("<I", len(setup)) + setup)
            status, *_ = await self.ack()
            if status != _READY:
                raise RuntimeError("the reader did not start")
            samples = await self.measure(torch)
            _write_frame(self.note_fd, _NOTE.pack(_STOP, 0, 0, 0, 0, 0, bytes(16), 0))
            _emit("RESULT", json.dumps(samples))
        finally:
            for enc in encoders:
                enc.close()
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)
            self.ring.close()

    async def ack(self) -> tuple[int, int, int, int, int]:
        loop = asyncio.get_running_loop()
        buf = b""
        while len(buf) < _ACK.size:
            try:
                chunk = os.read(self.ack_fd, _ACK.size - len(buf))
            except BlockingIOError:
                # the loop keeps serving the fetch socket while we wait
                fut = loop.create_future()
                loop.add_reader(self.ack_fd, _wake, fut)
                try:
                    await fut
                finally:
                    loop.remove_reader(self.ack_fd)
                continue
            if not chunk:
                raise RuntimeError("the reader exited")
            buf += chunk
        return _ACK.unpack(buf)

    async def measure(self, torch: Any) -> dict[str, Any]:
        cfg = self.cfg
        methods = cfg["methods"]
        out: dict[str, Any] = {
            m: {
                str(i): {"total": [], "faults_w": [], "faults_r": [], **{p: [] for p in PARTS[m]}}
                for i in range(len(cfg["rows"]))
            }
            for m in methods
        }
        for r in range(cfg["warmup"] + cfg["repeats"]):
            for size in range(len(cfg["rows"])):
                for m in _order(methods, r, size):
                    res = await self.one(m, size, torch)
                    if r >= cfg["warmup"]:
                        rec = out[m][str(size)]
                        for name, v in res.items():
                            rec[name].append(v)
                _emit("P")
        return out

    async def one(self, method: str, size: int, torch: Any) -> dict[str, int]:
        now = time.perf_counter_ns
        i = self.slot[size]
        self.slot[size] += 1
        src = self.src.slot(size, i)
        self.seq += 1
        stamp = 1 + self.seq % 250  # exact in bf16; the reader checks it arrived
        src[0, 0] = stamp
        src[-1, -1] = stamp
        f0 = _faults()  # first-touch page faults, counted outside the timed window
        if method == "memcpy":
            dst = self.dst.slot(size, i)
            t0 = now()
            dst.copy_(src)
            t1 = now()
            faults = _faults() - f0
            if dst[0, 0].item() != stamp or dst[-1, -1].item() != stamp:
                raise RuntimeError("memcpy baseline copied the wrong bytes")
            return {"total": t1 - t0, "copy": t1 - t0, "faults_w": faults, "faults_r": 0}
        key = struct.pack("<Q", self.seq) + self.salt
        nbytes = src.numel() * src.element_size()
        if method == "safetensors":
            import safetensors.torch

            folder = os.path.join(self.cfg["st_dir"], key.hex())
            t0 = now()
            os.makedirs(folder, exist_ok=True)
            safetensors.torch.save_file(
                {"ec_cache": src.detach().cpu()}, os.path.join(folder, "encoder_cache.safetensors")
            )
            t1 = now()
            _write_frame(self.note_fd, _NOTE.pack(_CODE[method], size, i, 0, nbytes, 1, key, stamp))
            status, woke, mid, done, faults_r = await self.ack()
            faults = _faults() - f0
            shutil.rmtree(folder, ignore_errors=True)  # unmeasured: vLLM's connector never deletes
            self._check(status, method)
            return {"total": done - t0, "save": t1 - t0, "wake": woke - t1, "load": mid - woke, "copy": done - mid,
                    "faults_w": faults, "faults_r": faults_r}  # fmt: skip
        # ring, fetch_tcp, fetch_curve: as the encoder does (EncoderWorker._announcing), the entry
        # is placed and announced (the note stands for its completion event), then its bytes are
        # copied in while the note travels; the reader waits for them if it gets there first
        t0 = now()
        loc = self.ring.reserve(key, nbytes)
        if loc is None:
            raise RuntimeError("ring full of pinned entries")
        t1 = now()
        _write_frame(
            self.note_fd,
            _NOTE.pack(_CODE[method], size, i, loc.offset, loc.nbytes, loc.generation, key, stamp),
        )
        t2 = now()
        if not self.ring.fill(key, loc.generation, src):
            raise RuntimeError("the reserved ring entry went away")
        t3 = now()
        status, woke, mid, done, faults_r = await self.ack()
        faults = _faults() - f0  # also those of serving the fetch
        self.ring.unpin(key, loc.generation)  # as the broker does once the PD worker is done
        self.ring.drain_evicted()
        self._check(status, method)
        res = {
            "total": done - t0,
            "reserve": t1 - t0,
            "announce": t2 - t1,
            "fill": t3 - t2,
            # from before the note's write: the reader can be up before the writer's write()
            # returns to it, so woke - t2 may be negative (it was, -0.005 ms, in CI)
            "wake": woke - t1,
            "faults_w": faults,
            "faults_r": faults_r,
        }
        if method == "ring":
            return {**res, "read": done - woke}
        if method == "ring_view":
            return {**res, "view": done - woke}
        return {**res, "fetch": mid - woke, "copy": done - mid}

    @staticmethod
    def _check(status: int, method: str) -> None:
        if status != _OK:
            raise RuntimeError(f"the reader failed a {method} transfer (see its stderr)")


def _reader_main(cfg: dict[str, Any], note_fd: int, ack_fd: int) -> None:
    """The PD side: sleeps on the pipe, takes each entry the way its method does, acks."""
    import safetensors.torch
    import torch
    import zmq

    from epdq import protocol as P
    from epdq.errors import EntryPending
    from epdq.ring import FILL_ONE_GO_BYTES
    from epdq.ring_reader import RingReader
    from epdq.worker.pd import RemoteFetcher, from_chunks

    now = time.perf_counter_ns
    setup = _read_setup(note_fd)
    if setup is None:
        return
    segment, endpoints = setup["segment"], setup["endpoints"]
    dtype = getattr(torch, cfg["dtype"])
    pool = _Pool(cfg, 0.125)
    reader = RingReader()
    ctx = zmq.Context()
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    fetchers = {"fetch_tcp": RemoteFetcher(ctx, security=None)}
    if "fetch_curve" in endpoints:
        from epdq.keys import security_for

        fetchers["fetch_curve"] = RemoteFetcher(
            ctx, security=security_for("worker", keys_dir=cfg["keys_dir"])
        )
    status = _READY
    try:
        _write_frame(ack_fd, _ACK.pack(_READY, 0, 0, 0, 0))
        for f0, woke, method, size, slot, offset, nbytes, generation, key, stamp in _notes(note_fd, _CODE):
            shape = (cfg["rows"][size], HIDDEN)
            try:
                if method == "ring_view":
                    # what the PD worker does with one image: a view the engine copies from, and
                    # the check once it has (the engine's copy is its own, in every method). The view
                    # is made first, then the bytes waited for, as PDWorker._gather does.
                    out, published = reader.view_early(segment, offset, nbytes, key, generation, dtype, shape)
                    if not published:
                        _published(reader, loop, segment, offset, nbytes, key, generation)
                    reader.check(segment, offset, nbytes, key, generation)
                    mid = done = now()
                elif method == "ring":
                    # as PDWorker._read_local: an entry still being copied in is copied out behind
                    # the encoder's copy (its fill mark), not after it. One the writer copies in
                    # one go has no mark to follow: waited for as the view is, then read.
                    args = (segment, offset, nbytes, key, generation, dtype, shape)
                    if nbytes <= FILL_ONE_GO_BYTES:
                        _published(reader, loop, segment, offset, nbytes, key, generation)
                    try:
                        out = reader.read(*args, out=pool.slot(size, slot))
                    except EntryPending:
                        out = loop.run_until_complete(reader.read_as_filled(*args, out=pool.slot(size, slot)))
                    mid = done = now()
                elif method == "safetensors":
                    folder = os.path.join(cfg["st_dir"], key.hex())
                    os.makedirs(folder, exist_ok=True)
                    path = os.path.join(folder, "encoder_cache.safetensors")
                    if not os.path.exists(path):
                        raise RuntimeError(f"{path} is not there")
                    # load_file maps the file lazily; the copy into the destination (what
                    # load_file(device="cuda") does on a GPU) brings the bytes in
                    loaded = safetensors.torch.load_file(path, device="cpu")["ec_cache"]
                    mid = now()
                    out = pool.slot(size, slot)
                    out.copy_(loaded)
                    done = now()
                    del loaded
                else:
                    ref = P.EmbedRef(
                        key, f"bench-{method}", "bench-encoder-node", segment, offset, nbytes, generation,
                        cfg["dtype"], list(shape), [1, 2, 2], endpoints[method],
                    )  # fmt: skip
                    data = loop.run_until_complete(fetchers[method].fetch(ref))
                    mid = now()
                    out = pool.slot(size, slot)
                    from_chunks(data, dtype, list(shape), out)  # as PDWorker._gather
                    done = now()
                    del data
                faults = _faults() - f0
                if out[0, 0].item() != stamp or out[-1, -1].item() != stamp or tuple(out.shape) != shape:
                    raise RuntimeError(f"{method} delivered the wrong bytes")
                del out
                status = _OK
            except Exception:
                traceback.print_exc()
                status, mid, done, faults = _FAILED, 0, 0, 0
            _write_frame(ack_fd, _ACK.pack(status, woke, mid, done, faults))
            if status == _FAILED:
                sys.exit(1)
    finally:
        for f in fetchers.values():
            f.close()
        reader.close()
        loop.close()
        ctx.destroy(linger=0)


def _published(reader: Any, loop: Any, segment: str, offset: int, nbytes: int, key: bytes, generation: int) -> None:
    """Wait for an entry's bytes if the encoder is still copying them in, as the PD worker does
    (RingReader.wait_published). Its first phases look at the header at every turn of the event
    loop; this process's loop has nothing else to run, so looking in a plain loop is the same
    (without a trip through the loop that the PD worker, already in a coroutine, does not make)."""
    from epdq.ring_reader import spin_budget

    if not reader.spin(segment, offset, nbytes, key, generation, spin_budget(nbytes)):
        loop.run_until_complete(reader.wait_published(segment, offset, nbytes, key, generation))
