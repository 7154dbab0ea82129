"""Pure scheduling logic of the broker: queues, credits, the embedding index, dispatch choices.

No sockets, no I/O, no awaiting: the broker feeds events in (`submit`, `on_encoded`, ...) and
takes the resulting decisions out (`take_actions`). Time comes from an injected clock, so the
whole thing is unit-tested and simulated with thousands of workers in-process.

Ring entries are pinned while any live request (waiting, ready or running) references them;
the scheduler tells the owning encoder when a pin starts (`SendPin`) and ends (`SendUnpin`).
A pin outlives its last request by `unpin_delay_s` (it *lingers*): an image asked for again
meanwhile costs its encoder no PIN and UNPIN, and the unpins of many requests leave together.
An encoder whose ring is full, or that drains, gets its lingering unpins at once.
Unpinned entries stay in the index for cache hits until the encoder reports them evicted.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epdq.embed_index import EmbedIndex, IndexEntry
from epdq.errors import (
    BusyError,
    CancelledError,
    DeadlineExceededError,
    EngineError,
    EpdqError,
    FetchFailedError,
    InvalidInputError,
    RingFullError,
    WorkerLostError,
    error_from_code,
)
from epdq.jobs import (
    Action,
    EncodeJob,
    Fail,
    ReqState,
    Request,
    Role,
    SendAbort,
    SendEncode,
    SendPin,
    SendPrefill,
    SendUnpin,
    WorkerState,
)
from epdq.protocol import EmbedRef, EntryId
from epdq.queue_share import QueueShares
from epdq.ring_space import entry_span
from epdq.worker_pool import WorkerPool


@dataclass(slots=True)
class SchedulerConfig:
    max_queued_requests: int = 1024  # waiting + ready; beyond that, submit answers busy
    max_held_image_bytes: int = 2**30  # image files kept for live requests (for re-encodes)
    max_encode_attempts: int = 3
    max_pd_attempts: int = 3
    busy_retry_after_s: float = 0.5
    max_timeout_s: float = 3600.0
    locality_scan: int = 64  # free PD workers examined for one on the embeddings' node
    encode_lease_s: float = 60.0  # an encoder holding a job longer than this loses it
    # a pin no request holds any more is released this long after (at the next expire()); 0: at once
    unpin_delay_s: float = 0.05

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1 or self.max_held_image_bytes < 1:
            raise ValueError("max_queued_requests and max_held_image_bytes must be >= 1")
        if self.max_encode_attempts < 1 or self.max_pd_attempts < 1:
            raise ValueError("attempt caps must be >= 1")
        if not self.encode_lease_s > 0:  # "not >": NaN fails too
            raise ValueError("encode_lease_s must be > 0")
        if not 0 <= self.unpin_delay_s <= 60:
            raise ValueError("unpin_delay_s must be in [0, 60]")
        if not (self.busy_retry_after_s >= 0 and self.max_timeout_s > 0):
            raise ValueError("retry hint must be >= 0 and max timeout > 0")


MAX_STALE_READS = 8  # per request; then it fails as busy (the rings are too small for the load)
# per request: an encoder that PD workers on other nodes cannot reach (a wrong --fetch-advertise, a
# firewall) fails it after this many re-encodes (each may land on a reachable encoder)
MAX_FETCH_FAILURES = 2

COUNTERS = (
    "requests_submitted", "requests_completed", "requests_failed", "invalid_requests", "busy_rejections", "cancelled",
    "deadline_exceeded", "encodes_queued", "encodes_done", "encode_failures", "encode_requeues",
    "cache_hits", "cache_misses", "dedup_joins", "evictions", "stale_reads", "fetch_failures", "pd_requeues",
    "workers_lost",
    "local_handoffs", "remote_handoffs", "aborts_confirmed", "leases_expired", "ring_blocks", "pins_released",
    "share_preemptions", "pins_reused",
)  # fmt: skip


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = config or SchedulerConfig()
        self.clock = clock
        self.pool = WorkerPool(self.cfg.locality_scan)
        self.workers = self.pool.workers  # read-only here: changed through the pool
        self.requests: dict[str, Request] = {}
        self.index = EmbedIndex()
        self.jobs: dict[bytes, EncodeJob] = {}  # key -> queued or running encode
        self._jobs_by_id: dict[int, EncodeJob] = {}
        self._encode_queue: deque[EncodeJob] = deque()
        self._ready: dict[str, deque[str]] = {"epd": deque(), "colocated": deque()}
        # key -> live EPD requests referencing it, in the order they came: a dict, not a set, so
        # that the requests an encode completes become ready first come, first served (a set of
        # str iterates in an order that changes with PYTHONHASHSEED)
        self.users: dict[bytes, dict[str, None]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._leases: list[tuple[float, int, int]] = []  # (expiry, job id, attempt)
        self._next_job = 1
        self._actions: list[Action] = []
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.queued = 0  # requests waiting or ready
        self.shares = QueueShares()  # the same, by client
        self.held_image_bytes = 0
        # kept up to date at every change so that gauges() is O(1) however deep the queues are
        self._n_state: dict[ReqState, int] = dict.fromkeys(ReqState, 0)
        self._jobs_assigned = 0  # jobs in self.jobs held by an encoder
        # pinned entries no live request holds, until their unpin leaves (key -> entry), and the
        # same in time order: when each began to linger and the entry, in two deques rather than
        # a tuple per request for the cyclic GC to track (a record whose entry lingers again
        # since, or no longer, is skipped)
        self._lingering: dict[bytes, IndexEntry] = {}
        self._linger_since: deque[float] = deque()
        self._linger_entries: deque[IndexEntry] = deque()
        # entries of draining encoders taken out of the index when a new request asked for their
        # image (encoded again elsewhere, so that the drain can end): key -> the entry and the
        # requests running on it; its pin is released when the last of them ends
        self._retiring: dict[bytes, tuple[IndexEntry, dict[str, None]]] = {}

    # ------------------------------------------------------------ plumbing

    def take_actions(self) -> list[Action]:
        out, self._actions = self._actions, []
        return out

    def has_actions(self) -> bool:
        return bool(self._actions)

    def _emit(self, action: Action) -> None:
        self._actions.append(action)

    # ------------------------------------------------------------ workers

    def add_worker(
        self, worker_id: str, role: Role, node: str, capacity: int, ring_capacity: int = 0
    ) -> None:
        if capacity < 1:
            raise InvalidInputError("worker capacity must be >= 1")
        if worker_id in self.workers:
            self.remove_worker(worker_id, "re-registered")
        self.pool.add(WorkerState(worker_id, Role(role), node, capacity, ring_capacity))
        self.dispatch()

    def drain_worker(self, worker_id: str) -> bool:
        """The worker finishes what it holds and then leaves: it gets no new jobs or requests.
        A draining encoder's unpinned entries leave the index now, so that no new request comes
        to depend on a ring that is about to go away (pinned ones serve the requests holding them).
        Returns False for an unknown or already draining worker."""
        w = self.workers.get(worker_id)
        if w is None or w.draining:
            return False
        w.draining = True  # credit 0: never popped from the free list again
        if w.role is Role.ENCODER:
            self._unpin_lingering_of(worker_id)
            for key in self.index.keys_of(worker_id):
                if not self.index[key].pinned:
                    self._drop_entry(key)
        self.dispatch()
        return True

    def remove_worker(self, worker_id: str, reason: str = "lost") -> None:
        w = self.pool.remove(worker_id)
        if w is None:
            return
        if not (w.draining and not w.inflight):  # a drained worker leaving is planned, not lost
            self.counters["workers_lost"] += 1
        if w.role is Role.ENCODER:
            # newest first: each goes back to the head of the queue, so the oldest ends up first
            for job_id in list(reversed(w.inflight)):
                job = self._jobs_by_id.get(job_id)
                if job is not None and job.worker == worker_id:  # not one re-queued to another encoder
                    job.worker = None
                    self._jobs_assigned -= 1
                    self._retry_encode(job, WorkerLostError(f"encoder {worker_id} {reason}"))
            for key in self.index.keys_of(worker_id):
                self._drop_entry(key)
            for key in [k for k, (e, _) in self._retiring.items() if e.ref.encoder_id == worker_id]:
                del self._retiring[key]  # its pins went with it
        else:
            for rid in list(reversed(w.inflight)):  # newest first, as above
                req = self.requests.get(rid)
                if req is None or req.worker != worker_id:
                    continue
                if req.streamed or req.attempts + 1 >= self.cfg.max_pd_attempts:
                    self._finish(
                        req, WorkerLostError(f"worker {worker_id} {reason} while running the request")
                    )
                else:
                    req.attempts += 1
                    self.counters["pd_requeues"] += 1
                    self._requeue(req)
        self.dispatch()

    # ------------------------------------------------------------ requests

    def submit(
        self, rid: str, client: bytes, keys: list[bytes], images: list[Any], timeout_s: float,
        payload: Any, route: str = "auto",
    ) -> None:  # fmt: skip
        """Admit a request or raise BusyError / InvalidInputError."""
        if rid in self.requests:
            raise InvalidInputError(f"request id {rid!r} is already in use", request_id=rid)
        if not 0 < timeout_s <= self.cfg.max_timeout_s:
            raise InvalidInputError(f"timeout must be in (0, {self.cfg.max_timeout_s}] s", request_id=rid)
        nbytes = sum(memoryview(im).nbytes for im in images)
        if self.held_image_bytes + nbytes > self.cfg.max_held_image_bytes:
            self.counters["busy_rejections"] += 1
            raise BusyError(
                f"{self.held_image_bytes >> 20} MiB of images held (limit {self.cfg.max_held_image_bytes >> 20} MiB)",
                retry_after=self.cfg.busy_retry_after_s, request_id=rid,
            )  # fmt: skip
        route = self._resolve_route(route)
        if route == "epd" and len(keys) != len(images):
            raise InvalidInputError("one key per image is required", request_id=rid)
        # last: room is made (another client's request turned away) only for a request that is
        # admitted once it has room
        if self.queued >= self.cfg.max_queued_requests and not self._make_room(client):
            self.counters["busy_rejections"] += 1
            raise BusyError(
                f"{self.queued} requests queued (limit {self.cfg.max_queued_requests})",
                retry_after=self.cfg.busy_retry_after_s, request_id=rid,
            )  # fmt: skip
        now = self.clock()
        req = Request(
            rid, client, route, list(keys), list(images), now + timeout_s, payload, now, image_bytes=nbytes
        )
        self.requests[rid] = req
        self._n_state[ReqState.WAITING] += 1
        self.held_image_bytes += nbytes
        self._queue_in(req)
        self.counters["requests_submitted"] += 1
        heapq.heappush(self._deadlines, (req.deadline, rid))
        if route == "epd":
            for key in dict.fromkeys(keys):
                self._reference(req, key)
        if not req.pending:
            self._make_ready(req)
        self.dispatch()

    def _make_room(self, client: bytes) -> bool:
        """A full queue: turn away the newest request of a client over its share (queue_share.py)
        for `client`, which holds less. Only one that never ran: one re-queued after its PD
        worker died may have streamed tokens already. False: `client` is told busy."""
        heavy = self.shares.over_share(client, self.cfg.max_queued_requests)
        if heavy is None:
            return False
        for rid in reversed(self.requests):
            r = self.requests[rid]
            if r.client == heavy and r.state in (ReqState.WAITING, ReqState.READY) and not r.dispatched_at:
                held, share = self.shares.held[heavy], self.shares.share(client, self.cfg.max_queued_requests)
                self.counters["share_preemptions"] += 1
                self._finish(r, BusyError(
                    f"the queue is full ({self.cfg.max_queued_requests} requests) and this client held {held} "
                    f"of them, over its share of {share}: its newest made room for another client's",
                    retry_after=self.cfg.busy_retry_after_s,
                ))  # fmt: skip
                return True
        return False

    def _queue_in(self, req: Request) -> None:
        self.queued += 1
        self.shares.add(req.client)

    def _queue_out(self, req: Request) -> None:
        self.queued -= 1
        self.shares.remove(req.client)

    def _resolve_route(self, route: str) -> str:
        if route in ("epd", "colocated"):
            return route
        if route != "auto":
            raise InvalidInputError(f"unknown route {route!r}; use auto, epd or colocated")
        n = self.pool.count
        if n[Role.BOTH] and not (n[Role.PD] and n[Role.ENCODER]):
            return "colocated"
        return "epd"

    def _reference(self, req: Request, key: bytes) -> None:
        users = self.users.setdefault(key, {})
        users[req.rid] = None
        entry = self.index.get(key)
        if entry is not None and (w := self.workers.get(entry.ref.encoder_id)) is not None and w.draining:
            # its encoder is leaving: a new request must not come to depend on its ring (the
            # drain would last as long as the image stays popular); encoded again elsewhere
            self._retire(key, entry)
            self.counters["cache_misses"] += 1
            return
        if entry is not None:
            req.cache_hits += 1
            self.counters["cache_hits"] += 1
            if self._lingering and self._lingering.pop(key, None) is entry:
                self.counters["pins_reused"] += 1  # still pinned: nothing to tell the encoder
            elif self.index.pin(entry):
                self._emit(SendPin(entry.ref.encoder_id, [entry.entry_id()]))
            return
        req.pending.add(key)
        if key in self.jobs:
            req.cache_hits += 1
            self.counters["dedup_joins"] += 1
            return
        self.counters["cache_misses"] += 1
        self._new_job(key, req.images[req.keys.index(key)])

    def _retire(self, key: bytes, entry: IndexEntry) -> None:
        """Take a draining encoder's entry out of the index: requests running on it keep its pin
        until they end; the others (and the new one) wait for an encode elsewhere."""
        running = {rid: None for rid in self.users.get(key, ()) if self.requests[rid].state is ReqState.RUNNING}
        if entry.pinned and running:
            self._retiring[key] = (entry, running)
        elif entry.pinned:
            self._emit(SendUnpin(entry.ref.encoder_id, [entry.entry_id()]))
        self._drop_entry(key)

    def _leave_retiring(self, req: Request) -> None:
        """`req` no longer runs on the retiring entries of its images: the last one out unpins."""
        for key in req.keys:
            r = self._retiring.get(key)
            if r is not None and r[1].pop(req.rid, 0) is None and not r[1]:
                del self._retiring[key]
                self._emit(SendUnpin(r[0].ref.encoder_id, [r[0].entry_id()]))

    def _new_job(self, key: bytes, image: Any) -> None:
        job = EncodeJob(self._next_job, key, image)
        self._next_job += 1
        self.jobs[key] = job
        self._jobs_by_id[job.job_id] = job
        self._encode_queue.append(job)
        self.counters["encodes_queued"] += 1

    def _requeue(self, req: Request) -> None:
        """A request back from its PD worker: queued again, first waiting for any embedding that
        is no longer resident (dropped with a dead encoder or evicted while it ran)."""
        req.worker = None
        self._queue_in(req)
        if self._retiring:
            self._leave_retiring(req)
        if req.route == "epd":
            for key in dict.fromkeys(req.keys):
                if key not in self.index and key not in req.pending:
                    req.pending.add(key)
                    if key not in self.jobs:
                        self._new_job(key, req.images[req.keys.index(key)])
        if req.pending:
            self._set_state(req, ReqState.WAITING)
        else:
            self._make_ready(req, front=True)

    def _set_state(self, req: Request, state: ReqState) -> None:
        n = self._n_state
        n[req.state] -= 1
        n[state] += 1
        req.state = state

    def _make_ready(self, req: Request, front: bool = False) -> None:
        if req.route == "epd":
            self._pin(req)  # entries whose pins were released under ring pressure (on_ring_blocked)
        self._set_state(req, ReqState.READY)
        req.ready_at = req.ready_at or self.clock()
        q = self._ready[req.route]
        q.appendleft(req.rid) if front else q.append(req.rid)

    def _unreference(self, req: Request) -> None:
        if self._retiring:
            self._leave_retiring(req)
        for key in dict.fromkeys(req.keys) if req.route == "epd" else ():
            users = self.users.get(key)
            if users is None:
                continue
            users.pop(req.rid, None)
            if users:
                continue
            del self.users[key]
            job = self.jobs.get(key)
            if job is not None and job.worker is None:
                # queued, and nobody needs it any more: its image goes now, not when an encoder
                # frees up (with encoders down, dead requests' images piled up past
                # max_held_image_bytes); its queue slot is skipped, or swept by _compact_queues
                del self.jobs[key]
                self._jobs_by_id.pop(job.job_id, None)
                job.image = None
            entry = self.index.get(key)
            if entry is not None and entry.pinned:
                self._release_pin(entry)

    def _release_pin(self, entry: IndexEntry) -> None:
        """The last live request holding `entry` is gone: unpin it now, or let the pin linger."""
        w = self.workers.get(entry.ref.encoder_id)
        if self.cfg.unpin_delay_s > 0 and w is not None and not w.draining:
            entry.linger_since = now = self.clock()
            self._lingering[entry.ref.key] = entry
            self._linger_since.append(now)
            self._linger_entries.append(entry)
        elif self.index.unpin(entry):
            self._emit(SendUnpin(entry.ref.encoder_id, [entry.entry_id()]))
            if w is not None and w.draining:
                # not cached any more: a later hit would pin it again on a ring that is leaving
                self.index.drop(entry.ref.key)

    def _unpin_lingering(self, now: float) -> None:
        """Unpin the entries that have lingered `unpin_delay_s`, one SendUnpin per encoder."""
        times, entries, lingering = self._linger_since, self._linger_entries, self._lingering
        cutoff = now - self.cfg.unpin_delay_s
        by_encoder: dict[str, list[EntryId]] = {}
        while times and times[0] <= cutoff:
            since = times.popleft()
            entry = entries.popleft()
            key = entry.ref.key
            if entry.linger_since == since and lingering.get(key) is entry:
                del lingering[key]
                self._unpin_idle(entry, by_encoder)
        for encoder_id, ids in by_encoder.items():
            self._emit(SendUnpin(encoder_id, ids))

    def _unpin_lingering_of(self, worker_id: str) -> None:
        """Unpin at once every entry lingering in `worker_id`'s ring (it is full, or drains)."""
        by_encoder: dict[str, list[EntryId]] = {}
        for key, entry in list(self._lingering.items()):
            if entry.ref.encoder_id == worker_id:
                del self._lingering[key]
                self._unpin_idle(entry, by_encoder)
        for encoder_id, ids in by_encoder.items():
            self._emit(SendUnpin(encoder_id, ids))

    def _unpin_idle(self, entry: IndexEntry, by_encoder: dict[str, list[EntryId]]) -> None:
        key = entry.ref.key
        # still this entry (not dropped, nor replaced by a re-encode), and still nobody's
        if self.index.get(key) is entry and not self.users.get(key) and self.index.unpin(entry):
            by_encoder.setdefault(entry.ref.encoder_id, []).append(entry.entry_id())

    def _finish(self, req: Request, error: EpdqError | None = None) -> None:
        """End a request: release its references and slot; report `error` to the client."""
        if req.state is ReqState.DONE:
            return
        if req.state in (ReqState.WAITING, ReqState.READY):
            self._queue_out(req)
        elif req.state is ReqState.RUNNING and error is not None and req.worker is not None:
            # the PD worker's slot stays taken until it acknowledges the abort
            self._emit(SendAbort(req.worker, req.rid))
        self._set_state(req, ReqState.DONE)
        del self.requests[req.rid]
        if len(self._deadlines) > 2 * len(self.requests) + 1024:
            # finished requests leave their deadline behind; keep the heap proportional to live ones
            live = self.requests
            self._deadlines = [d for d in self._deadlines if d[1] in live and live[d[1]].deadline == d[0]]
            heapq.heapify(self._deadlines)
        self.held_image_bytes -= req.image_bytes
        self._unreference(req)
        self._compact_queues()
        if error is None:
            self.counters["requests_completed"] += 1
        elif not isinstance(error, CancelledError):  # a client's cancel is counted apart ("cancelled")
            self.counters["requests_failed"] += 1
            if isinstance(error, InvalidInputError):
                self.counters["invalid_requests"] += 1
            error.request_id = req.rid
            self._emit(Fail(req.rid, req.client, error, req))

    def _compact_queues(self) -> None:
        """Drop the slots of finished requests and dropped jobs once they outnumber the live ones:
        they are skipped only when a worker frees up, which may be never (no encoder registered)."""
        q = self._encode_queue
        if len(q) > 2 * len(self.jobs) + 1024:
            self._encode_queue = deque(j for j in q if self._jobs_by_id.get(j.job_id) is j and j.worker is None)
        for route, rq in self._ready.items():
            if len(rq) > 2 * self.queued + 1024:
                live = self.requests
                self._ready[route] = deque(
                    rid for rid in rq if (r := live.get(rid)) is not None and r.state is ReqState.READY
                )

    def cancel(self, rid: str, client: bytes | None = None) -> bool:
        req = self.requests.get(rid)
        if req is None or (client is not None and req.client != client):
            return False
        self.counters["cancelled"] += 1
        self._finish(req, CancelledError("cancelled by the client"))
        self.dispatch()
        return True

    def _missing(self, req: Request) -> str:
        """Why a request waited in vain when no registered worker could ever take it ("" otherwise)."""
        n = self.pool.count
        if req.state is ReqState.WAITING and not n[Role.ENCODER]:
            return ": no encoder is registered"
        if req.state is ReqState.READY:
            if req.route == "colocated" and not n[Role.BOTH]:
                return ": no colocated ('both') worker is registered for route 'colocated'"
            if req.route == "epd" and not n[Role.PD]:
                return ": no PD worker is registered"
        return ""

    def expire(self) -> float | None:
        """Fail every request past its deadline, re-queue expired encode leases, release pins that
        have lingered long enough; return when the next of those is due (or None)."""
        now = self.clock()
        if self._linger_since:
            self._unpin_lingering(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            req = self.requests.get(rid)
            if req is not None and req.deadline <= now:
                self.counters["deadline_exceeded"] += 1
                self._finish(req, DeadlineExceededError(f"deadline passed while {req.state.value}{self._missing(req)}"))
        while self._leases and self._leases[0][0] <= now:
            _, job_id, attempt = heapq.heappop(self._leases)
            job = self._jobs_by_id.get(job_id)
            if job is not None and job.worker is not None and job.attempts == attempt:
                # the encoder is alive but stuck: its slot stays taken until it answers
                self.counters["leases_expired"] += 1
                worker = job.worker
                job.worker = None
                self._jobs_assigned -= 1
                # the next attempt under a new id: it may go to the same encoder, whose slot for
                # the old one stays taken (one slot per id: two attempts under one id counted as
                # one, and over-issued its credit); a late answer to the old id is then not ours
                del self._jobs_by_id[job_id]
                job = EncodeJob(self._next_job, job.key, job.image, job.attempts)
                self._next_job += 1
                self.jobs[job.key] = self._jobs_by_id[job.job_id] = job
                self._retry_encode(job, WorkerLostError(f"encoder {worker} held the job past its lease"))
        self.dispatch()
        nxt = [h[0][0] for h in (self._deadlines, self._leases) if h]
        if self._linger_since:
            nxt.append(self._linger_since[0] + self.cfg.unpin_delay_s)
        return min(nxt) if nxt else None

    # ------------------------------------------------------------ encoder events

    def on_encoded(self, worker_id: str, job_id: int, ref: EmbedRef) -> None:
        w = self.workers.get(worker_id)
        self.pool.release_slot(w, job_id)
        job = self._jobs_by_id.get(job_id)
        if job is None or job.worker != worker_id or ref.key != job.key:
            # a job re-queued meanwhile, or a confused worker: the entry is nobody's, let it go
            self._unpin_answer(worker_id, ref.key, ref.generation)
            self.dispatch()
            return
        del self._jobs_by_id[job_id]
        del self.jobs[job.key]
        self._jobs_assigned -= 1
        self.counters["encodes_done"] += 1
        if len(self._leases) > 2 * len(self._jobs_by_id) + 1024:
            jobs = self._jobs_by_id
            self._leases = [
                h for h in self._leases if (j := jobs.get(h[1])) is not None and j.worker is not None and j.attempts == h[2]
            ]
            heapq.heapify(self._leases)
        key = job.key
        users = self.users.get(key, {})
        if key in self.index or not users:
            # a duplicate of a resident entry, or nobody waits any more: resident but unpinned
            self._unpin_answer(worker_id, key, ref.generation)
        # an entry nobody waits for on a draining encoder is not cached: no new request may come
        # to depend on a ring that is going away
        if key not in self.index and (users or w is None or not w.draining):
            self.index.add(ref, pinned=bool(users))
        for rid in users:
            req = self.requests[rid]
            req.pending.discard(key)
            if not req.pending and req.state is ReqState.WAITING:
                self._make_ready(req)
        self.dispatch()

    def _unpin_answer(self, worker_id: str, key: bytes, generation: int) -> None:
        """Release the pin an ENCODED answer carries (an encoder pins what it places or finds
        resident), unless that pin is still wanted: an encoder's pin is one flag, not a count, and
        its ring holds one entry per key, so this answer names the same entry as the index's
        pinned one from that encoder, or as the answer to come of a job for the key it holds
        now (a late answer to an attempt whose lease expired, the job since sent to it again)."""
        entry = self.index.get(key)
        if entry is not None and entry.pinned and entry.ref.encoder_id == worker_id:
            return
        job = self.jobs.get(key)
        if job is not None and job.worker == worker_id:
            return
        self._emit(SendUnpin(worker_id, [EntryId(key, generation)]))

    def on_encode_failed(self, worker_id: str, job_id: int, code: str, message: str) -> None:
        self.pool.release_slot(self.workers.get(worker_id), job_id)
        job = self._jobs_by_id.get(job_id)
        if job is None or job.worker != worker_id:
            self.dispatch()
            return
        job.worker = None
        self._jobs_assigned -= 1
        self.counters["encode_failures"] += 1
        err = error_from_code(code, message)
        if err.retryable:
            self._retry_encode(job, err)
        else:
            self._fail_job(job, err)
        self.dispatch()

    def _retry_encode(self, job: EncodeJob, err: EpdqError) -> None:
        if job.attempts >= self.cfg.max_encode_attempts:
            self._fail_job(job, type(err)(f"encode failed {job.attempts} times; last: {err.message}"))
            return
        self.counters["encode_requeues"] += 1
        self._encode_queue.appendleft(job)

    def _fail_job(self, job: EncodeJob, err: EpdqError) -> None:
        self.jobs.pop(job.key, None)
        self._jobs_by_id.pop(job.job_id, None)
        for req in self._waiting_for(job.key):
            self._finish(req, error_from_code(err.code, err.message))

    def _waiting_for(self, key: bytes) -> list[Request]:
        """The live requests waiting for `key`'s encode, oldest first. Not every user of the key:
        one running (or ready) since an earlier entry of the same image has its bytes already,
        and another request's failed re-encode is not its failure."""
        live = self.requests
        return [r for rid in self.users.get(key, ()) if (r := live.get(rid)) is not None and key in r.pending]

    def _pin(self, req: Request) -> None:
        by_encoder: dict[str, list[EntryId]] = {}
        for key in dict.fromkeys(req.keys):
            entry = self.index.get(key)
            if entry is not None and self.index.pin(entry):
                by_encoder.setdefault(entry.ref.encoder_id, []).append(entry.entry_id())
        for encoder_id, ids in by_encoder.items():
            self._emit(SendPin(encoder_id, ids))  # one already evicted comes back as EVICTED

    def on_ring_blocked(self, worker_id: str, job_id: int, nbytes: int) -> None:
        """An encoder holds job `job_id`'s embedding but its ring is full of pinned entries.

        Pins held by requests still waiting for other images can deadlock the rings: each ring
        full of halves of requests whose other halves need room. So the pins that only waiting
        requests hold on that encoder are released (those entries may be evicted, and re-encoded
        when needed), except the ones of the requests this job serves, oldest first, as many as
        fit beside it: they go first. A request whose own entries leave no room for this one
        never will fit: it fails, alone (the others waiting for the same image are measured on
        their own images, not on everyone's). Pins no request holds any more (lingering ones)
        are released first, whatever the job."""
        job = self._jobs_by_id.get(job_id)
        w = self.workers.get(worker_id)
        if w is not None:
            self._unpin_lingering_of(worker_id)  # nobody's: they may go before anything else
        if job is None or job.worker != worker_id or w is None:
            return
        self.counters["ring_blocks"] += 1
        index, cap, need = self.index, w.ring_capacity, entry_span(nbytes)
        pinned = {key: index[key] for key in index.keys_of(worker_id) if index[key].pinned}
        kept: set[str] = set()
        kept_keys: set[bytes] = set()
        kept_bytes = 0
        too_big: list[tuple[Request, int]] = []
        for req in self._waiting_for(job.key):  # oldest first
            mine = [k for k in dict.fromkeys(req.keys) if k in pinned]
            own = sum(entry_span(pinned[k].ref.nbytes) for k in mine)
            if cap and own + need > cap:
                too_big.append((req, own + need))
                continue
            extra = sum(entry_span(pinned[k].ref.nbytes) for k in mine if k not in kept_keys)
            if not cap or kept_bytes + extra + need <= cap:
                kept.add(req.rid)
                kept_keys.update(mine)
                kept_bytes += extra
        for req, total in too_big:
            self._finish(req, RingFullError(
                f"the images of this request need {total} bytes at once in encoder {worker_id}'s ring of "
                f"{cap} bytes: send fewer or smaller images, or run encoders with a larger --ring-mb"
            ))  # fmt: skip
        if too_big:
            self._unpin_lingering_of(worker_id)  # what only they held: free at once, not in 50 ms
        if not kept:  # nobody left to serve: the job goes (its result, if it ever lands, is unpinned)
            if self._jobs_by_id.get(job_id) is job:
                job.worker = None
                self._jobs_assigned -= 1
                self.pool.release_slot(w, job_id)
                self._fail_job(job, RingFullError("no request waits for this image any more"))
            self.dispatch()
            return
        release: list[EntryId] = []
        for key in index.keys_of(worker_id):
            entry = index[key]
            users = self.users.get(key)
            if entry.pinned and key not in kept_keys and users and all(
                self.requests[r].state is ReqState.WAITING for r in users
            ):
                release.append(entry.entry_id())
        for e in release:
            index.unpin(index[e.key])
        if release:
            self.counters["pins_released"] += len(release)
            self._emit(SendUnpin(worker_id, release))
        self.dispatch()

    def on_evicted(self, worker_id: str, entries: list[EntryId]) -> None:
        for e in entries:
            entry = self.index.get(e.key)
            if (
                entry is not None
                and entry.ref.encoder_id == worker_id
                and entry.ref.generation == e.generation
            ):
                self.counters["evictions"] += 1
                self._drop_entry(e.key)
        self.dispatch()

    def _drop_entry(self, key: bytes) -> None:
        """Forget a resident entry; live requests that still need it go back to waiting."""
        self.index.drop(key)
        self._lingering.pop(key, None)
        for rid in self.users.get(key, ()):
            req = self.requests[rid]
            if req.state is ReqState.RUNNING:
                continue  # its PD worker reports a stale read, or has already copied the bytes
            self._set_state(req, ReqState.WAITING)  # its stale slot in the ready queue is skipped
            req.pending.add(key)
            if key not in self.jobs:
                self._new_job(key, req.images[req.keys.index(key)])

    # ------------------------------------------------------------ PD events

    def on_tokens(self, worker_id: str, rid: str, finished: bool) -> Request | None:
        """A token chunk arrived; returns the live request it belongs to (None if gone)."""
        req = self.requests.get(rid)
        if req is None or req.worker != worker_id:
            if finished:
                self.pool.release_slot(self.workers.get(worker_id), rid)
                self.dispatch()
            return None
        req.streamed = True
        if finished:
            self.pool.release_slot(self.workers.get(worker_id), rid)
            self._finish(req)
            self.dispatch()
        return req

    def on_pd_failed(self, worker_id: str, rid: str, code: str, message: str, stale: list[EntryId]) -> None:
        self.pool.release_slot(self.workers.get(worker_id), rid)
        if code == "cancelled":
            self.counters["aborts_confirmed"] += 1
        req = self.requests.get(rid)
        if req is None or req.worker != worker_id:
            self.dispatch()
            return
        if code == FetchFailedError.code:
            self.counters["fetch_failures"] += 1
            req.fetch_failures += 1
        if stale and not req.streamed and req.fetch_failures > MAX_FETCH_FAILURES:
            self._finish(req, WorkerLostError(
                f"PD workers could not fetch its embeddings from another node {req.fetch_failures} times (last: "
                f"{message[:300]}): check the encoders' --fetch-advertise and that PD workers can reach it"
            ))  # fmt: skip
        elif stale and not req.streamed and req.stale_reads < MAX_STALE_READS:
            # a ring under pressure (or an encoder out of reach), not a failing worker: retried apart
            # from max_pd_attempts; stale_reads tells of ring pressure alone
            if code != FetchFailedError.code:
                self.counters["stale_reads"] += 1
                req.stale_reads += 1
            for e in stale:
                entry = self.index.get(e.key)
                if entry is not None and entry.ref.generation == e.generation:
                    if entry.pinned:
                        # A worker names every entry of the request, and only one need be gone: the
                        # others are still in their ring, pinned. Forgotten here without an unpin,
                        # they stayed pinned for good, and enough of them deadlocked the ring.
                        self._emit(SendUnpin(entry.ref.encoder_id, [e]))
                    self._drop_entry(e.key)  # other users wait for it again; this one: below
            self._requeue(req)
        elif stale and not req.streamed:
            self._finish(req, BusyError(
                f"its embeddings were replaced in the encoders' rings {req.stale_reads} times before a PD worker "
                "could read them: the rings are too small for this load (--ring-mb)", retry_after=1.0,
            ))  # fmt: skip
        else:
            err = error_from_code(code, message)
            if isinstance(err, DeadlineExceededError):  # the PD worker's timer fired before ours
                self.counters["deadline_exceeded"] += 1
            if isinstance(err, CancelledError):
                # not the client's cancel (that one finished the request already): the engine aborted
                # it. Finished as a cancel, the client was told nothing.
                err = EngineError(f"the engine aborted the request ({message})")
            self._finish(req, err)
        self.dispatch()

    # ------------------------------------------------------------ dispatch

    def dispatch(self) -> None:
        free = self.pool.free
        self._dispatch_encodes()
        ready = self._ready
        if ready["epd"] and free[Role.PD]:
            if self._dispatch_ready("epd", Role.PD):
                self._dispatch_encodes()
        if ready["colocated"] and free[Role.BOTH]:
            self._dispatch_ready("colocated", Role.BOTH)

    def _dispatch_encodes(self) -> None:
        q = self._encode_queue
        free = self.pool.free
        while q and free[Role.ENCODER]:
            job = q[0]
            if (
                job.worker is not None
                or self._jobs_by_id.get(job.job_id) is not job
                or not self.users.get(job.key)
            ):
                q.popleft()  # stale queue slot, or nobody needs the image any more
                if self._jobs_by_id.get(job.job_id) is job and job.worker is None:
                    self._jobs_by_id.pop(job.job_id)
                    self.jobs.pop(job.key, None)
                continue
            w = self.pool.pop_free(Role.ENCODER)
            if w is None:
                break
            q.popleft()
            job.worker = w.worker_id
            self._jobs_assigned += 1
            job.attempts += 1
            heapq.heappush(self._leases, (self.clock() + self.cfg.encode_lease_s, job.job_id, job.attempts))
            self.pool.take_slot(w, job.job_id)
            self._emit(SendEncode(w.worker_id, job))

    def _dispatch_ready(self, route: str, role: Role) -> bool:
        """Ready requests to free workers; True when one went back to waiting for an encode."""
        q = self._ready[route]
        requeued = False
        while q and self.pool.free[role]:
            req = self.requests.get(q[0])
            if req is None or req.state is not ReqState.READY:
                q.popleft()
                continue
            try:
                refs = [self.index[k].ref for k in req.keys] if route == "epd" else []
            except KeyError:  # an embedding left the index unnoticed: wait for it, don't wedge the queue
                q.popleft()
                self._queue_out(req)  # _requeue counts it again
                self._requeue(req)
                requeued = True
                continue
            node = _majority_node(refs)
            w = self.pool.pop_free(role, node)
            if w is None:
                break
            q.popleft()
            self._set_state(req, ReqState.RUNNING)
            req.worker = w.worker_id
            req.dispatched_at = self.clock()
            self._queue_out(req)
            self.pool.take_slot(w, req.rid)
            if refs:
                remote = any(r.node != w.node for r in refs)
                self.counters["remote_handoffs" if remote else "local_handoffs"] += 1
            self._emit(SendPrefill(w.worker_id, req, refs))
        return requeued

    # ------------------------------------------------------------ introspection

    def gauges(self) -> dict[str, float]:
        """O(1): from counts kept at every change (`gauges_by_scan` recomputes them, for tests)."""
        n = self._n_state
        return {
            "requests_waiting": n[ReqState.WAITING],
            "requests_ready": n[ReqState.READY],
            "requests_running": n[ReqState.RUNNING],
            "requests_queued": self.queued,
            "held_image_bytes": self.held_image_bytes,
            "encode_queue": len(self.jobs) - self._jobs_assigned,
            "encodes_inflight": self._jobs_assigned,
            "index_entries": len(self.index),
            "index_bytes": self.index.nbytes,
            "index_pinned": self.index.pinned,
        }

    def gauges_by_scan(self) -> dict[str, float]:
        states = {s: 0 for s in ReqState}
        for r in self.requests.values():
            states[r.state] += 1
        return {
            "requests_waiting": states[ReqState.WAITING],
            "requests_ready": states[ReqState.READY],
            "requests_running": states[ReqState.RUNNING],
            "requests_queued": self.queued,
            "held_image_bytes": self.held_image_bytes,
            "encode_queue": sum(1 for j in self.jobs.values() if j.worker is None),
            "encodes_inflight": sum(1 for j in self.jobs.values() if j.worker is not None),
            "index_entries": len(self.index),
            "index_bytes": sum(e.ref.nbytes for e in self.index.values()),
            "index_pinned": sum(1 for e in self.index.values() if e.pinned),
        }


def _majority_node(refs: list[EmbedRef]) -> str | None:
    if not refs:
        return None
    weight: dict[str, int] = {}
    for r in refs:
        weight[r.node] = weight.get(r.node, 0) + r.nbytes
    return max(weight, key=weight.__getitem__)
