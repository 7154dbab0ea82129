"""Encoder worker: pulls encode jobs, runs the vision tower in batches, writes the ring.

Jobs arrive as the broker spends our credit; when the engine becomes free, the oldest jobs held,
at most `max_batch` of them, are encoded in ONE forward. The credit is larger than a batch (two
batches by default), so the next batch is already here when a forward ends: otherwise the engine
would wait a round trip through the broker after every batch, and at 32 misses in flight the
stages of the pipeline took turns instead of overlapping (bench/NOTES, 2026-12-04).

Each embedding goes into this process's ring (pinned): shared memory, or on a GPU a CUDA ring
(`epdq.ring_cuda`) that PD workers on the same GPU copy from directly, and a small completion
event with its location goes back to the broker. Bytes for PD workers on other nodes are served
from the ring by a fetch socket (ROUTER) this worker binds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from epdq import protocol as P
from epdq.channel import Channel, PeerUnreachable
from epdq.engines.base import EncodedImage, VisionEngine
from epdq.errors import EpdqError, InternalError, ProtocolError, RingFullError, StaleEmbeddingError
from epdq.media import decode_image, quick_to_decode
from epdq.ring import KEY_BYTES, RingWriter
from epdq.transport import bound_endpoint, make_socket, remove_stale_ipc_sockets

log = logging.getLogger("epdq.encoder")


@dataclass(slots=True)
class _Job:
    job_id: int
    key: bytes
    image: Any  # file bytes (a zmq frame)
    epoch: int = 0  # the registration it came with (EncoderWorker.abandon)


RING_BLOCKED_REPORT_S = 1.0  # how often a result still waiting for ring space is reported again
# Bytes announced ahead of their copy in one batch (see _announcing): the copies run one after
# another, and a PD worker waiting for the last entry waits for all of them.
ANNOUNCE_AHEAD_BYTES = 64 << 20
# Fetch answers queued for one PD worker that does not take them. A PD worker has at most a few
# hundred fetches in flight (its sequences times their images), so only a peer that stopped
# reading gets here.
FETCH_SEND_HWM = 1024
# The default fetch socket's name (epdq.worker.runner.default_fetch_bind): fetch-PID-8 hex digits.
# Encoders killed before they could remove theirs left these behind: they piled up in the directory.
FETCH_SOCKET_NAME = re.compile(r"fetch-([0-9]{1,10})-[0-9a-f]{8}")


class EncoderWorker:
    def __init__(
        self,
        engine: VisionEngine,
        ring: RingWriter,
        *,
        worker_id: str,
        node: str,
        max_image_bytes: int,
        max_image_pixels: int,
        fetch_bind: str = "tcp://127.0.0.1:*",
        ctx: zmq.Context | None = None,
        security: Any = None,
        max_batch: int = 8,  # WorkerConfig.max_batch's default
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine = engine
        self.max_batch = max_batch
        self.ring = ring
        self.worker_id = worker_id
        self.node = node
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self._ctx = ctx or zmq.Context.instance()
        self._fetch_bind = fetch_bind
        self._security = security
        self._jobs: deque[_Job] = deque()
        # (job, result, encode seconds, when the broker was last told): waiting for ring space
        self._blocked: deque[tuple[_Job, EncodedImage, float, float]] = deque()
        self._wake = asyncio.Event()
        self._fetch: Channel | None = None
        self.fetch_replies_dropped = 0
        self.fetch_endpoint = ""
        self.link: Any = None  # BrokerLink, set by the runner
        self._ring_kind = getattr(ring, "kind", "")  # "" = the shared-memory ring; "cuda" = epdq.ring_cuda
        self.encoded = 0
        self._encoding = False
        # bumped before each re-registration: jobs of an older one are never answered
        self._epoch = 0
        # (key, generation, tensor) of the entries announced in this batch, copied in once their
        # completion events have left (see _announcing); None outside a batch
        self._fills: list[tuple[bytes, int, Any]] | None = None
        self._fill_bytes = 0

    def idle(self) -> bool:
        """No job in hand and no entry pinned for a request (a draining encoder may leave: PD
        workers no longer need its ring)."""
        return not (self._jobs or self._blocked or self._encoding) and self.ring.pinned_bytes == 0

    def open_fetch_socket(self) -> str:
        self._remove_stale_fetch_sockets()
        sock = make_socket(
            self._ctx, zmq.ROUTER, bind=self._fetch_bind, max_message_bytes=4096, security=self._security,
            send_hwm=FETCH_SEND_HWM,
        )  # fmt: skip
        self._fetch = Channel(sock, self._on_fetch)
        self.fetch_endpoint = bound_endpoint(sock)
        return self.fetch_endpoint

    def _remove_stale_fetch_sockets(self) -> None:
        # only where this encoder's own socket is named that way: that directory is where the
        # others are, and someone else's directory is not ours to tidy
        if not self._fetch_bind.startswith("ipc://") or self._fetch_bind.startswith("ipc://@"):
            return
        path = self._fetch_bind[len("ipc://") :]
        if not FETCH_SOCKET_NAME.fullmatch(os.path.basename(path)):
            return
        removed = remove_stale_ipc_sockets(os.path.dirname(os.path.abspath(path)), FETCH_SOCKET_NAME)
        if removed:
            log.info("removed %d fetch sockets left by dead encoders", len(removed))

    def start(self) -> None:
        if self._fetch is not None:
            self._fetch.start()

    # ------------------------------------------------------------ broker messages

    def heartbeat(self) -> P.Heartbeat:
        return P.Heartbeat(self.ring.used_bytes, self.ring.pinned_bytes, self.ring.entry_count)

    def abandon(self) -> None:
        """The link is about to register again: a new broker (or one that dropped us) knows none
        of our entries or jobs, and takes whatever we send after the REGISTER for the new
        registration (which may send the same job ids again). So the old jobs are dropped and,
        those in the batch being encoded now included, never answered. Synchronous: it runs
        before the REGISTER leaves."""
        self._epoch += 1
        dropped = self.ring.clear()
        jobs = len(self._jobs) + len(self._blocked)
        self._jobs.clear()
        self._blocked.clear()
        if dropped or jobs or self._encoding:
            log.info("registering again: dropped %d ring entries and %d pending jobs%s", dropped, jobs,
                     " (the batch being encoded is not reported)" if self._encoding else "")  # fmt: skip

    def handle(self, msg: Any, payload: list[Any]) -> None:
        if isinstance(msg, P.Encode):
            if len(msg.key) != KEY_BYTES:
                self.link.send(P.EncodeFailed(msg.job_id, msg.key[:KEY_BYTES], "protocol", "encode keys are 16 bytes"))
                return
            self._jobs.append(_Job(msg.job_id, msg.key, payload[0], self._epoch))
            self._wake.set()
        elif isinstance(msg, P.Pin):
            for e in msg.entries:
                if not self.ring.pin(e.key, e.generation):
                    # already gone: tell the broker so waiting requests re-encode
                    self.link.send(P.Evicted([e]))
        elif isinstance(msg, P.Unpin):
            for e in msg.entries:
                self.ring.unpin(e.key, e.generation)
            if self._blocked:
                self._wake.set()
        else:
            log.debug("encoder ignores %s", type(msg).__name__)

    # ------------------------------------------------------------ encode loop

    async def run(self) -> None:
        while True:
            if self._blocked:  # look again now and then: the broker is told again (see _retry_blocked)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RING_BLOCKED_REPORT_S)
            else:
                await self._wake.wait()
            self._wake.clear()
            self._retry_blocked()
            if not self._jobs:
                continue
            jobs = self._jobs
            batch = [jobs.popleft() for _ in range(min(len(jobs), self.max_batch))]
            self._encoding = True
            try:
                await self._encode_batch(batch)
            except Exception as e:  # no single job may end the loop
                log.exception("encode batch failed")
                for job in batch:
                    self._fail(job, _as_epdq_error(e))
            finally:
                self._encoding = False
            if self._jobs:
                self._wake.set()

    async def _encode_batch(self, batch: list[_Job]) -> None:
        t0 = time.perf_counter()
        if getattr(self.engine, "inline", False) and quick_to_decode(j.image for j in batch):
            good, images, failed = self._decode(batch)
        else:
            # a batch of large images takes seconds to decode: meanwhile this loop keeps
            # answering pins, fetches and heartbeats (an engine that is not inline runs its
            # forward on a thread anyway)
            good, images, failed = await asyncio.to_thread(self._decode, batch)
        for job, e in failed:
            self._fail(job, e)
        if not good:
            return
        try:
            outs = await self._call_engine(images)
        except Exception as e:
            if len(good) > 1:
                # one bad image must not fail its batch-mates: encode them one by one
                for job, image in zip(good, images, strict=True):
                    await self._encode_one(job, image)
                self._report_evictions()
                return
            self._fail(good[0], _as_epdq_error(e))
            return
        per_image = (time.perf_counter() - t0) / len(good)
        if log.isEnabledFor(logging.DEBUG):  # the broker logs which requests these jobs serve
            log.debug("encoded jobs %s in %.3f s", [j.job_id for j in good], per_image * len(good),
                      extra={"event": "encoded", "job_ids": str([j.job_id for j in good])})  # fmt: skip
        with self._announcing():
            for job, out in zip(good, outs, strict=True):
                if not self._store(job, out, per_image):
                    self._block(job, out, per_image)
        self._report_evictions()

    def _decode(self, batch: list[_Job]) -> tuple[list[_Job], list[Any], list[tuple[_Job, EpdqError]]]:
        """(jobs whose image decoded, their images, (job, error) of the others). Thread-safe: it
        only reads the jobs."""
        good, images, failed = [], [], []
        for job in batch:
            try:
                images.append(decode_image(job.image, max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels))
                good.append(job)
            except EpdqError as e:
                failed.append((job, e))
        return good, images, failed

    async def _encode_one(self, job: _Job, image: Any) -> None:
        t0 = time.perf_counter()
        try:
            (out,) = await self._call_engine([image])
        except Exception as e:
            self._fail(job, _as_epdq_error(e))
            return
        with self._announcing():
            if not self._store(job, out, time.perf_counter() - t0):
                self._block(job, out, time.perf_counter() - t0)

    async def _call_engine(self, images: list) -> list[EncodedImage]:
        if getattr(self.engine, "inline", False):  # cheap engines: a thread hop would cost more
            return self.engine.encode(images)
        # a real forward runs in a thread so heartbeats and fetches keep flowing
        return await asyncio.to_thread(self.engine.encode, images)

    def _store(self, job: _Job, out: EncodedImage, encode_s: float) -> bool:
        if job.epoch != self._epoch:
            return True  # a job of the previous registration (abandoned while it was encoded)
        early = self._fills is not None
        t = out.embeds
        try:
            loc = self.ring.reserve(job.key, t.nbytes) if early else self.ring.write(job.key, t)
        except RingFullError as e:
            self._fail(job, e)
            return True
        if loc is None:
            return False  # every candidate region is pinned; retried after the next unpin
        if early:
            self._fills.append((job.key, loc.generation, t))
            self._fill_bytes += t.nbytes
        try:
            ref = P.EmbedRef(
                job.key, self.worker_id, self.node, self.ring.name, loc.offset, loc.nbytes, loc.generation,
                str(t.dtype).removeprefix("torch."), list(t.shape), list(out.grid_thw), self.fetch_endpoint,
                self._ring_kind,  # the IPC handle of a CUDA ring is stamped on by the broker (see REGISTER)
            )  # fmt: skip
            self.link.send(P.Encoded(job.job_id, ref, encode_s))
        except BaseException:
            self.ring.unpin(job.key, loc.generation)  # nobody was told of it: cache, not pinned for good
            raise
        self.encoded += 1
        if early and self._fill_bytes >= ANNOUNCE_AHEAD_BYTES:
            self._fill_now()  # a PD worker waits for at most this much copying
        return True

    @contextlib.contextmanager
    def _announcing(self):
        """Store results in the ring announcing each entry before its bytes are in: the
        completion events leave first and travel to the broker and on to a PD worker while the
        bytes are copied (a PD worker that gets there first waits for them: RingReader.
        wait_published). Rings that cannot announce early (a CUDA ring) write, then announce."""
        if not getattr(self.ring, "announces_early", False) or self._fills is not None:
            yield
            return
        self._fills, self._fill_bytes = [], 0
        try:
            yield
        finally:
            self._fill_now()
            self._fills = None

    def _fill_now(self) -> None:
        """Send the completion events queued in `_announcing` (and the evictions their placement
        caused: the broker must not send cache hits to entries that are gone), then copy the
        announced entries in."""
        fills, self._fills, self._fill_bytes = self._fills, [], 0
        if not fills:
            return
        self._report_evictions()
        self.link.flush()
        for key, generation, tensor in fills:
            try:
                self.ring.fill(key, generation, tensor)  # False: cleared meanwhile (re-registration)
            except Exception:  # the entry is dropped and reported evicted: it is encoded again
                log.exception("could not copy an embedding into the ring")

    def _block(self, job: _Job, out: EncodedImage, encode_s: float) -> None:
        """No room for `out` now: keep it, and tell the broker, which may release pins that can
        never be freed otherwise (see Scheduler.on_ring_blocked). Later results that fit go
        ahead of it: one large entry must not hold up every other request on this encoder."""
        self._blocked.append((job, out, encode_s, time.monotonic()))
        self.link.send(P.RingBlocked(job.job_id, out.embeds.numel() * out.embeds.element_size()))

    def _retry_blocked(self) -> None:
        if self._blocked:
            with self._announcing():
                self._retry_blocked_now()
        self._report_evictions()

    def _retry_blocked_now(self) -> None:
        now = time.monotonic()
        for _ in range(len(self._blocked)):
            job, out, encode_s, told = self._blocked.popleft()
            if self._store(job, out, encode_s):
                continue
            if now - told >= RING_BLOCKED_REPORT_S:
                # still no room: other requests may have pinned what was released meanwhile
                self.link.send(P.RingBlocked(job.job_id, out.embeds.numel() * out.embeds.element_size()))
                told = now
            self._blocked.append((job, out, encode_s, told))  # it keeps its turn

    def _report_evictions(self) -> None:
        ev = self.ring.drain_evicted()
        if ev:
            self.link.send(P.Evicted([P.EntryId(k, g) for k, g in ev]))

    def _fail(self, job: _Job, err: EpdqError) -> None:
        level = logging.INFO if err.code == "invalid_input" else logging.WARNING  # a bad image is the client's
        log.log(level, "encode job %d failed: %s: %s", job.job_id, err.code, err.message,
                extra={"event": "encode_failed", "job_id": job.job_id, "code": err.code})  # fmt: skip
        if job.epoch == self._epoch:  # an abandoned job (see abandon) is never answered
            self.link.send(P.EncodeFailed(job.job_id, job.key, err.code, err.message))

    # ------------------------------------------------------------ remote fetch

    def _on_fetch(self, frames: list[Any]) -> None:
        assert self._fetch is not None
        ident = frames[0]
        try:
            msg, _ = P.decode(frames[1:], max_payload_frames=0)
        except ProtocolError:
            return
        if not isinstance(msg, P.Fetch):
            return
        try:
            *chunks, seal = self.ring.fetch_frames(msg.offset, msg.nbytes, msg.key, msg.generation)
        except (StaleEmbeddingError, EpdqError) as e:
            self._reply([ident, *P.encode(P.Fetched(msg.nonce, e.code, e.message))])
            return
        except Exception as e:  # bad offsets from a confused peer must not kill the encoder
            self._reply([ident, *P.encode(P.Fetched(msg.nonce, "invalid_input", str(e)[:200]))])
            return
        # The seal as a Frame of its own: pyzmq copies small buffers at send time, and the seal
        # must be read after the bytes, on ZeroMQ's I/O thread (RingWriter.fetch_frames)
        head = P.encode(P.Fetched(msg.nonce, frames=len(chunks)))
        self._reply([ident, *head, *chunks, zmq.Frame(seal, copy=False)], copy=False)

    def _reply(self, frames: list[Any], copy: bool = True) -> None:
        assert self._fetch is not None
        try:
            self._fetch.send(frames, copy=copy)
        except PeerUnreachable:
            pass  # the fetcher left; it asked again elsewhere or gave up
        except zmq.Again:
            # it does not read its answers (a copy of an embedding each): they are dropped, where
            # they used to pile up in this process (it times out as for an unreachable encoder)
            self.fetch_replies_dropped += 1
            if self.fetch_replies_dropped in (1, 1000) or self.fetch_replies_dropped % 100_000 == 0:
                log.warning("dropped %d fetch answers to a peer that does not read them", self.fetch_replies_dropped)

    def close(self) -> None:
        if self._fetch is not None:
            self._fetch.close()  # removes an ipc socket file too (transport.close_socket)


def _as_epdq_error(e: BaseException) -> EpdqError:
    if isinstance(e, EpdqError):
        return e
    log.error("vision forward failed", exc_info=e)
    return InternalError(f"vision forward failed: {type(e).__name__}: {e}"[:500])
