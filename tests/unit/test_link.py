"""A worker's link to the broker, against a scripted broker socket (real ZeroMQ, ipc)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch
import zmq

from epdq import media
from epdq import protocol as P
from epdq.worker.link import BrokerLink

pytestmark = pytest.mark.timeout(30)


def register() -> P.Register:
    return P.Register("pd-test", "pd", "n", 4, "scope", "m", 1)


@pytest.fixture
def broker(tmp_path):
    """A bare ROUTER standing in for the broker; closed at the end."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/b.sock"
    sock.bind(addr)
    yield addr, sock
    sock.close(0)
    ctx.term()


async def recv_all(sock: zmq.Socket, wait_s: float, *, until: int = 0) -> list[tuple[bytes, object]]:
    """Every message that arrives within `wait_s`, decoded (BATCHes opened); with `until`, stop
    as soon as that many have arrived (a loaded machine may take longer than `wait_s` for them)."""
    out = []
    end = time.monotonic() + wait_s
    while time.monotonic() < end or len(out) < until:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await asyncio.sleep(0.01)
            continue
        ident, body = frames[0], frames[1:]
        parts = P.split_batch(body) if body[0] == P.BATCH_TYPE else [body]
        out += [(ident, P.decode(p)[0]) for p in parts]
    return out


@contextlib.asynccontextmanager
async def registering(broker, heartbeat_s: float):
    """A started link and the identity its REGISTER came from; closed at the end."""
    addr, sock = broker
    link = BrokerLink(addr, register(), lambda m, p: None, heartbeat_s=heartbeat_s, liveness=5)
    link.start()
    try:
        (ident, reg), = await asyncio.wait_for(recv_all(sock, 0.3, until=1), 10)
        assert isinstance(reg, P.Register)
        yield link, ident
    finally:
        link.close()


async def test_byes_that_arrive_together_get_one_register(broker):
    _, sock = broker
    async with registering(broker, 0.5) as (link, ident):
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        # a new broker answering five queued heartbeats: five BYEs in a row
        for _ in range(5):
            sock.send_multipart([ident, *P.encode(P.Bye("unknown worker: register again"))])
        got = [m for _, m in await recv_all(sock, 0.4) if isinstance(m, P.Register)]
        assert len(got) == 1  # it used to be five: the broker dropped and re-registered it 4 times
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        sock.send_multipart([ident, *P.encode(P.Bye("later"))])  # registered again: a BYE counts anew
        assert [type(m) for _, m in await recv_all(sock, 0.3) if isinstance(m, P.Register)] == [P.Register]


async def test_reconnect_backoff_doubles_while_the_broker_stays_away(tmp_path):
    link = BrokerLink(f"ipc://{tmp_path}/nobody.sock", register(), lambda m, p: None, heartbeat_s=0.02, liveness=2)
    connects: list[float] = []
    real = link._connect
    link._connect = lambda: (connects.append(time.monotonic()), real())[1]
    link.start()
    try:
        await asyncio.sleep(1.6)
    finally:
        link.close()
    gaps = [b - a for a, b in zip(connects, connects[1:], strict=False)]
    # silence after ~0.06 s, then 0.02 s doubling: ~0.08, 0.1, 0.14, 0.22, 0.38, 0.7 s apart; it used
    # to stay ~0.08 s apart (the first heartbeat after a reconnect reset the backoff)
    assert 3 <= len(gaps) <= 8, gaps
    assert gaps[-1] > 3 * gaps[0], gaps


async def test_a_shorter_interval_from_the_broker_applies_at_once(broker):
    # the worker starts with its own 1 s; a broker asking for 0.1 s (and judging by it) used to get
    # the first heartbeat only after the full second, and dropped the worker right after it registered
    _, sock = broker
    async with registering(broker, 1.0) as (_link, ident):
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.1))])
        beats = [m for _, m in await recv_all(sock, 0.6) if isinstance(m, P.Heartbeat)]
        assert len(beats) >= 3, beats


async def test_after_a_brokers_farewell_its_successor_gets_a_register_at_once(broker):
    """A REGISTER sent on the old broker's shutdown BYE was lost with it, and the successor's
    "register again" was then ignored for 5 heartbeats: ~5 s of a cluster without workers after
    every planned broker restart."""
    _, sock = broker
    async with registering(broker, 0.5) as (link, ident):
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        sock.send_multipart([ident, *P.encode(P.Bye(P.BYE_SHUTTING_DOWN))])
        assert not [m for _, m in await recv_all(sock, 0.2) if isinstance(m, P.Register)]
        assert not link.registered.is_set()
        sock.send_multipart([ident, *P.encode(P.Bye("unknown worker: register again"))])  # the new broker
        got = [m for _, m in await recv_all(sock, 0.2) if isinstance(m, P.Register)]
        assert len(got) == 1


# ------------------------------------------------------------ registering again
#
# The broker takes whatever a worker sends after its REGISTER for the new registration (one ordered
# connection), and may hand the same request and job ids straight back to it. A PD worker paused
# past the broker's liveness (SIGSTOP) used to keep its old runs until their cancellation landed:
# the re-sent PREFILLs were dropped as duplicates, and the old runs' tokens, then PdFailed
# "cancelled", were taken for the new dispatch (EngineError, or tokens from mid-sequence, or a
# short output). tests/integration/test_pd_stall.py has the real processes.


async def test_work_is_abandoned_before_a_second_register_and_stale_work_is_dropped(broker):
    addr, sock = broker
    handled: list[str] = []
    abandoned: list[int] = []

    def on_register_again() -> None:
        # what the worker could still send at this moment reaches the broker before the REGISTER
        abandoned.append(link._registers_sent)
        link.send(P.PdFailed("last-words", "cancelled", "sent by the hook"))

    link = BrokerLink(
        addr, register(), lambda m, p: handled.append(m.request_id), heartbeat_s=0.5, liveness=5,
        on_register_again=on_register_again,
    )  # fmt: skip
    link.start()
    try:
        (ident, reg), = await asyncio.wait_for(recv_all(sock, 0.2, until=1), 10)
        assert isinstance(reg, P.Register) and abandoned == []  # the first REGISTER: nothing held yet
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        await asyncio.wait_for(link.registered.wait(), 5)
        sock.send_multipart([ident, *P.encode(P.Abort("first"))])
        # the broker dropped us (missed heartbeats) and says so: register again
        sock.send_multipart([ident, *P.encode(P.Bye("unknown worker: register again"))])
        got = [m for _, m in await recv_all(sock, 0.3, until=2) if not isinstance(m, P.Heartbeat)]
        assert [type(m) for m in got] == [P.PdFailed, P.Register], got
        assert abandoned == [1]
        # sent before the broker read that REGISTER: work of the registration it ended
        sock.send_multipart([ident, *P.encode(P.Abort("stale"))])
        await asyncio.sleep(0.1)
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5))])
        sock.send_multipart([ident, *P.encode(P.Abort("new"))])
        end = time.monotonic() + 5
        while len(handled) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.01)
        assert handled == ["first", "new"] and link.stale_dropped == 1
    finally:
        link.close()


async def test_a_reconnect_abandons_the_work_before_the_backoff(broker):
    addr, sock = broker
    abandoned: list[int] = []  # reconnects counted when the hook ran
    link = BrokerLink(addr, register(), lambda m, p: None, heartbeat_s=0.05, liveness=2,
                      on_register_again=lambda: abandoned.append(link.reconnects))  # fmt: skip
    link.start()
    try:
        ident, _ = (await asyncio.wait_for(recv_all(sock, 0, until=1), 10))[0]
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.05))])
        await asyncio.wait_for(link.registered.wait(), 5)
        # then silence: the link gives the broker up and reconnects, registering again
        regs = [m for _, m in await recv_all(sock, 1.0, until=2) if isinstance(m, P.Register)]
        assert regs and link.reconnects >= 1
        # at once when the broker is given up (not after the backoff, up to 32 s), and again just
        # before the REGISTER (nothing left by then)
        assert abandoned[:2] == [0, 1], abandoned
    finally:
        link.close()


def _pd_worker(engine):
    from epdq.worker.pd import PDWorker

    worker = PDWorker(engine, worker_id="pd-test", node="n", colocated=False, max_image_bytes=1 << 20,
                      max_image_pixels=1 << 20)  # fmt: skip
    sent: list = []
    worker.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: sent.append(m)})()
    return worker, sent


def _prefill(rid: str, max_tokens: int) -> P.Prefill:
    return P.Prefill(rid, [P.ChatMessage("user", [P.Part("text", f"tell me about {rid}")])],
                     P.Sampling(max_tokens=max_tokens), 30.0, [])  # fmt: skip


async def _until(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


def _slow_abort_engine(**kw):
    from epdq.engines.noop import NoopPDEngine

    class SlowAbort(NoopPDEngine):
        """An abort that takes a while to reach the engine (as vLLM's does): it must not land on
        a new run of the same request id."""

        async def abort(self, request_id: str) -> None:
            await asyncio.sleep(0.1)
            await super().abort(request_id)

    return SlowAbort(**kw)


@pytest.mark.parametrize("when", ["streaming", "in-prefill"])
@pytest.mark.parametrize("slow_abort", [False, True], ids=["abort", "slow-abort"])
async def test_an_abandoned_run_is_silent_and_the_request_runs_again_from_its_first_token(when, slow_abort):
    from epdq.engines.noop import NoopPDEngine

    kw = {"token_s": 0.01} if when == "streaming" else {"prefill_s": 0.2, "token_s": 0.002}
    engine = _slow_abort_engine(**kw) if slow_abort else NoopPDEngine(**kw)
    worker, sent = _pd_worker(engine)
    reference, expected = _pd_worker(NoopPDEngine())
    try:
        reference.handle(_prefill("r1", 30), [])
        await _until(lambda: expected and expected[-1].finish_reason is not None)
        want = [t for m in expected for t in m.token_ids]
        assert len(want) == 30

        worker.handle(_prefill("r1", 30), [])
        worker.handle(_prefill("r2", 30), [])
        if when == "streaming":
            await _until(lambda: len(sent) >= 6)  # both mid-sequence
        else:
            await asyncio.sleep(0.05)
        worker.abandon()  # the link is about to send REGISTER again
        assert worker.idle()
        before = len(sent)
        # the broker re-queued both and sends r1 straight back (in the batch of its REGISTERED)
        worker.handle(_prefill("r1", 30), [])
        await _until(lambda: len(sent) > before and sent[-1].finish_reason is not None)
        await asyncio.sleep(0.2)  # anything the abandoned runs still had to say
        after = sent[before:]
        assert all(isinstance(m, P.Tokens) and m.request_id == "r1" for m in after), after
        assert [t for m in after for t in m.token_ids] == want  # from the first token, all of them
        assert after[-1].finish_reason == "length" and worker.idle() and not worker._abandoned
    finally:
        worker.close()
        reference.close()


async def test_an_encoder_never_answers_a_job_of_the_previous_registration(tmp_path):
    from epdq.demo import demo_image
    from epdq.engines.noop import NoopVisionEngine
    from epdq.ring import RingWriter
    from epdq.worker.encoder import EncoderWorker

    ring = RingWriter(1 << 20, owner_tag="test")
    worker = EncoderWorker(NoopVisionEngine(cost_s=0.3), ring, worker_id="enc-test", node="n",
                           max_image_bytes=1 << 20, max_image_pixels=1 << 20)  # fmt: skip
    sent: list = []
    worker.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: sent.append(m),
                                    "flush": lambda self: None})()  # fmt: skip
    loop = asyncio.create_task(worker.run())
    image = demo_image(7, (64, 64))
    try:
        worker.handle(P.Encode(1, b"k" * 16), [image])
        await _until(lambda: worker._encoding)  # in the vision forward (a thread)
        worker.abandon()  # the link is about to send REGISTER again
        await _until(lambda: not worker._encoding)
        await asyncio.sleep(0.05)
        assert sent == [] and ring.entry_count == 0  # its result would name an entry for the new registration
        worker.handle(P.Encode(1, b"k" * 16), [image])  # the same job, sent again by the broker
        await _until(lambda: sent)
        assert [type(m) for m in sent] == [P.Encoded] and sent[0].job_id == 1 and ring.entry_count == 1
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        ring.close(unlink=True)


async def test_a_late_answer_to_an_earlier_register_is_ignored_with_its_work(broker):
    """A broker slower than 5 heartbeats answers REGISTER #1 after the link has sent #2: the
    work that comes with REGISTERED #1 belongs to a registration that #2 ends (the broker re-queues
    it when it reads #2). REGISTERED names the REGISTER it answers, so the link waits for #2's."""
    addr, sock = broker
    handled: list[str] = []
    abandoned: list[list[str]] = []  # what had been handled when the hook ran
    link = BrokerLink(addr, register(), lambda m, p: handled.append(m.request_id), heartbeat_s=0.5, liveness=5,
                      on_register_again=lambda: abandoned.append(list(handled)))  # fmt: skip
    link.start()
    try:
        (ident, first), = await asyncio.wait_for(recv_all(sock, 0.2, until=1), 10)
        link._register_sent -= 10  # no answer for 5 heartbeats
        sock.send_multipart([ident, *P.encode(P.Bye("unknown worker: register again"))])
        got = [m for _, m in await recv_all(sock, 0.2, until=1) if isinstance(m, P.Register)]
        assert [first.attempt, *(m.attempt for m in got)] == [1, 2] and abandoned == [[]]
        sock.send_multipart([ident, *P.encode(P.Registered("pd-test", 0.5, 1))])
        sock.send_multipart([ident, *P.encode(P.Abort("old"))])
        await asyncio.sleep(0.3)
        assert not link.registered.is_set() and handled == [] and link.stale_dropped == 1
        for m in (P.Registered("pd-test", 0.5, 2), P.Abort("new")):
            sock.send_multipart([ident, *P.encode(m)])
        end = time.monotonic() + 5
        while not handled and time.monotonic() < end:
            await asyncio.sleep(0.01)
        assert handled == ["new"] and link.registered.is_set() and abandoned == [[]]
    finally:
        link.close()


async def test_an_encoder_announces_each_entry_before_it_copies_the_bytes_in():
    """The completion events leave (flush) while the entries still say "being written"; the bytes
    and the real header follow, so a PD worker that gets there first waits for them."""
    from epdq.demo import demo_image
    from epdq.engines.noop import NoopVisionEngine
    from epdq.media import decode_image
    from epdq.ring import _HDR, _MAGIC, _PENDING, RingWriter
    from epdq.ring_reader import RingReader

    ring = RingWriter(1 << 20, owner_tag="test")
    worker, sent = _encoder(ring)
    at_flush: list = []
    worker.link.flush = lambda: at_flush.extend(_HDR.unpack_from(ring._mm, m.ref.offset - 64)[0] for m in sent)
    loop = asyncio.create_task(worker.run())
    reader = RingReader()
    try:
        for i in range(3):
            worker.handle(P.Encode(i + 1, bytes([i]) * 16), [demo_image(i, (64, 64))])
        await _until(lambda: len(sent) == 3)
        assert [type(m) for m in sent] == [P.Encoded] * 3
        assert at_flush == [_PENDING] * 3  # one flush, with all three still being written
        engine = NoopVisionEngine()
        for i, m in enumerate(sent):
            r = m.ref
            assert _HDR.unpack_from(ring._mm, r.offset - 64)[0] == _MAGIC
            got = reader.read(r.segment, r.offset, r.nbytes, r.key, r.generation, torch.float32, tuple(r.shape))
            want = engine.encode([decode_image(demo_image(i, (64, 64)), max_bytes=1 << 20, max_pixels=1 << 20)])[0]
            assert torch.equal(got, want.embeds)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        reader.close()
        ring.close(unlink=True)


@pytest.mark.parametrize("images", [1, 2])
async def test_a_pd_worker_waits_for_an_entry_its_encoder_is_still_copying(images):
    from epdq.engines.noop import NoopPDEngine
    from epdq.ring import RingWriter

    ring = RingWriter(1 << 20, owner_tag="test")
    worker, sent = _pd_worker(NoopPDEngine(hidden_size=128))
    try:
        embeds = [torch.randn(4, 128) for _ in range(images)]
        refs, fills = [], []
        for i, t in enumerate(embeds):
            k = bytes([i + 1]) * 16
            loc = ring.reserve(k, t.nbytes)
            refs.append(P.EmbedRef(k, "enc", "n", ring.name, loc.offset, loc.nbytes, loc.generation, "float32",
                                   [4, 128], [1, 4, 4], ""))  # fmt: skip
            fills.append((k, loc.generation, t))
        task = asyncio.create_task(worker._gather(refs))
        await asyncio.sleep(0.03)  # past the busy-wait: polling from the event loop now
        assert not task.done()
        for k, gen, t in fills:
            ring.fill(k, gen, t)
        got, grid, viewed = await asyncio.wait_for(task, 5)
        assert torch.equal(got, torch.cat(embeds)) and grid.tolist() == [[1, 4, 4]] * images
        assert (viewed is not None) == (images == 1)  # one image: a view, checked after the engine's copy
    finally:
        worker.close()
        ring.close(unlink=True)


def _decode_threads(monkeypatch, module) -> list[int]:
    """The threads `module.decode_image` runs on, from now on."""
    import threading

    threads: list[int] = []
    real = module.decode_image

    def recording(data, **kw):
        threads.append(threading.get_ident())
        return real(data, **kw)

    monkeypatch.setattr(module, "decode_image", recording)
    return threads


@contextlib.asynccontextmanager
async def _running(worker, ring):
    """`worker.run()` as a task for the block; then it is cancelled and the ring closed."""
    loop = asyncio.create_task(worker.run())
    try:
        yield
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        ring.close(unlink=True)


def _encoder(ring):
    from epdq.engines.noop import NoopVisionEngine
    from epdq.worker.encoder import EncoderWorker

    worker = EncoderWorker(NoopVisionEngine(), ring, worker_id="enc-test", node="n",
                           max_image_bytes=1 << 20, max_image_pixels=1 << 20)  # fmt: skip
    sent: list = []
    worker.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: sent.append(m),
                                    "flush": lambda self: None})()  # fmt: skip
    return worker, sent


async def test_a_ring_that_cannot_announce_early_is_written_then_announced():
    """A CUDA ring's copy runs on a stream: its entries are written first (as before), never
    reserved; the encoder must not call reserve/fill on it."""
    from epdq.demo import demo_image
    from epdq.ring import RingWriter

    class WriteOnly(RingWriter):
        announces_early = False

        def reserve(self, key, nbytes):
            raise AssertionError("reserve on a ring that does not announce early")

    ring = WriteOnly(1 << 20, owner_tag="test")
    worker, sent = _encoder(ring)
    async with _running(worker, ring):
        worker.handle(P.Encode(1, b"w" * 16), [demo_image(3, (64, 64))])
        await _until(lambda: sent)
        assert [type(m) for m in sent] == [P.Encoded] and ring.entry_count == 1
        assert ring._space.by_key[b"w" * 16].published


async def test_an_announced_entry_whose_copy_fails_is_reported_evicted_and_not_left_pinned(monkeypatch):
    from epdq.demo import demo_image
    from epdq.ring import RingWriter

    ring = RingWriter(1 << 20, owner_tag="test")
    worker, sent = _encoder(ring)

    def broken(self, e, tensor, *, announced=False):
        self._drop_unpublished(e, announced)
        raise OSError("copy failed")

    monkeypatch.setattr(RingWriter, "_copy_in", broken)
    async with _running(worker, ring):
        worker.handle(P.Encode(1, b"f" * 16), [demo_image(4, (64, 64))])
        await _until(lambda: any(isinstance(m, P.Evicted) for m in sent))
        encoded = [m for m in sent if isinstance(m, P.Encoded)]
        evicted = [e for m in sent if isinstance(m, P.Evicted) for e in m.entries]
        assert len(encoded) == 1 and [(e.key, e.generation) for e in evicted] == [(b"f" * 16, encoded[0].ref.generation)]
        assert ring.pinned_bytes == 0 and ring.entry_count == 0  # the broker re-encodes it; nothing kept pinned


async def test_evictions_a_placement_causes_leave_with_its_completion_event():
    """Placing an entry may evict older ones: the broker must hear of it in the same flush as the
    completion event (before the copy), or it sends cache hits to entries that are gone."""
    from epdq.demo import demo_image
    from epdq.ring import RingWriter

    ring = RingWriter(1 << 20, owner_tag="test")
    for i in range(16):  # exactly full of unpinned (cache) entries of 64 KiB each, header included
        k = i.to_bytes(16, "little")
        ring.unpin(k, ring.write(k, torch.zeros((64 << 10) - 64, dtype=torch.uint8)).generation)
    assert ring.used_bytes == ring.capacity and not ring.drain_evicted()
    worker, sent = _encoder(ring)
    at_flush: list = []
    worker.link.flush = lambda: at_flush.extend(type(m) for m in sent)
    async with _running(worker, ring):
        worker.handle(P.Encode(1, b"e" * 16), [demo_image(5, (64, 64))])
        await _until(lambda: at_flush)
        assert P.Encoded in at_flush and P.Evicted in at_flush, at_flush


async def test_an_encoder_copies_in_what_it_announced_before_announcing_more_than_its_limit(monkeypatch):
    """Copies run one after another: a PD worker waiting for an entry announced last in a big batch
    would wait for all of them (past its 2 s), so at most ANNOUNCE_AHEAD_BYTES wait at once."""
    from epdq.demo import demo_image
    from epdq.ring import RingWriter
    from epdq.worker import encoder as encoder_mod

    monkeypatch.setattr(encoder_mod, "ANNOUNCE_AHEAD_BYTES", 1)  # each entry is over it
    ring = RingWriter(1 << 20, owner_tag="test")
    worker, sent = _encoder(ring)
    flushes: list = []
    worker.link.flush = lambda: flushes.append(sum(isinstance(m, P.Encoded) for m in sent))
    async with _running(worker, ring):
        for i in range(3):
            worker.handle(P.Encode(i + 1, bytes([i + 1]) * 16), [demo_image(i, (64, 64))])
        await _until(lambda: len(flushes) >= 3)
        assert flushes == [1, 2, 3]  # announced, copied; announced, copied; ...
        assert all(e.published for e in ring._space.order)


async def test_an_encoder_decodes_large_images_off_its_event_loop(monkeypatch):
    """A batch of large images took seconds to decode on the loop, where pins, fetches and
    heartbeats wait; small ones stay there (a thread hop costs more than decoding them)."""
    import threading

    from epdq.demo import demo_image
    from epdq.ring import RingWriter
    from epdq.worker import encoder as enc

    threads = _decode_threads(monkeypatch, enc)
    ring = RingWriter(8 << 20, owner_tag="test")
    worker, sent = _encoder(ring)
    worker.max_image_pixels = 1 << 22
    async with _running(worker, ring):
        worker.handle(P.Encode(1, b"s" * 16), [demo_image(1, (64, 64))])
        await _until(lambda: len(sent) == 1)
        assert threads == [threading.get_ident()]
        big = demo_image(2, (512, 512))
        assert media.header_pixels(big) > media.DECODE_INLINE_PIXELS
        # one batch: a large image, and a bad one whose error must still reach the broker
        worker.handle(P.Encode(2, b"b" * 16), [big])
        worker.handle(P.Encode(3, b"x" * 16), [b"\x89PNG\r\n\x1a\n" + b"\0" * 40])
        await _until(lambda: len(sent) == 3)
        assert threading.get_ident() not in threads[1:] and len(threads) == 3
        by_job = {m.job_id: type(m) for m in sent}
        assert by_job == {1: P.Encoded, 2: P.Encoded, 3: P.EncodeFailed}
        assert ring.entry_count == 2


async def test_a_colocated_worker_decodes_large_images_off_the_loop_that_streams_tokens(monkeypatch):
    """A colocated worker decoded every image on the loop that streams all its sequences'
    tokens: one large image stalled every other request on it."""
    import threading

    from epdq.demo import demo_image
    from epdq.engines.noop import NoopPDEngine
    from epdq.worker import pd as pd_mod
    from epdq.worker.pd import PDWorker

    threads = _decode_threads(monkeypatch, pd_mod)
    worker = PDWorker(NoopPDEngine(), worker_id="both-test", node="n", colocated=True, max_image_bytes=1 << 22,
                      max_image_pixels=1 << 22)  # fmt: skip
    sent: list = []
    worker.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: sent.append(m)})()
    parts = [P.Part("image"), P.Part("text", "what is it")]
    small, big = demo_image(1, (64, 64)), demo_image(2, (512, 512))
    assert media.header_pixels(big) > media.DECODE_INLINE_PIXELS >= media.header_pixels(small)
    try:
        for rid, image in (("small", small), ("big", big)):
            msg = P.Prefill(rid, [P.ChatMessage("user", parts)], P.Sampling(max_tokens=3), 30.0, [], 1)
            worker.handle(msg, [image])
            await _until(lambda rid=rid: any(m.request_id == rid and m.finish_reason for m in sent))
        assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident() and len(threads) == 2
        # the same tokens as the engine gives for the image decoded here
        want = []
        prompt = worker.engine.render_prompt(P.messages_to_openai([P.ChatMessage("user", parts)]))
        from epdq.engines.base import SamplingSpec
        from epdq.media import decode_image

        async for d in worker.engine.generate("ref", prompt, SamplingSpec(3), images=[decode_image(big)]):
            want += d.token_ids
        assert [t for m in sent if m.request_id == "big" for t in m.token_ids] == want
    finally:
        worker.close()


class _EndRecordingEngine:
    """A NoopPDEngine whose generator records how it ended: run to its end, or closed at a
    yield (vLLM's stream aborts the request when it is closed there, finished or not)."""

    def __init__(self, deltas: int = 2):
        from epdq.engines.noop import NoopPDEngine

        self._noop = NoopPDEngine()
        self.ends: list[str] = []
        self.deltas = deltas

    def __getattr__(self, name):
        return getattr(self._noop, name)

    async def generate(self, request_id, prompt, sampling, **kw):
        from epdq.engines.base import Delta

        try:
            for i in range(self.deltas):
                last = i == self.deltas - 1
                yield Delta([i], f"<{i}>", "length" if last else None, 3 if last else 0)
        except GeneratorExit:
            self.ends.append("closed at a yield")
            raise
        self.ends.append("ran to its end")


async def test_the_engine_stream_ends_by_itself_after_the_last_delta():
    """The PD worker left the engine's generator suspended after its last delta: the event loop's
    finalizer closed it later (a self-pipe write and a task per request), and for vLLM that close
    aborted every finished request."""
    engine = _EndRecordingEngine()
    worker, _ = _pd_worker(engine)
    try:
        tokens, finish = await worker._generate(_prefill("r1", 2), [], None)
        assert (tokens, finish) == (2, "length") and engine.ends == ["ran to its end"]
    finally:
        worker.close()


async def test_the_engine_stream_is_closed_at_once_when_the_worker_leaves_it_early():
    engine = _EndRecordingEngine(deltas=5)
    worker, _ = _pd_worker(engine)

    def failing_send(rid, msg, me):
        raise RuntimeError("link gone")

    worker._send = failing_send
    try:
        with pytest.raises(RuntimeError, match="link gone"):
            await worker._generate(_prefill("r2", 5), [], None)
        assert engine.ends == ["closed at a yield"]  # now, not whenever the generator is collected
    finally:
        worker.close()


async def test_an_engine_that_fails_after_its_last_delta_does_not_fail_the_answered_request():
    class FailsAfterTheEnd(_EndRecordingEngine):
        async def generate(self, request_id, prompt, sampling, **kw):
            async for d in super().generate(request_id, prompt, sampling, **kw):
                yield d
            raise RuntimeError("cleanup failed")

    worker, _ = _pd_worker(FailsAfterTheEnd())
    try:
        assert await worker._generate(_prefill("r3", 2), [], None) == (2, "length")
    finally:
        worker.close()


async def test_an_encoder_runs_at_most_max_batch_jobs_a_forward_oldest_first():
    """Its credit holds two batches: a forward takes the oldest `max_batch` jobs, and the next
    forward the ones that waited (no job is left behind, none is taken twice)."""
    from epdq.demo import demo_image
    from epdq.engines.noop import NoopVisionEngine
    from epdq.ring import RingWriter
    from epdq.worker.encoder import EncoderWorker

    with pytest.raises(ValueError, match="max_batch"):
        EncoderWorker(NoopVisionEngine(), None, worker_id="e", node="n", max_image_bytes=1, max_image_pixels=1,
                      max_batch=0)  # fmt: skip
    ring = RingWriter(1 << 20, owner_tag="test")
    worker, sent = _encoder(ring)
    worker.max_batch = 3
    batches: list[int] = []
    encode = worker.engine.encode
    worker.engine.encode = lambda images: batches.append(len(images)) or encode(images)
    async with _running(worker, ring):
        for i in range(7):  # all queued before the loop's next turn
            worker.handle(P.Encode(i + 1, bytes([i + 1]) * 16), [demo_image(i, (64, 64))])
        await _until(lambda: sum(isinstance(m, P.Encoded) for m in sent) == 7)
    assert batches == [3, 3, 1]
    assert [m.job_id for m in sent if isinstance(m, P.Encoded)] == list(range(1, 8))
