"""The wire protocol: every message that crosses a socket is defined here.

A message is a list of frames: `[type, header, *payload]`. `type` is one byte (`MsgType`),
`header` is a msgpack-encoded `msgspec.Struct` (positional arrays: field order IS the protocol,
so fields are only ever appended), and `payload` frames carry raw bytes out of band (image file
bytes, embedding bytes) so they are never copied into or parsed as msgpack. ROUTER sockets see
one more frame in front: the peer identity. Nothing is ever pickled.

Decoding is strict: the type byte must be known, the header must match its schema exactly, its
size is capped, and the number of payload frames must be what the header declares.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Any

import msgspec

from epdq.errors import ProtocolError

# 2: REGISTER and EmbedRef carry ring_kind and the CUDA ring handle; 3: TOKENS carries prompt_tokens; 4: DRAIN;
# 5: PING carries the client's requests in flight, PONG those the broker does not hold; RING_BLOCKED; BYE refused
# 6: BATCH packs its small frames into one (Batch.sizes); 7: FETCHED carries an entry in several frames (fetch_chunks)
# 8: FETCHED's entry frames are followed by the entry's ring header, its seal (sent from the ring itself)
PROTOCOL_VERSION = 8
MAX_HEADER_BYTES = 1 << 20
MAX_TEXT_CHARS = 256 * 1024
MAX_MESSAGES = 256
MAX_TOKENS_LIMIT = 32768  # a request's max_tokens; the broker refuses more
MAX_PAYLOAD_FRAMES = 64
# A FETCHED's payload frames (fetch_chunks). As one frame, a large entry needed buffers of its whole
# size at every fetch (the encoder's copy, ZeroMQ's receive buffer and, with CURVE, its encryption
# buffers), which glibc maps and faults in afresh; frames of 4 MiB stay in the heap each process
# reuses (epdq.launch.keep_large_buffers). With CURVE, 32 MiB took 117 -> 72 ms from the frames alone.
FETCH_CHUNK_BYTES = 4 << 20


class MsgType(IntEnum):
    # client -> broker
    SUBMIT = 1
    CANCEL = 2
    STATS_REQUEST = 3
    PING = 4
    # broker -> client
    TOKENS = 10
    ERROR = 11
    STATS = 12
    PONG = 13
    # worker <-> broker
    REGISTER = 20
    REGISTERED = 21
    HEARTBEAT = 22
    BYE = 23
    DRAIN = 24  # worker -> broker: send me nothing new; BYE follows once my work is done
    # encoder <-> broker
    ENCODE = 30
    ENCODED = 31
    ENCODE_FAILED = 32
    PIN = 33
    UNPIN = 34
    EVICTED = 35
    RING_BLOCKED = 36  # encoder -> broker: a finished embedding waits for room in the ring
    # pd <-> broker
    PREFILL = 40
    ABORT = 41
    PD_FAILED = 42
    # pd <-> encoder (remote fetch of ring bytes)
    FETCH = 50
    FETCHED = 51
    # any direction: several messages to one peer in one ZeroMQ message (see split_batch)
    BATCH = 60


class _S(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    pass


# ---------------------------------------------------------------- request content


class Part(_S):
    """One content part of a chat message: `kind` is "text" or "image" (images in payload order)."""

    kind: str
    text: str = ""


class ChatMessage(_S):
    role: str
    parts: list[Part]


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a 64-bit signed integer (as vLLM's API takes it)


class Sampling(_S):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False


class Timings(_S):
    """Broker-side timings of one request, in seconds."""

    encode_s: float = 0.0  # admitted -> every embedding resident
    queue_s: float = 0.0  # ready -> handed to a PD worker
    images: int = 0
    cache_hits: int = 0  # images served from the index or an encode already running
    route: str = ""


# ---------------------------------------------------------------- client <-> broker


class Submit(_S):
    request_id: str
    messages: list[ChatMessage]
    sampling: Sampling
    timeout_s: float
    n_images: int  # payload frames that follow: one image file per frame, in prompt order
    route: str = "auto"  # "auto" | "epd" | "colocated"


class Cancel(_S):
    request_id: str


class StatsRequest(_S):
    nonce: int = 0


MAX_PING_IDS = 4096  # request ids are 1..128 characters: a full PING stays far below MAX_HEADER_BYTES
_PingIds = Annotated[list[Annotated[str, msgspec.Meta(max_length=128)]], msgspec.Meta(max_length=MAX_PING_IDS)]


class Ping(_S):
    nonce: int = 0
    # The client's requests in flight. Messages on one connection arrive in order, so any of them
    # the broker does not hold when this arrives, and has not answered, is lost (a restart).
    request_ids: _PingIds = []


class Pong(_S):
    nonce: int
    broker_id: str  # random per broker process: a change means the broker restarted
    unknown: _PingIds = []  # those of the PING's request ids this broker holds no request for
    # the broker's PROTOCOL_VERSION (0: a broker before 6, which does not say): a client of another
    # release fails its requests at once with a clear error, instead of losing them to messages
    # the broker cannot read
    protocol_version: int = 0


class Tokens(_S):
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    timings: Timings | None = None  # set by the broker on the final message only
    # final message: the prompt's length in the engine (images expanded)
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] = 0


class Error(_S):
    request_id: str
    code: str
    message: str
    retry_after: float = 0.0


class WorkerInfo(_S):
    worker_id: str
    role: str
    node: str
    capacity: int
    inflight: int
    ring_capacity: int = 0
    ring_used: int = 0
    ring_pinned: int = 0
    ring_entries: int = 0
    draining: bool = False


class Stats(_S):
    nonce: int
    counters: dict[str, int]
    gauges: dict[str, float]
    workers: list[WorkerInfo]


# ---------------------------------------------------------------- workers


class CudaRing(_S):
    """How a process on the same node maps an encoder's CUDA ring (`epdq.ring_cuda`): the fields of
    torch's CUDA IPC sharing of one device buffer, as plain values (never pickled). Sent once, in the
    encoder's REGISTER; the broker copies it onto every EmbedRef of that encoder."""

    device_uuid: str  # the GPU, by UUID: device indices differ between processes (CUDA_VISIBLE_DEVICES)
    device_index: int  # in the encoder's own numbering (informational)
    handle: bytes  # the allocation's IPC handle (torch's format; opaque)
    storage_bytes: int  # the ring buffer's size
    storage_offset: int  # its offset inside the shared allocation
    ref_counter_handle: bytes  # torch's producer-side reference counter (a shared-memory file name)
    ref_counter_offset: int
    event_handle: bytes  # IPC event the reader waits on once, when it maps the buffer
    event_sync_required: bool


class Register(_S):
    worker_id: str
    role: str  # "encoder" | "pd" | "both"
    node: str
    capacity: int
    scope: str  # model + processor fingerprint; all encoders behind one broker must agree
    model: str
    pid: int
    protocol_version: int = PROTOCOL_VERSION
    ring_segment: str = ""
    ring_capacity: int = 0
    fetch_endpoint: str = ""
    ring_kind: str = ""  # "" or "shm": a POSIX shared-memory segment; "cuda": a CUDA ring (cuda_ring)
    cuda_ring: CudaRing | None = None
    attempt: int = 0  # this worker's how-manyth REGISTER (1, 2, ...): REGISTERED echoes it


class Registered(_S):
    worker_id: str
    heartbeat_s: float
    # the REGISTER answered: a worker that has sent a later one ignores this (and the work with it:
    # the broker re-queues it when it reads the later REGISTER); 0 from a peer that does not say
    attempt: int = 0


class Heartbeat(_S):
    # encoders report their ring so operators (and the soak test) can see occupancy
    ring_used: int = 0
    ring_pinned: int = 0
    ring_entries: int = 0


class Bye(_S):
    reason: str = ""
    refused: bool = False  # broker -> worker: this registration can never succeed (do not retry)


BYE_SHUTTING_DOWN = "broker shutting down"  # a broker's farewell: its successor will want a REGISTER


class Drain(_S):
    reason: str = ""


class EntryId(_S):
    key: bytes
    generation: int


class EmbedRef(_S):
    """Where one image's embedding lives: an entry of an encoder's ring."""

    key: bytes
    encoder_id: str
    node: str
    segment: str
    offset: int
    nbytes: int
    generation: int
    dtype: str
    shape: list[int]
    grid: list[int]  # image_grid_thw of this image: [t, h, w]
    fetch_endpoint: str
    ring_kind: str = ""  # "" or "shm": `segment` is a shared-memory segment; "cuda": a CUDA ring
    cuda_ring: CudaRing | None = None  # set by the broker from the encoder's registration


class Encode(_S):
    job_id: int
    key: bytes  # one payload frame follows: the image file bytes


class Encoded(_S):
    job_id: int
    ref: EmbedRef
    encode_s: float


class EncodeFailed(_S):
    job_id: int
    key: bytes
    code: str
    message: str


class Pin(_S):
    entries: list[EntryId]


class Unpin(_S):
    entries: list[EntryId]


class Evicted(_S):
    entries: list[EntryId]


class RingBlocked(_S):
    """Job `job_id`'s embedding (`nbytes`) is done but every region of the ring that could take
    it holds pinned entries. The encoder keeps it and stores it once room appears."""

    job_id: int
    nbytes: Annotated[int, msgspec.Meta(ge=0)]


class Prefill(_S):
    request_id: str
    messages: list[ChatMessage]
    sampling: Sampling
    timeout_s: float
    embeds: list[EmbedRef]  # EPD route: one per image in prompt order
    n_images: int = 0  # colocated route: image file frames that follow


class Abort(_S):
    request_id: str


class PdFailed(_S):
    request_id: str
    code: str
    message: str
    stale: list[EntryId] = []


class Fetch(_S):
    nonce: int
    key: bytes
    generation: int
    offset: int
    nbytes: int


class Fetched(_S):
    nonce: int
    # "" on success: then the entry's bytes follow in `frames` frames (fetch_chunks), and after
    # them its seal (`epdq.ring.entry_seal`): the entry's header as ZeroMQ read it, after the bytes
    code: str = ""
    message: str = ""
    frames: int = 1


def fetch_chunks(nbytes: int) -> list[tuple[int, int]]:
    """(start, size) of each payload frame of a FETCHED carrying `nbytes`, in order: frames of
    FETCH_CHUNK_BYTES, larger only where MAX_PAYLOAD_FRAMES (less the seal's) would not hold them;
    one frame at least."""
    size = max(FETCH_CHUNK_BYTES, -(-nbytes // (MAX_PAYLOAD_FRAMES - 1)))
    return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)] or [(0, 0)]


MAX_BATCH = 4096


class Batch(_S):
    # frames of each message, in order; the messages' frames follow
    counts: Annotated[list[int], msgspec.Meta(max_length=MAX_BATCH)]
    # Since protocol 6: the byte length of every frame, in order. Frames of at most
    # INLINE_FRAME_BYTES travel back to back in the one ZeroMQ frame after this header, the others
    # (-1 here) as ZeroMQ frames of their own after it (zero-copy). Empty: every frame is its own.
    sizes: Annotated[list[int], msgspec.Meta(max_length=MAX_BATCH * (MAX_PAYLOAD_FRAMES + 2))] = []


# Each ZeroMQ frame costs a send, a receive and a "more?" query (which pyzmq answers through a
# Python enum) on top of the work of its message: a batch of small messages packed into one frame
# costs about what a single message does.
INLINE_FRAME_BYTES = 4096
BATCH_TYPE = bytes([MsgType.BATCH])
_BATCH_DECODER = msgspec.msgpack.Decoder(Batch)


def pack_batch(bodies: list[list[Any]]) -> list[Any]:
    """One message carrying several (`[type, header, *payload]` each) to the same peer: the
    BATCH type, its header, the small frames packed into one, then the large frames."""
    counts: list[int] = []
    sizes: list[int] = []
    small: list[Any] = []
    large: list[Any] = []
    for b in bodies:
        counts.append(len(b))
        for f in b:
            n = len(f) if type(f) is bytes else memoryview(f).nbytes
            if n <= INLINE_FRAME_BYTES:
                sizes.append(n)
                small.append(f)
            else:
                sizes.append(-1)
                large.append(f)
    return [BATCH_TYPE, _ENCODER.encode(Batch(counts, sizes)), b"".join(small), *large]


def split_batch(frames: list[Any]) -> list[list[Any]]:
    """The messages inside a BATCH message (its type frame already checked); ProtocolError if bad.
    Type and header frames of packed messages are views of the packed frame (decoded at once);
    payloads are copied out, so that a request that keeps its image keeps only that image."""
    if len(frames) < 2:
        raise ProtocolError("batch without a header")
    if memoryview(frames[1]).nbytes > MAX_HEADER_BYTES:  # before decoding: a 60 MiB one cost 0.5 GB and 1 s
        raise ProtocolError(f"BATCH header larger than {MAX_HEADER_BYTES} bytes")
    try:
        batch = _BATCH_DECODER.decode(frames[1])
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError(f"bad BATCH header: {e}") from None
    counts, sizes = batch.counts, batch.sizes
    if not 0 < len(counts) <= MAX_BATCH or any(not 2 <= c <= MAX_PAYLOAD_FRAMES + 2 for c in counts):
        raise ProtocolError("bad BATCH frame counts")
    if not sizes:  # every frame its own (protocol 5)
        if sum(counts) != len(frames) - 2:
            raise ProtocolError("BATCH frame counts do not add up")
        out, i = [], 2
        for c in counts:
            out.append(frames[i : i + c])
            i += c
        return out
    if len(frames) < 3 or len(sizes) != sum(counts):
        raise ProtocolError("BATCH frame sizes do not match its counts")
    packed = memoryview(frames[2]).cast("B")
    large = frames[3:]
    if any(n < -1 or n > INLINE_FRAME_BYTES for n in sizes) or sizes.count(-1) != len(large):
        raise ProtocolError("bad BATCH frame sizes")
    if sum(n for n in sizes if n > 0) != packed.nbytes:
        raise ProtocolError("BATCH frame sizes do not add up")
    out = []
    i = off = j = 0
    for c in counts:
        msg: list[Any] = []
        for k in range(c):
            n = sizes[i]
            i += 1
            if n < 0:
                msg.append(large[j])
                j += 1
            elif k < 2:
                msg.append(packed[off : off + n])
                off += n
            else:
                msg.append(bytes(packed[off : off + n]))
                off += n
        out.append(msg)
    return out


# ---------------------------------------------------------------- codec

SCHEMAS: dict[MsgType, type[_S]] = {
    MsgType.SUBMIT: Submit,
    MsgType.CANCEL: Cancel,
    MsgType.STATS_REQUEST: StatsRequest,
    MsgType.PING: Ping,
    MsgType.PONG: Pong,
    MsgType.TOKENS: Tokens,
    MsgType.ERROR: Error,
    MsgType.STATS: Stats,
    MsgType.REGISTER: Register,
    MsgType.REGISTERED: Registered,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.BYE: Bye,
    MsgType.DRAIN: Drain,
    MsgType.ENCODE: Encode,
    MsgType.ENCODED: Encoded,
    MsgType.ENCODE_FAILED: EncodeFailed,
    MsgType.PIN: Pin,
    MsgType.UNPIN: Unpin,
    MsgType.EVICTED: Evicted,
    MsgType.RING_BLOCKED: RingBlocked,
    MsgType.PREFILL: Prefill,
    MsgType.ABORT: Abort,
    MsgType.PD_FAILED: PdFailed,
    MsgType.FETCH: Fetch,
    MsgType.FETCHED: Fetched,
}
TYPE_OF: dict[type[_S], MsgType] = {cls: t for t, cls in SCHEMAS.items()}
_TYPE_BY_VALUE = {int(t) for t in MsgType}
_TYPE_FRAMES: dict[MsgType, bytes] = {t: bytes([t]) for t in MsgType}
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in SCHEMAS.items()}
_ENCODER = msgspec.msgpack.Encoder()
# indexed by the type byte: no enum construction per message on the hot path
_DECODER_BY_BYTE = [_DECODERS.get(b) for b in range(256)]  # type: ignore[call-overload]
_NAME_BY_BYTE = [MsgType(b).name if b in _TYPE_BY_VALUE else "" for b in range(256)]


def encode(msg: _S) -> list[Any]:
    """Frames `[type, header]` for a message; the caller appends payload frames."""
    return [_TYPE_FRAMES[TYPE_OF[type(msg)]], _ENCODER.encode(msg)]


def payload_count(msg: _S) -> int:
    """How many payload frames must follow this header."""
    if isinstance(msg, Submit):
        return msg.n_images
    if isinstance(msg, Prefill):
        return msg.n_images
    if isinstance(msg, Encode):
        return 1
    if isinstance(msg, Fetched):
        if msg.code:
            return 0
        return msg.frames + 1 if msg.frames >= 1 else -1  # the entry's frames (one at least), then its seal
    return 0


def decode(frames: list[Any], *, max_payload_frames: int = MAX_PAYLOAD_FRAMES) -> tuple[_S, list[Any]]:
    """Decode `[type, header, *payload]` (identity already stripped) into (struct, payload).

    Raises ProtocolError for anything that does not match the schema exactly.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    tb = memoryview(frames[0])
    if tb.nbytes != 1:
        raise ProtocolError("type frame must be exactly one byte")
    decoder = _DECODER_BY_BYTE[tb[0]]
    if decoder is None:
        raise ProtocolError(f"unknown message type {tb[0]}")
    name = _NAME_BY_BYTE[tb[0]]
    header = frames[1]
    if memoryview(header).nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header larger than {MAX_HEADER_BYTES} bytes")
    try:
        msg = decoder.decode(header)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ProtocolError(f"bad {name} header: {e}") from None
    payload = frames[2:]
    want = payload_count(msg)
    if want < 0 or want > max_payload_frames:
        raise ProtocolError(f"{name} declares {want} payload frames (limit {max_payload_frames})")
    if len(payload) != want:
        raise ProtocolError(f"{name} declares {want} payload frames, got {len(payload)}")
    return msg, payload


def validate_messages(messages: list[ChatMessage], n_images: int) -> None:
    """Semantic checks on chat content shared by the client, the broker and workers."""
    if not messages:
        raise ProtocolError("a request needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise ProtocolError(f"at most {MAX_MESSAGES} messages per request")
    images = 0
    chars = 0
    for m in messages:
        if m.role not in ("system", "user", "assistant"):
            raise ProtocolError(f"unknown role {m.role[:32]!r}")
        for p in m.parts:
            if p.kind == "image":
                images += 1
            elif p.kind == "text":
                chars += len(p.text)
            else:
                raise ProtocolError(f"unknown content part kind {p.kind[:32]!r}")
    if chars > MAX_TEXT_CHARS:
        raise ProtocolError(f"text longer than {MAX_TEXT_CHARS} characters")
    if images != n_images:
        raise ProtocolError(f"messages reference {images} images but {n_images} were sent")


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def validate_sampling(s: Sampling) -> None:
    """Value ranges of sampling parameters, shared by the client (before it sends) and the broker."""
    if not 1 <= s.max_tokens <= MAX_TOKENS_LIMIT:
        raise ProtocolError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], not {s.max_tokens}")
    if not 0.0 <= s.temperature <= 2.0:  # NaN fails both
        raise ProtocolError(f"temperature must be in [0, 2], not {s.temperature!r}")
    if not 0.0 < s.top_p <= 1.0:
        raise ProtocolError(f"top_p must be in (0, 1], not {s.top_p!r}")
    if s.seed is not None and not SEED_MIN <= s.seed <= SEED_MAX:
        raise ProtocolError("seed must be a 64-bit signed integer")
    if s.seed == -1:
        # vLLM reads -1 as "no seed" (random sampling), the hf engine as a seed: refused rather
        # than served differently by each backend
        raise ProtocolError(
            "seed -1 is not accepted (vLLM reads it as 'no seed'): leave seed unset for random sampling"
        )
    if len(s.stop) > MAX_STOP_STRINGS:
        raise ProtocolError(f"{len(s.stop)} stop strings (at most {MAX_STOP_STRINGS})")
    for x in s.stop:
        if not 0 < len(x) <= MAX_STOP_CHARS:
            raise ProtocolError(f"a stop string must have 1..{MAX_STOP_CHARS} characters, not {len(x)}")


def messages_to_openai(messages: list[ChatMessage]) -> list[dict]:
    """The OpenAI-style dicts the engines' chat templates take."""
    out = []
    for m in messages:
        content = [
            {"type": "image"} if p.kind == "image" else {"type": "text", "text": p.text} for p in m.parts
        ]
        out.append({"role": m.role, "content": content})
    return out
