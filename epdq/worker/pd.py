"""PD worker: runs prefill+decode in a PDEngine fed precomputed image embeddings.

Each PREFILL becomes a task: read the embeddings (a view of the ring copied once on the same
node; fetched from the owning encoder over ZeroMQ from another node), check their hash and
generation, run the engine, stream token deltas to the broker. Role `both` gets image files
instead and lets the engine encode them (the colocated baseline). Every request ends with a
final TOKENS (finish_reason set) or a PD_FAILED, so the broker's credit accounting stays exact.

Before the worker registers again (see epdq.worker.link) its runs are abandoned: out of
`_tasks`, cancelled, and silent from then on (a task sends only while it is the live run of its
request), because the broker takes anything sent after the REGISTER for the new registration,
which may hand the same request ids back to this worker. A PREFILL for such an id starts a
fresh run, once the abandoned one has left the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import numpy as np
import torch
import zmq

from epdq import protocol as P
from epdq.channel import Channel
from epdq.deadlines import Deadlines
from epdq.engines.base import PDEngine, SamplingSpec
from epdq.errors import (
    ConfigError,
    EngineError,
    EntryPending,
    EpdqError,
    FetchFailedError,
    InvalidInputError,
    ProtocolError,
    StaleEmbeddingError,
)
from epdq.keys import own_public_key
from epdq.media import decode_image, quick_to_decode
from epdq.ring import entry_seal
from epdq.ring_reader import RingReader
from epdq.transport import endpoint_problem, make_socket

log = logging.getLogger("epdq.pd")

_MAX_FETCH_CHANNELS = 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RemoteFetcher:
    """Fetches ring bytes from encoders on other nodes (one DEALER per encoder endpoint)."""

    def __init__(
        self, ctx: zmq.Context, *, timeout_s: float = 10.0, max_bytes: int = 512 * 2**20, security: Any = None
    ):
        self._ctx = ctx
        self._channels: dict[str, Channel] = {}
        self._waiters: dict[int, asyncio.Future] = {}
        self._nonce = itertools.count(1)
        self.timeout_s = timeout_s
        self._max_bytes = max_bytes
        self._security = security
        # encoders serve fetches with the worker key pair, which this process holds too
        self._server_public = own_public_key(security) if security is not None else None

    def _channel(self, endpoint: str) -> Channel:
        ch = self._channels.pop(endpoint, None)
        if ch is None:
            if len(self._channels) >= _MAX_FETCH_CHANNELS:  # bounded: drop the least recently used
                oldest = next(iter(self._channels))
                self._channels.pop(oldest).close()
            # not inproc: there the frames would be the encoder's ring itself, read after the seal
            if not endpoint.startswith(("tcp://", "ipc://")) or endpoint_problem(endpoint):
                # an encoder's advertised endpoint: its settings, not the client's input
                raise FetchFailedError(f"bad fetch endpoint {endpoint[:64]!r}")
            try:
                sock = make_socket(
                    self._ctx, zmq.DEALER, connect=endpoint, max_message_bytes=self._max_bytes,
                    security=self._security, server_public=self._server_public,
                )  # fmt: skip
            except zmq.ZMQError as e:
                raise FetchFailedError(f"bad fetch endpoint {endpoint[:64]!r}: {e}") from None
            except ConfigError as e:  # e.g. no keys for a tcp endpoint off loopback: this link, not the client
                raise FetchFailedError(f"cannot fetch from {endpoint[:64]!r}: {e.message}") from None
            ch = Channel(sock, self._on_frames)
            ch.start()
        self._channels[endpoint] = ch  # re-inserted: dict order is recency
        return ch

    def _on_frames(self, frames: list[Any]) -> None:
        try:
            msg, payload = P.decode(frames, max_payload_frames=P.MAX_PAYLOAD_FRAMES)
        except ProtocolError:
            return
        if isinstance(msg, P.Fetched):
            fut = self._waiters.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result((msg, payload))

    async def fetch(self, ref: P.EmbedRef) -> list[memoryview]:
        """The entry's bytes, in the frames they came in (`from_chunks` makes them a tensor)."""
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[nonce] = fut
        try:
            ch = self._channel(ref.fetch_endpoint)
            try:
                ch.send(P.encode(P.Fetch(nonce, ref.key, ref.generation, ref.offset, ref.nbytes)))
            except zmq.ZMQError as e:  # e.g. EAGAIN once ZeroMQ gave the link up (a refused CURVE key)
                self._channels.pop(ref.fetch_endpoint, None)
                ch.close()  # the next fetch connects afresh
                raise FetchFailedError(
                    f"cannot send a fetch to encoder {ref.encoder_id} at {ref.fetch_endpoint}: {e}"
                ) from None
            async with asyncio.timeout(self.timeout_s):
                msg, payload = await fut
        except TimeoutError:
            raise FetchFailedError(
                f"encoder {ref.encoder_id} at {ref.fetch_endpoint} did not answer a fetch within {self.timeout_s:g} s"
            ) from None
        finally:
            self._waiters.pop(nonce, None)
        if msg.code:
            raise StaleEmbeddingError(f"remote fetch failed: {msg.code}: {msg.message}")
        *chunks, seal = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in payload]  # decode: 2 at least
        if sum(c.nbytes for c in chunks) != ref.nbytes:
            raise StaleEmbeddingError("remote fetch returned the wrong number of bytes")
        if seal != entry_seal(ref.key, ref.generation, ref.nbytes):
            # the encoder sends straight from its ring: the entry was replaced before ZeroMQ had sent it
            raise StaleEmbeddingError(f"entry {ref.key.hex()}@{ref.generation} was overwritten while it was sent")
        return chunks

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()


def from_chunks(
    chunks: list[memoryview], dtype: torch.dtype, shape: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """A fetched entry as a tensor of `shape`: its one frame itself (no copy) when no `out` is given,
    else its frames copied in order into `out` (contiguous), or into a new tensor."""
    if out is None and len(chunks) == 1:
        return torch.frombuffer(chunks[0], dtype=dtype).view(shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1).view(torch.uint8)
    pos = 0
    for c in chunks:
        if c.nbytes:
            flat[pos : pos + c.nbytes].copy_(torch.frombuffer(c, dtype=torch.uint8))
            pos += c.nbytes
    return out


class PDWorker:
    def __init__(
        self,
        engine: PDEngine,
        *,
        worker_id: str,
        node: str,
        colocated: bool,
        max_image_bytes: int,
        max_image_pixels: int,
        ctx: zmq.Context | None = None,
        security: Any = None,
        device: str = "cpu",
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.node = node
        self.colocated = colocated
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self._ctx = ctx or zmq.Context.instance()
        self.reader = RingReader()
        self.fetcher = RemoteFetcher(self._ctx, security=security)
        self._tasks: dict[str, asyncio.Task] = {}  # the live run of each request
        # runs of a previous registration (see abandon), until they have left the engine
        self._abandoned: dict[asyncio.Task, str] = {}
        # each run's deadline (PREFILL's timeout_s): one timer for all of them, made on first use
        self._deadlines: Deadlines | None = None
        self._expired: set[asyncio.Task] = set()  # runs cancelled by their deadline, until they end
        self.link: Any = None
        self.local_reads = 0
        self.remote_reads = 0
        # times a viewed ring entry was found overwritten after the engine read it: its caches
        # were then cleared (see _forget_cached_inputs)
        self.stale_views = 0
        # where the engine wants its embeddings; on a GPU, entries of CUDA rings on the same GPU
        # are copied device-to-device (epdq.ring_cuda), everything else is copied up once
        self.device = torch.device(device)
        self.cuda_reader: Any = None
        self.cuda_reads = 0
        self._warned_rings: set[str] = set()
        # why the engine is dead for good (vLLM's EngineCore process gone), once it is: the runner
        # then leaves the broker, which re-queues what had not streamed, and the process exits non-zero
        self.death = ""
        if self.device.type == "cuda":
            from epdq.ring_cuda import CudaRingReader

            self.cuda_reader = CudaRingReader(self.device)

    def idle(self) -> bool:
        """No request in hand (a draining worker may leave)."""
        return not self._tasks

    def heartbeat(self) -> P.Heartbeat:
        self.reader.release_unlinked()  # once a heartbeat: a few fstat calls
        return P.Heartbeat()

    def abandon(self) -> None:
        """The link is about to register again: the broker that sent these requests is gone or has
        dropped us (and re-queued them, perhaps back to us under the same ids). It takes whatever
        we send after the REGISTER for the new registration, so from now on these runs send
        nothing: out of `_tasks` (a re-sent PREFILL starts afresh), then cancelled (their
        sequences leave the engine). Synchronous: it runs before the REGISTER leaves."""
        if not self._tasks:
            return
        old, self._tasks = self._tasks, {}
        for rid, t in old.items():
            self._abandoned[t] = rid
            t.cancel()
        log.warning("registering again: dropped %d requests of the previous registration (the broker "
                    "re-queues those that had not streamed)", len(old), extra={"event": "pd_abandoned"})  # fmt: skip

    def handle(self, msg: Any, payload: list[Any]) -> None:
        if isinstance(msg, P.Prefill):
            if msg.request_id in self._tasks:
                return  # duplicate delivery; the running task answers
            task = asyncio.create_task(self._run(msg, payload))
            self._tasks[msg.request_id] = task
            task.add_done_callback(lambda t, rid=msg.request_id: self._task_done(rid, t))
        elif isinstance(msg, P.Abort):
            task = self._tasks.get(msg.request_id)
            if task is not None:
                task.cancel()
        else:
            log.debug("pd worker ignores %s", type(msg).__name__)

    def _task_done(self, rid: str, task: asyncio.Task) -> None:
        self._expired.discard(task)
        if self._tasks.get(rid) is not task:
            self._abandoned.pop(task, None)  # abandoned: the broker hears nothing more of it
            return
        del self._tasks[rid]
        if task.cancelled():
            # Cancelled before its first step (a PREFILL and its ABORT in one batch), or again
            # while it was aborting: _run never said so, and the broker holds this worker's slot
            # until it hears (it used to leak the slot for good).
            self.link.send(P.PdFailed(rid, "cancelled", "aborted by the broker"))

    def _send(self, rid: str, msg: Any, me: asyncio.Task | None) -> None:
        """Send for the running task `me`, if it is still the live run of `rid` (not abandoned)."""
        if self._tasks.get(rid) is me:
            self.link.send(msg)

    async def _after_abandoned(self, rid: str) -> None:
        """Wait until the abandoned runs of `rid` have left the engine: their abort, by request
        id, must not hit this run, nor may two sequences of one id be in the engine at once."""
        old = [t for t, r in self._abandoned.items() if r == rid]
        if old:
            await asyncio.wait(old)

    def _expire(self, task: asyncio.Task) -> None:
        if not task.done():
            self._expired.add(task)
            task.cancel()

    async def _run(self, msg: P.Prefill, payload: list[Any]) -> None:
        rid = msg.request_id
        t0 = time.perf_counter()
        images = len(msg.embeds) or msg.n_images
        me = asyncio.current_task()
        try:
            if not 0 < msg.timeout_s <= 86400:  # also NaN: the deadline would never come
                raise InvalidInputError(f"timeout_s must be in (0, 86400], got {msg.timeout_s}")
            # as `asyncio.timeout(msg.timeout_s)` around the run, without a loop timer per request
            deadlines = self._deadlines
            if deadlines is None:
                deadlines = self._deadlines = Deadlines(asyncio.get_running_loop(), self._expire)
            deadlines.add_after(me, msg.timeout_s)
            try:
                await self._after_abandoned(rid)
                tokens, finish = await self._generate(msg, payload, me)
            except asyncio.CancelledError:
                if me not in self._expired:
                    raise  # the broker's abort, or the worker closing
                raise TimeoutError from None
            finally:
                deadlines.discard(me)
                if me in self._expired:
                    self._expired.discard(me)
                    me.uncancel()  # that cancellation was the deadline's, and is answered
        except asyncio.CancelledError:
            await self._abort_engine(rid)
            self._send(rid, P.PdFailed(rid, "cancelled", "aborted by the broker"), me)
            live = self._tasks.get(rid) is me
            self._log_end(rid, t0, images, "cancelled" if live else "abandoned", logging.INFO)
        except TimeoutError:
            await self._abort_engine(rid)
            self._send(rid, P.PdFailed(rid, "deadline", "deadline passed on the PD worker"), me)
            self._log_end(rid, t0, images, "deadline")
        except StaleEmbeddingError as e:
            stale = [P.EntryId(r.key, r.generation) for r in msg.embeds]
            self._send(rid, P.PdFailed(rid, e.code, e.message, stale), me)
            self._log_end(rid, t0, images, e.code, detail=e.message)
        except EpdqError as e:
            if self.check_engine():
                return  # no PdFailed: once we leave, the broker gives the request to another worker
            self._send(rid, P.PdFailed(rid, e.code, e.message), me)
            self._log_end(rid, t0, images, e.code, detail=e.message)
        except Exception as e:
            if self.check_engine():
                return
            log.exception("request %s failed in the engine", rid, extra={"request_id": rid, "event": "pd_error"})
            self._send(rid, P.PdFailed(rid, "engine", f"{type(e).__name__}: {e}"[:500]), me)
        else:
            if log.isEnabledFor(logging.DEBUG):  # the broker logs each request's end at info level
                log.debug(
                    "request %s done: %d tokens (%s), %d images, %.3f s", rid, tokens, finish, images,
                    time.perf_counter() - t0,
                    extra={"request_id": rid, "event": "pd_done", "tokens": tokens, "finish_reason": finish,
                           "images": images, "seconds": round(time.perf_counter() - t0, 6)},
                )  # fmt: skip

    def check_engine(self) -> bool:
        """True (and `death` set) once the engine is dead for good."""
        if not self.death and getattr(self.engine, "dead", False):
            self.death = str(getattr(self.engine, "dead_reason", "") or "the engine process is gone")
            log.error("engine dead (%s): leaving the broker; its requests go to other workers", self.death,
                      extra={"event": "engine_dead"})  # fmt: skip
        return bool(self.death)

    @staticmethod
    def _log_end(rid: str, t0: float, images: int, code: str, level: int = logging.WARNING, detail: str = "") -> None:
        log.log(
            level, "request %s ended: %s after %.3f s%s", rid, code, time.perf_counter() - t0,
            f" ({detail})" if detail else "",
            extra={"request_id": rid, "event": "pd_failed", "code": code, "images": images,
                   "seconds": round(time.perf_counter() - t0, 6)},
        )  # fmt: skip

    async def _abort_engine(self, rid: str) -> None:
        try:
            await self.engine.abort(rid)
        except Exception:
            log.exception("abort of %s failed", rid)

    async def _generate(self, msg: P.Prefill, payload: list[Any], me: asyncio.Task | None) -> tuple[int, str]:
        if self.death:  # set here, not by the engine, when its caches could not be cleared
            raise EngineError(f"this worker is leaving: {self.death}")
        s = msg.sampling
        try:
            sampling = SamplingSpec(s.max_tokens, s.temperature, s.top_p, s.seed, tuple(s.stop), s.ignore_eos)
        except ValueError as e:
            raise InvalidInputError(str(e)) from None
        prompt = self.engine.render_prompt(P.messages_to_openai(msg.messages))
        kwargs: dict[str, Any] = {}
        viewed: P.EmbedRef | None = None  # a ring entry the engine reads in place; checked after
        if self.colocated:
            if msg.embeds:
                raise InvalidInputError("a colocated worker takes images, not embeddings")
            if payload:
                if quick_to_decode(payload):
                    kwargs["images"] = self._decode(payload)
                else:  # not on the loop that streams every other sequence's tokens
                    kwargs["images"] = await asyncio.to_thread(self._decode, payload)
        elif msg.embeds:
            kwargs["image_embeds"], kwargs["image_grid_thw"], viewed = await self._gather(msg.embeds)
        elif payload:
            raise InvalidInputError("a PD worker takes embeddings, not images")
        final = None
        n = 0
        stale_view = False
        stream = self.engine.generate(msg.request_id, prompt, sampling, **kwargs)
        try:
            async for d in stream:
                if viewed:
                    # the engine has its copy of the embeddings by now: verify it read intact bytes
                    r, viewed = viewed, None
                    try:
                        self.reader.check(r.segment, r.offset, r.nbytes, r.key, r.generation)
                    except StaleEmbeddingError:
                        stale_view = True
                        raise
                if d.finish_reason is not None:
                    final = d
                    break
                if d.token_ids or d.text:
                    n += len(d.token_ids)
                    self._send(msg.request_id, P.Tokens(msg.request_id, list(d.token_ids), d.text), me)
            if final is None:
                raise EngineError("the engine stopped without a finish reason")
            self._send(
                msg.request_id,
                P.Tokens(msg.request_id, list(final.token_ids), final.text, final.finish_reason, None,
                         final.prompt_tokens),
                me,
            )  # fmt: skip
            # One more step lets the engine's generator end by itself. Left suspended after its
            # last delta, it was closed later by the event loop's async-generator finalizer: a
            # self-pipe write (a system call) and a task per request; and closing vLLM's stream
            # before its end aborts the request, finished or not (one more message to its core).
            try:
                await anext(stream, None)
            except Exception:  # the request is answered: what the engine does after it is its own
                log.debug("the engine's stream of %s failed after its last delta", msg.request_id, exc_info=True)
        finally:
            if viewed is not None:
                # ended before its first delta (refused, failed, cancelled): it may have read the
                # view all the same, and cached what it read
                stale_view = not self._intact(viewed)
            await stream.aclose()  # nothing to do once it has ended; an early exit closes it now
            if stale_view:
                # after the close: the request has left the engine, or it would cache its bytes again
                await asyncio.shield(self._forget_cached_inputs(msg.request_id))
        return n + len(final.token_ids), final.finish_reason

    def _intact(self, r: P.EmbedRef) -> bool:
        try:
            self.reader.check(r.segment, r.offset, r.nbytes, r.key, r.generation)
        except EpdqError:
            return False
        return True

    async def _forget_cached_inputs(self, rid: str) -> None:
        """The engine read a ring entry in place that was overwritten meanwhile. vLLM hashes its
        input before it copies it: it may have computed (and kept, in its prefix and multimodal
        caches) KV of the wrong bytes under the right image's hash, which the broker's retry, the
        same image, would reuse. The engine forgets what it cached before the request fails."""
        self.stale_views += 1
        forget = getattr(self.engine, "forget_cached_inputs", None)
        log.warning(
            "request %s: its embeddings were overwritten while the engine read them; %s", rid,
            "clearing the engine's cached inputs" if forget else "the engine caches no inputs",
            extra={"request_id": rid, "event": "pd_stale_view", "stale_views": self.stale_views},
        )  # fmt: skip
        if forget is None:
            return
        try:
            await forget()
        except Exception as e:
            # its caches may hold KV of the wrong bytes: served on, it could answer the retry with
            # wrong tokens. Leave instead (as for a dead engine); a restart starts with empty caches.
            self.death = f"could not clear the engine's cached inputs after overwritten embeddings: {e}"[:300]
            log.exception("request %s: %s", rid, self.death, extra={"request_id": rid, "event": "engine_dead"})

    def _decode(self, frames: list[Any]) -> list[Any]:
        return [decode_image(f, max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels) for f in frames]

    async def _gather(self, refs: list[P.EmbedRef]) -> tuple[torch.Tensor, torch.Tensor, P.EmbedRef | None]:
        """Embeddings of every image in prompt order in ONE tensor, and their grids [n, 3].

        One image on this node: a zero-copy view of the ring entry (the engine makes the only
        copy; the returned ref must be checked after it did). Otherwise each entry is copied once,
        straight into its rows of the result; an image repeated in the prompt is copied from its
        first rows instead of being read again.
        """
        hidden = self.engine.hidden_size
        dtype = _DTYPES.get(refs[0].dtype)
        for r in refs:
            if (
                _DTYPES.get(r.dtype) is not dtype
                or dtype is None
                or len(r.shape) != 2
                or r.shape[1] != hidden
            ):
                raise InvalidInputError(
                    f"embedding {r.dtype}{r.shape} does not fit this model (hidden {hidden})"
                )
            if len(r.grid) != 3 or self.engine.expected_embed_rows([r.grid]) != r.shape[0]:
                raise InvalidInputError(f"embedding rows {r.shape[0]} do not match grid {r.grid}")
            if r.nbytes != r.shape[0] * r.shape[1] * dtype.itemsize:
                # the ring reader refuses such an entry, but a fetch copies only nbytes into the
                # result: the rows past them reached the engine uninitialised (torch.empty)
                raise ProtocolError(f"shape {tuple(r.shape)} of {dtype} does not hold {r.nbytes} bytes")
        # through numpy: torch.tensor of a nested list took ~20 us per request with the caches cold,
        # as they are in a worker woken for one request (8 % of a PD worker's time on cache hits)
        grid = torch.from_numpy(np.array([r.grid for r in refs], dtype=np.int64))
        if self.device.type != "cpu":
            return await self._gather_device(refs, dtype, hidden), grid, None
        r = refs[0]
        if len(refs) == 1 and self._local_shm(r):
            self.local_reads += 1
            view, published = self.reader.view_early(
                r.segment, r.offset, r.nbytes, r.key, r.generation, dtype, tuple(r.shape)
            )
            if not published:  # announced while its encoder was still copying it in
                await self.reader.wait_published(r.segment, r.offset, r.nbytes, r.key, r.generation)
            return view, grid, r
        embeds = torch.empty((sum(r.shape[0] for r in refs), hidden), dtype=dtype)
        first: dict[tuple[bytes, int], torch.Tensor] = {}
        row = 0
        for r in refs:
            out = embeds[row : row + r.shape[0]]
            row += r.shape[0]
            ident = (r.key, r.generation)
            if ident in first:
                out.copy_(first[ident])
                continue
            if self._local_shm(r):
                await self._read_local(r, dtype, out)
                self.local_reads += 1
            else:
                from_chunks(await self.fetcher.fetch(r), dtype, r.shape, out)
                self.remote_reads += 1
            first[ident] = out
        return embeds, grid, None

    async def _read_local(self, r: P.EmbedRef, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """One copy of a ring entry on this node; one still being copied in by its encoder is
        copied out behind the encoder's copy, not after it."""
        args = (r.segment, r.offset, r.nbytes, r.key, r.generation)
        try:
            return self.reader.read(*args, dtype, tuple(r.shape), out=out)
        except EntryPending:  # announced while its encoder was still copying it in
            return await self.reader.read_as_filled(*args, dtype, tuple(r.shape), out=out)

    def _local_shm(self, r: P.EmbedRef) -> bool:
        """A shared-memory ring entry on this node (a CUDA ring entry never is: its name is no segment)."""
        return r.ring_kind in ("", "shm") and r.node == self.node and bool(r.segment)

    def _local_cuda(self, r: P.EmbedRef) -> bool:
        """An entry of a CUDA ring on this worker's GPU that this process can map."""
        if self.cuda_reader is None or r.ring_kind != "cuda" or r.node != self.node:
            return False
        if self.cuda_reader.usable(r):
            if r.segment not in self._warned_rings:
                self._warned_rings.add(r.segment)
                log.info("mapped CUDA ring %s of %s: device-to-device reads", r.segment, r.encoder_id)
            return True
        why = self.cuda_reader.failure(r.segment)
        if r.segment not in self._warned_rings:
            self._warned_rings.add(r.segment)
            log.warning(
                "CUDA ring %s of %s: %s; reading its entries through the encoder's fetch socket", r.segment,
                r.encoder_id, why or "on another GPU" if r.cuda_ring is not None else "no IPC handle in the reference",
            )  # fmt: skip
        return False

    async def _gather_device(self, refs: list[P.EmbedRef], dtype: torch.dtype, hidden: int) -> torch.Tensor:
        """`_gather` for an engine on a GPU: one tensor on that GPU; CUDA ring entries on the same GPU
        are copied device-to-device, other entries are read to host memory first and copied up."""
        host: dict[tuple[bytes, int], torch.Tensor] = {}
        for r in refs:  # first everything that awaits: no stream context may span an await
            ident = (r.key, r.generation)
            if ident in host or self._local_cuda(r):
                continue
            if self._local_shm(r):
                host[ident] = await self._read_local(r, dtype)
                self.local_reads += 1
            else:
                host[ident] = from_chunks(await self.fetcher.fetch(r), dtype, r.shape)
                self.remote_reads += 1
        rd = self.cuda_reader
        embeds = rd.empty((sum(r.shape[0] for r in refs), hidden), dtype)
        first: dict[tuple[bytes, int], torch.Tensor] = {}
        row = 0
        with rd.stream():
            for r in refs:
                out = embeds[row : row + r.shape[0]]
                row += r.shape[0]
                ident = (r.key, r.generation)
                if ident in first:
                    out.copy_(first[ident])
                elif ident in host:
                    out.copy_(host[ident])
                else:
                    rd.read(r, dtype, out=out)  # checked against the ring's header after the copy
                    self.cuda_reads += 1
                first[ident] = out
        return rd.finish(embeds)

    def close(self) -> None:
        for t in [*self._tasks.values(), *self._abandoned]:
            t.cancel()
        if self._deadlines is not None:
            self._deadlines.close()
        self.fetcher.close()
        self.reader.close()
        if self.cuda_reader is not None:
            log.info(
                "embedding reads: cuda=%d shm=%d remote=%d", self.cuda_reads, self.local_reads, self.remote_reads
            )
            self.cuda_reader.close()
