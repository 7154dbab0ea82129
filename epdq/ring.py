"""POSIX shared-memory embedding ring: one per encoder process, read by PD workers on the node
(`epdq.ring_reader`). This module is the writing side, the layout both share and the sweep of
segments whose encoder died.

Layout: entries are `[64-byte header][data, padded to 64 B]`, placed anywhere in the segment at
64-byte offsets. The header is (magic, key, generation, nbytes, fill mark); readers trust bytes
only while that header still names the entry they were told about, checked before AND after their
copy.

Overwrite protocol (a seqlock without a counter): the writer first sets the generation of every
old entry that the new entry's window touches to 0, then writes the data, then the new header.
An entry can be announced before its bytes are in (`reserve`, then `fill`): its header then
carries the "being written" magic, and a reader that finds it waits for the real one
(`ring_reader.RingReader.wait_published`) instead of taking the entry as stale. The encoder announces that
way, so its completion event travels to the broker and on to a PD worker while it copies.
While it copies, the header's fill mark (8 bytes at offset 40, zero at reserve) says how many
leading bytes are in, advanced after each chunk of the copy: a reader that copies the entry out
follows it (`RingReader.read_as_filled`), so its copy runs beside the writer's instead of after
it (on x86 the mark's store comes after the chunk's, as the magic's does after the whole copy).
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

import ctypes
import errno
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref

import torch

from epdq.errors import ConfigError, EntryPending, ProtocolError, RingFullError, StaleEmbeddingError
from epdq.protocol import fetch_chunks
from epdq.ring_space import ALIGN, HEADER_BYTES, EntryLoc, RingSpace, _Entry

SHM_DIR = "/dev/shm"
KEY_BYTES = 16
MIN_CAPACITY = 1 << 20
MAX_CAPACITY = 64 << 30
_MAGIC = b"EPDQRNG1"
_PENDING = b"EPDQRNGW"  # an entry placed and announced, its bytes still being copied in (reserve -> fill)
_HDR = struct.Struct("<8s16sQQ")  # magic, key, generation, nbytes; then the fill mark; rest of the 64 B zero
_GEN = struct.Struct("<Q")
_GEN_AT = 24  # offset of the generation inside the header
_FILLED_AT = 40  # offset of the fill mark: bytes of an announced entry copied in so far
# Copies of announced entries larger than FILL_ONE_GO_BYTES advance the fill mark after every
# eighth of the entry (at most FILL_CHUNK_BYTES): two processes copying at once here run at ~1.1x
# one memcpy, not 2x (one core does not use all the memory bandwidth), so a reader copying out
# behind the writer ends about an eighth of a copy after it. Each chunk costs the writer's own
# copy a little (1 MiB chunks made a 32 MiB fill 2-5 % slower than one copy; eighths about half
# that). Smaller entries are copied in one go: a reader right behind the writer pulls freshly
# written lines out of the writer's cache, and at 1 MiB that made the two copies together no
# faster than one after the other.
FILL_ONE_GO_BYTES = 2 << 20
FILL_CHUNK_BYTES = 4 << 20
_TAG = re.compile(r"[A-Za-z0-9_]{1,32}")
NEW_FILE_GRACE_S = 60.0  # a segment not yet named is a dead writer's once this old (cleanup_stale_segments)
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


def entry_seal(key: bytes, generation: int, nbytes: int) -> bytes:
    """The header of a published entry, as a remote fetch's answer ends with it (`fetch_frames`)."""
    return _HDR.pack(_MAGIC, key, generation, nbytes)


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


def _copy_chunk(dst: int, src: int, n: int) -> None:
    # Module-level so tests can run a reader between two chunks of a fill.
    ctypes.memmove(dst, src, n)


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
        # Made and locked under a name the sweep does not match, then renamed into place: the
        # sweep takes any unlocked segment for a dead writer's, so it must never see ours unlocked.
        made = f"{self._path}.new"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(made, flags, 0o600)
        try:
            os.fchmod(self._fd, 0o600)  # umask can only remove bits, but be explicit
            # Held for our lifetime: cleanup_stale_segments never unlinks a live ring.
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(made, self._path)
            made = self._path
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
            os.unlink(made)
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

    def fetch_frames(self, offset: int, nbytes: int, key: bytes, generation: int) -> list[memoryview]:
        """An entry for a fetch from another node, as the payload of its answer, copied nowhere:
        views of the ring in the frames of `protocol.fetch_chunks`, then a view of the entry's
        header, its seal. ZeroMQ reads them later, on its I/O thread, in that order, so the seal it
        sends was read after the bytes: the fetcher takes the bytes only if the seal is still
        `entry_seal(key, generation, nbytes)`, the reader's after-copy check (see the module
        docstring) done at the other end. StaleEmbeddingError if the entry is not resident now.

        The views keep the mapping alive (`close` leaves it to them), never the entry: a fetch
        pins nothing, and an entry overwritten while queued goes out with a broken seal."""
        _check_key(key, ProtocolError)  # these come from another node's message
        with self._lock:
            self._check_open()
            e = self._space.by_key.get(key)
            if e is None or (e.start + HEADER_BYTES, e.nbytes, e.generation) != (offset, nbytes, generation):
                raise StaleEmbeddingError(f"entry {key.hex()}@{generation} is no longer resident")
            if not e.published:
                raise EntryPending(f"entry {key.hex()}@{generation} is still being written")
            whole = memoryview(self._mm)
        frames = [whole[offset + start : offset + start + size] for start, size in fetch_chunks(nbytes)]
        hdr = offset - HEADER_BYTES
        frames.append(whole[hdr : hdr + _HDR.size])
        return frames

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
        # nobody has been told of this entry yet, so the header may be written in any order here;
        # the fill mark's bytes held an older entry's data
        _HDR.pack_into(self._mm, start, _PENDING, key, gen, nbytes)
        _GEN.pack_into(self._mm, start + _FILLED_AT, 0)
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
                    dst, src = self._base + offset, tensor.data_ptr()
                    if not announced or nbytes <= FILL_ONE_GO_BYTES:
                        ctypes.memmove(dst, src, nbytes)
                    else:  # a reader may be copying it out already: say how far we are
                        mm, mark, done = self._mm, e.start + _FILLED_AT, 0
                        chunk = min(FILL_CHUNK_BYTES, max(ALIGN, nbytes // 8 // ALIGN * ALIGN))
                        while done < nbytes:
                            n = min(chunk, nbytes - done)
                            _copy_chunk(dst + done, src + done, n)
                            done += n
                            _GEN.pack_into(mm, mark, done)
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


def cleanup_stale_segments(uid: int | None = None) -> list[str]:
    """Unlink this uid's ring segments whose writer is gone; returns the names removed.

    The flock a writer holds for life is the test, whatever pid the name carries: a restarted
    container's encoder often gets the pid of the one that died (1, in a fresh pid namespace)
    while /dev/shm outlives it, and pids from another pid namespace look dead from here. A
    writer locks its segment before the segment takes its name (see RingWriter).

    A NAME.new file is one a writer died with between creating and naming it: empty, but one
    more file per crash. It is unlocked for a moment in a live writer too (between its creation
    and its lock), so it is taken only once NEW_FILE_GRACE_S old."""
    uid = os.getuid() if uid is None else uid
    pattern = _name_pattern(uid)
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        unnamed = name.endswith(".new")
        if pattern.fullmatch(name[:-4] if unnamed else name) is None:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != uid or (unnamed and time.time() - st.st_mtime < NEW_FILE_GRACE_S):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue  # locked by a live writer (or a reader's brief liveness check), or already gone
        finally:
            os.close(fd)
    return removed
