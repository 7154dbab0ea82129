"""How a channel cuts what it coalesced into BATCH messages."""

from epdq import protocol as P
from epdq.transport import BATCH_PAYLOAD_BYTES, _batches


def msg(payload: int = 0) -> tuple[list, bool]:
    return P.encode(P.Cancel("r")) + ([bytes(payload)] if payload else []), True


def test_no_batch_holds_more_messages_than_the_receiver_accepts():
    # 5,000 requests in one loop turn used to go as one BATCH that split_batch refused whole:
    # every request then waited for its deadline
    chunks = _batches([msg() for _ in range(5000)])
    assert [len(c) for c in chunks] == [P.MAX_BATCH, 5000 - P.MAX_BATCH]
    for c in chunks:
        frames = P.pack_batch([m for m, _ in c])
        assert len(P.split_batch(frames)) == len(c)


def test_large_payloads_go_in_several_batches_in_order():
    mib = 2**20
    msgs = [msg(mib) for _ in range(10)] + [msg() for _ in range(3)]
    chunks = _batches(msgs)
    per = BATCH_PAYLOAD_BYTES // mib
    assert [len(c) for c in chunks] == [per, per, 10 - 2 * per + 3]
    assert [m for c in chunks for m in c] == msgs  # nothing lost or reordered
    big = msg(64 * mib)
    assert _batches([big, msg()]) == [[big], [msg()]]  # one message over the limit goes alone
