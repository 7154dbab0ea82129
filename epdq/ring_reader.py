"""The reading side of the shared-memory ring (`epdq.ring`): a PD worker's view of the rings on
its node.

A reader maps each encoder's segment once (cached per name, at most `max_segments`), checks every
reference it is given against the entry's header, and trusts bytes only while that header still
names the entry: before and after the copy (`read`), or after the consumer's own copy (`view`, then
`check`). An entry announced before its bytes are in is waited for (`spin`, `wait_published`)
rather than taken as stale, or copied out as its writer's fill mark advances (`read_as_filled`).
Nothing a message names is trusted: segment names must match this user's pattern, offsets and
shapes must fit the segment, and the file must be a private one of this uid.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from epdq.errors import EntryPending, ProtocolError, StaleEmbeddingError
from epdq.ring import (
    _FILLED_AT,
    _GEN,
    _HDR,
    _MAGIC,
    _PENDING,
    MIN_CAPACITY,
    SHM_DIR,
    _check_key,
    _close_map,
    _header_ok,
    _name_pattern,
)
from epdq.ring_space import ALIGN, HEADER_BYTES

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

def _copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Module-level so tests can interleave a concurrent overwrite with the copy.
    dst.copy_(src)



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
        await self._wait(
            segment, key, generation, nbytes, timeout_s,
            lambda: self.spin(segment, offset, nbytes, key, generation, 0.0),
        )  # fmt: skip

    async def read_as_filled(
        self, segment: str, offset: int, nbytes: int, key: bytes, generation: int, dtype: torch.dtype,
        shape: tuple[int, ...], *, out: torch.Tensor | None = None, timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> torch.Tensor:  # fmt: skip
        """`read`, also of an entry whose bytes are still being copied in: its leading bytes are
        copied out as the writer's fill mark passes them, so the two copies run side by side
        rather than one after the other. Checked after the last byte as `read` is; waits and
        fails as `wait_published` does."""
        seg, published = self._locate(segment, offset, nbytes, key, generation, dtype, shape, pending_ok=True)
        if published:
            return self.read(segment, offset, nbytes, key, generation, dtype, shape, out=out)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or tuple(out.shape) != tuple(shape) or out.device.type != "cpu":
            raise ValueError("out tensor does not match dtype/shape or is not on the CPU")
        if not out.is_contiguous():
            await self.wait_published(segment, offset, nbytes, key, generation, timeout_s=timeout_s)
            return self.read(segment, offset, nbytes, key, generation, dtype, shape, out=out)
        src = seg.tensor(torch.uint8, offset, (nbytes,))
        dst = out.view(-1).view(torch.uint8) if nbytes else out
        hdr = offset - HEADER_BYTES
        mm, unpack = seg.mm, _HDR.unpack_from
        final, pending = (_MAGIC, key, generation, nbytes), (_PENDING, key, generation, nbytes)
        done = 0

        def step() -> bool:
            """Copy what has come in since the last look; True once the entry is published and
            all of it copied."""
            nonlocal done
            h = unpack(mm, hdr)
            if h == final:
                filled = nbytes
            elif h == pending:
                # the writer's own word, still bounded: a mark past the entry is not believed
                filled = min(_GEN.unpack_from(mm, hdr + _FILLED_AT)[0], nbytes)
            else:
                # `seg` may have been let go meanwhile (its encoder left: release_unlinked), its fd
                # closed; the mapping this copy holds stays readable
                if self._segments.get(segment) is seg:
                    self._stale(segment, seg)
                raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {segment} is gone")
            if filled > done:
                _copy_tensor(dst[done:filled], src[done:filled])
                done = filled
            return h == final

        end = time.perf_counter() + SPIN_S
        while not step():
            if time.perf_counter() >= end:
                await self._wait(segment, key, generation, nbytes, timeout_s, step)
                break
        # as `read`: bytes copied while the header named the entry, and it still does after them
        if not _header_ok(mm, hdr, key, generation, nbytes):
            raise StaleEmbeddingError(f"entry {key.hex()}@{generation} in {segment} was overwritten")
        return out

    async def _wait(
        self, segment: str, key: bytes, generation: int, nbytes: int, timeout_s: float,
        look: Callable[[], bool],
    ) -> None:  # fmt: skip
        """Call `look` until it says done: at every turn of the event loop for about as long as
        the encoder's copy can take, then every POLL_S (looking whether the writer still lives)
        until `timeout_s`."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + timeout_s
        eager = start + min(timeout_s, spin_budget(nbytes))
        while loop.time() < eager:
            # a look per turn of the loop: found within a turn of the copy's end, where a
            # timer (milliseconds here) would find it up to a millisecond late
            await asyncio.sleep(0)
            if look():
                return
        polls = 0
        while loop.time() < end:
            await asyncio.sleep(POLL_S)
            if look():
                return
            polls += 1
            if polls % LIVENESS_POLLS == 0:
                # let go of already (its file unlinked): looked up again, which says it is gone
                seg = self._segments.get(segment) or self._attach(segment)
                if not _writer_alive(seg.fd):
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
