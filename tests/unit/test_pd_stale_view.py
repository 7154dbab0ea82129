"""A ring entry handed to the engine as a view and overwritten while the engine read it.

The PD worker gives a PD engine one local image as a zero-copy view of its ring entry and checks
the entry after the first delta: overwritten, the request fails stale and the broker re-encodes
the image and retries. But vLLM hashes its multimodal input before it copies it, so its prefix
and multimodal caches could keep KV of the overwritten bytes under the right image's hash, and
the retry (the same image, the same hash) reused it: wrong tokens, no error. The worker now makes
the engine forget its cached inputs first, once the stale request has left the engine."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest
import torch

from epdq import protocol as P
from epdq.engines.base import IMAGE_PLACEHOLDER, Delta, embed_rows
from epdq.errors import EngineError
from epdq.ring import MIN_CAPACITY, RingWriter
from epdq.worker.pd import PDWorker

pytestmark = pytest.mark.timeout(60)

HIDDEN = 8
GRID = [1, 4, 4]  # merged 2x2: 4 rows
ROWS = 4


class FakeEngine:
    """Reads its embeddings when it starts (as vLLM hashes them); `during_read` runs right then."""

    def __init__(
        self, *, forget: bool = True, fail_first: bool = False, forget_fails: bool = False, stall: bool = False
    ):
        self.hidden_size = HIDDEN
        self.events: list[str] = []
        self.during_read = None
        self.fail_first = fail_first
        self.stall = asyncio.Event() if stall else None  # set once it has read, and never yields
        self.forget_fails = forget_fails
        if not forget:
            self.forget_cached_inputs = None  # getattr finds None: treated as absent

    def render_prompt(self, messages):
        return f"{IMAGE_PLACEHOLDER} describe"

    def expected_embed_rows(self, grid):
        return embed_rows(grid, 2)

    async def generate(self, request_id, prompt, sampling, *, image_embeds=None, image_grid_thw=None, images=None):
        self.events.append("read")
        if self.during_read is not None:
            self.during_read()
        try:
            await asyncio.sleep(0)
            if self.stall is not None:
                self.stall.set()
                await asyncio.Event().wait()
            if self.fail_first:
                raise EngineError("the engine failed before its first delta")
            yield Delta([1], "a")
            yield Delta([2], "b", "length", 5)
        finally:
            self.events.append("closed")

    async def abort(self, request_id):
        self.events.append("abort")

    async def forget_cached_inputs(self):
        self.events.append("forget")
        if self.forget_fails:
            raise EngineError("could not reset")


@pytest.fixture
def writer():
    w = RingWriter(MIN_CAPACITY, owner_tag="stale")
    yield w
    w.close()


def make_worker(engine) -> PDWorker:
    w = PDWorker(engine, worker_id="pd-0", node="node-here", colocated=False,
                 max_image_bytes=1 << 20, max_image_pixels=1 << 20)  # fmt: skip
    sent: list = []
    w.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: sent.append(m)})()
    w.sent = sent
    return w


def local_ref(writer: RingWriter, key: bytes) -> P.EmbedRef:
    loc = writer.write(key, torch.randn(ROWS, HIDDEN))
    return P.EmbedRef(key, "enc-0", "node-here", writer.name, loc.offset, loc.nbytes, loc.generation,
                      "float32", [ROWS, HIDDEN], GRID, "tcp://127.0.0.1:1")  # fmt: skip


def overwrite(writer: RingWriter, ref: P.EmbedRef):
    def now():
        writer.unpin(ref.key, ref.generation)
        assert writer.evict_unpinned() == 1
        writer.write(b"o" * 16, torch.full((ROWS, HIDDEN), 7.0))  # lands where the entry was

    return now


def prefill(rid: str, ref: P.EmbedRef) -> P.Prefill:
    return P.Prefill(rid, [P.ChatMessage("user", [P.Part("image", ""), P.Part("text", "describe")])],
                     P.Sampling(max_tokens=2), 30.0, [ref])  # fmt: skip


async def serve(worker: PDWorker, msg: P.Prefill) -> None:
    worker.handle(msg, [])
    await asyncio.wait_for(asyncio.gather(*worker._tasks.values(), return_exceptions=True), 10)


async def test_an_entry_overwritten_while_the_engine_read_it_makes_the_engine_forget_then_fails_stale(
    writer, caplog
):
    engine = FakeEngine()
    worker = make_worker(engine)
    ref = local_ref(writer, b"k" * 16)
    engine.during_read = overwrite(writer, ref)
    with caplog.at_level(logging.WARNING, logger="epdq.pd"):
        await serve(worker, prefill("r1", ref))
    # the engine forgot only after the request had left it: still running, it would cache its
    # bytes again (vLLM recomputes the requests a prefix-cache reset preempts)
    assert engine.events == ["read", "closed", "forget"]
    assert [type(m) for m in worker.sent] == [P.PdFailed]
    failed = worker.sent[0]
    assert failed.code == "stale" and failed.stale == [P.EntryId(ref.key, ref.generation)]
    assert worker.stale_views == 1 and worker.local_reads == 1 and not worker.death
    assert any(getattr(r, "event", "") == "pd_stale_view" for r in caplog.records)
    worker.close()


async def test_an_intact_entry_costs_no_forgetting(writer):
    engine = FakeEngine()
    worker = make_worker(engine)
    await serve(worker, prefill("r1", local_ref(writer, b"k" * 16)))
    assert "forget" not in engine.events
    assert worker.sent[-1].finish_reason == "length" and worker.stale_views == 0
    worker.close()


async def test_an_engine_that_fails_before_its_first_delta_still_forgets_a_stale_view(writer):
    # its first delta never came, so the check after it never ran: the engine may have read
    # (and cached) the overwritten bytes all the same
    engine = FakeEngine(fail_first=True)
    worker = make_worker(engine)
    ref = local_ref(writer, b"k" * 16)
    engine.during_read = overwrite(writer, ref)
    await serve(worker, prefill("r1", ref))
    assert engine.events == ["read", "closed", "forget"]
    assert worker.sent[0].code == "engine" and worker.stale_views == 1
    # and not when the entry was intact
    engine2 = FakeEngine(fail_first=True)
    worker2 = make_worker(engine2)
    await serve(worker2, prefill("r2", local_ref(writer, b"j" * 16)))
    assert "forget" not in engine2.events and worker2.stale_views == 0
    worker.close()
    worker2.close()


async def test_a_request_cancelled_before_its_first_delta_forgets_a_stale_view(writer):
    engine = FakeEngine(stall=True)
    worker = make_worker(engine)
    ref = local_ref(writer, b"k" * 16)
    engine.during_read = overwrite(writer, ref)
    worker.handle(prefill("r1", ref), [])
    await asyncio.wait_for(engine.stall.wait(), 5)
    worker.handle(P.Abort("r1"), [])
    await asyncio.wait_for(asyncio.gather(*worker._tasks.values(), return_exceptions=True), 10)
    assert engine.events[:2] == ["read", "closed"] and "forget" in engine.events
    assert worker.sent[-1].code == "cancelled" and worker.stale_views == 1
    worker.close()


async def test_an_engine_without_the_method_is_served_as_before(writer):
    engine = FakeEngine(forget=False)
    worker = make_worker(engine)
    ref = local_ref(writer, b"k" * 16)
    engine.during_read = overwrite(writer, ref)
    await serve(worker, prefill("r1", ref))
    assert worker.sent[0].code == "stale" and worker.stale_views == 1 and not worker.death


async def test_an_engine_that_cannot_forget_makes_the_worker_leave(writer):
    # its caches may still hold KV of the wrong bytes: the retry must not be served from them
    engine = FakeEngine(forget_fails=True)
    worker = make_worker(engine)
    ref = local_ref(writer, b"k" * 16)
    engine.during_read = overwrite(writer, ref)
    await serve(worker, prefill("r1", ref))
    assert worker.sent[0].code == "stale"
    assert "could not clear the engine's cached inputs" in worker.death and worker.check_engine()
    # the retry of the same image, newly encoded, is not run here: the broker re-queues it once
    # the worker has left (no answer from this worker)
    worker.sent.clear()
    engine.during_read = None
    engine.events.clear()
    await serve(worker, prefill("r2", local_ref(writer, b"k" * 16)))
    assert worker.sent == [] and engine.events == []
    worker.close()


# -- the vLLM engine's side, without starting vLLM -----------------------------------------------


class FakeAsyncLLM:
    def __init__(self, prefix_ok: bool = True):
        self.calls: list[tuple] = []
        self.errored = False
        self.prefix_ok = prefix_ok

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False):
        self.calls.append(("prefix", reset_running_requests))
        return self.prefix_ok

    async def reset_mm_cache(self):
        self.calls.append(("mm",))

    async def reset_encoder_cache(self):
        self.calls.append(("encoder",))


@pytest.fixture(scope="module")
def vllm_engine():
    from epdq.engines.vllm_engine import VllmEngine
    from epdq.models.tiny import default_model_dir

    return VllmEngine(default_model_dir(), mode="pd", max_model_len=256)


def test_the_fake_has_the_methods_of_this_vllm():
    from vllm.v1.engine.async_llm import AsyncLLM

    for name in ("reset_prefix_cache", "reset_mm_cache", "reset_encoder_cache"):
        assert inspect.iscoroutinefunction(getattr(AsyncLLM, name)), name
    assert "reset_running_requests" in inspect.signature(AsyncLLM.reset_prefix_cache).parameters


async def test_the_vllm_engine_forgets_its_prefix_multimodal_and_encoder_caches(vllm_engine):
    llm = FakeAsyncLLM()
    vllm_engine._llm = llm
    try:
        await vllm_engine.forget_cached_inputs()
    finally:
        vllm_engine._llm = None
    # running requests too: blocks in use are not freed otherwise (the reset would fail), and a
    # running request with the same image may have hit the wrong KV already
    assert llm.calls == [("prefix", True), ("mm",), ("encoder",)]


async def test_a_prefix_cache_vllm_did_not_reset_is_an_engine_error(vllm_engine):
    vllm_engine._llm = FakeAsyncLLM(prefix_ok=False)
    try:
        with pytest.raises(EngineError, match="did not reset its prefix cache"):
            await vllm_engine.forget_cached_inputs()
    finally:
        vllm_engine._llm = None


async def test_an_engine_not_started_or_dead_has_nothing_to_forget(vllm_engine):
    await vllm_engine.forget_cached_inputs()  # not started
    llm = FakeAsyncLLM()
    llm.errored = True
    vllm_engine._llm = llm
    try:
        await vllm_engine.forget_cached_inputs()
    finally:
        vllm_engine._llm = None
    assert llm.calls == []
