"""What the broker's embedding index keeps per entry, through a real broker and raw peers."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import pytest
import zmq

from epdq import protocol as P
from epdq.broker import Broker, BrokerConfig
from epdq.demo import demo_image
from epdq.transport import make_socket

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ENTRIES = 200


async def _until(cond, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def _recv(s: zmq.Socket) -> list[P._S]:
    """The messages of the next ZeroMQ message from the broker (a BATCH is split)."""
    async with asyncio.timeout(10):
        while not s.poll(0):
            await asyncio.sleep(0.002)
    frames = s.recv_multipart()
    if P.BATCH_TYPE == frames[0]:
        return [P.decode(part)[0] for part in P.split_batch(frames)]
    return [P.decode(frames)[0]]


async def test_index_entries_share_the_registrations_strings(tmp_path):
    """Every resident embedding keeps its EmbedRef in the broker's index, and each decoded ref
    carried its own copies of the encoder's id, ring segment and dtype name: a third of what an
    entry cost. The broker now points them at the registration's strings."""
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/b.sock"
    broker = Broker(BrokerConfig(address=addr, log_requests=False), ctx=ctx)
    serving = asyncio.create_task(broker.serve())
    socks: list[zmq.Socket] = []
    try:
        await _until(lambda: broker.channel is not None and broker.endpoint)
        enc = make_socket(ctx, zmq.DEALER, connect=addr)
        client = make_socket(ctx, zmq.DEALER, connect=addr)
        socks += [enc, client]
        segment = f"epdq-{os.getuid()}-enc_0-{os.getpid()}-{'0' * 16}"
        enc.send_multipart(P.encode(P.Register(
            "enc-0", "encoder", "n1", ENTRIES, "scope-1", "m", os.getpid(), ring_segment=segment,
            ring_capacity=64 << 20, fetch_endpoint=f"ipc://{tmp_path}/fetch.sock",
        )))  # fmt: skip
        assert isinstance((await _recv(enc))[0], P.Registered)
        peer = next(iter(broker.workers.values()))

        # ENTRIES requests of one distinct image each: ENTRIES encode jobs for the fake encoder
        for i in range(ENTRIES):
            parts = [P.Part("image"), P.Part("text", "hi")]
            submit = P.Submit(f"r{i}", [P.ChatMessage("user", parts)], P.Sampling(max_tokens=1), 30.0, 1)
            client.send_multipart(P.encode(submit) + [demo_image(i + 1, (16, 16))])
        jobs: list[P.Encode] = []
        while len(jobs) < ENTRIES:
            jobs += [m for m in await _recv(enc) if isinstance(m, P.Encode)]

        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i, job in enumerate(jobs):
            # what a real encoder sends: every string decoded afresh by the broker
            ref = P.EmbedRef(job.key, "enc-0", "n1", segment, 4096 + i * 4096, 2048, i + 1, "float32",
                             [4, 128], [1, 4, 4], "")  # fmt: skip
            enc.send_multipart(P.encode(P.Encoded(job.job_id, ref, 0.001)))
        await _until(lambda: len(broker.scheduler.index) == ENTRIES)
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / ENTRIES
        tracemalloc.stop()

        print(f"broker memory per index entry (with the request's bookkeeping): {per_entry:.0f} B")
        reg = peer.register
        for e in broker.scheduler.index.values():
            assert e.ref.encoder_id is peer.worker_id and e.ref.segment is reg.ring_segment
            assert e.ref.node is reg.node and e.ref.fetch_endpoint is reg.fetch_endpoint
        assert len({id(e.ref.dtype) for e in broker.scheduler.index.values()}) == 1
    finally:
        for s in socks:
            s.close(linger=0)
        broker.stop()
        await asyncio.wait_for(serving, 10)
        ctx.destroy(linger=0)


async def test_stats_requests_sent_without_reading_get_few_replies(tmp_path):
    """A STATS reply is hundreds of times its request: a client that sent requests and read
    nothing made the broker hold one reply each. A connection's requests that come within the
    interval are answered together by one reply carrying the latest nonce."""
    from epdq.broker import STATS_INTERVAL_S

    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/b.sock"
    broker = Broker(BrokerConfig(address=addr, log_requests=False), ctx=ctx)
    serving = asyncio.create_task(broker.serve())
    client = None
    try:
        await _until(lambda: broker.channel is not None and broker.endpoint)
        client = make_socket(ctx, zmq.DEALER, connect=addr)
        for nonce in range(1, 2001):
            client.send_multipart(P.encode(P.StatsRequest(nonce)))
        replies: list[P.Stats] = []
        async with asyncio.timeout(10):
            while not replies or replies[-1].nonce != 2000:
                replies += [m for m in await _recv(client) if isinstance(m, P.Stats)]
        assert [r.nonce for r in replies] == sorted(r.nonce for r in replies)  # in order, latest last
        # at most one answer now and one per tick while the 2,000 arrive (they take a few ms)
        assert len(replies) <= 2 + 20, len(replies)
        await asyncio.sleep(STATS_INTERVAL_S * 1.5)
        client.send_multipart(P.encode(P.StatsRequest(2001)))  # a lone one later: answered at once
        assert [m.nonce for m in await _recv(client)] == [2001]
    finally:
        broker.stop()
        await asyncio.wait_for(serving, 10)
        if client is not None:
            client.close(linger=0)
        ctx.term()
