"""Many deadlines, one timer: a heap of deadlines and one event-loop timer for the earliest.

`asyncio.timeout` around each request costs a loop timer per request (≈ 5 µs here with uvloop,
made and cancelled), a sixth of what a PD worker spends on a short request. Here a request costs
a heap push and a dict entry; the one timer is moved only when a new deadline is earlier than
every other, which with equal timeouts is never. Finished requests leave their heap entries
behind (dropped when they come to the top, or in a rebuild once they outnumber the live ones),
as `Scheduler` does with its request deadlines.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger("epdq.deadlines")

_REBUILD_SLACK = 1024  # dead entries tolerated on top of twice the live ones
# A loop may run a timer up to its clock's resolution early (libuv's is 1 ms): what is due within
# it expires now, or the timer would be re-armed for the same instant, again and again.
_EARLY_S = 0.001


class Deadlines:
    """Calls `on_expire(key)` once the loop's clock reaches the deadline `add` gave `key`, unless
    `discard(key)` came first. Keys are any hashable (a task, a request id); one deadline per key:
    adding a key again replaces its deadline. Not thread-safe: the loop's thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[Any], None]):
        self._loop = loop
        self._on_expire = on_expire
        self._live: dict[Hashable, float] = {}
        self._heap: list[tuple[float, int, Hashable]] = []  # the counter orders equal deadlines
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def add(self, key: Hashable, when: float) -> None:
        """Expire `key` at `when` (the loop's clock, `loop.time()`)."""
        if when != when:  # NaN would never expire: a caller's bug, not a request's
            raise ValueError("a deadline is a number, not NaN")
        self._live[key] = when
        heap = self._heap
        heapq.heappush(heap, (when, next(self._seq), key))
        if len(heap) > 2 * len(self._live) + _REBUILD_SLACK:
            live = self._live
            self._heap = heap = [e for e in heap if live.get(e[2]) == e[0]]
            heapq.heapify(heap)
        if when < self._timer_at:
            self._arm(when)

    def add_after(self, key: Hashable, delay: float) -> None:
        """Expire `key` `delay` seconds from now."""
        self.add(key, self._loop.time() + delay)

    def discard(self, key: Hashable) -> None:
        """Forget `key`'s deadline (a finished request); nothing if it has none."""
        self._live.pop(key, None)

    def close(self) -> None:
        """Forget every deadline and stop the timer."""
        self._live.clear()
        self._heap.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = self._loop.time() + _EARLY_S
        heap, live = self._heap, self._live
        due = []
        while heap and heap[0][0] <= now:
            when, _, key = heapq.heappop(heap)
            if live.get(key) == when:
                del live[key]
                due.append(key)
        while heap and live.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)  # a finished key's entry: the next timer is for a live one
        if heap:
            self._arm(heap[0][0])
        for key in due:  # after the re-arm: a callback may add or discard deadlines
            try:
                self._on_expire(key)
            except Exception:  # one failing callback must not keep the others' keys from expiring
                log.exception("deadline callback failed for %r", key)
