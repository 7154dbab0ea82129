"""A PD worker checks every embedding reference's byte count against its shape before it reads.

The ring reader refused an entry whose shape does not hold `nbytes`, but the remote fetch path
copied `nbytes` into a `torch.empty` result of the full shape: fewer bytes left rows of
uninitialised memory that reached the engine as embeddings."""

from __future__ import annotations

import asyncio

import pytest
import torch

from epdq import protocol as P
from epdq.engines.noop import NoopPDEngine
from epdq.errors import ProtocolError
from epdq.worker.pd import PDWorker

pytestmark = pytest.mark.timeout(30)

HIDDEN = 4
GRID = [1, 4, 4]  # merged 2x2: 4 rows


def far_ref(nbytes: int, key: bytes = b"k" * 16) -> P.EmbedRef:
    # on another node: read through the encoder's fetch socket
    return P.EmbedRef(key, "enc-far", "node-far", "", 0, nbytes, 1, "float32", [4, HIDDEN], GRID, "tcp://127.0.0.1:1")


@pytest.fixture
def worker():
    w = PDWorker(NoopPDEngine(hidden_size=HIDDEN), worker_id="pd-0", node="node-here", colocated=False,
                 max_image_bytes=1 << 20, max_image_pixels=1 << 20)  # fmt: skip
    fetched: list[P.EmbedRef] = []

    async def fetch(ref: P.EmbedRef) -> list[memoryview]:  # what an encoder serves: nbytes, as asked
        fetched.append(ref)
        return [memoryview(bytearray((bytes(range(256)) * (ref.nbytes // 256 + 1))[: ref.nbytes]))]

    w.fetcher.fetch = fetch
    w.fetched = fetched
    sent: list = []
    w.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: sent.append(m)})()
    w.sent = sent
    yield w
    w.close()


@pytest.mark.parametrize("nbytes", [32, 0, 4 * HIDDEN * 4 - 4, 4 * HIDDEN * 4 + 4])
async def test_a_fetched_reference_whose_bytes_do_not_fill_its_shape_is_refused_before_the_fetch(worker, nbytes):
    with pytest.raises(ProtocolError, match="does not hold"):
        await worker._gather([far_ref(nbytes)])
    # one bad reference among good ones: nothing fetched at all
    with pytest.raises(ProtocolError, match="does not hold"):
        await worker._gather([far_ref(4 * HIDDEN * 4, b"a" * 16), far_ref(nbytes, b"b" * 16)])
    assert worker.fetched == []


async def test_a_reference_that_fits_is_fetched_whole(worker):
    embeds, grid, viewed = await worker._gather([far_ref(4 * HIDDEN * 4)])
    assert embeds.shape == (4, HIDDEN) and grid.tolist() == [GRID] and viewed is None
    expected = torch.frombuffer(bytearray(bytes(range(64))), dtype=torch.float32).view(4, HIDDEN)
    assert torch.equal(embeds.view(torch.uint8), expected.view(torch.uint8))


async def test_the_request_fails_typed_and_the_worker_stays(worker):
    msg = P.Prefill("r1", [P.ChatMessage("user", [P.Part("image", ""), P.Part("text", "what is it")])],
                    P.Sampling(max_tokens=3), 30.0, [far_ref(32)])  # fmt: skip
    worker.handle(msg, [])
    await asyncio.wait_for(asyncio.gather(*worker._tasks.values(), return_exceptions=True), 10)
    assert [type(m) for m in worker.sent] == [P.PdFailed]
    assert worker.sent[0].code == "protocol" and "does not hold 32 bytes" in worker.sent[0].message
    assert not worker.death and not worker.fetched
    # the next, well-formed request is served
    worker.sent.clear()
    worker.handle(P.Prefill("r2", msg.messages, msg.sampling, 30.0, [far_ref(4 * HIDDEN * 4)]), [])
    await asyncio.wait_for(asyncio.gather(*worker._tasks.values(), return_exceptions=True), 10)
    assert worker.sent[-1].finish_reason == "length"
