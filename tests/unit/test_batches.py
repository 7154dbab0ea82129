"""How a channel cuts what it coalesced into BATCH messages."""

from epdq import protocol as P
from epdq.channel import BATCH_BYTES, _batches


def msg(payload: int = 0) -> tuple[list, bool]:
    return P.encode(P.Cancel("r")) + ([bytes(payload)] if payload else []), True


def test_header_only_messages_count_towards_a_batchs_bytes():
    # a STATS answer has no payload frame: 4,096 of them went in one ~3 MB message, and the
    # broker's send queue (bounded in messages) held 10,000 such for a client that read nothing
    reply = P.encode(P.Error("r" * 100, "busy", "x" * 700, 0.0)), True
    chunks = _batches([reply] * 4000)
    assert len(chunks) > 1 and [m for c in chunks for m in c] == [reply] * 4000
    size = sum(len(f) for f in reply[0])
    assert all(sum(len(f) for m, _ in c for f in m) < BATCH_BYTES + size for c in chunks)


def test_no_batch_holds_more_messages_than_the_receiver_accepts():
    # 5,000 requests in one loop turn used to go as one BATCH that split_batch refused whole:
    # every request then waited for its deadline
    chunks = _batches([msg() for _ in range(5000)])
    assert [len(c) for c in chunks] == [P.MAX_BATCH, 5000 - P.MAX_BATCH]
    for c in chunks:
        frames = P.pack_batch([m for m, _ in c])
        assert len(P.split_batch(frames)) == len(c)


def test_large_payloads_go_in_several_batches_in_order():
    kib = 2**10
    msgs = [msg(64 * kib) for _ in range(10)] + [msg() for _ in range(3)]
    chunks = _batches(msgs)
    per = BATCH_BYTES // (64 * kib)  # each a few bytes over 64 KiB: `per` of them reach the cut
    assert [len(c) for c in chunks] == [per, per, 10 - 2 * per + 3]
    assert [m for c in chunks for m in c] == msgs  # nothing lost or reordered
    big = msg(64 * 2**20)
    assert _batches([big, msg()]) == [[big], [msg()]]  # one message over the limit goes alone


async def test_a_peer_that_does_not_read_is_cut_off_not_queued_for_without_end(tmp_path):
    """The broker's send queues had no limit: a client that sent pings or STATS requests and never
    read the answers grew the broker's memory by gigabytes. Past `send_hwm` unsent messages the
    channel reports the peer unreachable, as if it had disconnected; a reading peer is unaffected."""
    import asyncio
    import threading

    import zmq

    from epdq.channel import Channel
    from epdq.transport import make_socket

    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/hwm.sock"
    router = make_socket(ctx, zmq.ROUTER, bind=addr, send_hwm=32)
    deaf = make_socket(ctx, zmq.DEALER, identity=b"deaf", connect=addr)
    deaf.setsockopt(zmq.RCVHWM, 1)
    reader = make_socket(ctx, zmq.DEALER, identity=b"reader", connect=addr)
    gone: list[bytes] = []
    ch = Channel(router, lambda frames: None, coalesce=True, on_unreachable=gone.append)
    ch.start()
    stop = threading.Event()
    got = [0]
    thread = threading.Thread(target=lambda: read(), daemon=True)

    def read() -> None:  # a peer that reads all the time, as a ZeroMQ I/O thread does
        while not stop.is_set():
            if reader.poll(20):
                reader.recv_multipart()
                got[0] += 1

    try:
        for s in (deaf, reader):
            s.send(b"hello")  # the ROUTER knows a peer once it has heard from it
        async with asyncio.timeout(20):
            while ch.received < 2:
                await asyncio.sleep(0.01)
            thread.start()
            sent = 0
            while not gone and sent < 400:  # one 256 KiB message per peer per loop turn
                for ident in (b"deaf", b"reader"):
                    ch.send([ident, *P.encode(P.Cancel("r")), bytes(256 << 10)], copy=False)
                sent += 1
                await asyncio.sleep(0.001)
            assert gone == [b"deaf"], (gone, sent)  # long before 400 x 256 KiB were queued for it
            while got[0] < sent:  # the reader gets everything it was sent
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(5)
        ch.close()
        for s in (deaf, reader):
            s.close(linger=0)
        ctx.term()
