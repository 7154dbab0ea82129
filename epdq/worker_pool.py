"""The workers the scheduler may give work to, and their credits.

Part of the pure scheduling logic (`epdq.scheduler` owns one): no I/O. A worker's credit is its
capacity less what it holds (`WorkerState.credit`); each role keeps a free list of the workers
with credit left, in round-robin order: a worker given a slot goes to the back of the line.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from epdq.jobs import Role, WorkerState


class WorkerPool:
    __slots__ = ("workers", "count", "free", "locality_scan")

    def __init__(self, locality_scan: int):
        self.workers: dict[str, WorkerState] = {}
        self.count: dict[Role, int] = dict.fromkeys(Role, 0)  # registered workers by role
        # per role, ids of workers with credit (a slot may be stale: its worker left; skipped)
        self.free: dict[Role, deque[str]] = {r: deque() for r in Role}
        self.locality_scan = locality_scan  # free workers examined for one on a preferred node

    def add(self, w: WorkerState) -> None:
        """Register `w` (its id must not be registered)."""
        if w.worker_id in self.workers:
            raise KeyError(f"worker {w.worker_id!r} is already registered")
        self.workers[w.worker_id] = w
        self.count[w.role] += 1
        self._list(w)

    def remove(self, worker_id: str) -> WorkerState | None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            self.count[w.role] -= 1
        return w

    def pop_free(self, role: Role, prefer_node: str | None = None) -> WorkerState | None:
        """A worker of `role` with credit, on `prefer_node` if one of the first `locality_scan`
        free ones is there; None if none has credit."""
        free = self.free[role]
        if prefer_node is not None:
            for i, wid in enumerate(free):
                if i >= self.locality_scan:
                    break
                w = self.workers.get(wid)
                if w is not None and w.node == prefer_node and w.credit > 0:
                    del free[i]
                    w.listed = False
                    return w
        while free:
            w = self.workers.get(free.popleft())
            if w is None:
                continue
            w.listed = False
            if w.credit > 0:
                return w
        return None

    def take_slot(self, w: WorkerState, token: Any) -> None:
        w.inflight[token] = None
        self._list(w)  # back of the line: round robin among workers with credit

    def release_slot(self, w: WorkerState | None, token: Any) -> None:
        if w is not None and token in w.inflight:
            del w.inflight[token]
            self._list(w)

    def _list(self, w: WorkerState) -> None:
        if not w.listed and w.credit > 0 and w.worker_id in self.workers:
            w.listed = True
            self.free[w.role].append(w.worker_id)
