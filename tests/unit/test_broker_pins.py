"""How the broker turns the scheduler's pin decisions into messages to encoders."""

from epdq import protocol as P
from epdq.broker import ENTRIES_PER_MESSAGE, Broker, BrokerConfig
from epdq.jobs import SendPin, SendUnpin
from epdq.protocol import EntryId


def test_a_great_many_unpins_go_in_messages_the_encoder_accepts():
    # a full ring may release tens of thousands of entries at once (small embeddings in a large
    # ring): one UNPIN naming more than ~43,000 (24 bytes each) is over the receiver's header limit,
    # and the encoder would refuse it whole, leaving every one of them pinned
    broker = Broker(BrokerConfig(address="ipc:///x/b.sock"))
    sent: list[tuple[str, object]] = []
    broker._send_worker = lambda worker_id, msg, *rest: sent.append((worker_id, msg))
    ids = [EntryId(i.to_bytes(16, "big"), i) for i in range(2 * ENTRIES_PER_MESSAGE + 5)]
    broker.scheduler._emit(SendUnpin("enc-0", ids))
    broker.scheduler._emit(SendPin("enc-1", ids[:3]))
    broker._flush()
    unpins = [m for w, m in sent if w == "enc-0"]
    assert [len(m.entries) for m in unpins] == [ENTRIES_PER_MESSAGE, ENTRIES_PER_MESSAGE, 5]
    assert [e for m in unpins for e in m.entries] == ids  # all of them, in order
    assert all(isinstance(m, P.Unpin) for m in unpins)
    (pin,) = [m for w, m in sent if w == "enc-1"]
    assert isinstance(pin, P.Pin) and pin.entries == ids[:3]
    for m in unpins:
        header = P.encode(m)[1]
        assert len(header) < P.MAX_HEADER_BYTES
        assert P.decode(P.encode(m))[0].entries == m.entries


def test_a_lost_clients_requests_are_cancelled_in_the_order_they_came():
    # the broker's record of a client's live requests is insertion-ordered: what a disconnect
    # cancels (and the aborts it sends to workers) goes oldest first, whatever the ids' hashes
    broker = Broker(BrokerConfig(address="ipc:///x/b.sock"))
    client = b"client-1"
    rids = [f"req-{i}" for i in (7, 3, 11, 0, 5, 42, 1)]
    for rid in rids:
        sub = P.Submit(rid, [P.ChatMessage("user", [P.Part("text", "hi")])], P.Sampling(), 30.0, 0)
        broker._on_submit(client, None, sub, [])
    cancelled: list[str] = []
    cancel = broker.scheduler.cancel
    broker.scheduler.cancel = lambda rid, who=None: cancelled.append(rid) or cancel(rid, who)
    broker._peer_unreachable(client)
    assert cancelled == rids
    assert not broker.scheduler.requests and client not in broker._clients


def test_a_client_uploading_a_large_request_is_not_taken_for_gone():
    """ZeroMQ hands a message over whole: while a client uploads 8 images of 20 MiB (8.4 s at
    20 MB/s, longer over a slow CURVE link) its pings wait behind them and the broker hears
    nothing. Its other requests were cancelled after client_liveness_s (10 s) of silence; the
    largest request the broker accepts, at 20 MB/s, now comes on top."""
    from epdq.broker import SLOWEST_LINK_BPS

    broker = Broker(BrokerConfig(address="ipc:///x/b.sock", client_liveness_s=2.0))
    allowance = 8 * 20 * 2**20 / SLOWEST_LINK_BPS
    assert broker.client_silence_s() == 2.0 + allowance
    client = b"client-1"
    sub = P.Submit("r1", [P.ChatMessage("user", [P.Part("text", "hi")])], P.Sampling(), 600.0, 0)
    broker._on_submit(client, None, sub, [])
    seen = broker._client_seen[client]
    broker._expire_clients(seen + 2.0 + allowance - 0.5)  # past client_liveness_s, still uploading
    assert "r1" in broker.scheduler.requests
    broker._expire_clients(seen + 2.0 + allowance + 0.5)
    assert "r1" not in broker.scheduler.requests and client not in broker._clients
