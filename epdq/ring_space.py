"""Placement bookkeeping of the embedding ring: where entries sit and which to evict.

Pure data structures, no memory touched, so the policy is tested (and fuzzed against a
brute-force search) without shared memory. `epdq.ring` owns the bytes.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import OrderedDict
from typing import NamedTuple

HEADER_BYTES = 64
ALIGN = 64


def entry_span(nbytes: int) -> int:
    """Bytes an entry of `nbytes` takes in a ring: its header, the data rounded up to ALIGN."""
    return HEADER_BYTES + -(-nbytes // ALIGN) * ALIGN
_LRU_TRIES = 4  # oldest entries whose neighbourhood is tried before a full scan
_EARLY_END = True  # tests turn it off to check it changes no choice


class EntryLoc(NamedTuple):
    """Where an entry's data lives in its segment (the header sits just before `offset`). Made
    only from a placed entry, so it needs no checks of its own; a tuple because a reservation
    runs with cold caches, where a dataclass's constructor costs ~10 us."""

    offset: int
    nbytes: int
    generation: int


class _Entry:
    __slots__ = ("key", "generation", "start", "span", "nbytes", "pinned", "stamp", "published", "end")

    def __init__(self, key: bytes, generation: int, start: int, span: int, nbytes: int, published: bool = True):
        self.key = key
        self.generation = generation
        self.start = start  # header offset
        self.span = span  # header + padded data
        self.nbytes = nbytes
        self.pinned = True
        self.stamp = 0  # LRU clock at the last unpin
        self.published = published  # False between RingWriter.reserve and fill: its bytes are not in yet
        self.end = start + span  # a field, not a property: placement reads it in its inner loops

    def loc(self) -> EntryLoc:
        return EntryLoc(self.start + HEADER_BYTES, self.nbytes, self.generation)

    def __repr__(self) -> str:
        return f"_Entry({self.key.hex()}@{self.generation}, [{self.start}, {self.end}), pinned={self.pinned})"


class RingSpace:
    """Where entries sit in the ring and which to evict: pure bookkeeping, no memory touched.

    Placement: a free window if any (trying the end of the last placement first, so sequential
    writes pack densely), else a window around one of the few least recently unpinned entries,
    else a full O(n) scan; each picks the window whose newest victim is least recently used
    (ties: fewer victims) and never one that touches a pinned entry."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.starts: list[int] = []  # sorted header offsets, parallel to `order`
        self.order: list[_Entry] = []
        self.by_key: dict[bytes, _Entry] = {}
        self.lru: OrderedDict[bytes, _Entry] = OrderedDict()  # unpinned, least recent first
        self.used_bytes = 0  # header + padded data of resident entries, pinned or not
        self.pinned_bytes = 0
        self._clock = 0
        self._cursor = 0

    def set_pinned(self, e: _Entry, pinned: bool) -> None:
        if e.pinned != pinned:
            self.pinned_bytes += e.span if pinned else -e.span
            e.pinned = pinned
        if pinned:
            self.lru.pop(e.key, None)
        else:
            self._clock += 1
            e.stamp = self._clock
            self.lru[e.key] = e
            self.lru.move_to_end(e.key)

    def add(self, e: _Entry) -> None:
        """Record a new pinned entry; the caller has removed everything it overlaps."""
        idx = bisect_left(self.starts, e.start)
        self.starts.insert(idx, e.start)
        self.order.insert(idx, e)
        self.by_key[e.key] = e
        self.used_bytes += e.span
        self.pinned_bytes += e.span * e.pinned
        self._cursor = e.end

    def remove(self, e: _Entry) -> None:
        if e.pinned:
            raise AssertionError("evicting a pinned ring entry")  # a bug, never a runtime case
        idx = bisect_left(self.starts, e.start)
        del self.starts[idx], self.order[idx], self.by_key[e.key]
        self.lru.pop(e.key, None)
        self.used_bytes -= e.span

    def _first_reaching(self, start: int) -> int:
        """Index of the first entry that ends after `start`."""
        i = bisect_left(self.starts, start)
        return i - 1 if i and self.order[i - 1].end > start else i

    def overlapping(self, start: int, end: int) -> list[_Entry]:
        return self.order[self._first_reaching(start) : bisect_left(self.starts, end)]

    def find_window(self, span: int) -> int | None:
        """Start of the window for a new entry of `span` bytes; None if every window is pinned."""
        # Runs on every encode (the encoder's hot path, with cold caches): one function, plain
        # loops over plain fields, no generators or calls but bisect's.
        cap = self.capacity
        s = self._cursor if self._cursor + span <= cap else 0
        starts, order, n = self.starts, self.order, len(self.order)
        # entries are disjoint and sorted, so the last one starting before the window's end is
        # the one that reaches furthest: the window is free if that one ends by `s`
        i = bisect_left(starts, s + span)
        if not i or order[i - 1].end <= s:
            return s
        best, best_top, best_count = None, 0, 0
        tries = 0
        # With fewer free bytes in the whole ring than the window needs, no window is free, and
        # none costs less than one whose only victim is the least recently unpinned entry: the
        # first such candidate ends the search (the loop would keep it anyway, ties going to the
        # first found). In a full ring of like-sized entries that is the first candidate, and the
        # other seven are not looked at.
        floor = None if _EARLY_END and cap - self.used_bytes < span else -1  # -1: no early end
        for e in self.lru.values():  # the least recently unpinned first; O(log n) each
            if floor is None:
                floor = e.stamp  # stamps start at 1
            if tries == _LRU_TRIES:
                break
            tries += 1
            idx = bisect_left(starts, e.start)
            before = order[idx - 1].end if idx else 0
            after = order[idx + 1].start if idx + 1 < n else cap
            for w in (before, after - span):
                # the window's cost: (newest victim's stamp, victims); out of bounds or pinned: none
                end = w + span
                if w < 0 or end > cap:
                    continue
                j = bisect_left(starts, w)
                if j and order[j - 1].end > w:
                    j -= 1
                top = count = 0
                while j < n:
                    v = order[j]
                    if v.start >= end:
                        break
                    if v.pinned:
                        count = -1
                        break
                    if v.stamp > top:
                        top = v.stamp
                    count += 1
                    j += 1
                if count >= 0 and (best is None or top < best_top or (top == best_top and count < best_count)):
                    if top == floor and count == 1:
                        return w
                    best, best_top, best_count = w, top, count
        return best if best is not None else self._scan(span)

    def _scan(self, span: int) -> int | None:
        # Sliding window over candidate starts (0, each unpinned start, each entry end), all
        # ascending; an optimal pin-free window can always be shifted left onto one of them.
        order, n = self.order, len(self.order)
        i = j = pinned_in = head = 0
        maxq: list[int] = []  # indices in [i, j) with decreasing stamps (unpinned only), from head
        best, best_cost = None, None
        for s in itertools.chain((0,), *(((e.start, e.end) if not e.pinned else (e.end,)) for e in order)):
            end = s + span
            if end > self.capacity:
                break
            while j < n and order[j].start < end:
                if order[j].pinned:
                    pinned_in += 1
                else:
                    while len(maxq) > head and order[maxq[-1]].stamp <= order[j].stamp:
                        maxq.pop()
                    maxq.append(j)
                j += 1
            while i < j and order[i].end <= s:
                pinned_in -= order[i].pinned
                head += len(maxq) > head and maxq[head] == i
                i += 1
            if pinned_in:
                continue
            if i == j:
                return s
            cost = (order[maxq[head]].stamp, j - i)
            if best_cost is None or cost < best_cost:
                best, best_cost = s, cost
        return best

    def check_invariants(self) -> None:
        """For tests: entries sorted, disjoint, aligned, in bounds; counters and LRU match."""
        assert self.starts == [e.start for e in self.order] and len(self.by_key) == len(self.order)
        assert all(a.end <= b.start for a, b in zip(self.order, self.order[1:], strict=False))
        assert all(e.start % ALIGN == 0 and e.end <= self.capacity for e in self.order)
        assert self.used_bytes == sum(e.span for e in self.order)
        assert self.pinned_bytes == sum(e.span for e in self.order if e.pinned)
        unpinned = sorted((e for e in self.order if not e.pinned), key=lambda e: e.stamp)
        assert list(self.lru.values()) == unpinned
