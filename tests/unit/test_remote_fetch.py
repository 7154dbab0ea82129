"""The PD worker's remote fetch against endpoints that do not answer (real ZeroMQ sockets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq

from epdq import protocol as P
from epdq.errors import FetchFailedError, StaleEmbeddingError
from epdq.security import SecurityConfig
from epdq.worker.pd import RemoteFetcher

pytestmark = pytest.mark.timeout(30)


def ref(endpoint: str) -> P.EmbedRef:
    return P.EmbedRef(b"k" * 16, "enc-far", "node-a", "", 0, 16, 1, "float32", [4, 1], [1, 2, 2], endpoint)


@pytest.fixture
def make_fetcher():
    """RemoteFetcher(ctx, **kw) on a context of its own; every one closed at the end."""
    ctx = zmq.Context()
    made: list[RemoteFetcher] = []

    def make(**kw) -> RemoteFetcher:
        made.append(RemoteFetcher(ctx, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()
    ctx.term()


async def test_an_endpoint_nobody_answers_is_a_fetch_failure_naming_it(make_fetcher, unused_tcp_port):
    # it was a plain StaleEmbeddingError naming no endpoint: the broker re-encoded 8 times, then
    # blamed the rings' size
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    with pytest.raises(FetchFailedError, match=f"enc-far at {endpoint} did not answer a fetch within 0.2 s"):
        await make_fetcher(timeout_s=0.2).fetch(ref(endpoint))
    assert issubclass(FetchFailedError, StaleEmbeddingError)  # the request's entries are re-encoded first


async def test_a_link_zeromq_gave_up_is_a_fetch_failure_not_a_traceback(make_fetcher, unused_tcp_port, monkeypatch):
    # after a refused CURVE key ZeroMQ drops the pipe and a send raises EAGAIN: it escaped as a
    # traceback and reached the client as EngineError
    fetcher = make_fetcher(timeout_s=5)
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    ch = fetcher._channel(endpoint)

    def gave_up(*_a, **_k):
        raise zmq.Again()

    monkeypatch.setattr(ch, "send", gave_up)
    with pytest.raises(FetchFailedError, match=f"cannot send a fetch to encoder enc-far at {endpoint}"):
        await fetcher.fetch(ref(endpoint))
    assert endpoint not in fetcher._channels  # the next fetch connects afresh


@pytest.mark.parametrize(
    ("endpoint", "match"),
    [
        # a PD worker without keys given a tcp endpoint off loopback: the ConfigError reached the
        # client as "error (config)", as if its own settings were wrong
        ("tcp://10.1.2.3:7710", "cannot fetch from 'tcp://10.1.2.3:7710'"),
        # an encoder's malformed --fetch-advertise: it was InvalidInputError (HTTP 400, invalid_requests)
        ("udp://somewhere:1", "bad fetch endpoint"),
    ],
)
async def test_an_endpoint_this_worker_cannot_use_fails_the_fetch_not_the_client(make_fetcher, endpoint, match):
    with pytest.raises(FetchFailedError, match=match):
        await make_fetcher(timeout_s=1, security=SecurityConfig(insecure_ok=True)).fetch(ref(endpoint))


@pytest.mark.parametrize(
    ("nbytes", "sizes"),
    [
        (0, [0]),
        (16, [16]),
        (P.FETCH_CHUNK_BYTES, [P.FETCH_CHUNK_BYTES]),
        (P.FETCH_CHUNK_BYTES + 1, [P.FETCH_CHUNK_BYTES, 1]),
        # frames grow rather than exceed MAX_PAYLOAD_FRAMES, less one for the seal
        (512 << 20, [8_521_761] * 62 + [8_521_730]),
        ((512 << 20) + 64, [8_521_762] * 62 + [8_521_732]),
    ],
)
def test_fetch_chunks_cover_the_entry_in_order_within_the_frame_limit(nbytes, sizes):
    chunks = P.fetch_chunks(nbytes)
    assert [size for _, size in chunks] == sizes and len(chunks) < P.MAX_PAYLOAD_FRAMES
    assert [start for start, _ in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert sum(sizes) == nbytes


async def test_a_large_entry_comes_in_several_frames_and_lands_whole(make_fetcher):
    from epdq.ring import RingWriter
    from epdq.worker.encoder import EncoderWorker
    from epdq.worker.pd import from_chunks

    rows, hidden = (9 << 20) // (4 * 1024) + 3, 1024  # 9 MiB and a bit: three frames
    t = torch.arange(rows * hidden, dtype=torch.float32).view(rows, hidden)
    ctx = zmq.Context()
    with RingWriter(32 << 20, owner_tag="fetchtest") as ring:
        enc = EncoderWorker(
            None, ring, worker_id="enc-far", node="node-a", max_image_bytes=1, max_image_pixels=1,
            fetch_bind="tcp://127.0.0.1:*", ctx=ctx, security=None,
        )  # fmt: skip
        try:
            endpoint = enc.open_fetch_socket()
            enc.start()
            k = b"f" * 16
            loc = ring.write(k, t)
            r = P.EmbedRef(k, "enc-far", "node-a", ring.name, loc.offset, loc.nbytes, loc.generation,
                           "float32", [rows, hidden], [1, 2, 2], endpoint)  # fmt: skip
            chunks = await make_fetcher(timeout_s=10).fetch(r)
            assert [c.nbytes for c in chunks] == [size for _, size in P.fetch_chunks(t.nbytes)]
            assert len(chunks) == 3
            assert torch.equal(from_chunks(chunks, torch.float32, [rows, hidden]), t)
            embeds = torch.zeros(rows + 2, hidden)
            from_chunks(chunks, torch.float32, [rows, hidden], embeds[1 : rows + 1])  # as PDWorker._gather
            assert torch.equal(embeds[1 : rows + 1], t) and not embeds[0].any() and not embeds[-1].any()
            wrong = P.EmbedRef(k, "enc-far", "node-a", ring.name, loc.offset, 4096, loc.generation,
                               "float32", [1, 1024], [1, 2, 2], endpoint)  # fmt: skip
            with pytest.raises(StaleEmbeddingError):  # not the entry's size: refused by the encoder
                await make_fetcher(timeout_s=10).fetch(wrong)
            # an entry in one frame: the tensor is that frame, not a copy of it
            k1 = b"g" * 16
            one = torch.arange(4096, dtype=torch.float32).view(4, 1024)
            loc1 = ring.write(k1, one)
            r1 = P.EmbedRef(k1, "enc-far", "node-a", ring.name, loc1.offset, loc1.nbytes, loc1.generation,
                            "float32", [4, 1024], [1, 2, 2], endpoint)  # fmt: skip
            (frame,) = await make_fetcher(timeout_s=10).fetch(r1)
            got = from_chunks([frame], torch.float32, [4, 1024])
            assert torch.equal(got, one) and got.data_ptr() == np.frombuffer(frame, np.uint8).ctypes.data
        finally:
            enc.close()
    ctx.destroy(linger=0)


async def test_an_entry_overwritten_while_zeromq_sends_it_is_stale_never_torn(make_fetcher):
    """The encoder answers a fetch from its ring itself (no copy): ZeroMQ's I/O thread reads the
    bytes after the answer was queued, and here the entry is evicted and its window written over
    at once, while they go out. Each fetch must then either bring the old bytes whole or fail
    stale (the seal, read after the bytes, is broken): never a mix of old and new."""
    from epdq.ring import RingWriter
    from epdq.worker.encoder import EncoderWorker
    from epdq.worker.pd import from_chunks

    rows, hidden = 2048, 1024  # 8 MiB: two frames; the ring holds one such entry only
    ctx = zmq.Context()
    outcomes = {"whole": 0, "stale": 0}
    with RingWriter(9 << 20, owner_tag="tornfetch") as ring:
        enc = EncoderWorker(
            None, ring, worker_id="enc-far", node="node-a", max_image_bytes=1, max_image_pixels=1,
            fetch_bind="tcp://127.0.0.1:*", ctx=ctx, security=None,
        )  # fmt: skip
        replied = enc._reply

        def reply_then_overwrite(frames, copy=True):
            replied(frames, copy)
            # the answer is queued, not sent: evict the entry and fill its window with new bytes
            assert ring.evict_unpinned() == 1
            assert ring.write(b"n" * 16, torch.full((rows, hidden), -1.0)).offset == loc.offset

        enc._reply = reply_then_overwrite
        fetcher = make_fetcher(timeout_s=10)
        try:
            endpoint = enc.open_fetch_socket()
            enc.start()
            for i in range(20):
                ring.clear()
                k = i.to_bytes(16, "big")
                loc = ring.write(k, torch.full((rows, hidden), float(i)))
                ring.unpin(k, loc.generation)  # nobody's pin: the overwrite may take its window
                r = P.EmbedRef(k, "enc-far", "node-a", ring.name, loc.offset, loc.nbytes, loc.generation,
                               "float32", [rows, hidden], [1, 2, 2], endpoint)  # fmt: skip
                try:
                    got = from_chunks(await fetcher.fetch(r), torch.float32, [rows, hidden])
                except StaleEmbeddingError as e:
                    assert "overwritten while it was sent" in str(e)
                    outcomes["stale"] += 1
                else:
                    assert bool((got == float(i)).all()), f"fetch {i} mixes old and new bytes"
                    outcomes["whole"] += 1
        finally:
            enc.close()
    ctx.destroy(linger=0)
    assert outcomes["stale"] > 0, outcomes  # the overwrite did race the send (else this proves nothing)
