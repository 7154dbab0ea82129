"""Unit tests of the shared-memory embedding ring (one process; see tests/integration for two)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import math
import os
import secrets
import stat
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from epdq import ring as ring_mod
from epdq import ring_reader, ring_space
from epdq.errors import ConfigError, EntryPending, ProtocolError, RingFullError, StaleEmbeddingError
from epdq.protocol import fetch_chunks
from epdq.ring import ALIGN, HEADER_BYTES, MIN_CAPACITY, SHM_DIR, EntryLoc, RingWriter, entry_seal
from epdq.ring_reader import RingReader
from epdq.transport import pid_alive

MIB = 1 << 20


def key(n: int | None = None) -> bytes:
    return secrets.token_bytes(16) if n is None else n.to_bytes(16, "little")


def span_of(nbytes: int) -> int:
    return HEADER_BYTES + -(-nbytes // ALIGN) * ALIGN


def f32(nbytes: int, fill: float = 1.0) -> torch.Tensor:
    return torch.full((nbytes // 4,), fill, dtype=torch.float32)


@pytest.fixture
def writer():
    w = RingWriter(MIN_CAPACITY, owner_tag="test")
    yield w
    w.close()


@pytest.fixture
def reader():
    r = RingReader()
    yield r
    r.close()


def read(r: RingReader, w: RingWriter, k: bytes, loc: EntryLoc, t: torch.Tensor) -> torch.Tensor:
    return r.read(w.name, loc.offset, loc.nbytes, k, loc.generation, t.dtype, tuple(t.shape))


# -- creation -------------------------------------------------------------------------------------


def test_segment_is_private_named_and_page_rounded():
    w = RingWriter(MIN_CAPACITY + 1, owner_tag="enc0")
    try:
        st_ = os.stat(os.path.join(SHM_DIR, w.name))
        assert stat.S_IMODE(st_.st_mode) == 0o600
        assert st_.st_uid == os.getuid()
        assert w.capacity == st_.st_size == MIN_CAPACITY + os.sysconf("SC_PAGE_SIZE")
        prefix = f"epdq-{os.getuid()}-enc0-{os.getpid()}-"
        assert w.name.startswith(prefix) and len(w.name) == len(prefix) + 16
    finally:
        w.close()


@pytest.mark.parametrize("cap", [0, MIN_CAPACITY - 1, (64 << 30) + 1, 1.5 * MIB])
def test_capacity_validated(cap):
    with pytest.raises(ValueError):
        RingWriter(cap)


def _my_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"epdq-{os.getuid()}-") and f"-{os.getpid()}-" in n}


def test_a_ring_larger_than_free_shared_memory_is_a_config_error(monkeypatch):
    """Not a SIGBUS later, not an OSError: one clear line naming the fix (Docker gives
    containers 64 MiB of /dev/shm unless told otherwise)."""
    real = os.statvfs(SHM_DIR)
    before = _my_segments()

    class Small:
        f_bavail, f_frsize = 8 * MIB // real.f_frsize, real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda _path: Small)
    with pytest.raises(ConfigError, match=r"a ring of 16 MiB does not fit in /dev/shm \(8 MiB free\).*--shm-size"):
        RingWriter(16 * MIB)
    monkeypatch.undo()

    def full(fd, offset, length):  # room when we looked, none when we took it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="does not fit in /dev/shm"):
        RingWriter(MIN_CAPACITY)
    assert _my_segments() == before  # nothing left behind


@pytest.mark.parametrize("tag", ["", "a-b", "../x", "x" * 33, "é"])
def test_owner_tag_validated(tag):
    with pytest.raises(ValueError):
        RingWriter(MIN_CAPACITY, owner_tag=tag)


def test_close_unlinks_and_is_idempotent():
    w = RingWriter(MIN_CAPACITY)
    path = os.path.join(SHM_DIR, w.name)
    assert os.path.exists(path)
    w.close()
    w.close()
    assert not os.path.exists(path)
    with pytest.raises(ValueError):
        w.write(key(), f32(64))


def test_close_without_unlink_keeps_segment():
    w = RingWriter(MIN_CAPACITY)
    path = os.path.join(SHM_DIR, w.name)
    w.close(unlink=False)
    try:
        assert os.path.exists(path)
    finally:
        os.unlink(path)


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(writer, reader, dtype):
    t = torch.randn(37, 96).to(dtype)
    k = key()
    loc = writer.write(k, t)
    assert loc is not None and loc.offset % ALIGN == 0 and loc.nbytes == t.numel() * t.element_size()
    out = read(reader, writer, k, loc, t)
    assert out.dtype == dtype and torch.equal(out, t)
    out[:] = 0  # a fresh tensor, not a view of the ring
    assert torch.equal(read(reader, writer, k, loc, t), t)
    assert writer.lookup(k) == loc


def test_non_contiguous_source_and_out_tensor(writer, reader):
    t = torch.randn(64, 48).t()
    k = key()
    loc = writer.write(k, t)
    out = torch.empty(48, 64)
    got = reader.read(
        writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (48, 64), out=out
    )
    assert got is out and torch.equal(out, t)
    with pytest.raises(ValueError):
        reader.read(
            writer.name,
            loc.offset,
            loc.nbytes,
            k,
            loc.generation,
            torch.float32,
            (48, 64),
            out=torch.empty(48, 64, dtype=torch.float16),
        )


def test_fetch_frames_are_the_entry_in_place_then_its_seal(writer):
    t = torch.arange(1000, dtype=torch.float32)
    k = key()
    loc = writer.write(k, t)
    *data, seal = writer.fetch_frames(loc.offset, loc.nbytes, k, loc.generation)
    assert len(data) == 1 and data[0] == t.numpy().tobytes() and seal == entry_seal(k, loc.generation, loc.nbytes)
    assert isinstance(data[0], memoryview) and data[0].readonly is False  # the ring's bytes, not a copy
    with pytest.raises(StaleEmbeddingError):
        writer.fetch_frames(loc.offset, loc.nbytes, k, loc.generation + 1)
    for off, nb in ((0, loc.nbytes), (loc.offset + 1, loc.nbytes), (loc.offset, loc.nbytes + 4), (-64, 4)):
        with pytest.raises(StaleEmbeddingError):  # values from a remote message: never a crash
            writer.fetch_frames(off, nb, k, loc.generation)
    with pytest.raises(ProtocolError):
        writer.fetch_frames(loc.offset, loc.nbytes, b"short", loc.generation)
    # evicted before ZeroMQ got to it (its window free for new bytes): the seal, read after the
    # bytes, no longer matches
    writer.unpin(k, loc.generation)
    assert writer.evict_unpinned() == 1
    assert bytes(seal) != entry_seal(k, loc.generation, loc.nbytes)
    del data, seal


def test_a_large_entry_is_fetched_in_the_frames_of_its_answer():
    t = torch.arange((9 << 20) // 4 + 7, dtype=torch.float32)
    with RingWriter(16 << 20, owner_tag="chunks") as w:
        k = key()
        loc = w.write(k, t)
        *data, seal = w.fetch_frames(loc.offset, loc.nbytes, k, loc.generation)
        assert [len(c) for c in data] == [size for _, size in fetch_chunks(t.nbytes)] == [4 << 20, 4 << 20, (1 << 20) + 28]
        assert b"".join(data) == t.numpy().tobytes() and seal == entry_seal(k, loc.generation, loc.nbytes)
    # the ring closed while views of it were out (ZeroMQ still sending): the mapping stays theirs
    assert b"".join(data) == t.numpy().tobytes()
    del data, seal


def test_empty_tensor(writer, reader):
    t = torch.empty(0, 16)
    k = key()
    loc = writer.write(k, t)
    assert loc.nbytes == 0
    assert read(reader, writer, k, loc, t).shape == (0, 16)


def test_rewrite_of_resident_key_returns_existing_loc_and_pins(writer):
    k = key()
    loc = writer.write(k, f32(4096))
    writer.unpin(k, loc.generation)
    assert writer.pinned_bytes == 0
    assert writer.write(k, f32(4096, 2.0)) == loc
    assert writer.pinned_bytes == span_of(4096)


def test_too_big_raises_ring_full(writer):
    with pytest.raises(RingFullError):
        writer.write(key(), f32(writer.capacity))


def test_bad_key_rejected(writer):
    with pytest.raises(ValueError):
        writer.write(b"short", f32(64))


# -- pins and eviction ----------------------------------------------------------------------------


def fill_exactly(w: RingWriter, per: int) -> list[tuple[bytes, EntryLoc]]:
    """Entries of `per` data bytes whose spans tile the whole ring."""
    n = w.capacity // span_of(per)
    assert n * span_of(per) == w.capacity
    out = []
    for i in range(n):
        k = key(i)
        loc = w.write(k, f32(per, float(i)))
        assert loc is not None
        out.append((k, loc))
    return out


def ident(entry: tuple[bytes, EntryLoc]) -> tuple[bytes, int]:
    return entry[0], entry[1].generation


def test_pinned_entries_block_writes(writer):
    per = 64 * 1024 - HEADER_BYTES
    entries = fill_exactly(writer, per)
    assert writer.pinned_bytes == writer.used_bytes == writer.capacity
    assert writer.write(key(), f32(per)) is None
    assert writer.write(key(), f32(64)) is None
    assert writer.drain_evicted() == []
    k, loc = entries[5]
    writer.unpin(*ident(entries[5]))
    new = writer.write(key(), f32(per))
    assert new is not None and new.offset == loc.offset and new.generation > loc.generation
    assert writer.drain_evicted() == [(k, loc.generation)]
    assert writer.lookup(k) is None and not writer.pin(k, loc.generation)
    writer._space.check_invariants()


@pytest.mark.parametrize("lru_tries", [ring_space._LRU_TRIES, 0])  # 0: always the full scan
def test_eviction_is_least_recently_unpinned_first(writer, reader, monkeypatch, lru_tries):
    monkeypatch.setattr(ring_space, "_LRU_TRIES", lru_tries)
    per = 64 * 1024 - HEADER_BYTES
    entries = fill_exactly(writer, per)
    order = [3, 0, 7, 1, 2]
    for i in order:
        writer.unpin(*ident(entries[i]))
    assert writer.pin(*ident(entries[0]))  # in use again: no longer a candidate
    writer.unpin(*ident(entries[0]))  # ... and now the most recent
    expect = [3, 7, 1, 2, 0]
    for _ in expect:
        assert writer.write(key(), f32(per)) is not None
    assert writer.drain_evicted() == [ident(entries[i]) for i in expect]
    assert writer.write(key(), f32(per)) is None
    # Survivors still read back intact.
    k, loc = entries[4]
    assert torch.equal(read(reader, writer, k, loc, f32(per)), f32(per, 4.0))


def test_big_write_evicts_several_neighbours_never_pinned(writer):
    per = 64 * 1024 - HEADER_BYTES
    entries = fill_exactly(writer, per)
    for i in (4, 5, 6, 9):
        writer.unpin(*ident(entries[i]))
    loc = writer.write(key(), f32(3 * 64 * 1024 - HEADER_BYTES))
    assert loc is not None and loc.offset == entries[4][1].offset
    assert sorted(writer.drain_evicted()) == sorted(ident(entries[i]) for i in (4, 5, 6))
    writer._space.check_invariants()


def test_full_scan_finds_a_window_the_oldest_neighbourhoods_lack(writer):
    per = 64 * 1024 - HEADER_BYTES
    entries = fill_exactly(writer, per)
    for i in (0, 2, 4, 6, 8, 11, 12):  # the oldest are each boxed in by pinned neighbours
        writer.unpin(*ident(entries[i]))
    loc = writer.write(key(), f32(2 * 64 * 1024 - HEADER_BYTES))
    assert loc is not None and loc.offset == entries[11][1].offset
    assert sorted(writer.drain_evicted()) == sorted(ident(entries[i]) for i in (11, 12))
    assert writer.write(key(), f32(2 * 64 * 1024 - HEADER_BYTES)) is None
    writer._space.check_invariants()


@pytest.mark.parametrize("sizes", ["alike", "mixed"])
def test_the_placement_search_ends_early_only_where_it_would_choose_the_same(monkeypatch, sizes):
    """find_window stops at a window whose one victim is the least recently unpinned entry (when
    no window can be free): the same window the whole search picks, in any state a writer leaves."""
    import random

    rng = random.Random(11 if sizes == "alike" else 12)
    space = ring_space.RingSpace(64 * ALIGN * 100)
    placed, early_ends = 0, 0
    for n in range(4000):
        span = 64 * ALIGN if sizes == "alike" else ALIGN * rng.choice([16, 40, 64, 100, 300])
        monkeypatch.setattr(ring_space, "_EARLY_END", False)
        want = space.find_window(span)
        monkeypatch.setattr(ring_space, "_EARLY_END", True)
        got = space.find_window(span)
        assert got == want, (n, span)
        early_ends += want is not None and space.capacity - space.used_bytes < span
        if got is not None:
            for v in space.overlapping(got, got + span):
                space.remove(v)
            space.add(ring_space._Entry(b"%015d" % n + b"k", n, got, span, span - HEADER_BYTES))
            placed += 1
        for e in list(space.order):  # most entries unpinned soon, a few held a while
            if e.pinned and rng.random() < 0.7:
                space.set_pinned(e, False)
            elif not e.pinned and rng.random() < 0.05:
                space.set_pinned(e, True)  # a cache hit pins it again
        space.check_invariants()
    # the case it is for was exercised (mixed sizes leave free bytes enough more often)
    assert placed > 3000 and early_ends > (1000 if sizes == "alike" else 5)


def test_pin_unpin_with_wrong_generation(writer):
    k = key()
    loc = writer.write(k, f32(256))
    writer.unpin(k, loc.generation + 1)  # ignored
    assert writer.pinned_bytes == span_of(256)
    assert not writer.pin(k, loc.generation + 1)
    assert not writer.pin(key(), loc.generation)
    writer.unpin(k, loc.generation)
    assert writer.pin(k, loc.generation)


def test_no_leak_over_10000_cycles(reader):
    # <= 5 pinned entries of <= 16 KiB always leave a free gap big enough somewhere.
    writer = RingWriter(MIN_CAPACITY)
    try:
        _cycles(writer, reader)
    finally:
        writer.close()


def _cycles(writer: RingWriter, reader: RingReader) -> None:
    rng = np.random.default_rng(0)
    held: list[tuple[bytes, EntryLoc]] = []
    evicted = 0
    for i in range(10_000):
        nbytes = int(rng.integers(1, 4096)) * 4
        k = key(i)
        loc = writer.write(k, f32(nbytes, float(i % 1000)))
        assert loc is not None, f"write {i} found no space"
        held.append((k, loc))
        if len(held) > 4 or rng.random() < 0.5:  # a few requests in flight at a time
            writer.unpin(*ident(held.pop(int(rng.integers(len(held))))))
        evicted += len(writer.drain_evicted())
        if i % 997 == 0:
            writer._space.check_invariants()
            assert torch.equal(read(reader, writer, k, loc, f32(nbytes)), f32(nbytes, float(i % 1000)))
    for k, loc in held:
        writer.unpin(k, loc.generation)
    assert writer.pinned_bytes == 0 and writer.used_bytes <= writer.capacity
    resident = writer.entry_count
    assert writer.evict_unpinned() == resident
    evicted += len(writer.drain_evicted())
    assert writer.used_bytes == writer.pinned_bytes == 0 and writer.entry_count == 0
    assert evicted == 10_000
    assert len(writer._space.by_key) == len(writer._space.lru) == len(writer._space.starts) == 0


# -- staleness ------------------------------------------------------------------------------------


def test_reader_detects_full_overwrite(writer, reader):
    per = 64 * 1024 - HEADER_BYTES
    entries = fill_exactly(writer, per)
    k, loc = entries[2]
    writer.unpin(k, loc.generation)
    assert writer.write(key(), f32(per, -1.0)) is not None
    with pytest.raises(StaleEmbeddingError):
        read(reader, writer, k, loc, f32(per))


def test_reader_detects_overwrite_of_data_only(writer, reader):
    nbytes = 256 * 1024
    k = key()
    loc = writer.write(k, f32(nbytes))
    writer.unpin(k, loc.generation)
    # Force a placement that starts inside the old entry's data, past its header.
    inner = loc.offset + 128 * 1024
    with writer._lock:
        writer._place(inner, span_of(4096), key(), f32(4096, 9.0), 4096)
    assert writer.drain_evicted() == [(k, loc.generation)]
    with pytest.raises(StaleEmbeddingError):
        read(reader, writer, k, loc, f32(nbytes))


@pytest.mark.parametrize("data_only", [False, True])
def test_reader_detects_overwrite_during_its_copy(writer, reader, monkeypatch, data_only):
    nbytes = 256 * 1024
    k = key()
    loc = writer.write(k, f32(nbytes))
    writer.unpin(k, loc.generation)
    real_copy = ring_reader._copy_tensor

    def racing_copy(dst, src):
        real_copy(dst[: len(dst) // 2], src[: len(src) // 2])
        with writer._lock:  # the writer gets in halfway through
            start = loc.offset + (64 * 1024 if data_only else -HEADER_BYTES)
            writer._place(start, span_of(64 * 1024), key(), f32(64 * 1024, 7.0), 64 * 1024)
        real_copy(dst[len(dst) // 2 :], src[len(src) // 2 :])

    monkeypatch.setattr(ring_reader, "_copy_tensor", racing_copy)
    with pytest.raises(StaleEmbeddingError):
        read(reader, writer, k, loc, f32(nbytes))


def test_wrong_key_or_generation_is_stale(writer, reader):
    t = f32(1024)
    k = key()
    loc = writer.write(k, t)
    for bad_k, bad_gen in ((key(), loc.generation), (k, loc.generation + 1), (k, loc.generation - 1)):
        with pytest.raises(StaleEmbeddingError):
            reader.read(writer.name, loc.offset, loc.nbytes, bad_k, bad_gen, t.dtype, tuple(t.shape))


def test_unlinked_segment_is_stale_and_forgotten(reader):
    w = RingWriter(MIN_CAPACITY)
    t = f32(1024)
    k = key()
    loc = w.write(k, t)
    assert torch.equal(read(reader, w, k, loc, t), t)
    w.close()
    with pytest.raises(StaleEmbeddingError):
        read(reader, w, k, loc, t)
    assert w.name not in reader._segments
    with pytest.raises(StaleEmbeddingError):  # and a name that never existed
        read(reader, w, k, loc, t)


def test_segment_of_a_crashed_writer_is_let_go_at_the_next_link_check(reader, monkeypatch):
    # A killed encoder invalidates nothing; its segment is unlinked later by cleanup. The bytes a
    # reader still maps are intact, so they may be read until the next link check, which then
    # drops the mapping (the check is throttled: an fstat per read costs ~15 us with cold caches).
    w = RingWriter(MIN_CAPACITY)
    t = f32(4096, 3.0)
    k = key()
    loc = w.write(k, t)
    assert torch.equal(read(reader, w, k, loc, t), t)
    view = reader.view(w.name, loc.offset, loc.nbytes, k, loc.generation, t.dtype, tuple(t.shape))
    w.close(unlink=False)  # as after SIGKILL: nothing invalidated
    os.unlink(os.path.join(SHM_DIR, w.name))  # cleanup_stale_segments
    assert torch.equal(read(reader, w, k, loc, t), t)  # within RELINK_CHECK_S: intact bytes
    monkeypatch.setattr(ring_reader, "RELINK_CHECK_S", 0.0)
    with pytest.raises(StaleEmbeddingError, match="removed"):
        read(reader, w, k, loc, t)
    assert w.name not in reader._segments
    assert torch.equal(view, t)  # a view handed out earlier keeps its pages mapped


def test_views_are_exact_windows_of_the_entry(writer, reader):
    # views come from one cached flat tensor per dtype: shape, strides and bytes must be the entry's
    for dtype, shape in ((torch.bfloat16, (7, 48)), (torch.float32, (3, 5, 8)), (torch.float16, (0, 64))):
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(dtype)
        k = key()
        loc = writer.write(k, t)
        v = reader.view(writer.name, loc.offset, loc.nbytes, k, loc.generation, dtype, shape)
        assert v.shape == shape and v.is_contiguous() and v.dtype == dtype
        assert torch.equal(v, t)
        out = reader.read(writer.name, loc.offset, loc.nbytes, k, loc.generation, dtype, shape)
        assert torch.equal(out, t)


# -- announce first, copy after (reserve + fill) ---------------------------------------------------


def test_a_reserved_entry_is_pending_until_filled(writer, reader):
    t = torch.randn(40, 64)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    args = (writer.name, loc.offset, loc.nbytes, k, loc.generation)
    assert loc.nbytes == t.nbytes and writer.pinned_bytes == span_of(t.nbytes)
    with pytest.raises(EntryPending):
        reader.view(*args, torch.float32, (40, 64))
    with pytest.raises(EntryPending):
        reader.read(*args, torch.float32, (40, 64))
    with pytest.raises(EntryPending):  # nor does a remote fetch get the half-written bytes
        writer.fetch_frames(loc.offset, loc.nbytes, k, loc.generation)
    view, published = reader.view_early(*args, torch.float32, (40, 64))
    assert not published and not reader.spin(*args, 0.0)
    assert writer.fill(k, loc.generation, t)
    assert reader.spin(*args, 0.0)
    assert torch.equal(view, t) and torch.equal(read(reader, writer, k, loc, t), t)
    reader.check(*args)
    assert writer.fill(k, loc.generation, torch.zeros(40, 64))  # published already: nothing is copied again
    assert torch.equal(read(reader, writer, k, loc, t), t)


def test_reserving_a_resident_key_returns_its_entry(writer, reader):
    t = f32(4096, 3.0)
    k = key()
    loc = writer.write(k, t)
    writer.unpin(k, loc.generation)
    assert writer.reserve(k, t.nbytes) == loc and writer.pinned_bytes == span_of(4096)
    assert writer.fill(k, loc.generation, f32(4096, 9.0))
    assert torch.equal(read(reader, writer, k, loc, t), t)


def test_fill_of_an_entry_that_is_gone_writes_nothing(writer, reader):
    k = key()
    loc = writer.reserve(k, 4096)
    assert writer.clear() == 1  # a re-registration dropped it; its window may be someone else's now
    assert not writer.fill(k, loc.generation, f32(4096, 1.0))
    assert not any(writer._mm[loc.offset : loc.offset + 4096])  # not a byte written
    with pytest.raises(StaleEmbeddingError) as e:
        reader.view(writer.name, loc.offset, 4096, k, loc.generation, torch.float32, (1024,))
    assert not isinstance(e.value, EntryPending)


def test_a_fill_of_the_wrong_size_drops_the_entry_and_reports_it(writer, reader):
    k = key()
    loc = writer.reserve(k, 4096)
    with pytest.raises(ValueError, match="reserved for 4096"):
        writer.fill(k, loc.generation, f32(8192))
    assert writer.lookup(k) is None and writer.pinned_bytes == 0
    assert writer.drain_evicted() == [(k, loc.generation)]  # announced: the broker must hear it is gone
    with pytest.raises(StaleEmbeddingError) as e:
        reader.view(writer.name, loc.offset, 4096, k, loc.generation, torch.float32, (1024,))
    assert not isinstance(e.value, EntryPending)


async def test_a_reader_waits_for_bytes_still_being_copied_in(writer, reader):
    t = torch.randn(2048)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    args = (writer.name, loc.offset, loc.nbytes, k, loc.generation)
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, writer.fill, k, loc.generation, t)  # after the reader's busy-wait has ended
    t0 = loop.time()
    await asyncio.wait_for(reader.wait_published(*args), 5)
    assert loop.time() - t0 >= 0.015
    assert torch.equal(read(reader, writer, k, loc, t), t)


async def test_waiting_for_an_entry_that_never_comes_ends_stale(writer, reader):
    k = key()
    loc = writer.reserve(k, 4096)
    args = (writer.name, loc.offset, loc.nbytes, k, loc.generation)
    with pytest.raises(StaleEmbeddingError, match="not written within"):
        await asyncio.wait_for(reader.wait_published(*args, timeout_s=0.05), 5)
    writer._space.set_pinned(writer._space.by_key[k], False)
    assert writer.evict_unpinned() == 1  # now replaced: stale at once, not after a timeout
    writer.write(key(), f32(4096))
    with pytest.raises(StaleEmbeddingError, match="is gone"):
        await asyncio.wait_for(reader.wait_published(*args, timeout_s=30), 5)


async def test_waiting_ends_at_once_when_the_writer_died_mid_copy(writer, reader):
    k = key()
    loc = writer.reserve(k, 4096)
    args = (writer.name, loc.offset, loc.nbytes, k, loc.generation)
    assert not reader.spin(*args, 0.0)
    fcntl.flock(writer._fd, fcntl.LOCK_UN)  # what the kernel does when the encoder dies
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(StaleEmbeddingError, match="died"):
        await asyncio.wait_for(reader.wait_published(*args, timeout_s=30), 5)
    assert asyncio.get_running_loop().time() - t0 < 1.0


def test_an_entry_published_between_two_header_reads_is_not_taken_as_gone(writer, reader, monkeypatch):
    """The reader looked at the header twice (the real magic? then "being written"?): published in
    between, the entry matched neither and a good entry was reported gone (re-encoded)."""
    t = torch.randn(256)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    real = ring_reader._HDR

    class PublishAfterFirstRead:
        reads = 0

        def unpack_from(self, buf, offset=0):
            h = real.unpack_from(buf, offset)
            PublishAfterFirstRead.reads += 1
            if PublishAfterFirstRead.reads == 1:
                writer.fill(k, loc.generation, t)  # the encoder's copy ends right after this read
            return h

        def pack_into(self, *a):
            return real.pack_into(*a)

    monkeypatch.setattr(ring_reader, "_HDR", PublishAfterFirstRead())
    view, published = reader.view_early(writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (256,))
    monkeypatch.setattr(ring_reader, "_HDR", real)
    assert not published and reader.spin(writer.name, loc.offset, loc.nbytes, k, loc.generation, 0.0)
    assert torch.equal(view, t)


# -- copying out behind the writer (the fill mark) -------------------------------------------------

def mark_of(w: RingWriter, loc: EntryLoc) -> int:
    return int.from_bytes(w._mm[loc.offset - HEADER_BYTES + 40 : loc.offset - HEADER_BYTES + 48], "little")


def test_reserve_zeroes_the_fill_mark_over_old_bytes(writer):
    writer._mm[: 4 * ALIGN] = b"\xff" * (4 * ALIGN)  # an older entry's data where the header goes
    loc = writer.reserve(key(), 4096)
    assert loc.offset == HEADER_BYTES and mark_of(writer, loc) == 0


def test_a_fill_advances_the_mark_after_each_chunk(writer, monkeypatch):
    monkeypatch.setattr(ring_mod, "FILL_ONE_GO_BYTES", 4096)
    monkeypatch.setattr(ring_mod, "FILL_CHUNK_BYTES", 4096)
    t = torch.randn(16384 // 4)  # an eighth would be 2 KiB
    k = key()
    loc = writer.reserve(k, t.nbytes)
    seen = []
    real = ring_mod._copy_chunk

    def chunk(dst, src, n):
        seen.append((mark_of(writer, loc), n))  # what a reader would see as this chunk starts
        real(dst, src, n)

    monkeypatch.setattr(ring_mod, "_copy_chunk", chunk)
    assert writer.fill(k, loc.generation, t)
    assert seen == [(i * 2048, 2048) for i in range(8)]
    assert mark_of(writer, loc) == t.nbytes
    seen.clear()
    t = torch.randn(65536 // 4)  # an eighth would be 8 KiB: FILL_CHUNK_BYTES at most
    k = key()
    loc = writer.reserve(k, t.nbytes)
    assert writer.fill(k, loc.generation, t)
    assert seen == [(i * 4096, 4096) for i in range(16)]


def test_small_or_unannounced_entries_are_copied_in_one_go(writer, monkeypatch):
    calls = []
    monkeypatch.setattr(ring_mod, "_copy_chunk", lambda *a: calls.append(a))
    monkeypatch.setattr(ring_mod, "FILL_ONE_GO_BYTES", 64 << 10)
    writer.write(key(), f32(512 << 10))  # nobody was told of it before its bytes are in
    k = key()
    loc = writer.reserve(k, 64 << 10)  # announced, but not above FILL_ONE_GO_BYTES
    assert writer.fill(k, loc.generation, f32(64 << 10))
    assert calls == []


class _GatedFill:
    """A fill in a thread that stops before each chunk after the first until the test opens it."""

    def __init__(self, writer: RingWriter, monkeypatch, k: bytes, loc: EntryLoc, t: torch.Tensor):
        import threading

        self.gates = [threading.Event() for _ in range(t.nbytes // 4096)]
        self.gates[0].set()
        calls = iter(self.gates)
        real = ring_mod._copy_chunk

        def chunk(dst, src, n):
            assert next(calls).wait(10)
            real(dst, src, n)

        monkeypatch.setattr(ring_mod, "FILL_ONE_GO_BYTES", 4096)
        monkeypatch.setattr(ring_mod, "FILL_CHUNK_BYTES", 4096)  # entries of 32 KiB: eight chunks
        monkeypatch.setattr(ring_mod, "_copy_chunk", chunk)
        self.thread = threading.Thread(target=writer.fill, args=(k, loc.generation, t), daemon=True)

    def open_all(self) -> None:
        for g in self.gates:
            g.set()


async def _until(cond, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while not cond():
        assert loop.time() < end, what
        await asyncio.sleep(0.001)


async def test_a_reader_copies_an_entry_out_as_its_writer_fills_it(writer, reader, monkeypatch):
    t = torch.arange(32768 // 4, dtype=torch.float32)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    gated = _GatedFill(writer, monkeypatch, k, loc, t)
    copied = []
    real = ring_reader._copy_tensor
    monkeypatch.setattr(ring_reader, "_copy_tensor", lambda d, s: (copied.append(d.numel()), real(d, s)))
    out = torch.full_like(t, -1.0)
    task = asyncio.create_task(
        reader.read_as_filled(writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (8192,), out=out)
    )
    gated.thread.start()
    try:
        for i in range(1, 8):
            await _until(lambda i=i: sum(copied) == 4096 * i, f"the reader copied chunk {i} as it came in")
            assert not task.done()
            assert torch.equal(out[: 1024 * i], t[: 1024 * i]) and bool((out[1024 * i :] == -1).all())
            gated.gates[i].set()
        assert await asyncio.wait_for(task, 5) is out
        assert torch.equal(out, t) and copied == [4096] * 8
    finally:
        gated.open_all()
        gated.thread.join(10)
        task.cancel()


async def test_an_entry_replaced_while_it_is_copied_out_is_stale(writer, reader, monkeypatch):
    t = torch.arange(32768 // 4, dtype=torch.float32)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    gated = _GatedFill(writer, monkeypatch, k, loc, t)
    out = torch.zeros_like(t)
    task = asyncio.create_task(
        reader.read_as_filled(writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (8192,), out=out)
    )
    gated.thread.start()
    try:
        await _until(lambda: bool(out[0] == 0) and bool(out[1023] == 1023), "the first chunk copied out")
        # held by the gated fill's lock: clear once it is done. Until then the reader keeps waiting.
        gated.open_all()
        gated.thread.join(10)
        writer.clear()
        writer.write(key(), f32(16384, 7.0))  # its window taken by another entry
        with pytest.raises(StaleEmbeddingError):
            await asyncio.wait_for(task, 5)
    finally:
        gated.open_all()
        gated.thread.join(10)
        task.cancel()


async def test_a_reader_believes_no_fill_mark_past_the_entry(writer, reader):
    k = key()
    loc = writer.reserve(k, 4096)
    hdr = loc.offset - HEADER_BYTES
    writer._mm[hdr + 40 : hdr + 48] = (2**64 - 1).to_bytes(8, "little")  # a writer gone wrong
    args = (writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (1024,))
    with pytest.raises(StaleEmbeddingError, match="not written within"):  # not taken as all there: waited
        await asyncio.wait_for(reader.read_as_filled(*args, timeout_s=0.05), 5)
    t = torch.randn(1024)
    assert writer.fill(k, loc.generation, t)
    assert torch.equal(await asyncio.wait_for(reader.read_as_filled(*args), 5), t)


async def test_copying_out_ends_at_once_when_the_writer_died_mid_copy(writer, reader):
    k = key()
    loc = writer.reserve(k, 4096)
    fcntl.flock(writer._fd, fcntl.LOCK_UN)  # what the kernel does when the encoder dies
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(StaleEmbeddingError, match="died"):
        await asyncio.wait_for(
            reader.read_as_filled(writer.name, loc.offset, 4096, k, loc.generation, torch.float32, (1024,), timeout_s=30),
            5,
        )
    assert asyncio.get_running_loop().time() - t0 < 1.0


async def test_an_entry_overwritten_during_the_last_copy_out_is_stale(writer, reader, monkeypatch):
    t = torch.arange(1024, dtype=torch.float32)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    task = asyncio.create_task(
        reader.read_as_filled(writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (1024,))
    )
    await asyncio.sleep(0.005)  # the reader waits on the event loop now
    assert writer.fill(k, loc.generation, t)
    real = ring_reader._copy_tensor

    def overwritten_meanwhile(d, s):
        writer.clear()
        writer.write(key(), torch.full((2048,), 7.0))  # its window taken while the reader copies
        real(d, s)

    monkeypatch.setattr(ring_reader, "_copy_tensor", overwritten_meanwhile)
    with pytest.raises(StaleEmbeddingError):
        await asyncio.wait_for(task, 5)


@pytest.mark.parametrize("published", [False, True])
async def test_copying_out_of_a_segment_let_go_meanwhile_is_stale_at_once(reader, published):
    """The encoder leaves while a PD worker waits to copy an entry out, and the worker's heartbeat
    lets go of the segment (release_unlinked closes its fd): stale (re-encoded), not an OSError
    on the closed fd, and not after the whole timeout."""
    w = RingWriter(MIN_CAPACITY, owner_tag="test")
    k = key()
    loc = w.reserve(k, 4096)
    task = asyncio.create_task(
        reader.read_as_filled(w.name, loc.offset, 4096, k, loc.generation, torch.float32, (1024,), timeout_s=30)
    )
    await asyncio.sleep(0.01)
    if published:
        assert w.fill(k, loc.generation, f32(4096))
        w.clear()  # then gone before the reader looked again
    w.close()
    assert reader.release_unlinked() == [w.name]
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(StaleEmbeddingError):
        await asyncio.wait_for(task, 5)
    assert asyncio.get_running_loop().time() - t0 < 1.0


async def test_read_as_filled_of_a_published_entry_is_a_read(writer, reader):
    t = torch.randn(64, 16)
    k = key()
    loc = writer.write(k, t)
    args = (writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (64, 16))
    assert torch.equal(await reader.read_as_filled(*args), t)
    out = torch.empty(16, 64).t()  # not contiguous: waited for, then read as `read` does
    assert torch.equal(await reader.read_as_filled(*args, out=out), t)


async def test_read_as_filled_into_a_non_contiguous_tensor_waits_for_the_whole_entry(writer, reader):
    t = torch.randn(64, 16)
    k = key()
    loc = writer.reserve(k, t.nbytes)
    out = torch.empty(16, 64).t()
    asyncio.get_running_loop().call_later(0.01, writer.fill, k, loc.generation, t)
    got = await asyncio.wait_for(
        reader.read_as_filled(writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float32, (64, 16), out=out),
        5,
    )
    assert got is out and torch.equal(out, t)


# -- hostile messages -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "/dev/shm/epdq-0-enc-1-0123456789abcdef",
        "epdq-{other}-enc-1-0123456789abcdef",
        "epdq-{uid}-enc-1-0123456789abcdef/../../etc/passwd",
        "epdq-{uid}-enc-1-0123456789ABCDEF",
        "epdq-{uid}-e-n-c-1-0123456789abcdef",
        "epdq-{uid}-enc-١-0123456789abcdef",
        "epdq-{uid}-enc-1-0123456789abcdef\x00",
        "",
    ],
)
def test_bogus_segment_names_rejected(reader, name):
    name = name.format(uid=os.getuid(), other=os.getuid() + 1)
    with pytest.raises(ProtocolError):
        reader.read(name, 64, 16, key(), 1, torch.float32, (4,))


def test_foreign_mode_segment_rejected(reader):
    name = f"epdq-{os.getuid()}-evil-1-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, MIN_CAPACITY)
        os.fchmod(fd, 0o644)
        with pytest.raises(ProtocolError):
            reader.read(name, 64, 16, key(), 1, torch.float32, (4,))
    finally:
        os.close(fd)
        os.unlink(path)


def test_out_of_range_and_inconsistent_requests_rejected(writer, reader):
    t = f32(1024)
    k = key()
    loc = writer.write(k, t)
    cap = writer.capacity
    for off, nb, shape in [
        (cap, 16, (4,)),
        (cap - 64, 128, (32,)),
        (0, 16, (4,)),
        (-64, 16, (4,)),
        (loc.offset + 4, loc.nbytes, tuple(t.shape)),
        (loc.offset, loc.nbytes, (t.numel() + 1,)),
        (loc.offset, loc.nbytes, (-1, 2)),
        (loc.offset, -4, (-1,)),
    ]:
        with pytest.raises(ProtocolError):
            reader.read(writer.name, off, nb, k, loc.generation, torch.float32, shape)
    with pytest.raises(ProtocolError):
        reader.read(writer.name, loc.offset, loc.nbytes, k, 0, torch.float32, tuple(t.shape))
    with pytest.raises(ProtocolError):
        reader.read(writer.name, loc.offset, loc.nbytes, k[:8], loc.generation, torch.float32, tuple(t.shape))
    # The right bytes under the wrong dtype label are rejected too (nbytes names the header).
    with pytest.raises((ProtocolError, StaleEmbeddingError)):
        reader.read(writer.name, loc.offset, loc.nbytes, k, loc.generation, torch.float16, tuple(t.shape))


def test_reader_caches_a_bounded_number_of_segments():
    r = RingReader(max_segments=2)
    ws = [RingWriter(MIN_CAPACITY) for _ in range(3)]
    try:
        for w in ws:
            k = key()
            loc = w.write(k, f32(64))
            read(r, w, k, loc, f32(64))
        assert list(r._segments) == [ws[1].name, ws[2].name]
        r.forget(ws[1].name)
        assert list(r._segments) == [ws[2].name]
    finally:
        r.close()
        for w in ws:
            w.close()


# -- cleanup --------------------------------------------------------------------------------------


def dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while pid_alive(pid):
        pid -= 1
    return pid


def fake_segment(pid: int) -> tuple[str, int]:
    name = f"epdq-{os.getuid()}-enc-{pid}-{secrets.token_hex(8)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, MIN_CAPACITY)
    return name, fd


def test_cleanup_removes_every_unlocked_segment_whatever_pid_its_name_carries(writer):
    # The sweep spared segments whose pid was alive. A restarted container's encoder often has
    # the pid of the one that crashed (1, in a fresh pid namespace) and /dev/shm outlives it:
    # each crash leaked a whole ring, until the next ring no longer fit.
    names = []
    for pid in (dead_pid(), os.getpid(), 1):
        name, fd = fake_segment(pid)
        os.close(fd)
        names.append(name)
    try:
        removed = ring_mod.cleanup_stale_segments()
        for name in names:
            assert name in removed
            assert not os.path.exists(os.path.join(SHM_DIR, name))
        assert writer.name not in removed
        assert os.path.exists(os.path.join(SHM_DIR, writer.name))
    finally:
        for name in names:
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.parametrize("pid", ["dead", "ours"])
def test_cleanup_keeps_a_segment_whose_writer_still_holds_its_lock(pid):
    # e.g. a writer in another pid namespace: its pid looks dead from here.
    name, fd = fake_segment(dead_pid() if pid == "dead" else os.getpid())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert name not in ring_mod.cleanup_stale_segments()
        assert os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        os.close(fd)
        os.unlink(os.path.join(SHM_DIR, name))


def test_a_sweep_never_sees_a_new_ring_before_it_is_locked(monkeypatch):
    # The sweep takes every unlocked segment for a dead writer's. One that runs while a writer is
    # between creating its segment and locking it (an encoder starting beside another) must not
    # take the new ring: the segment gets its name only once it is locked.
    real_flock = fcntl.flock
    swept: list[list[str]] = []

    def flock(fd, op):
        if not swept:
            swept.append([])  # the sweep below locks too: it must not recurse
            swept[0] = ring_mod.cleanup_stale_segments()
        return real_flock(fd, op)

    monkeypatch.setattr(ring_mod.fcntl, "flock", flock)
    w = RingWriter(MIN_CAPACITY, owner_tag="test")
    try:
        monkeypatch.undo()
        assert swept and w.name not in swept[0]
        path = os.path.join(SHM_DIR, w.name)
        assert os.path.exists(path) and not os.path.exists(path + ".new")
        assert w.name not in ring_mod.cleanup_stale_segments()
        assert w.write(key(), f32(64)) is not None
    finally:
        w.close()


def test_cleanup_removes_a_dead_writers_unnamed_segment_once_it_is_old():
    # An encoder killed between creating NAME.new and renaming it left the file for good.
    name, fd = fake_segment(dead_pid())
    os.close(fd)
    src = os.path.join(SHM_DIR, name)
    os.rename(src, src + ".new")
    fresh, fd = fake_segment(os.getpid())  # as a live writer's is, for a moment, before its lock
    os.close(fd)
    os.rename(os.path.join(SHM_DIR, fresh), os.path.join(SHM_DIR, fresh) + ".new")
    locked, lfd = fake_segment(dead_pid())
    os.rename(os.path.join(SHM_DIR, locked), os.path.join(SHM_DIR, locked) + ".new")
    fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    old = time.time() - ring_mod.NEW_FILE_GRACE_S - 5
    for n in (name, locked):
        os.utime(os.path.join(SHM_DIR, n) + ".new", (old, old))
    try:
        removed = ring_mod.cleanup_stale_segments()
        assert name + ".new" in removed and not os.path.exists(src + ".new")
        assert fresh + ".new" not in removed and locked + ".new" not in removed
    finally:
        os.close(lfd)
        for n in (name, fresh, locked):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, n) + ".new")


def test_a_ring_that_cannot_lock_its_segment_leaves_no_file(monkeypatch):
    def cannot(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    def mine() -> set[str]:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(f"epdq-{os.getuid()}-") and f"-{os.getpid()}-" in n}

    before = mine()  # with the names of segments not yet locked
    monkeypatch.setattr(ring_mod.fcntl, "flock", cannot)
    with pytest.raises(OSError, match="no locks"):
        RingWriter(MIN_CAPACITY, owner_tag="test")
    monkeypatch.undo()
    assert mine() == before


# -- random operation sequences -------------------------------------------------------------------


class RingMachine(RuleBasedStateMachine):
    """Random writes/pins/unpins/reads against a model of what should be resident."""

    def __init__(self):
        super().__init__()
        self.w = RingWriter(MIN_CAPACITY, owner_tag="hyp")
        self.r = RingReader()
        self.model: dict[bytes, tuple[EntryLoc, torch.Tensor]] = {}  # everything ever written
        self.pinned: set[bytes] = set()
        self.n = 0

    def teardown(self):
        self.r.close()
        self.w.close()

    @rule(words=st.integers(0, 96 * 1024), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
    def write(self, words, dtype):
        self.n += 1
        k = key(self.n)
        t = torch.arange(self.n * 7, self.n * 7 + words, dtype=torch.float32).to(dtype)
        loc = self.w.write(k, t)
        if loc is None:
            assert not self.free_window_exists(span_of(t.numel() * t.element_size()))
            return
        self.model[k] = (loc, t)
        self.pinned.add(k)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(self.model)))
        self.w.unpin(k, self.model[k][0].generation)
        self.pinned.discard(k)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pin(self, data):
        k = data.draw(st.sampled_from(sorted(self.model)))
        if self.w.pin(k, self.model[k][0].generation):
            self.pinned.add(k)
        else:
            assert k not in self.pinned

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read(self, data):
        k = data.draw(st.sampled_from(sorted(self.model)))
        loc, t = self.model[k]
        try:
            got = self.r.read(self.w.name, loc.offset, loc.nbytes, k, loc.generation, t.dtype, tuple(t.shape))
        except StaleEmbeddingError:
            assert k not in self.pinned
            return
        assert torch.equal(got, t)

    def free_window_exists(self, span: int) -> bool:
        units = np.zeros(self.w.capacity // ALIGN, dtype=bool)
        for k in self.pinned:
            loc = self.model[k][0]
            units[(loc.offset - HEADER_BYTES) // ALIGN : (loc.offset + loc.nbytes + ALIGN - 1) // ALIGN] = (
                True
            )
        need = span // ALIGN
        run = 0
        for busy in units:
            run = 0 if busy else run + 1
            if run >= need:
                return True
        return False

    @invariant()
    def consistent(self):
        self.w._space.check_invariants()
        for k in self.pinned:
            assert self.w.lookup(k) == self.model[k][0]
        assert self.w.pinned_bytes == sum(span_of(self.model[k][0].nbytes) for k in self.pinned)


RingMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ring_machine = RingMachine.TestCase


def test_clear_drops_pinned_and_unpinned_entries():
    with RingWriter(MIN_CAPACITY) as w:
        a = w.write(b"a" * 16, torch.zeros(64))
        w.write(b"b" * 16, torch.ones(64))
        w.unpin(b"b" * 16, w.lookup(b"b" * 16).generation)
        assert w.clear() == 2
        assert w.entry_count == 0 and w.used_bytes == 0 and w.drain_evicted() == []
        assert w.lookup(b"a" * 16) is None and a is not None
        assert w.write(b"c" * 16, torch.zeros(64)) is not None


def test_view_is_zero_copy_and_check_detects_overwrite():
    with RingWriter(MIN_CAPACITY) as w:
        r = RingReader()
        try:
            t = torch.arange(256, dtype=torch.float32).reshape(16, 16)
            loc = w.write(b"v" * 16, t)
            v = r.view(w.name, loc.offset, loc.nbytes, b"v" * 16, loc.generation, torch.float32, (16, 16))
            assert torch.equal(v, t)
            r.check(w.name, loc.offset, loc.nbytes, b"v" * 16, loc.generation)
            w.unpin(b"v" * 16, loc.generation)
            w.evict_unpinned()
            with pytest.raises(StaleEmbeddingError):
                r.check(w.name, loc.offset, loc.nbytes, b"v" * 16, loc.generation)
            del v
        finally:
            r.close()


def test_the_workers_ring_setting_has_the_rings_bounds():
    # a usage error for `epdq worker --ring-mb 100000`, not a ValueError traceback from the ring
    from epdq.ring import MAX_CAPACITY, MIN_CAPACITY
    from epdq.worker.runner import WorkerConfig

    for ok in (MIN_CAPACITY, MAX_CAPACITY):
        WorkerConfig(role="encoder", ring_bytes=ok)
    for bad in (MIN_CAPACITY - 1, MAX_CAPACITY + 1):
        with pytest.raises(ValueError, match="ring_bytes must be 1 MiB..64 GiB"):
            WorkerConfig(role="encoder", ring_bytes=bad)


def test_the_stale_segment_sweep_survives_a_name_with_an_impossible_pid():
    # any local user can create such a name in /dev/shm: os.kill raised OverflowError, and every
    # encoder start (which sweeps) crashed
    from epdq.ring import SHM_DIR, cleanup_stale_segments

    name = f"epdq-{os.getuid()}-enc-9999999999-{'0' * 16}"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    try:
        assert name in cleanup_stale_segments()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_segments_of_encoders_that_left_are_unmapped_without_another_read(reader):
    # a segment nobody reads again stayed mapped (and its pages resident) until 64 others had
    # pushed it out: each encoder restart held a whole ring in every PD worker (which now runs
    # this with each heartbeat)
    kept, left = RingWriter(MIN_CAPACITY), RingWriter(MIN_CAPACITY)
    try:
        for w in (kept, left):
            t = f32(1024)
            k = key()
            assert torch.equal(read(reader, w, k, w.write(k, t), t), t)
        left.close()  # unlinks its segment
        assert reader.release_unlinked() == [left.name]
        assert left.name not in reader._segments and kept.name in reader._segments
        assert reader.release_unlinked() == []
    finally:
        kept.close()
