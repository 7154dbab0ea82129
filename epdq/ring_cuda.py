"""CUDA embedding ring: one device buffer per encoder, mapped once by PD workers on the same GPU.

Same entries, placement, pins, LRU reclaim and generations as the shared-memory ring
(`epdq.ring`; `CudaRingWriter` reuses `RingWriter`'s protocol methods and `RingSpace`), but the
bytes never leave the GPU: the encoder writes an entry device-to-device, the PD worker copies it
device-to-device into its own memory.

Sharing: the encoder allocates ONE `uint8` buffer and exports it once through torch's CUDA IPC
(`UntypedStorage._share_cuda_`, what torch.multiprocessing does when it sends a CUDA tensor);
the fields travel as plain values in a `protocol.CudaRing` (never pickled) inside the encoder's
REGISTER, and the broker copies them onto every EmbedRef. A PD worker whose GPU has the same UUID
maps the buffer once (`UntypedStorage._new_shared_cuda`) and keeps the mapping; one on another GPU
or node, or one that cannot open the handle, reads through the encoder's fetch socket instead.

Ordering, all on the writer's own stream: overwritten entries' generations are zeroed first, then
the data is copied, then the 64-byte header (magic, key, generation, nbytes) is written, and the
stream is synchronised before `write` returns, so the completion event the encoder sends next can
only name finished bytes. The reader copies the data on its own stream and then reads the header
back (stream order puts that read after the copy; the read blocks until both are done): if the
header still names the entry, no overwrite had begun when the data was read, because every
overwrite is preceded, in the writer's stream order, by zeroing that header. One host
synchronisation per read, no hashing of the bytes: the key is the image's content hash and the
generation is unique per ring, exactly the check the shared-memory ring makes.

A process must keep its CUDA context alive while others map its ring: when an encoder exits, its
PD workers learn it from the broker (worker lost) and their next reads fail over to a re-encode.

For tests without a GPU both classes also work on a CPU "device" (same code, no streams, no IPC:
a reader is then handed the writer's buffer with `attach_local`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import struct
import threading
from collections import OrderedDict
from typing import Any

import torch

from epdq import protocol as P
from epdq.errors import EntryPending, ProtocolError, StaleEmbeddingError
from epdq.ring import MAX_CAPACITY, MIN_CAPACITY, RingWriter, _check_key, _round_up, entry_seal
from epdq.ring_space import ALIGN, HEADER_BYTES, RingSpace, _Entry

KIND = "cuda"
_MAGIC = b"EPDQCRG1"
_HDR = struct.Struct("<8s16sQQ")  # magic, key, generation, nbytes; rest of the 64 B is zero
_GEN_AT = 24  # offset of the generation inside the header
_TAG = re.compile(r"[A-Za-z0-9_]{1,32}")
NAME_PATTERN = re.compile(r"cuda-[0-9]{1,10}-[A-Za-z0-9_]{1,32}-[0-9]{1,10}-[0-9a-f]{16}")
MAX_HANDLE_BYTES = 1024
EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
HEADER_COPIES = ("pinned", "pageable")  # how a reader copies an entry's header back for its check
_REF_COUNTER = re.compile(rb"[A-Za-z0-9_./-]{1,255}")
# torch's reference-counter file holds this many int64 counters (CUDA_IPC_REF_COUNTER_FILE_SIZE):
# an offset past it would make torch write outside the mapping when it releases the storage
_MAX_REF_COUNTER_OFFSET = 10000


def device_uuid(device: torch.device | str) -> str:
    """A GPU's UUID as text (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:  # very old torch: fall back to the PCI bus id, also unique per node
        return "pci-" + torch.cuda.get_device_properties(index).name + f"-{index}"
    return str(uuid)


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with this UUID, or None when it is not visible here."""
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


def check_cuda_ring(segment: str, ring: P.CudaRing) -> None:
    """ProtocolError unless a CudaRing from the wire is well formed (it is mapped, never trusted blindly)."""
    if not isinstance(segment, str) or not NAME_PATTERN.fullmatch(segment):
        raise ProtocolError(f"not an epdq CUDA ring name: {segment!r:.80}")
    if not 0 < len(ring.handle) <= MAX_HANDLE_BYTES:
        raise ProtocolError(f"CUDA IPC handle of {len(ring.handle)} bytes")
    if not MIN_CAPACITY <= ring.storage_bytes <= MAX_CAPACITY or ring.storage_bytes % ALIGN:
        raise ProtocolError(f"CUDA ring of {ring.storage_bytes} bytes")
    if not 0 <= ring.storage_offset < 1 << 48 or not 0 <= ring.device_index < 1024:
        raise ProtocolError("bad CUDA ring offset or device index")
    if not _REF_COUNTER.fullmatch(ring.ref_counter_handle) or b".." in ring.ref_counter_handle:
        raise ProtocolError("bad CUDA IPC reference-counter name")
    if not 0 <= ring.ref_counter_offset < _MAX_REF_COUNTER_OFFSET:
        raise ProtocolError("bad CUDA IPC reference-counter offset")
    if len(ring.event_handle) != EVENT_HANDLE_BYTES:
        raise ProtocolError(f"CUDA IPC event handle of {len(ring.event_handle)} bytes")
    if not 0 < len(ring.device_uuid) <= 128:
        raise ProtocolError("bad device uuid")


def _header_matches(raw: bytes, key: bytes, generation: int, nbytes: int) -> bool:
    return _HDR.unpack_from(raw, 0) == (_MAGIC, key, generation, nbytes)


def _stream_ctx(stream: Any):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class CudaRingWriter(RingWriter):
    """The encoder's CUDA ring. Thread-safe like `RingWriter` (whose pin/unpin/lookup/evict/clear
    it inherits); `write` returns once the entry is complete on the device."""

    kind = KIND
    # `reserve` + `fill` work here too, but its readers (CudaRingReader) do not wait for an entry
    # still being written, so the encoder writes, then announces
    announces_early = False

    def __init__(self, capacity_bytes: int, *, device: str | torch.device = "cuda", owner_tag: str = "enc"):
        # RingWriter.__init__ is not called: there is no shared-memory segment. The attributes its
        # protocol methods use (_lock, _space, _evicted, _next_gen, _closed, capacity, name) are set here.
        if not isinstance(capacity_bytes, int) or not MIN_CAPACITY <= capacity_bytes <= MAX_CAPACITY:
            raise ValueError(f"ring capacity must be {MIN_CAPACITY}..{MAX_CAPACITY} B, not {capacity_bytes}")
        if not _TAG.fullmatch(owner_tag):
            raise ValueError(f"owner_tag must match {_TAG.pattern}, got {owner_tag!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.capacity = _round_up(capacity_bytes, ALIGN)
        self.name = f"cuda-{os.getuid()}-{owner_tag}-{os.getpid()}-{secrets.token_hex(8)}"
        self._cuda = device.type == "cuda"
        # zeroed: no stale magic anywhere, so a reader can never match a header that was not written
        self._buf: torch.Tensor | None = torch.zeros(self.capacity, dtype=torch.uint8, device=device)
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None
        # host staging for headers; pinned so the header copy is a plain DMA on the ring's stream
        self._hdr_host = torch.zeros(HEADER_BYTES, dtype=torch.uint8, pin_memory=self._cuda)
        self._lock = threading.Lock()
        self._fence = threading.Lock()
        self._space = RingSpace(self.capacity)
        self._evicted: list[tuple[bytes, int]] = []
        self._invalidate: list[int] = []  # offsets of evicted generations not yet zeroed on the stream
        self._next_gen = secrets.randbits(32) + 1
        self._closed = False
        self._export: P.CudaRing | None = None

    @property
    def buffer(self) -> torch.Tensor:
        """The ring's device buffer (for an in-process reader: `CudaRingReader.attach_local`)."""
        if self._buf is None:
            raise ValueError(f"ring {self.name} is closed")
        return self._buf

    def export(self) -> P.CudaRing:
        """The IPC description of the buffer, made once (torch re-wraps the storage on every share)."""
        if not self._cuda:
            raise RuntimeError("only a ring on a CUDA device can be shared with other processes")
        with self._lock:
            self._check_open()
            if self._export is None:
                assert self._buf is not None
                dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = (
                    self._buf.untyped_storage()._share_cuda_()
                )
                self._export = P.CudaRing(
                    device_uuid(self.device), int(dev), bytes(handle), int(size), int(offset), bytes(rc_handle),
                    int(rc_offset), bytes(ev_handle or b"\0" * EVENT_HANDLE_BYTES), bool(ev_sync),
                )  # fmt: skip
                check_cuda_ring(self.name, self._export)
            return self._export

    def read_chunks(self, offset: int, nbytes: int, key: bytes, generation: int) -> list[memoryview]:
        """Copy an entry to host memory for a fetch from another GPU or node, in the frames of its
        answer (`protocol.fetch_chunks`); StaleEmbeddingError if gone."""
        _check_key(key, ProtocolError)
        with self._lock:
            self._check_open()
            e = self._space.by_key.get(key)
            if e is None or (e.start + HEADER_BYTES, e.nbytes, e.generation) != (offset, nbytes, generation):
                raise StaleEmbeddingError(f"entry {key.hex()}@{generation} is no longer resident")
            if not e.published:
                raise EntryPending(f"entry {key.hex()}@{generation} is still being written")
            # under the lock no write can start, and every write is finished when it releases it
            chunks = P.fetch_chunks(nbytes)
            out = [torch.empty(size, dtype=torch.uint8) for _, size in chunks]
            with _stream_ctx(self._stream):
                for (start, size), o in zip(chunks, out, strict=True):
                    o.copy_(self._buf[offset + start : offset + start + size])  # type: ignore[index]
            if self._stream is not None:
                self._stream.synchronize()
        return [memoryview(o.numpy()) for o in out]

    def fetch_frames(self, offset: int, nbytes: int, key: bytes, generation: int) -> list[Any]:
        """The payload of a fetch's answer (see `epdq.ring.RingWriter.fetch_frames`): the entry
        copied to host memory, then its seal. The copy was made under the lock, which no write
        of these bytes can pass, so the seal is the entry's header as it was."""
        return [*self.read_chunks(offset, nbytes, key, generation), entry_seal(key, generation, nbytes)]

    def close(self, unlink: bool = True) -> None:  # noqa: ARG002 - same signature as RingWriter.close
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._stream is not None:
                self._stream.synchronize()
            self._buf = None  # readers that still map it keep the allocation alive (torch's IPC refcount)

    # -- called with the lock held -------------------------------------------------------------

    def _evict(self, e: _Entry, *, report: bool = True, defer: bool = False) -> None:
        # Invalidate first (on the ring's stream, so before any later write of these bytes) so a
        # reader mid-copy fails its after-copy check. `defer`: the write that follows queues it,
        # inside its own stream context (entering one costs ~18 µs of host time on an H200 host)
        self._invalidate.append(e.start + _GEN_AT)
        if not defer:
            with _stream_ctx(self._stream):
                self._queue_invalidations()
        self._space.remove(e)
        if report:
            self._evicted.append((e.key, e.generation))

    def _queue_invalidations(self) -> None:
        """Zero the generations of evicted entries, on the current (the ring's) stream."""
        assert self._buf is not None
        for at in self._invalidate:
            self._buf[at : at + 8].zero_()
        self._invalidate.clear()

    def _claim(self, start: int, span: int, key: bytes, nbytes: int) -> _Entry:
        # no "being written" header: its readers never wait for one (the invalidations above make
        # whatever lay here fail their header check until the real header is written)
        for victim in self._space.overlapping(start, start + span):
            self._evict(victim, defer=True)  # queued by _copy_in, before any byte of the new entry
        e = _Entry(key, self._next_gen, start, span, nbytes, False)
        self._next_gen += 1
        self._space.add(e)
        return e

    def _copy_in(self, e: _Entry, tensor: torch.Tensor, *, announced: bool = False) -> None:
        assert self._buf is not None
        nbytes = e.nbytes
        try:
            if tensor.device.type != "cpu" and tensor.device != self.device:
                tensor = tensor.to(self.device)  # another GPU of this process: one peer copy first
            producer = torch.cuda.current_stream(self.device) if self._cuda else None
            with _stream_ctx(self._stream):
                self._queue_invalidations()  # stream order: before the bytes that overwrite them
                if self._stream is not None and tensor.is_cuda:
                    self._stream.wait_stream(producer)  # the vision forward that made `tensor`
                if nbytes:
                    off = e.loc().offset
                    dst = self._buf[off : off + nbytes].view(tensor.dtype).view(tensor.shape)
                    with torch.no_grad():
                        dst.copy_(tensor, non_blocking=True)
                _HDR.pack_into(self._hdr_host.numpy(), 0, _MAGIC, e.key, e.generation, nbytes)
                self._buf[e.start : e.start + HEADER_BYTES].copy_(self._hdr_host, non_blocking=True)
            if self._stream is not None:
                # the completion event that follows must only name finished bytes; this also makes
                # the pinned header staging free for the next write
                self._stream.synchronize()
        except BaseException:
            self._drop_unpublished(e, announced)  # never published
            raise
        e.published = True


class CudaRingReader:
    """A PD worker's mappings of the CUDA rings of encoders on its GPU (one per ring, kept)."""

    def __init__(self, device: str | torch.device, *, max_rings: int = 64, header_copy: str = "pinned"):
        if max_rings < 1:
            raise ValueError("max_rings must be >= 1")
        if header_copy not in HEADER_COPIES:
            raise ValueError(f"header_copy must be one of {HEADER_COPIES}, not {header_copy!r}")
        self.header_copy = header_copy
        self._local = threading.local()  # per thread: a pinned staging buffer for the header check
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._cuda = device.type == "cuda"
        self.uuid = device_uuid(device)
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._max = max_rings
        self._rings: OrderedDict[str, tuple[bytes, torch.Tensor]] = OrderedDict()
        self._failed: dict[str, str] = {}  # rings whose handle could not be opened here: fetch instead
        self._lock = threading.Lock()
        self.opened = 0

    # -- which path ----------------------------------------------------------------------------

    def usable(self, ref: P.EmbedRef) -> bool:
        """True when `ref` is in a CUDA ring on this reader's GPU that is (or can be) mapped here.
        False means: read it another way (the encoder's fetch socket)."""
        ring = ref.cuda_ring
        if ref.ring_kind != KIND or ring is None or ring.device_uuid != self.uuid:
            return False
        with self._lock:
            if ref.segment in self._failed:
                return False
            cached = self._rings.get(ref.segment)
        if cached is not None and cached[0] == ring.handle:
            return True
        try:
            self._attach(ref.segment, ring)
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. no IPC in this container: the fetch path works
            with self._lock:
                self._failed[ref.segment] = f"{type(e).__name__}: {e}"[:300]
            return False
        return True

    def failure(self, segment: str) -> str | None:
        with self._lock:
            return self._failed.get(segment)

    # -- reading -------------------------------------------------------------------------------

    def stream(self):
        """Context in which the caller allocates and fills the tensor that entries are read into."""
        return _stream_ctx(self._stream)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self.stream():
            return torch.empty(shape, dtype=dtype, device=self.device)

    def read(self, ref: P.EmbedRef, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy one entry device-to-device into `out` (or a new tensor); checked after the copy.

        Call inside `stream()` when `out` is filled by other copies too; `finish(out)` before the
        tensor is used on another stream (the check below has already waited for this copy)."""
        key, generation, offset, nbytes = ref.key, ref.generation, ref.offset, ref.nbytes
        shape = tuple(ref.shape)
        _check_key(key, ProtocolError)
        if any(not isinstance(d, int) or d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
            raise ProtocolError(f"shape {shape} of {dtype} does not hold {nbytes} bytes")
        if not 0 < generation < 2**64:
            raise ProtocolError(f"bad generation {generation}")
        buf = self._mapped(ref)
        if offset % ALIGN or offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > buf.numel():
            raise ProtocolError(f"entry [{offset}, +{nbytes}) is outside CUDA ring {ref.segment}")
        if out is None:
            out = self.empty(shape, dtype)
        elif out.dtype != dtype or tuple(out.shape) != shape or out.device != self.device:
            raise ValueError("out tensor does not match dtype/shape or is not on this reader's device")
        with self.stream():
            if nbytes:
                out.copy_(buf[offset : offset + nbytes].view(dtype).view(shape), non_blocking=True)
            raw = self._header_after_copy(buf, offset)
        if not _header_matches(raw, key, generation, nbytes):
            raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {ref.segment} was overwritten")
        return out

    def _header_after_copy(self, buf: torch.Tensor, offset: int) -> bytes:
        """The entry's header read after the copies queued before it on the reader's stream (stream
        order), returned once they are done. "pinned": an async copy into this thread's pinned
        staging, then one stream synchronisation; "pageable": `.to("cpu")`, which stages through a
        driver buffer and waits the same way (the form before 2026-12-04; kept to compare)."""
        window = buf[offset - HEADER_BYTES : offset]
        if self._stream is None or self.header_copy == "pageable":
            return window.to("cpu").numpy().tobytes()
        staging = getattr(self._local, "header", None)
        if staging is None:
            staging = self._local.header = torch.empty(HEADER_BYTES, dtype=torch.uint8, pin_memory=True)
        staging.copy_(window, non_blocking=True)
        self._stream.synchronize()
        return staging.numpy().tobytes()

    def finish(self, t: torch.Tensor) -> torch.Tensor:
        """Make `t` (filled on the reader's stream) safe to use and free on the caller's stream."""
        if self._stream is not None:
            self._stream.synchronize()
            t.record_stream(torch.cuda.current_stream(self.device))
        return t

    # -- mappings ------------------------------------------------------------------------------

    def attach_local(self, segment: str, buffer: torch.Tensor, handle: bytes = b"local") -> None:
        """Map a ring of this process (tests, benchmarks): `buffer` is the writer's `buffer`."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("a ring buffer is a 1-D uint8 tensor")
        with self._lock:
            self._rings[segment] = (handle, buffer)

    def _mapped(self, ref: P.EmbedRef) -> torch.Tensor:
        with self._lock:
            cached = self._rings.get(ref.segment)
            if cached is not None:
                self._rings.move_to_end(ref.segment)
        if cached is not None and (ref.cuda_ring is None or cached[0] == ref.cuda_ring.handle):
            return cached[1]
        if ref.cuda_ring is None:
            raise StaleEmbeddingError(f"CUDA ring {ref.segment} is not mapped here")
        return self._attach(ref.segment, ref.cuda_ring)

    def _attach(self, segment: str, ring: P.CudaRing) -> torch.Tensor:
        check_cuda_ring(segment, ring)
        if not self._cuda:
            raise StaleEmbeddingError("a CPU reader cannot map CUDA rings")
        index = local_index(ring.device_uuid)
        if index is None:
            raise RuntimeError(f"GPU {ring.device_uuid} is not visible in this process")
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, ring.handle, ring.storage_bytes, ring.storage_offset, ring.ref_counter_handle,
            ring.ref_counter_offset, ring.event_handle, ring.event_sync_required,
        )  # fmt: skip
        buf = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        buf.set_(storage, 0, (ring.storage_bytes,), (1,))
        with self._lock:
            old = self._rings.pop(segment, None)
            self._rings[segment] = (ring.handle, buf)
            while len(self._rings) > self._max:
                self._rings.popitem(last=False)
            self.opened += 1
        del old  # a re-registered encoder's old mapping: released when no tensor uses it
        return buf

    def forget(self, segment: str) -> None:
        with self._lock:
            self._rings.pop(segment, None)
            self._failed.pop(segment, None)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        with self._lock:
            self._rings.clear()
            self._failed.clear()
