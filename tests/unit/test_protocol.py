import msgspec
import pytest

from epdq import protocol as P
from epdq.errors import ProtocolError


def _submit(n_images=1):
    parts = [P.Part("image") for _ in range(n_images)] + [P.Part("text", "hi")]
    return P.Submit("r1", [P.ChatMessage("user", parts)], P.Sampling(max_tokens=3, stop=["x"]), 5.0, n_images)


def test_every_message_round_trips():
    ref = P.EmbedRef(
        b"k" * 16, "enc-0", "node", "seg", 64, 512, 7, "float32", [4, 32], [1, 4, 4], "tcp://h:1"
    )
    samples = [
        _submit(0), P.Cancel("r"), P.StatsRequest(3), P.Tokens("r", [1, 2], "ab", "stop", P.Timings(0.1, 0.2, 1, 1, "epd")),
        P.Error("r", "busy", "full", 0.5), P.Stats(1, {"a": 1}, {"g": 0.5}, [P.WorkerInfo("w", "pd", "n", 4, 1)]),
        P.Register("w", "encoder", "n", 8, "scope", "m", 123, ring_segment="s", ring_capacity=1 << 20),
        P.Ping(1), P.Pong(1, "b"), P.Registered("w", 1.0), P.Heartbeat(), P.Bye("x"), P.Drain("x"), P.Encode(4, b"k" * 16), P.Encoded(4, ref, 0.01),
        P.EncodeFailed(4, b"k", "invalid_input", "bad"), P.Pin([P.EntryId(b"k", 1)]), P.Unpin([]),
        P.Evicted([P.EntryId(b"k", 2)]), P.RingBlocked(4, 1 << 20), P.Prefill("r", [], P.Sampling(), 3.0, [ref]), P.Abort("r"),
        P.PdFailed("r", "stale", "m", [P.EntryId(b"k", 1)]), P.Fetch(1, b"k", 2, 0, 10), P.Fetched(1, "stale", "x"),
    ]  # fmt: skip
    assert {type(m) for m in samples} == set(P.SCHEMAS.values())
    assert P.MsgType.BATCH not in P.SCHEMAS  # a container, split by the transport
    for m in samples:
        frames = P.encode(m) + [b"payload"] * P.payload_count(m)
        got, payload = P.decode(frames)
        assert got == m
        assert len(payload) == P.payload_count(m)


def test_type_frame_is_one_byte_and_payload_is_out_of_band():
    frames = P.encode(_submit(1)) + [b"\x89PNG" + b"x" * 1000]
    assert frames[0] == bytes([P.MsgType.SUBMIT])
    assert len(frames[1]) < 200  # the image is not inside the header
    msg, payload = P.decode(frames)
    assert payload[0].startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "frames, match",
    [
        ([b"\x01"], "at least 2"),
        ([b"\x01\x01", b""], "one byte"),
        ([b"\xff", b"\x90"], "unknown message type"),
        ([bytes([P.MsgType.CANCEL]), b"\x91\x05"], "bad CANCEL"),
        ([bytes([P.MsgType.CANCEL]), b"garbage"], "bad CANCEL"),
        ([bytes([P.MsgType.CANCEL]), msgspec.msgpack.encode(["r", "extra"])], "bad CANCEL"),
        (P.encode(_submit(2)) + [b"one"], "declares 2 payload frames, got 1"),
        (P.encode(P.Cancel("r")) + [b"unexpected"], "declares 0"),
        ([bytes([P.MsgType.TOKENS]), msgspec.msgpack.encode(["r", [1], "a", "stop", None, -1])], "bad TOKENS"),
        ([bytes([P.MsgType.TOKENS]), msgspec.msgpack.encode(["r", [1], "a", "stop", None, 2**40])], "bad TOKENS"),
    ],
)
def test_malformed_frames_raise_protocol_error(frames, match):
    with pytest.raises(ProtocolError, match=match):
        P.decode(frames)


def test_payload_frame_cap():
    with pytest.raises(ProtocolError, match="limit 4"):
        P.decode(P.encode(_submit(5)) + [b"x"] * 5, max_payload_frames=4)


def test_header_size_cap():
    big = P.Cancel("r" * (P.MAX_HEADER_BYTES + 10))
    with pytest.raises(ProtocolError, match="header larger"):
        P.decode(P.encode(big))


def test_validate_messages():
    P.validate_messages(_submit(1).messages, 1)
    with pytest.raises(ProtocolError, match="reference 1 images but 2"):
        P.validate_messages(_submit(1).messages, 2)
    with pytest.raises(ProtocolError, match="unknown role"):
        P.validate_messages([P.ChatMessage("root", [])], 0)
    with pytest.raises(ProtocolError, match="unknown content part"):
        P.validate_messages([P.ChatMessage("user", [P.Part("video")])], 0)
    with pytest.raises(ProtocolError, match="at least one"):
        P.validate_messages([], 0)


def test_messages_to_openai():
    out = P.messages_to_openai(_submit(1).messages)
    assert out == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]


def test_batch_round_trip_and_malformed_batches():
    bodies = [P.encode(P.Cancel("a")), P.encode(_submit(1)) + [b"img"], P.encode(P.Ping(3))]
    frames = P.pack_batch(bodies)
    assert frames[0] == P.BATCH_TYPE
    parts = P.split_batch(frames)
    assert parts == bodies
    assert [P.decode(p)[0] for p in parts] == [P.Cancel("a"), _submit(1), P.Ping(3)]
    for bad in (
        [P.BATCH_TYPE],
        [P.BATCH_TYPE, b"junk"],
        [P.BATCH_TYPE, msgspec.msgpack.encode([[2, 2]]), b"a", b"b", b"c"],
        [P.BATCH_TYPE, msgspec.msgpack.encode([[1]]), b"a"],
        [P.BATCH_TYPE, msgspec.msgpack.encode([[]])],
        [P.BATCH_TYPE, msgspec.msgpack.encode([[10**9]]), b"a", b"b"],
    ):
        with pytest.raises(ProtocolError):
            P.split_batch(bad)


def test_a_batch_packs_small_frames_into_one_and_sends_large_ones_apart():
    big = bytes(range(256)) * 64  # over INLINE_FRAME_BYTES: its own (zero-copy) frame
    bodies = [P.encode(P.Cancel("a")), P.encode(_submit(2)) + [b"small image", big], P.encode(P.Ping(3))]
    frames = P.pack_batch(bodies)
    assert len(frames) == 4 and frames[3] is big  # type, header, the packed small frames, the large one
    parts = P.split_batch(frames)
    assert parts == bodies
    # payloads are copies (a request keeps its image, not the whole packed frame); a large one is as sent
    assert type(parts[1][2]) is bytes and parts[1][3] is big
    assert [P.decode(p)[0] for p in parts] == [P.Cancel("a"), _submit(2), P.Ping(3)]
    # the protocol-5 form (every frame its own) is still read
    old = [P.BATCH_TYPE, msgspec.msgpack.encode([[len(b) for b in bodies]]), *[f for b in bodies for f in b]]
    assert P.split_batch(old) == bodies


@pytest.mark.parametrize("counts, sizes, packed, large", [
    ([2], [1], b"a", []),  # fewer sizes than frames
    ([2], [1, 1, 1], b"abc", []),  # more sizes than frames
    ([2], [1, 2], b"ab", []),  # sizes add up to more than the packed frame
    ([2], [1, 1], b"abc", []),  # ... or to less
    ([2], [1, -1], b"a", []),  # a large frame that is not there
    ([2], [1, 1], b"ab", [b"x"]),  # a large frame nobody named
    ([2], [1, -2], b"a", [b"x"]),
    ([2], [1, P.INLINE_FRAME_BYTES + 1], b"a" + bytes(P.INLINE_FRAME_BYTES + 1), []),  # packed, though large
    ([1], [1], b"a", []),  # a message needs a type and a header
])  # fmt: skip
def test_malformed_packed_batches_are_refused(counts, sizes, packed, large):
    with pytest.raises(ProtocolError):
        P.split_batch([P.BATCH_TYPE, msgspec.msgpack.encode([counts, sizes]), packed, *large])


def test_batch_headers_are_bounded_before_they_are_decoded():
    with pytest.raises(ProtocolError, match="sizes do not match"):  # sizes, but no packed frame
        P.split_batch([P.BATCH_TYPE, msgspec.msgpack.encode([[2], [1, 1]])])
    with pytest.raises(ProtocolError, match="larger than"):  # a 60 MiB header cost 0.5 GB and 1 s to decode
        P.split_batch([P.BATCH_TYPE, bytes(P.MAX_HEADER_BYTES + 1), b""])
    with pytest.raises(ProtocolError, match="length <= 4096"):
        P.split_batch([P.BATCH_TYPE, msgspec.msgpack.encode([[2] * (P.MAX_BATCH + 1)]), b""])


def test_ping_request_ids_are_bounded():
    ids = [f"c-{i}" for i in range(P.MAX_PING_IDS)]
    assert P.decode(P.encode(P.Ping(1, ids)))[0].request_ids == ids
    assert P.decode(P.encode(P.Pong(1, "b", ids[:2])))[0].unknown == ids[:2]
    for bad in (ids + ["one more"], ["x" * 129]):
        with pytest.raises(ProtocolError):
            P.decode(P.encode(P.Ping(1, bad)))


def test_a_fetch_answer_carries_its_entry_then_its_seal():
    data, seal = b"\1" * 32, b"\2" * 40
    msg, payload = P.decode([*P.encode(P.Fetched(3, frames=2)), data[:16], data[16:], seal], max_payload_frames=3)
    assert msg.frames == 2 and payload == [data[:16], data[16:], seal]
    with pytest.raises(ProtocolError, match="declares 3 payload frames, got 2"):  # no seal: an older encoder
        P.decode([*P.encode(P.Fetched(3, frames=2)), data[:16], data[16:]], max_payload_frames=3)
    for frames in (0, -1):  # an entry comes in one frame at least
        with pytest.raises(ProtocolError, match="payload frames"):
            P.decode([*P.encode(P.Fetched(3, frames=frames)), seal], max_payload_frames=3)
    msg, payload = P.decode(P.encode(P.Fetched(3, "stale", "gone", frames=5)), max_payload_frames=3)
    assert msg.code == "stale" and payload == []  # a refusal carries nothing
