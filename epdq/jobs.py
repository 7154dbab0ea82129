"""The scheduler's vocabulary: worker roles, the records it keeps (workers, encode jobs, requests
and their states; the index's entries are `epdq.embed_index`'s) and the decisions it hands the
broker (`Send*`, `Fail`).

Plain data, no logic: `epdq.scheduler` changes these records, `epdq.broker` turns the decisions
into messages, and the cost-model simulation (`epdq.benchmarks.costmodel`) acts them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from epdq.errors import EpdqError
from epdq.protocol import EmbedRef, EntryId


class Role(StrEnum):
    ENCODER = "encoder"
    PD = "pd"
    BOTH = "both"


class ReqState(StrEnum):  # a StrEnum hashes in C: the scheduler keys counts by state at every change
    WAITING = "waiting"  # blocked on pending encodes
    READY = "ready"  # in the prefill queue
    RUNNING = "running"  # held by a PD (or both) worker
    DONE = "done"


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    role: Role
    node: str
    capacity: int
    ring_capacity: int = 0
    # encode job ids, or request ids for PD roles, oldest first (a dict: a lost worker's work goes
    # back to the queue in the order it came)
    inflight: dict = field(default_factory=dict)
    listed: bool = False  # present in the free list of its role
    draining: bool = False  # finishing what it holds before it leaves: given nothing new

    @property
    def credit(self) -> int:
        return 0 if self.draining else self.capacity - len(self.inflight)


@dataclass(slots=True)
class EncodeJob:
    job_id: int
    key: bytes
    image: Any  # the image file bytes (a frame or bytes), kept for re-queueing
    attempts: int = 0
    worker: str | None = None


@dataclass(slots=True)
class Request:
    rid: str
    client: bytes
    route: str  # "epd" | "colocated"
    keys: list[bytes]  # per image, prompt order (duplicates kept)
    images: list[Any]
    deadline: float
    payload: Any  # the Submit message, forwarded to the PD worker
    admitted_at: float
    state: ReqState = ReqState.WAITING
    pending: set = field(default_factory=set)
    ready_at: float = 0.0
    dispatched_at: float = 0.0
    worker: str | None = None
    streamed: bool = False
    attempts: int = 0
    stale_reads: int = 0  # PD reads that found an entry replaced (ring pressure, not a failure)
    fetch_failures: int = 0  # PD workers that could not reach an encoder on another node
    cache_hits: int = 0
    image_bytes: int = 0
    first_token_at: float = 0.0  # set by the broker, for TTFT / TPOT metrics
    tokens: int = 0


# ---------------------------------------------------------------- decisions


@dataclass(slots=True)
class SendEncode:
    worker_id: str
    job: EncodeJob


@dataclass(slots=True)
class SendPrefill:
    worker_id: str
    request: Request
    refs: list[EmbedRef]  # per image in prompt order; empty on the colocated route


@dataclass(slots=True)
class SendPin:
    worker_id: str
    entries: list[EntryId]


@dataclass(slots=True)
class SendUnpin:
    worker_id: str
    entries: list[EntryId]


@dataclass(slots=True)
class SendAbort:
    worker_id: str
    rid: str


@dataclass(slots=True)
class Fail:
    rid: str
    client: bytes
    error: EpdqError
    request: Request | None = None  # what it was (for the request log)


Action = SendEncode | SendPrefill | SendPin | SendUnpin | SendAbort | Fail
