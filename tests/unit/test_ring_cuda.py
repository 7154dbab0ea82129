"""The CUDA embedding ring (`epdq.ring_cuda`), device and ring selection, and the GPU check script.

Most tests run anywhere: the ring's logic runs unchanged on a CPU "device" (no streams, no IPC),
the wire struct and its validation are pure. Tests marked `gpu` need a CUDA device and are skipped
with that reason elsewhere; they cover what only a GPU has: streams, and sharing the buffer with
another process through CUDA IPC (a spawned child is the encoder).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import secrets
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from epdq import protocol as P
from epdq.errors import ProtocolError, StaleEmbeddingError
from epdq.ring import MIN_CAPACITY, RingWriter
from epdq.ring_cuda import EVENT_HANDLE_BYTES, CudaRingReader, CudaRingWriter, check_cuda_ring
from epdq.worker.devices import DeviceUnavailableError, parse_device, resolve_dtype, resolve_ring
from epdq.worker.runner import WorkerConfig
from tests.procs import readline

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: torch.cuda.is_available() is False")


def key(n: int | None = None) -> bytes:
    return secrets.token_bytes(16) if n is None else n.to_bytes(16, "little")


def fake_ring(**kw) -> P.CudaRing:
    fields = dict(
        device_uuid="GPU-00000000-1111-2222-3333-444444444444", device_index=0, handle=b"\x01" * 66,
        storage_bytes=256 << 20, storage_offset=0, ref_counter_handle=b"/torch_1234_5678_0", ref_counter_offset=3,
        event_handle=b"\x02" * EVENT_HANDLE_BYTES, event_sync_required=True,
    )  # fmt: skip
    fields.update(kw)
    return P.CudaRing(**fields)


NAME = f"cuda-{os.getuid()}-enc-1234-{'ab' * 8}"


def ref_for(segment: str, k: bytes, loc, t: torch.Tensor, ring: P.CudaRing | None, **kw) -> P.EmbedRef:
    fields = dict(
        key=k, encoder_id="enc-0", node="n", segment=segment, offset=loc.offset, nbytes=loc.nbytes,
        generation=loc.generation, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), grid=[1, 2, 2],
        fetch_endpoint="", ring_kind="cuda", cuda_ring=ring,
    )  # fmt: skip
    fields.update(kw)
    return P.EmbedRef(**fields)


# -- the wire ---------------------------------------------------------------------------------------


def test_cuda_ring_round_trips_in_register_and_refs():
    ring = fake_ring()
    reg = P.Register("enc-0", "encoder", "n", 8, "scope", "m", 1, ring_segment=NAME, ring_capacity=256 << 20,
                     fetch_endpoint="ipc:///tmp/x", ring_kind="cuda", cuda_ring=ring)  # fmt: skip
    ref = P.EmbedRef(key(1), "enc-0", "n", NAME, 64, 128, 7, "bfloat16", [2, 32], [1, 2, 4], "", "cuda", ring)
    for msg in (reg, P.Encoded(1, ref, 0.1), P.Prefill("r", [], P.Sampling(), 1.0, [ref, ref])):
        got, _ = P.decode(P.encode(msg))
        assert got == msg
    assert got.embeds[0].cuda_ring.handle == b"\x01" * 66  # bytes stay bytes: no pickle, no base64
    # a shared-memory ref still decodes with the old field count's defaults
    old = P.EmbedRef(key(1), "e", "n", "seg", 64, 128, 7, "float32", [1, 32], [1, 2, 2], "")
    assert (old.ring_kind, old.cuda_ring) == ("", None)
    assert P.decode(P.encode(P.Encoded(1, old, 0.0)))[0].ref == old


def test_cuda_ring_schema_is_strict():
    enc = msgspec.msgpack.encode(["uuid", 0, "not bytes", 1, 0, b"x", 0, b"e" * 64, True])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(enc, type=P.CudaRing)


@pytest.mark.parametrize(
    "segment, kw, match",
    [
        ("epdq-0-enc-1-" + "0" * 16, {}, "not an epdq CUDA ring"),
        ("cuda-0-../x-1-" + "0" * 16, {}, "not an epdq CUDA ring"),
        (NAME, dict(handle=b""), "IPC handle"),
        (NAME, dict(handle=b"x" * 5000), "IPC handle"),
        (NAME, dict(storage_bytes=100), "CUDA ring of"),
        (NAME, dict(storage_bytes=(64 << 30) + 64), "CUDA ring of"),
        (NAME, dict(storage_offset=-1), "offset"),
        (NAME, dict(ref_counter_handle=b"/torch\x00x"), "reference-counter"),
        (NAME, dict(ref_counter_handle=b"/../etc/passwd"), "reference-counter"),
        (NAME, dict(ref_counter_offset=1 << 30), "reference-counter offset"),
        (NAME, dict(ref_counter_offset=10000), "reference-counter offset"),  # torch's file holds 10,000
        (NAME, dict(event_handle=b"x" * 63), "event handle"),
        (NAME, dict(device_uuid=""), "uuid"),
    ],
)
def test_wire_handles_are_validated(segment, kw, match):
    check_cuda_ring(NAME, fake_ring())  # the baseline is fine
    with pytest.raises(ProtocolError, match=match):
        check_cuda_ring(segment, fake_ring(**kw))


# -- device, ring and dtype selection ------------------------------------------------------------------


@pytest.mark.parametrize("raw, canon", [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:3", "cuda:3")])
def test_parse_device(raw, canon):
    assert parse_device(raw) == canon


@pytest.mark.parametrize("raw", ["gpu", "cuda:", "cuda:-1", "cuda:x", "CUDA", "cuda:0 ", "", "mps"])
def test_parse_device_rejects(raw):
    with pytest.raises(ValueError, match="device must be"):
        parse_device(raw)


def test_ring_kind_follows_the_device():
    assert resolve_ring("auto", "cpu") == "shm"
    assert resolve_ring("auto", "cuda:1") == "cuda"
    assert resolve_ring("shm", "cuda:0") == "shm"  # overridable
    assert resolve_ring("cuda", "cuda") == "cuda"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_ring("cuda", "cpu")
    with pytest.raises(ValueError, match="ring must be"):
        resolve_ring("nvme", "cpu")
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("float16", "cuda:0") == "float16"


def test_worker_config_on_cpu_is_unchanged():
    cfg = WorkerConfig(role="encoder")
    assert (cfg.device, cfg.ring, cfg.dtype) == ("cpu", "shm", "float32")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        WorkerConfig(role="encoder", ring="cuda")
    with pytest.raises(ValueError, match="device must be"):
        WorkerConfig(role="pd", device="gpu0")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine WITHOUT a CUDA device")
def test_cuda_device_without_cuda_is_a_typed_start_up_error():
    with pytest.raises(DeviceUnavailableError, match="cuda:0 was asked for"):
        WorkerConfig(role="encoder", device="cuda:0")
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, ["worker", "--role", "encoder", "--device", "cuda:0"])
    assert res.exit_code == 2
    assert "cuda:0 was asked for" in res.output and "Traceback" not in res.output


def test_cuda_device_index_beyond_the_visible_ones():
    n = torch.cuda.device_count() if HAS_CUDA else 0
    with pytest.raises(DeviceUnavailableError):
        WorkerConfig(role="pd", device=f"cuda:{n + 7}")


# -- the ring's logic, on a CPU "device" -----------------------------------------------------------


@pytest.fixture
def cpu_ring():
    w = CudaRingWriter(MIN_CAPACITY, device="cpu", owner_tag="test")
    r = CudaRingReader("cpu")
    r.attach_local(w.name, w.buffer)
    yield w, r
    r.close()
    w.close()


def test_write_then_read_exact_bytes(cpu_ring):
    w, r = cpu_ring
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.randn(37, 96).to(dtype)
        k = key()
        loc = w.write(k, t)
        assert loc.offset % 64 == 0 and loc.nbytes == t.numel() * t.element_size()
        got = r.read(ref_for(w.name, k, loc, t, None), dtype)
        assert torch.equal(got, t)
        assert b"".join(w.read_chunks(loc.offset, loc.nbytes, k, loc.generation)) == t.view(torch.uint8).numpy().tobytes()
    assert w.entry_count == 3 and w.pinned_bytes == w.used_bytes


def test_reserve_then_fill_as_the_shm_ring_does(cpu_ring):
    """The encoder writes, then announces, on this ring (announces_early False: its readers do
    not wait for bytes still coming), but reserve/fill behave as the shared-memory ring's."""
    from epdq.errors import StaleEmbeddingError

    w, r = cpu_ring
    t, k = torch.randn(12, 32), key()
    loc = w.reserve(k, t.nbytes)
    with pytest.raises(StaleEmbeddingError):  # not in yet: neither read nor fetched
        r.read(ref_for(w.name, k, loc, t, None), torch.float32)
    with pytest.raises(StaleEmbeddingError):
        w.read_chunks(loc.offset, loc.nbytes, k, loc.generation)
    assert w.fill(k, loc.generation, t)
    assert torch.equal(r.read(ref_for(w.name, k, loc, t, None), torch.float32), t)
    with pytest.raises(ValueError):  # a fill of the wrong size drops the entry and reports it
        k2 = key()
        w.fill(k2, w.reserve(k2, 64).generation, torch.zeros(32))
    assert w.lookup(k2) is None and [e[0] for e in w.drain_evicted()] == [k2]
    assert not CudaRingWriter.announces_early


def test_same_key_is_stored_once_and_pins_follow_the_shm_ring(cpu_ring):
    w, _ = cpu_ring
    t, k = torch.ones(8, 16), key()
    loc = w.write(k, t)
    assert w.write(k, t) == loc  # resident: re-pinned, not rewritten
    w.unpin(k, loc.generation)
    assert w.pinned_bytes == 0 and w.lookup(k) == loc  # unpinned entries stay as cache
    assert w.pin(k, loc.generation) and not w.pin(k, loc.generation + 1)
    w.unpin(k, loc.generation)
    assert w.evict_unpinned() == 1 and w.drain_evicted() == [(k, loc.generation)]
    assert w.lookup(k) is None


def test_overwritten_entry_is_stale_for_the_reader(cpu_ring):
    w, r = cpu_ring
    big = torch.zeros((MIN_CAPACITY - 64) // 4 // 2, dtype=torch.float32)  # more than half the ring
    k1 = key()
    loc1 = w.write(k1, big)
    ref1 = ref_for(w.name, k1, loc1, big, None)
    assert torch.equal(r.read(ref1, torch.float32), big)
    assert w.write(key(), big) is None  # every window overlaps the pinned entry
    w.unpin(k1, loc1.generation)
    loc2 = w.write(key(), torch.ones_like(big))  # reclaims the LRU entry
    assert loc2 is not None and w.drain_evicted() == [(k1, loc1.generation)]
    with pytest.raises(StaleEmbeddingError):
        r.read(ref1, torch.float32)
    with pytest.raises(StaleEmbeddingError):
        w.read_chunks(loc1.offset, loc1.nbytes, k1, loc1.generation)


def test_reader_validates_what_came_from_the_wire(cpu_ring):
    w, r = cpu_ring
    t, k = torch.ones(4, 16), key()
    loc = w.write(k, t)
    good = ref_for(w.name, k, loc, t, None)
    bad = [
        dict(key=b"short"),
        dict(shape=[5, 16]),
        dict(generation=0),
        dict(offset=loc.offset + 1),
        dict(offset=MIN_CAPACITY - 64),
        dict(offset=0),
    ]
    for kw in bad:
        with pytest.raises(ProtocolError):
            r.read(msgspec.structs.replace(good, **kw), torch.float32)
    with pytest.raises(StaleEmbeddingError):
        r.read(msgspec.structs.replace(good, generation=loc.generation + 1), torch.float32)
    with pytest.raises(ValueError):
        r.read(good, torch.float32, out=torch.empty(4, 15))


def test_which_refs_a_reader_takes():
    r = CudaRingReader("cpu")
    t = torch.ones(2, 2)
    loc = type("L", (), {"offset": 64, "nbytes": 16, "generation": 1})
    local = fake_ring(device_uuid="cpu", handle=b"local")
    r.attach_local(NAME, torch.zeros(MIN_CAPACITY, dtype=torch.uint8))
    assert r.usable(ref_for(NAME, key(), loc, t, local))
    assert not r.usable(ref_for(NAME, key(), loc, t, local, ring_kind=""))  # a shm ref
    assert not r.usable(ref_for(NAME, key(), loc, t, None))  # no handle stamped on by the broker
    assert not r.usable(ref_for(NAME, key(), loc, t, fake_ring()))  # another GPU: fetch instead
    with pytest.raises(ProtocolError):
        r.usable(ref_for("cuda-x", key(), loc, t, fake_ring(device_uuid="cpu")))


def test_reader_header_copy_is_validated():
    with pytest.raises(ValueError, match="header_copy"):
        CudaRingReader("cpu", header_copy="mmap")
    assert CudaRingReader("cpu").header_copy == "pinned"


@pytest.mark.parametrize("header_copy", ["pinned", "pageable"])
def test_stale_check_holds_for_either_header_copy(header_copy):
    w = CudaRingWriter(MIN_CAPACITY, device="cpu", owner_tag="test")
    r = CudaRingReader("cpu", header_copy=header_copy)
    try:
        r.attach_local(w.name, w.buffer)
        t = torch.randn(16, 64)
        k = key()
        loc = w.write(k, t)
        ref = ref_for(w.name, k, loc, t, None)
        assert torch.equal(r.read(ref, torch.float32), t)
        w.unpin(k, loc.generation)
        w.evict_unpinned()
        with pytest.raises(StaleEmbeddingError):
            r.read(ref, torch.float32)
    finally:
        r.close()
        w.close()


def test_export_needs_a_gpu():
    w = CudaRingWriter(MIN_CAPACITY, device="cpu")
    try:
        with pytest.raises(RuntimeError, match="CUDA device"):
            w.export()
    finally:
        w.close()


@pytest.mark.parametrize("cap", [0, MIN_CAPACITY - 1, (64 << 30) + 1])
def test_capacity_validated(cap):
    with pytest.raises(ValueError):
        CudaRingWriter(cap, device="cpu")


# -- the PD worker's gather onto a device (logic on the CPU) -------------------------------------------


class _Engine:
    hidden_size = 16

    def expected_embed_rows(self, grids):
        return sum(t * h * w for t, h, w in grids) // 4


class _Fetcher:
    def __init__(self, data: dict[bytes, bytes]):
        self.data, self.calls = data, 0

    async def fetch(self, ref):
        self.calls += 1
        b = self.data[ref.key]
        # in two frames, as larger answers come (protocol.fetch_chunks); zmq frames are writable buffers
        return [memoryview(bytearray(b[: len(b) // 2 + 1])), memoryview(bytearray(b[len(b) // 2 + 1 :]))]

    def close(self):
        pass


def test_pd_gather_device_mixes_cuda_shm_and_fetched_entries():
    from epdq.worker.pd import PDWorker

    pd = PDWorker(_Engine(), worker_id="pd-0", node="n", colocated=False, max_image_bytes=1, max_image_pixels=1)
    cw = CudaRingWriter(MIN_CAPACITY, device="cpu")
    sw = RingWriter(MIN_CAPACITY, owner_tag="test")
    try:
        pd.cuda_reader = CudaRingReader("cpu")
        pd.cuda_reader.attach_local(cw.name, cw.buffer)
        ring = fake_ring(device_uuid="cpu", handle=b"local")
        a, b, c, d = (torch.full((n, 16), float(i)) for i, n in enumerate((2, 4, 1, 3), 1))
        ka, kb, kc, kd = key(1), key(2), key(3), key(4)
        la, lb = cw.write(ka, a), sw.write(kb, b)
        lc = cw.write(kc, c)
        refs = [
            ref_for(cw.name, ka, la, a, ring, grid=[1, 2, 4]),
            ref_for(sw.name, kb, lb, b, None, ring_kind="", grid=[1, 4, 4]),
            ref_for(cw.name, kc, lc, c, ring, grid=[1, 2, 2], node="other-node"),  # not this node: fetched
            ref_for(cw.name, ka, la, a, ring, grid=[1, 2, 4]),  # repeated image: copied from its first rows
            ref_for("", kd, lc, d, None, ring_kind="", offset=64, nbytes=d.numel() * 4, grid=[1, 2, 6]),
        ]
        pd.fetcher = _Fetcher({kc: c.numpy().tobytes(), kd: d.numpy().tobytes()})
        out = asyncio.run(pd._gather_device(refs, torch.float32, 16))
        assert torch.equal(out, torch.cat([a, b, c, a, d]))
        assert (pd.cuda_reads, pd.local_reads, pd.remote_reads, pd.fetcher.calls) == (1, 1, 2, 2)
        # a CUDA ring on another GPU (or one that cannot be mapped) falls back to the fetch path
        pd.fetcher = _Fetcher({ka: a.numpy().tobytes()})
        other = ref_for(cw.name, ka, la, a, fake_ring(), grid=[1, 2, 4])
        assert torch.equal(asyncio.run(pd._gather_device([other], torch.float32, 16)), a)
        assert pd.fetcher.calls == 1
    finally:
        pd.close()
        cw.close()
        sw.close()


# -- the GPU check script ---------------------------------------------------------------------------


def test_gpu_check_script_parses():
    script = ROOT / "bench" / "gpu_check.sh"
    assert script.is_file()
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# -- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("header_copy", ["pinned", "pageable"])
def test_gpu_ring_in_process_round_trip(header_copy):
    w = CudaRingWriter(8 << 20, device="cuda:0")
    r = CudaRingReader("cuda:0", header_copy=header_copy)
    try:
        r.attach_local(w.name, w.buffer)
        t = torch.randn(300, 2048, device="cuda:0").to(torch.bfloat16)
        k = key()
        loc = w.write(k, t)
        ref = ref_for(w.name, k, loc, t, None)
        got = r.finish(r.read(ref, torch.bfloat16))
        assert got.device == torch.device("cuda:0") and torch.equal(got, t)
        assert b"".join(w.read_chunks(loc.offset, loc.nbytes, k, loc.generation)) == t.cpu().view(torch.uint8).numpy().tobytes()
        host = torch.randn(10, 2048).to(torch.bfloat16)  # a CPU tensor goes up once
        lh = w.write(key(9), host)
        assert torch.equal(r.read(ref_for(w.name, key(9), lh, host, None), torch.bfloat16).cpu(), host)
        # threads read at once, each checking headers through its own staging
        refs = []
        for i in range(8):
            ti = torch.full((64, 2048), float(i), device="cuda:0", dtype=torch.bfloat16)
            li = w.write(key(100 + i), ti)
            refs.append((ref_for(w.name, key(100 + i), li, ti, None), float(i)))

        def read_all(n: int) -> bool:
            return all(bool((r.finish(r.read(ref, torch.bfloat16)) == v).all()) for ref, v in refs * n)

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(read_all, [5, 5, 5, 5]))
        w.unpin(k, loc.generation)
        w.evict_unpinned()
        with pytest.raises(StaleEmbeddingError):
            r.read(ref, torch.bfloat16)
        exp = w.export()
        check_cuda_ring(w.name, exp)
        assert exp.storage_bytes == w.capacity and exp is w.export()  # shared once
    finally:
        r.close()
        w.close()


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from epdq import protocol as P
    from epdq.ring_cuda import CudaRingWriter
    w = CudaRingWriter(4 << 20, device="cuda:0", owner_tag="gputest")
    t = (torch.arange(512 * 1024, device="cuda:0", dtype=torch.float32) % 251).to(torch.bfloat16).view(512, 1024)
    k = bytes(range(16))
    loc = w.write(k, t)
    reg = P.Register("enc-0", "encoder", "n", 1, "s", "m", 1, ring_segment=w.name, ring_capacity=w.capacity,
                     ring_kind="cuda", cuda_ring=w.export())
    print(P.encode(reg)[1].hex(), loc.offset, loc.nbytes, loc.generation, flush=True)
    assert sys.stdin.readline().strip() == "overwrite"
    w.unpin(k, loc.generation)
    w.evict_unpinned()
    w.write(bytes(16), torch.zeros(1536, 1024, device="cuda:0", dtype=torch.bfloat16))
    print("done", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.gpu
@needs_gpu
def test_gpu_ring_shared_with_another_process_through_ipc():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip
    r = CudaRingReader("cuda:0")
    try:
        line = readline(child).split()
        assert line, "the encoder child printed nothing"
        reg, _ = P.decode([bytes([P.MsgType.REGISTER]), bytes.fromhex(line[0])])
        offset, nbytes, gen = map(int, line[1:])
        ref = P.EmbedRef(bytes(range(16)), "enc-0", "n", reg.ring_segment, offset, nbytes, gen, "bfloat16",
                         [512, 1024], [1, 2, 2], "", "cuda", reg.cuda_ring)  # fmt: skip
        assert r.usable(ref), r.failure(ref.segment)
        got = r.finish(r.read(ref, torch.bfloat16))
        want = (torch.arange(512 * 1024, device="cuda:0", dtype=torch.float32) % 251).to(torch.bfloat16)
        assert torch.equal(got.view(-1), want)
        child.stdin.write("overwrite\n")
        child.stdin.flush()
        assert readline(child).strip() == "done"
        with pytest.raises(StaleEmbeddingError):
            r.read(ref, torch.bfloat16)
    finally:
        r.close()
        # the StaleEmbeddingError's traceback holds read()'s frame, and with it the mapping: let it
        # go before the producer exits, else torch warns that the producer left with it still open
        gc.collect()
        if child.poll() is None:
            child.stdin.write("\n")
            child.stdin.flush()
        child.wait(30)
        child.stdin.close()
        child.stdout.close()
    assert child.returncode == 0


def test_json_roundtrip_of_handle_fields_is_lossless():
    # bytes fields survive msgspec's JSON too (base64): configs and logs may carry them
    ring = fake_ring(handle=bytes(range(256)) * 2)
    assert msgspec.json.decode(msgspec.json.encode(ring), type=P.CudaRing) == ring
    assert isinstance(json.loads(msgspec.json.encode(ring))[2], str)  # array-like: positional


def test_handoff_gpu_rows_dry_run_and_skip(tmp_path):
    """The GPU rows' two processes and protocol run with device "cpu" (no IPC there: the CUDA ring
    row reports failed, the others are measured); without CUDA the default reports them skipped."""
    from epdq.benchmarks import handoff

    kw = dict(sizes_mib=(1,), repeats=2, out_dir=tmp_path, plot=False, progress=False, pool_mib=16, ring_mib=16)
    c = handoff.run(cuda=True, device="cpu", **kw)["cuda"]
    assert c["status"] == "ok" and c["failed"] == ["cuda_ring"] and "only a ring on a CUDA device" in c["reader_stderr"]
    ok = {r["method"] for r in c["results"] if r["status"] == "ok"}
    assert ok == {"cuda_d2d", "shm_ring_gpu", "safetensors_gpu"}
    assert all(r["p50_ms"] > 0 for r in c["results"] if r["status"] == "ok")
    if not HAS_CUDA:
        skipped = handoff.run(**kw)["cuda"]
        assert skipped["status"] == "skipped: no CUDA"
        assert "skipped: no CUDA" in handoff.render_cuda(skipped, {"dtype": "bfloat16", "hidden": 3584})


def test_gpu_rows_without_a_d2d_row_print_no_nan():
    """When the device-to-device row itself fails there is nothing to divide by: the other rows
    said "nan×"; they now say so in words."""
    from epdq.benchmarks import handoff

    ok = {"size_mib": 1, "label": "shm ring from/to GPU", "status": "ok", "p50_ms": 0.5, "p90_ms": 0.6,
          "gb_per_s": 2.0, "x_d2d": float("nan"), "parts": {"copy": {"p50_ms": 0.4}}}  # fmt: skip
    failed = {"size_mib": 1, "label": "device-to-device copy", "status": "failed"}
    c = {"status": "ok", "device": "cuda:0", "gpu": "test", "results": [failed, ok], "failed": ["cuda_d2d"]}
    cfg = {"dtype": "bfloat16", "hidden": 3584, "repeats": 2}
    text = handoff.render_cuda(c, cfg)
    assert "nan" not in text.lower() and "n/a (d2d failed)" in text
    ok["x_d2d"] = None  # as the JSON file has it
    assert handoff.render_cuda(c, cfg) == text


def test_ring_costs_runs_on_a_cpu_device(tmp_path, capsys):
    from epdq.benchmarks import ring_cuda_costs

    assert ring_cuda_costs.main(["--device", "cpu", "--sizes", "1", "--repeats", "3", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "ring_cuda_costs.json").read_text())
    assert [w["size_mib"] for w in d["whole"]] == [1] and d["whole"][0]["write_p50_us"] > 0
    assert "CUDA ring write and read" in capsys.readouterr().out
    for bad in (["--sizes", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            ring_cuda_costs.main(["--device", "cpu", *bad])
