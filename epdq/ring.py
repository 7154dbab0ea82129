"""POSIX shared-memory embedding ring: one per encoder process, read by PD workers on the node.

Layout: entries are `[64-byte header][data, padded to 64 B]`, placed anywhere in the segment at
64-byte offsets. The header is (magic, key, generation, nbytes); readers trust bytes only while
that header still names the entry they were told about, checked before AND after their copy.

Overwrite protocol (a seqlock without a counter): the writer first sets the generation of every
old entry that the new entry's window touches to 0, then writes the data, then the new header.
An entry can be announced before its bytes are in (`reserve`, then `fill`): its header then
carries the "being written" magic, and a reader that finds it waits for the real one
(`RingReader.wait_published`) instead of taking the entry as stale. The encoder announces that
way, so its completion event travels to the broker and on to a PD worker while it copies.
A reader whose after-copy check still sees the old generation copied bytes no one had started
to overwrite. This relies on x86 ordering: loads are not reordered with loads, and the writer
puts a full fence (an atomic read-modify-write) after the invalidation so that memcpy's
streaming stores, which may pass older stores, cannot. Weakly ordered CPUs (ARM) would also
need a reader-side load fence, which Python cannot express: there the check is best effort.

Pins belong to the broker: a pinned entry is never overwritten; unpinned entries stay resident
as a cache and are evicted least-recently-unpinned first, only when space is needed. Pins are a
flag, not a count: the broker keeps the count of requests that need an entry.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epdq.errors import ConfigError, EntryPending, ProtocolError, RingFullError, StaleEmbeddingError
from epdq.ring_space import ALIGN, HEADER_BYTES, EntryLoc, RingSpace, _Entry
from epdq.transport import pid_alive as _pid_alive  # one liveness test for segments and socket files

SHM_DIR = "/dev/shm"
KEY_BYTES = 16
MIN_CAPACITY = 1 << 20
MAX_CAPACITY = 64 << 30
_MAGIC = b"EPDQRNG1"
_PENDING = b"EPDQRNGW"  # an entry placed and announced, its bytes still being copied in (reserve -> fill)
_HDR = struct.Struct("<8s16sQQ")  # magic, key, generation, nbytes; rest of the 64 B is zero
_GEN = struct.Struct("<Q")
_GEN_AT = 24  # offset of the generation inside the header
_TAG = re.compile(r"[A-Za-z0-9_]{1,32}")
# How long a reader trusts that a mapped segment is still linked before looking again (fstat).
# Its bytes stay valid either way; the look only lets go of a dead encoder's pages, and costs
# ~15 us with cold caches, which is what a PD worker woken by a new request has.
RELINK_CHECK_S = 1.0
# A reader waiting for an announced entry (RingReader.wait_published): a short busy-wait, then it
# looks again at every turn of its event loop (other tasks run in between) for about as long as the
# encoder's copy can take at COPY_BYTES_PER_S (bounded), then every POLL_S until the timeout.
SPIN_S = 50e-6
COPY_BYTES_PER_S = 1e9
MAX_EAGER_S = 0.05  # then the waiting reader gives its core back to the copy (a 2-core machine)
POLL_S = 1e-3  # uvloop's timers tick in milliseconds
LIVENESS_POLLS = 10  # polls between two looks at whether the segment's writer is still alive
PUBLISH_TIMEOUT_S = 2.0
# real dtypes: their bytes in memory are their values (no lazy conjugate/negate bits)
_PLAIN_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8})


def _name_pattern(uid: int) -> re.Pattern[str]:
    # The owner tag has no '-' so the pid field parses unambiguously; ASCII digits only.
    return re.compile(rf"epdq-{uid}-[A-Za-z0-9_]{{1,32}}-([0-9]{{1,10}})-[0-9a-f]{{16}}")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _check_key(key: bytes, exc: type[Exception] = ValueError) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise exc(f"ring keys are {KEY_BYTES} bytes, got {key!r:.40}")


def _full_fence(lock: threading.Lock) -> None:
    # Taking a lock is a locked RMW on x86 (CPython's Lock is a futex/semaphore): a full fence.
    lock.acquire()
    lock.release()


def _header_ok(buf: mmap.mmap, hdr: int, key: bytes, generation: int, nbytes: int) -> bool:
    return _HDR.unpack_from(buf, hdr) == (_MAGIC, key, generation, nbytes)


def _copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Module-level so tests can interleave a concurrent overwrite with the copy.
    dst.copy_(src)


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a tensor still views it; the mapping goes when that tensor is freed


def _no_room(capacity: int, free: int) -> ConfigError:
    return ConfigError(
        f"a ring of {capacity >> 20} MiB does not fit in {SHM_DIR} ({free >> 20} MiB free): lower the "
        "encoder's --ring-mb, or give this machine (a container: docker run --shm-size) more shared memory"
    )


def _unlink_segment(path: str, creator_pid: int) -> None:
    # A forked child that exits normally must not unlink its parent's segment.
    if os.getpid() == creator_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class RingWriter:
    """The encoder's ring. All methods are thread-safe (one lock; `write` and `fill` hold it for
    their copy)."""

    announces_early = True  # reserve + fill: see the module docstring (a CUDA ring does not)

    def __init__(self, capacity_bytes: int, *, owner_tag: str = "enc"):
        if not isinstance(capacity_bytes, int) or not MIN_CAPACITY <= capacity_bytes <= MAX_CAPACITY:
            raise ValueError(f"ring capacity must be {MIN_CAPACITY}..{MAX_CAPACITY} B, not {capacity_bytes}")
        if not _TAG.fullmatch(owner_tag):
            raise ValueError(f"owner_tag must match {_TAG.pattern}, got {owner_tag!r}")
        self.capacity = _round_up(capacity_bytes, mmap.PAGESIZE)
        st = os.statvfs(SHM_DIR)
        if self.capacity > st.f_bavail * st.f_frsize:
            raise _no_room(self.capacity, st.f_bavail * st.f_frsize)
        self.name = f"epdq-{os.getuid()}-{owner_tag}-{os.getpid()}-{secrets.token_hex(8)}"
        self._path = os.path.join(SHM_DIR, self.name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self._path, flags, 0o600)
        try:
            os.fchmod(self._fd, 0o600)  # umask can only remove bits, but be explicit
            # Held for our lifetime: cleanup_stale_segments never unlinks a live ring.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(self._fd, self.capacity)
            # Reserve tmpfs pages now: a full /dev/shm fails here, not as SIGBUS mid-write.
            try:
                os.posix_fallocate(self._fd, 0, self.capacity)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                st = os.statvfs(SHM_DIR)  # another process took the room since we looked
                raise _no_room(self.capacity, st.f_bavail * st.f_frsize) from None
            self._mm = mmap.mmap(self._fd, self.capacity)
            # Touch one byte per page so first writes don't page-fault.
            pages = torch.frombuffer(self._mm, dtype=torch.uint8).view(-1, mmap.PAGESIZE)
            pages[:, 0] = 0
            del pages
            # The mapping's address, for one plain memmove per write of a CPU tensor: the torch
            # path (frombuffer, view, no_grad, copy_) costs ~50 us more once caches are cold,
            # as they are when an encoder wakes up with a new embedding. Released in close().
            self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mm)
            self._base = ctypes.addressof(self._anchor)
        except BaseException:
            os.close(self._fd)
            os.unlink(self._path)
            raise
        self._finalizer = weakref.finalize(self, _unlink_segment, self._path, os.getpid())
        self._lock = threading.Lock()
        self._fence = threading.Lock()
        self._space = RingSpace(self.capacity)
        self._evicted: list[tuple[bytes, int]] = []
        self._next_gen = secrets.randbits(32) + 1  # a restarted encoder doesn't reuse generations
        self._closed = False

    @property
    def used_bytes(self) -> int:
        """Header + padded data of resident entries, pinned or not (unpinned ones are cache)."""
        return self._space.used_bytes

    @property
    def pinned_bytes(self) -> int:
        return self._space.pinned_bytes

    @property
    def entry_count(self) -> int:
        return len(self._space.order)

    def write(self, key: bytes, tensor: torch.Tensor) -> EntryLoc | None:
        """Copy `tensor` into the ring as a new pinned entry; None if every window is pinned."""
        with self._lock:
            e = self._entry_for(key, tensor.nbytes)
            if e is not None and not e.published:
                self._copy_in(e, tensor)
            return None if e is None else e.loc()

    def reserve(self, key: bytes, nbytes: int) -> EntryLoc | None:
        """Place a new pinned entry of `nbytes` without its bytes: its header says "being written"
        until `fill` copies them in, so its location can be announced first (readers wait for it).
        A key already resident is pinned and returned as it is (its `fill` then does nothing).
        None if every window is pinned."""
        with self._lock:
            e = self._entry_for(key, nbytes)
            return None if e is None else e.loc()

    def fill(self, key: bytes, generation: int, tensor: torch.Tensor) -> bool:
        """Copy `tensor` into the entry `reserve` made and publish it. False if that entry is no
        longer here (cleared by a re-registration, or failed): nothing is written then."""
        with self._lock:
            e = self._space.by_key.get(key)
            if e is None or e.generation != generation or self._closed:
                return False
            if e.published:
                return True  # a duplicate: the resident entry `reserve` returned
            if tensor.nbytes != e.nbytes:
                self._drop_unpublished(e)
                raise ValueError(f"entry {key.hex()} was reserved for {e.nbytes} bytes, not {tensor.nbytes}")
            self._copy_in(e, tensor, announced=True)
            return True

    def pin(self, key: bytes, generation: int) -> bool:
        with self._lock:
            e = self._space.by_key.get(key)
            if e is None or e.generation != generation:
                return False
            self._space.set_pinned(e, True)
            return True

    def unpin(self, key: bytes, generation: int) -> None:
        with self._lock:
            e = self._space.by_key.get(key)
            if e is not None and e.generation == generation:
                self._space.set_pinned(e, False)

    def lookup(self, key: bytes) -> EntryLoc | None:
        with self._lock:
            e = self._space.by_key.get(key)
            return None if e is None else e.loc()

    def drain_evicted(self) -> list[tuple[bytes, int]]:
        with self._lock:
            out, self._evicted = self._evicted, []
            return out

    def evict_unpinned(self) -> int:
        """Drop every unpinned entry now (reported by drain_evicted); returns how many."""
        with self._lock:
            victims = list(self._space.lru.values())
            for e in victims:
                self._evict(e)
            return len(victims)

    def clear(self) -> int:
        """Drop every entry, pinned or not (the broker that pinned them is gone); not reported."""
        with self._lock:
            victims = list(self._space.order)
            for e in victims:
                if e.pinned:
                    self._space.set_pinned(e, False)
                self._evict(e, report=False)
            self._evicted.clear()
            return len(victims)

    def read_bytes(self, offset: int, nbytes: int, key: bytes, generation: int) -> bytes:
        """Copy an entry out for a fetch from another node; StaleEmbeddingError if it changed."""
        _check_key(key, ProtocolError)  # these come from another node's message
        with self._lock:
            self._check_open()
            e = self._space.by_key.get(key)
            if e is None or (e.start + HEADER_BYTES, e.nbytes, e.generation) != (offset, nbytes, generation):
                raise StaleEmbeddingError(f"entry {key.hex()}@{generation} is no longer resident")
            if not e.published:
                raise EntryPending(f"entry {key.hex()}@{generation} is still being written")
        data = self._mm[offset : offset + nbytes]
        if not _header_ok(self._mm, offset - HEADER_BYTES, key, generation, nbytes):
            raise StaleEmbeddingError(f"entry {key.hex()}@{generation} was overwritten while copied")
        return data

    def close(self, unlink: bool = True) -> None:
        """Unmap; with `unlink` also remove the segment and invalidate every entry, so readers
        that still map it see stale entries at once rather than at their next link check."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if unlink:
                for e in self._space.order:
                    _GEN.pack_into(self._mm, e.start + _GEN_AT, 0)
                self._finalizer()
            else:
                self._finalizer.detach()
            self._anchor = None  # its buffer export would keep the map from closing
            _close_map(self._mm)
            os.close(self._fd)

    def __enter__(self) -> RingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- called with the lock held -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"ring {self.name} is closed")

    def _evict(self, e: _Entry, *, report: bool = True) -> None:
        # Invalidate first so a reader mid-copy fails its after-copy check.
        _GEN.pack_into(self._mm, e.start + _GEN_AT, 0)
        self._space.remove(e)
        if report:
            self._evicted.append((e.key, e.generation))

    def _entry_for(self, key: bytes, nbytes: int) -> _Entry | None:
        """The entry of `key`, pinned: the resident one, or a new one claimed for `nbytes` (not
        written yet); None if every window is pinned."""
        # The encoder's hot path, run with the caches its vision forward left cold: few calls.
        if type(key) is not bytes or len(key) != KEY_BYTES:
            _check_key(key)
        span = HEADER_BYTES + -(-nbytes // ALIGN) * ALIGN  # entry_span, inlined
        if span > self.capacity or nbytes < 0:
            raise RingFullError(f"embedding of {nbytes} bytes does not fit a ring of {self.capacity}")
        if self._closed:
            self._check_open()
        space = self._space
        old = space.by_key.get(key)
        if old is not None:
            space.set_pinned(old, True)
            return old
        start = space.find_window(span)
        return None if start is None else self._claim(start, span, key, nbytes)

    def _claim(self, start: int, span: int, key: bytes, nbytes: int) -> _Entry:
        """Take the window at `start` for a new pinned entry: evict what it overlaps, record it."""
        space = self._space
        victims = space.overlapping(start, start + span)
        if victims:
            mm, evicted = self._mm, self._evicted
            for v in victims:
                # invalidate first, so that a reader mid-copy fails its after-copy check
                _GEN.pack_into(mm, v.start + _GEN_AT, 0)
                space.remove(v)
                evicted.append((v.key, v.generation))
            # the invalidations must be visible before any byte of the new data
            _full_fence(self._fence)
        gen = self._next_gen
        self._next_gen = gen + 1
        e = _Entry(key, gen, start, span, nbytes, False)
        space.add(e)
        # nobody has been told of this entry yet, so the header may be written in any order here
        _HDR.pack_into(self._mm, start, _PENDING, key, gen, nbytes)
        return e

    def _drop_unpublished(self, e: _Entry, announced: bool = True) -> None:
        # its location may have been announced: reported evicted, the broker has it encoded again
        self._space.set_pinned(e, False)
        self._evict(e, report=announced)

    def _copy_in(self, e: _Entry, tensor: torch.Tensor, *, announced: bool = False) -> None:
        """The bytes of a claimed entry, then its header (which publishes it)."""
        nbytes = e.nbytes
        try:
            if nbytes:
                offset = e.start + HEADER_BYTES
                if tensor.dtype in _PLAIN_DTYPES and tensor.is_cpu and tensor.is_contiguous():
                    ctypes.memmove(self._base + offset, tensor.data_ptr(), nbytes)
                else:
                    view = torch.frombuffer(self._mm, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
                    with torch.no_grad():
                        view.view(tensor.shape).copy_(tensor)
                    del view
        except BaseException:
            self._drop_unpublished(e, announced)  # never published
            raise
        # After the data: glibc's large copies end with a store fence (their non-temporal stores
        # are weakly ordered), and x86 keeps ordinary stores in order. Only the magic changes, in
        # one aligned 8-byte store: a reader spinning on the header (wait_published) sees the
        # header before or after it, never in between (struct's pack_into clears the fields
        # before it writes them).
        self._mm[e.start : e.start + len(_MAGIC)] = _MAGIC
        e.published = True

    def _place(self, start: int, span: int, key: bytes, tensor: torch.Tensor, nbytes: int) -> EntryLoc:
        """Claim the window at `start` and write the entry (tests place entries where they want)."""
        e = self._claim(start, span, key, nbytes)
        self._copy_in(e, tensor)
        return e.loc()


@dataclass(slots=True)
class _Attached:
    fd: int
    mm: mmap.mmap
    size: int
    linked_at: float  # monotonic time the segment was last seen linked
    flat: dict[torch.dtype, torch.Tensor]  # the whole segment as one tensor per dtype read

    def tensor(self, dtype: torch.dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of `shape` at byte `offset`: one as_strided over a cached flat tensor (a fresh
        frombuffer + view costs twice as much with cold caches)."""
        flat = self.flat.get(dtype)
        if flat is None:
            # through a memoryview: torch.frombuffer keeps a reference to the object it is given
            # but not a buffer export, so over the bare mmap a close() would unmap the pages under
            # live views (a segfault in whoever copies from one). The memoryview's export lives
            # as long as any view does, and close() is refused (BufferError) until then.
            flat = self.flat[dtype] = torch.frombuffer(memoryview(self.mm), dtype=dtype)
        if len(shape) == 2:  # [rows, hidden]: every embedding the engines produce
            strides: Sequence[int] = (shape[1], 1)
        else:
            strides, step = [], 1
            for d in reversed(shape):
                strides.append(step)
                step *= d
            strides.reverse()
        return flat.as_strided(shape, strides, offset // dtype.itemsize)

    def release(self) -> None:
        self.flat.clear()  # their buffer export would keep the map from closing
        _close_map(self.mm)
        os.close(self.fd)


class RingReader:
    """A PD worker's view of the rings on its node; mappings are cached per segment name."""

    def __init__(self, *, uid: int | None = None, max_segments: int = 64):
        if max_segments < 1:
            raise ValueError("max_segments must be >= 1")
        self._pattern = _name_pattern(os.getuid() if uid is None else uid)
        self._uid = os.getuid() if uid is None else uid
        self._max = max_segments
        self._segments: OrderedDict[str, _Attached] = OrderedDict()
        self._lock = threading.Lock()

    def read(
        self,
        segment: str,
        offset: int,
        nbytes: int,
        key: bytes,
        generation: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Copy one entry into a fresh tensor (or `out`): one memcpy, checked before and after."""
        seg, _ = self._locate(segment, offset, nbytes, key, generation, dtype, shape)
        hdr = offset - HEADER_BYTES
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != tuple(shape) or out.device.type != "cpu":
            raise ValueError("out tensor does not match dtype/shape or is not on the CPU")
        if nbytes:
            _copy_tensor(out, seg.tensor(dtype, offset, shape))
        if not _header_ok(seg.mm, hdr, key, generation, nbytes):
            raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {segment} was overwritten")
        return out

    def view(
        self, segment: str, offset: int, nbytes: int, key: bytes, generation: int, dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> torch.Tensor:  # fmt: skip
        """A zero-copy tensor over one entry, checked now. Its bytes are trustworthy only once
        `check()` passes AFTER the consumer has copied them (the broker's pin normally keeps the
        entry in place; the check catches the case where it did not). EntryPending if the entry
        is announced but its bytes are not in yet (see `view_early`)."""
        seg, _ = self._locate(segment, offset, nbytes, key, generation, dtype, shape)
        return seg.tensor(dtype, offset, shape)

    def view_early(
        self, segment: str, offset: int, nbytes: int, key: bytes, generation: int, dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> tuple[torch.Tensor, bool]:  # fmt: skip
        """`view`, also of an entry whose bytes are still being copied in: (view, published). An
        unpublished view must not be read before `spin` or `wait_published` says the bytes are in;
        making it first takes the reader's own work out of the wait."""
        seg, published = self._locate(segment, offset, nbytes, key, generation, dtype, shape, pending_ok=True)
        return seg.tensor(dtype, offset, shape), published

    def check(self, segment: str, offset: int, nbytes: int, key: bytes, generation: int) -> None:
        """StaleEmbeddingError unless the entry still holds (key, generation)."""
        # Right after a view/read of the same entry: the header decides. (A segment unlinked in
        # between still maps intact bytes; the next view/read notices the unlink and lets go.)
        seg = self._segments.get(segment) if type(segment) is str else None
        if seg is None:
            seg = self._attach(segment)
        if offset < HEADER_BYTES or offset + nbytes > seg.size or not _header_ok(
            seg.mm, offset - HEADER_BYTES, key, generation, nbytes
        ):
            self._stale(segment, seg)
            raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {segment} was overwritten")

    def _locate(
        self, segment: str, offset: int, nbytes: int, key: bytes, generation: int, dtype: torch.dtype,
        shape: tuple[int, ...], *, pending_ok: bool = False,
    ) -> tuple[_Attached, bool]:  # fmt: skip
        """The segment of a valid reference, and whether the entry is published (with `pending_ok`
        False an unpublished one raises EntryPending)."""
        _check_key(key, ProtocolError)
        n = dtype.itemsize
        for d in shape:
            if type(d) is not int or d < 0:
                raise ProtocolError(f"shape {shape} of {dtype} does not hold {nbytes} bytes")
            n *= d
        if n != nbytes:
            raise ProtocolError(f"shape {shape} of {dtype} does not hold {nbytes} bytes")
        if not 0 < generation < 2**64:
            raise ProtocolError(f"bad generation {generation}")
        seg = self._attach(segment)
        if offset % ALIGN or offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > seg.size:
            raise ProtocolError(f"entry [{offset}, +{nbytes}) is outside segment {segment}")
        # one read: the encoder may publish the entry between two, which then match neither
        h = _HDR.unpack_from(seg.mm, offset - HEADER_BYTES)
        if h == (_MAGIC, key, generation, nbytes):
            return seg, True
        if h == (_PENDING, key, generation, nbytes):
            if pending_ok:
                return seg, False
            raise EntryPending(f"entry {key.hex()}@{generation} in {segment} is still being written")
        self._stale(segment, seg)
        raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {segment} is gone")

    def spin(self, segment: str, offset: int, nbytes: int, key: bytes, generation: int, seconds: float) -> bool:
        """Busy-wait up to `seconds` for an announced entry's bytes (see `RingWriter.reserve`): True
        once its header is the real one, False if it is still being written, StaleEmbeddingError if
        it is neither (replaced, or never announced). Only for a moment: it holds the caller's thread."""
        seg = self._attach(segment)
        hdr = offset - HEADER_BYTES
        if type(offset) is not int or offset % ALIGN or hdr < 0 or offset + nbytes > seg.size:
            raise ProtocolError(f"entry [{offset}, +{nbytes}) is outside segment {segment}")
        mm, unpack = seg.mm, _HDR.unpack_from
        final, pending = (_MAGIC, key, generation, nbytes), (_PENDING, key, generation, nbytes)
        end = time.perf_counter() + seconds
        while True:
            h = unpack(mm, hdr)
            if h == final:
                return True
            if h != pending:
                self._stale(segment, seg)
                raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {segment} is gone")
            if time.perf_counter() >= end:
                return False

    async def wait_published(
        self, segment: str, offset: int, nbytes: int, key: bytes, generation: int, *,
        timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> None:  # fmt: skip
        """Wait (without holding the event loop for more than a moment) until an announced entry's
        bytes are in. StaleEmbeddingError if it is replaced, or not published within `timeout_s`:
        its encoder died or stalled mid-copy, and the broker has the image encoded again."""
        if self.spin(segment, offset, nbytes, key, generation, SPIN_S):
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + timeout_s
        eager = start + min(timeout_s, spin_budget(nbytes))
        while loop.time() < eager:
            # a header read per turn of the loop: found within a turn of the copy's end, where a
            # timer (milliseconds here) would find it up to a millisecond late
            await asyncio.sleep(0)
            if self.spin(segment, offset, nbytes, key, generation, 0.0):
                return
        polls = 0
        while loop.time() < end:
            await asyncio.sleep(POLL_S)
            if self.spin(segment, offset, nbytes, key, generation, 0.0):
                return
            polls += 1
            seg = self._segments.get(segment)
            if polls % LIVENESS_POLLS == 0 and seg is not None and not _writer_alive(seg.fd):
                self.forget(segment)
                raise StaleEmbeddingError(f"the encoder of ring segment {segment} died while it wrote an entry")
        raise StaleEmbeddingError(
            f"entry {key.hex()}@{generation} in {segment} was announced but not written within {timeout_s:g} s"
        )

    def _stale(self, segment: str, seg: _Attached) -> None:
        # A missing entry may mean its encoder is gone: look at the link now, not in a second.
        if not os.fstat(seg.fd).st_nlink:
            self.forget(segment)
            raise StaleEmbeddingError(f"ring segment {segment} was removed")

    def release_unlinked(self) -> list[str]:
        """Unmap the segments whose encoder has left (file unlinked); returns their names. Those
        no request names again were otherwise kept mapped (their pages alive) until 64 others had
        pushed them out: every encoder restart held a ring's worth of memory in each PD worker."""
        with self._lock:
            attached = list(self._segments.items())
        gone = [name for name, seg in attached if not os.fstat(seg.fd).st_nlink]
        for name in gone:
            self.forget(name)
        return gone

    def forget(self, segment: str) -> None:
        with self._lock:
            seg = self._segments.pop(segment, None)
        if seg is not None:
            seg.release()

    def close(self) -> None:
        with self._lock:
            segs, self._segments = list(self._segments.values()), OrderedDict()
        for seg in segs:
            seg.release()

    def _attach(self, segment: str) -> _Attached:
        if type(segment) is not str:
            raise ProtocolError(f"not an epdq ring segment of uid {self._uid}: {segment!r:.80}")
        with self._lock:
            seg = self._segments.get(segment)  # only names that passed the pattern are cached
            if seg is not None:
                self._segments.move_to_end(segment)
        if seg is None and not self._pattern.fullmatch(segment):
            raise ProtocolError(f"not an epdq ring segment of uid {self._uid}: {segment!r:.80}")
        if seg is not None:
            now = time.monotonic()
            if now - seg.linked_at < RELINK_CHECK_S:
                return seg
            if os.fstat(seg.fd).st_nlink:
                seg.linked_at = now
                return seg
            self.forget(segment)  # unlinked: its encoder is gone; don't keep its pages alive
            raise StaleEmbeddingError(f"ring segment {segment} was removed")
        try:
            # Read-write because torch cannot view a read-only buffer without a warning; this
            # reader never writes through it.
            fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StaleEmbeddingError(f"ring segment {segment} does not exist") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self._uid or st.st_mode & 0o077:
                raise ProtocolError(f"ring segment {segment} is not a private file of uid {self._uid}")
            if st.st_size < MIN_CAPACITY or st.st_size % mmap.PAGESIZE:
                raise ProtocolError(f"ring segment {segment} has a bad size {st.st_size}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, st.st_size, flags=flags)
        except BaseException:
            os.close(fd)
            raise
        seg = _Attached(fd, mm, st.st_size, time.monotonic(), {})
        with self._lock:
            self._segments[segment] = seg
            while len(self._segments) > self._max:
                _, old = self._segments.popitem(last=False)
                old.release()
        return seg


def _writer_alive(fd: int) -> bool:
    """Whether the segment's writer still holds the lock it takes for life (see RingWriter)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell: the timeout decides
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def spin_budget(nbytes: int) -> float:
    """How long a reader looks for an announced entry of `nbytes` at every turn of its event loop
    before it polls on a timer: about as long as the encoder's copy can take, bounded."""
    return min(MAX_EAGER_S, max(SPIN_S, nbytes / COPY_BYTES_PER_S))


def cleanup_stale_segments(uid: int | None = None) -> list[str]:
    """Unlink this uid's ring segments whose creator is dead; returns the names removed.

    A live pid is taken as alive even if reused; a dead pid is confirmed by taking the segment's
    flock, which its writer holds for life (pids from another pid namespace look dead)."""
    uid = os.getuid() if uid is None else uid
    pattern = _name_pattern(uid)
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != uid:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue  # locked by a live writer, or already gone
        finally:
            os.close(fd)
    return removed
