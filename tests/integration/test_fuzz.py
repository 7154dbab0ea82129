"""Fuzzing the broker's and the workers' message handling with real processes and sockets.

Thousands of malformed messages (random frames, random headers behind valid type bytes, msgpack
of the wrong shape, mutated valid messages, lying payload counts, huge declared sizes, hostile
but well-formed messages) go to a broker, to an encoder and a PD worker (driven by a fake broker:
a ROUTER socket owned by the test) and to the encoder's fetch socket. Afterwards every process
is alive, malformed messages were counted, and valid traffic is served normally.

All cases come from fixed seeds, so a failure reproduces. No-op engines: no model is loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from PIL import Image

from epdq import AsyncClient
from epdq import protocol as P
from epdq.cluster import Cluster, die_with_parent
from epdq.demo import demo_image
from epdq.errors import ProtocolError
from epdq.ring import entry_seal
from epdq.ring_reader import RingReader
from epdq.worker.runner import WorkerConfig
from tests.integration.helpers import noop_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

T = P.MsgType
SCHEMA_TYPES = [t for t in T if t in P.SCHEMAS]  # BATCH is a container, fuzzed separately
NOOP_SCOPE = "noop-vision-v1"  # NoopVisionEngine.scope: a REGISTER with it is accepted as an encoder
HIDDEN = 128  # no-op engines' hidden size
# codes a PD_FAILED / ENCODE_FAILED / FETCHED may carry (epdq.errors)
TYPED_CODES = {"invalid_input", "protocol", "stale", "fetch_failed", "deadline", "engine", "cancelled", "internal",
               "ring_full", "busy", "worker_lost"}  # fmt: skip
BROKER_HANDLED = {
    P.Submit, P.Cancel, P.StatsRequest, P.Ping, P.Register, P.Heartbeat, P.Bye,
    P.Encoded, P.EncodeFailed, P.Evicted, P.RingBlocked, P.Tokens, P.PdFailed,
}  # fmt: skip


# ====================================================================== generators

_EDGE_INTS = [
    0,
    1,
    -1,
    2,
    7,
    64,
    255,
    256,
    4096,
    10**9,
    2**31 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
]
_EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0000001, 1e-300, 1e300, -1e300, math.inf, -math.inf, math.nan]


def _rstr(rng: random.Random, n: int | None = None) -> str:
    n = rng.choice([0, 1, 3, 16, 64]) if n is None else n
    alphabet = "abcXYZ019 _-./\\\x00\n\u00e9\u4e2d\U0001f600"
    return "".join(rng.choice(alphabet) for _ in range(n))


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-encodable value: scalars at their edges, nested containers."""
    k = rng.randrange(10 if depth < 3 else 7)
    if k == 0:
        return None
    if k == 1:
        return rng.random() < 0.5
    if k == 2:
        return rng.choice(_EDGE_INTS) if rng.random() < 0.7 else rng.randint(-(2**63), 2**64 - 1)
    if k == 3:
        return rng.choice(_EDGE_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
    if k == 4:
        return _rstr(rng) if rng.random() < 0.97 else "x" * rng.choice([300, 10_240, 200_000])
    if k == 5:
        return rng.randbytes(rng.choice([0, 1, 15, 16, 17, 64]))
    if k == 6:
        return rng.choice(
            ["text", "image", "user", "system", "assistant", "pd", "encoder", "both", "float32", ""]
        )
    if k in (7, 8):
        return [junk(rng, depth + 1) for _ in range(rng.choice([0, 1, 2, 3, 5, 11]))]
    return {_rstr(rng, rng.randint(0, 6)): junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(16)


def _sampling(rng: random.Random, hostile: bool) -> P.Sampling:
    if not hostile:
        return P.Sampling(max_tokens=rng.randint(1, 3))
    return P.Sampling(
        max_tokens=rng.choice([0, -1, 1, 2, 32769, 2**63 - 1, -(2**63)]),
        temperature=rng.choice(_EDGE_FLOATS), top_p=rng.choice(_EDGE_FLOATS),
        seed=rng.choice([None, 0, -1, 2**64 - 1]), stop=rng.choice([[], [""], ["x" * 300], ["a"] * 40]),
        ignore_eos=rng.random() < 0.5,
    )  # fmt: skip


def _messages(rng: random.Random, n_images: int, hostile: bool) -> list[P.ChatMessage]:
    if hostile and rng.random() < 0.5:
        return rng.choice([
            [],
            [P.ChatMessage("root", [P.Part("text", "hi")])],
            [P.ChatMessage("user", [P.Part("video", "")])],
            [P.ChatMessage("user", [P.Part("text", "x" * (P.MAX_TEXT_CHARS + 1))])],
            [P.ChatMessage("user", [P.Part("text", "m")])] * (P.MAX_MESSAGES + 1),
            [P.ChatMessage("user", [P.Part("image")] * 5)],
            [P.ChatMessage("user", [])],
        ])  # fmt: skip
    parts = [P.Part("image") for _ in range(n_images)] + [P.Part("text", _rstr(rng))]
    rng.shuffle(parts)
    return [P.ChatMessage(rng.choice(["user", "system"]), parts)]


def _ref(rng: random.Random, **kw: Any) -> P.EmbedRef:
    rows = rng.choice([1, 4, 16])
    fields = dict(
        key=_key(rng), encoder_id="enc", node="fuzz-node", segment=f"epdq-{os.getuid()}-enc-1-{'0' * 16}",
        offset=64, nbytes=rows * HIDDEN * 4, generation=1, dtype="float32", shape=[rows, HIDDEN],
        grid=[1, 2, rows * 2], fetch_endpoint="",
    )  # fmt: skip
    fields.update(kw)
    return P.EmbedRef(**fields)


def template(rng: random.Random, t: T) -> tuple[P._S, list[bytes]]:
    """A valid message of type `t` (semantically it may be nonsense) and its payload frames."""
    e = P.EntryId(_key(rng), rng.randint(1, 2**32))
    if t is T.SUBMIT:
        n = rng.choice([0, 0, 1])
        return P.Submit(
            f"fz-{rng.getrandbits(48):x}", _messages(rng, n, False), _sampling(rng, False), 5.0, n
        ), [demo_image(rng.randrange(1000), (32, 32)) for _ in range(n)]
    table: dict[T, Any] = {
        T.CANCEL: lambda: P.Cancel(_rstr(rng)),
        T.STATS_REQUEST: lambda: P.StatsRequest(rng.randint(0, 2**63 - 1)),
        T.PING: lambda: P.Ping(rng.randint(0, 2**63 - 1), [_rstr(rng) for _ in range(rng.randint(0, 3))]),
        T.PONG: lambda: P.Pong(1, "b"),
        T.TOKENS: lambda: P.Tokens(_rstr(rng), [1, 2], "xy", rng.choice([None, "length"]), P.Timings()),
        T.ERROR: lambda: P.Error("r", "busy", "m", 1.0),
        T.STATS: lambda: P.Stats(1, {"a": 1}, {"b": 1.0}, [P.WorkerInfo("w", "pd", "n", 1, 0)]),
        T.REGISTER: lambda: P.Register("fuzz-w", "pd", "n", 4, "", "m", 1),
        T.REGISTERED: lambda: P.Registered("fuzz-w", 1.0),
        T.HEARTBEAT: lambda: P.Heartbeat(rng.randint(0, 10), 0, 0),
        T.BYE: lambda: P.Bye(_rstr(rng)),
        T.DRAIN: lambda: P.Drain(_rstr(rng)),
        T.ENCODE: lambda: P.Encode(rng.randint(0, 2**64 - 1), _key(rng)),
        T.ENCODED: lambda: P.Encoded(rng.randint(0, 100), _ref(rng), 0.1),
        T.ENCODE_FAILED: lambda: P.EncodeFailed(rng.randint(0, 100), _key(rng), "invalid_input", "m"),
        T.PIN: lambda: P.Pin([e]),
        T.UNPIN: lambda: P.Unpin([e]),
        T.EVICTED: lambda: P.Evicted([e]),
        T.RING_BLOCKED: lambda: P.RingBlocked(rng.randint(0, 2**63 - 1), rng.randint(0, 2**40)),
        T.PREFILL: lambda: P.Prefill(f"fz-{rng.getrandbits(48):x}", _messages(rng, 0, False), _sampling(rng, False), 5.0, []),
        T.ABORT: lambda: P.Abort(_rstr(rng)),
        T.PD_FAILED: lambda: P.PdFailed(_rstr(rng), "engine", "m", [e]),
        T.FETCH: lambda: P.Fetch(rng.randint(0, 10), _key(rng), 1, 64, 512),
        T.FETCHED: lambda: P.Fetched(rng.randint(0, 10), "stale", "m"),
    }  # fmt: skip
    msg = table[t]()
    # payload frames for ENCODE are never a valid image here: see test_encoder_survives_encode_with_bad_key
    payload = [rng.randbytes(rng.choice([0, 8, 100]))] if t is T.ENCODE else []
    return msg, payload


def mutate(rng: random.Random, msg: P._S) -> Any:
    """The msg as a positional array with one hostile change (wrong type, extra, missing, nested junk)."""
    arr = msgspec.to_builtins(msg)
    if not isinstance(arr, list):
        return junk(rng)
    op = rng.randrange(6)
    if op == 0 and arr:
        arr[rng.randrange(len(arr))] = junk(rng)
    elif op == 1:
        arr.extend(junk(rng) for _ in range(rng.randint(1, 3)))
    elif op == 2 and arr:
        del arr[rng.randrange(len(arr)) :]
    elif op == 3:
        arr = {f: v for f, v in zip(msg.__struct_fields__, arr, strict=False)}  # map instead of array
    elif op == 4 and arr:
        i = rng.randrange(len(arr))
        arr[i] = [arr[i], junk(rng)] if rng.random() < 0.5 else {"x": arr[i]}
    else:
        for i, v in enumerate(arr):  # swap numbers for edge numbers of the other kind
            if isinstance(v, bool):
                continue
            if isinstance(v, int):
                arr[i] = rng.choice(_EDGE_FLOATS)
            elif isinstance(v, float):
                arr[i] = rng.choice(_EDGE_INTS + _EDGE_FLOATS)
    return arr


def malformed(rng: random.Random, types: list[T]) -> list[bytes]:
    """Frames `[type, header, *payload]` (no identity) of one random malformed-ish message."""
    k = rng.randrange(100)
    if k < 15:  # fully random frame lists
        n = rng.choice([1, 1, 2, 3, 4, 8, rng.randint(1, 80)])
        return [rng.randbytes(rng.choice([0, 1, 2, 16, 100, rng.randint(0, 4096)])) for _ in range(n)]
    if k < 20:  # unknown or multi-byte type frames
        tb = rng.choice([b"", b"\x00", b"\xff", bytes([rng.randrange(256)]), b"\x01\x01"])
        return [tb, msgspec.msgpack.encode(junk(rng)), *([b"x"] * rng.randint(0, 2))]
    t = rng.choice(types)
    tb = bytes([t])
    if k < 35:  # valid type, random header bytes
        return [
            tb,
            rng.randbytes(rng.choice([0, 1, 5, 64, 1024])),
            *[rng.randbytes(8) for _ in range(rng.randint(0, 3))],
        ]
    if k < 50:  # valid type, msgpack of the wrong shape
        return [tb, msgspec.msgpack.encode(junk(rng))]
    msg, payload = template(rng, t)
    if k < 80:  # one field wrong / extra / missing
        return [tb, msgspec.msgpack.encode(mutate(rng, msg)), *payload]
    if k < 90:  # valid header, payload frame count that does not match the header
        frames = P.encode(msg)
        extra = rng.choice([1, 2, 65]) if not payload or rng.random() < 0.5 else -1
        return frames + (payload[:-1] if extra < 0 else payload + [b"\x89PNG\r\n\x1a\n"] * extra)
    # a header over the size cap, or an oversized declared count
    if rng.random() < 0.1:
        return [tb, b"\x91" + b"\xda\xff\xff" + b"a" * (P.MAX_HEADER_BYTES + 16)]
    return [tb, msgspec.msgpack.encode(msg), *payload]  # valid: interleaved real traffic


def undecodable(frames: list[bytes], max_payload_frames: int = P.MAX_PAYLOAD_FRAMES) -> bool:
    try:
        P.decode(frames, max_payload_frames=max_payload_frames)
    except ProtocolError:
        return True
    return False


def decoded_type(frames: list[bytes]) -> type | None:
    try:
        return type(P.decode(frames)[0])
    except ProtocolError:
        return None


def is_refusal(frames: list[bytes]) -> bool:
    """A well-formed BYE that refuses the worker: the broker's word that registering again cannot
    help, which a worker obeys by stopping (see `BrokerLink`)."""
    try:
        msg = P.decode(frames)[0]
    except ProtocolError:
        return False
    return isinstance(msg, P.Bye) and msg.refused


def hostile_submits(rng: random.Random) -> list[list[bytes]]:
    """Well-formed-looking SUBMITs that lie about sizes or carry absurd values."""
    img = demo_image(7, (32, 32))
    out: list[list[bytes]] = []
    for _ in range(40):
        n = rng.choice([1, 2, 3, 9, 64, 65, 10**9, 2**63 - 1, -1, -(2**63)])
        have = rng.choice([0, 1, 2, 3, 64])
        s = P.Submit("fz-" + _rstr(rng, 8), _messages(rng, 1, False), _sampling(rng, False), 5.0, n)
        out.append([*P.encode(s), *[img] * have])
    for _ in range(40):  # huge request ids, NaN/inf/negative numbers, bogus routes
        n = rng.choice([0, 1])
        s = P.Submit(
            rng.choice(["x" * 10_240, "", "fz-" + _rstr(rng, 8), "\x00" * 129]),
            _messages(rng, n, True), _sampling(rng, True),
            rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, 3601.0, 2.0]), n,
            rng.choice(["auto", "epd", "colocated", "", "x" * 1000]),
        )  # fmt: skip
        out.append([*P.encode(s), *[rng.choice([img, b"", b"GIF89a", rng.randbytes(64)])] * n])
    return out


def hostile_registers(rng: random.Random) -> list[list[bytes]]:
    """REGISTERs the broker must refuse with a BYE (bad role, capacity, id, version, scope)."""
    bad = [
        dict(role="root"), dict(role=""), dict(role="x" * 10_000), dict(capacity=0), dict(capacity=-1),
        dict(capacity=4097), dict(capacity=2**63 - 1), dict(worker_id=""), dict(worker_id="w" * 129),
        dict(worker_id="w" * 100_000), dict(protocol_version=0), dict(protocol_version=2**64 - 1),
        dict(role="encoder", scope="some-other-model"), dict(node=""), dict(node="n" * 129), dict(node="n" * 100_000),
    ]  # fmt: skip
    out = []
    for i in range(60):
        kw = dict(worker_id=f"fuzz-bad-{i}", role="pd", node="n", capacity=4, scope="", model="m", pid=1)
        kw.update(rng.choice(bad))
        out.append(P.encode(P.Register(**kw)))
    return out


def fake_registers(rng: random.Random) -> list[list[bytes]]:
    """REGISTERs that are accepted: the fuzzing socket becomes a (fake) worker for a while."""
    return [
        P.encode(P.Register("fuzz-fake-pd", "pd", "n", 2, "", "m", 1)),
        P.encode(P.Register("fuzz-fake-enc", "encoder", "n", 2, NOOP_SCOPE, "m", 1, ring_segment="../../x",
                            ring_capacity=2**20, fetch_endpoint="tcp://256.0.0.1:0")),
    ]  # fmt: skip


def worker_only(rng: random.Random) -> list[list[bytes]]:
    """Worker->broker messages with bad contents (sent before, during and after a fake registration)."""
    out = []
    for _ in range(30):
        ref = _ref(rng, encoder_id=rng.choice(["fuzz-fake-enc", "encoder-0", ""]),
                   segment=rng.choice(["../../etc/passwd", "", "x" * 1000]),
                   offset=rng.choice([-64, 0, 2**62, 64]), nbytes=rng.choice([-1, 0, 2**62, 512]),
                   shape=rng.choice([[], [1], [2**62, 2**62], [-1, 128]]), grid=rng.choice([[], [0, 0, 0], [1, 2, 2]]))  # fmt: skip
        out += [
            P.encode(P.Encoded(rng.choice([0, 1, 2, 2**64 - 1]), ref, rng.choice(_EDGE_FLOATS))),
            P.encode(P.Tokens(rng.choice(["", "fz-nope", "x" * 10_240]), [2**63 - 1], "t", rng.choice([None, "length"]))),
            P.encode(P.PdFailed("fz-nope", rng.choice(["", "stale", "x" * 1000]), "m", [P.EntryId(b"", 2**64 - 1)] * 100)),
            P.encode(P.Evicted([P.EntryId(rng.randbytes(rng.choice([0, 16, 1000])), 0)] * rng.choice([1, 1000]))),
            P.encode(P.EncodeFailed(rng.randint(0, 5), b"", rng.choice(["", "internal", "stale", "\x00"]), "m")),
            P.encode(P.Heartbeat(-1, 2**63 - 1, -(2**63))),
        ]  # fmt: skip
    return out


# ====================================================================== process / socket helpers



def spawn_worker(cfg: WorkerConfig, log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "epdq.launch", "worker", msgspec.json.encode(cfg).decode()],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent, start_new_session=True,
        )  # fmt: skip


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def raw_socket(
    ctx: zmq.Context, kind: int, *, connect: str | None = None, bind: str | None = None
) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if bind:
        s.bind(bind)
    if connect:
        s.connect(connect)
    return s


def unbatch(frames: list) -> list[list]:
    """epdq peers pack several messages for one peer into a BATCH message: split it."""
    if len(frames) >= 2 and bytes(frames[0]) == P.BATCH_TYPE:
        return P.split_batch(frames)
    return [frames]


def drain(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while True:
        try:
            out.extend(unbatch(sock.recv_multipart(zmq.NOBLOCK)))
        except zmq.Again:
            return out


async def recv_until(sock: zmq.Socket, pred, timeout: float) -> list[bytes]:
    """Receive (discarding) until a message satisfies pred; bounded."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sock.poll(0, zmq.POLLIN):
            for frames in unbatch(sock.recv_multipart(zmq.NOBLOCK)):
                if pred(frames):
                    return frames
        else:
            await asyncio.sleep(0.01)
    raise AssertionError(f"no matching message within {timeout}s")


# ====================================================================== 1. the broker


async def test_broker_survives_fuzz_and_serves(tmp_path):
    rng = random.Random(0xB40C3)
    cases: list[list[bytes]] = []
    types = SCHEMA_TYPES
    cases += [malformed(rng, types) for _ in range(4000)]
    cases += hostile_submits(rng) + hostile_registers(rng) + worker_only(rng)
    cases += [
        [bytes([rng.choice(types)]), rng.randbytes(rng.choice([2, 3, 4]) << 20)] for _ in range(3)
    ]  # MiB frames
    cases += [[b"\x01", msgspec.msgpack.encode(junk(rng)), *[rng.randbytes(1 << 20)] * 3]]
    # malformed batches: junk headers, counts that lie, batches of malformed messages
    for _ in range(200):
        inner = [malformed(rng, types) for _ in range(rng.randint(1, 5))]
        good = P.pack_batch([m for m in inner if len(m) >= 2] or [[b"\x01", b""]])
        cases.append(rng.choice([
            [P.BATCH_TYPE, rng.randbytes(rng.randint(0, 64))],
            [P.BATCH_TYPE, msgspec.msgpack.encode([[rng.randint(-5, 10**6)]]), *good[2:]],
            good,
        ]))  # fmt: skip
    rng.shuffle(cases)
    # a fake registration in the middle: later worker-only messages hit the registered paths
    mid = len(cases) // 2
    cases[mid:mid] = fake_registers(rng) + worker_only(rng)
    expected_errors = sum(1 for f in cases if undecodable(f) or decoded_type(f) not in BROKER_HANDLED)
    assert len(cases) > 2800 and expected_errors > 1500

    ctx = zmq.Context()
    sock = None
    cluster = Cluster(noop_spec(tmp_path))
    try:
        await cluster.start()
        async with AsyncClient(cluster.address) as c:
            before = (await c.stats())["counters"]
            sock = raw_socket(ctx, zmq.DEALER, connect=cluster.address)
            i = 0
            t0 = time.monotonic()
            while i < len(cases):  # bursts larger and smaller than the broker's drain batch (512)
                burst = rng.choice([1, 5, 50, 300, 700, 1200])
                for frames in cases[i : i + burst]:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                i += burst
                drain(sock)
                await asyncio.sleep(rng.choice([0, 0.005, 0.02]))
            # leave: the fake worker registration must not survive to take real work
            sock.send_multipart(P.encode(P.Bye("fuzz done")))
            sock.send_multipart(P.encode(P.Ping(424242)))
            await recv_until(
                sock,
                lambda f: f[0] == bytes([T.PONG]) and msgspec.msgpack.decode(f[1])[0] == 424242,
                timeout=60,
            )
            fuzz_s = time.monotonic() - t0
            cluster.check_alive()

            after = (await c.stats())["counters"]
            got_errors = after["protocol_errors"] - before["protocol_errors"]
            assert after["messages_in"] - before["messages_in"] >= len(cases)
            # every undecodable message is counted once; refused REGISTERs and unexpected types count too
            assert expected_errors <= got_errors <= len(cases) + 2, (expected_errors, got_errors)

            # valid traffic: a multimodal request through the real encoder and PD worker
            r = await asyncio.wait_for(
                c.generate("describe", images=[demo_image(99, (64, 64))], max_tokens=3, route="epd"), 30
            )
            assert len(r.token_ids) == 3 and r.finish_reason == "length" and r.timings.route == "epd"
            r2 = await asyncio.wait_for(c.generate("text only", max_tokens=2), 30)
            assert len(r2.token_ids) == 2
            s = await c.stats()
            assert sorted(w["worker_id"] for w in s["workers"]) == ["encoder-0", "pd-0"]
            cluster.check_alive()
        log = (Path(cluster.log_dir) / "broker.log").read_text(errors="replace")
        # malformed input is rejected by the decoder or a handler's checks, not by an exception
        assert "failed to handle a message" not in log, tail(Path(cluster.log_dir) / "broker.log", 60)
        print(f"broker fuzz: {len(cases)} messages in {fuzz_s:.1f}s, {got_errors} protocol errors "
              f"({expected_errors} undecodable or unexpected)")  # fmt: skip
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
        await asyncio.to_thread(cluster.stop)


# ====================================================================== 2. workers behind a fake broker


class FakeBroker:
    """A ROUTER the workers register with; answers REGISTER and heartbeats, records the rest."""

    def __init__(self, address: str):
        self.ctx = zmq.asyncio.Context()
        self.sock = raw_socket(self.ctx, zmq.ROUTER, bind=address)
        self.registers: dict[bytes, P.Register] = {}
        self.registrations: Counter[bytes] = Counter()
        self.last_beat: dict[bytes, float] = {}
        self.beats: Counter[bytes] = Counter()
        self.inbox: dict[bytes, list[tuple[Any, list[bytes]]]] = {}
        self.bad = 0
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._beater())]

    async def _reader(self) -> None:
        while True:
            raw = await self.sock.recv_multipart()
            ident = raw[0]
            for frames in unbatch(raw[1:]):
                await self._handle(ident, frames)

    async def _handle(self, ident: bytes, frames: list) -> None:
        try:
            msg, payload = P.decode(frames)
        except ProtocolError:
            self.bad += 1
            return
        if isinstance(msg, P.Register):
            self.registers[ident] = msg
            self.registrations[ident] += 1
            await self.send(ident, P.Registered(msg.worker_id, 1.0))
        elif isinstance(msg, P.Heartbeat):
            self.last_beat[ident] = time.monotonic()
            self.beats[ident] += 1
        else:
            self.inbox.setdefault(ident, []).append((msg, payload))
        self._changed.set()

    async def _beater(self) -> None:
        hb = P.encode(P.Heartbeat())
        while True:
            await asyncio.sleep(0.3)
            for ident in list(self.registers):
                await self.sock.send_multipart([ident, *hb])

    async def send(self, ident: bytes, msg: Any, payload: list[bytes] = ()) -> None:
        await self.sock.send_multipart([ident, *P.encode(msg), *payload])

    async def send_raw(self, ident: bytes, frames: list[bytes]) -> None:
        await self.sock.send_multipart([ident, *frames])

    async def wait_for(self, pred, timeout: float, what: str = "condition", diag=None):
        end = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"fake broker: {what} not met within {timeout}s" + (f": {diag()}" if diag else "")
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
            except TimeoutError:
                pass

    def take(self, ident: bytes, cls: type) -> list[tuple[Any, list[bytes]]]:
        box = self.inbox.get(ident, [])
        return [(m, p) for m, p in box if isinstance(m, cls)]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()


class Workers:
    def __init__(self, fb: FakeBroker, procs: dict[str, subprocess.Popen], logs: dict[str, Path]):
        self.fb, self.procs, self.logs = fb, procs, logs
        self.enc, self.pd = b"", b""  # their ZeroMQ identities, once they registered

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            rc = p.poll()
            assert rc is None, f"{name} exited with code {rc}:\n{tail(self.logs[name])}"


async def start_workers(tmp_path: Path, roles: tuple[str, ...] = ("encoder", "pd")) -> Workers:
    (tmp_path / "sock").mkdir(mode=0o700, exist_ok=True)
    fb = FakeBroker(f"ipc://{tmp_path}/sock/fake-broker")
    fb.start()
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    w = Workers(fb, procs, logs)
    try:
        for role in roles:
            name = "fuzz-enc" if role == "encoder" else "fuzz-pd"
            cfg = WorkerConfig(role=role, broker=fb.sock.getsockopt_string(zmq.LAST_ENDPOINT), engine="noop",
                               worker_id=name, node="fuzz-node", ring_bytes=4 * 2**20, heartbeat_s=1.0,
                               insecure=True)  # plaintext ipc links whatever keys exist  # fmt: skip
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = spawn_worker(cfg, logs[name])
        def ready():
            w.check_alive()
            return set(procs) <= {r.worker_id for r in fb.registers.values()}

        await fb.wait_for(ready, 60, "worker registration")
        # workers connect under random identities: find theirs
        idents = {r.worker_id: ident for ident, r in fb.registers.items()}
        w.enc, w.pd = idents.get("fuzz-enc", b""), idents.get("fuzz-pd", b"")
    except BaseException:
        await stop_workers(w)
        raise
    return w


async def stop_workers(w: Workers) -> None:
    for p in w.procs.values():
        await asyncio.to_thread(stop_proc, p)
    await w.fb.close()


@pytest.fixture(scope="module")
async def workers(tmp_path_factory):
    w = await start_workers(tmp_path_factory.mktemp("fuzz-workers"))
    try:
        yield w
    finally:
        await stop_workers(w)


def hostile_prefills(rng: random.Random, segment: str, real: P.EmbedRef | None, tmp: Path) -> list[P.Prefill]:
    """Well-formed PREFILLs a PD worker must answer with a typed PD_FAILED, never crash on."""
    uid = os.getuid()
    segs = ["../../etc/passwd", "/dev/shm/../../etc/passwd", "", "x" * 4096, f"epdq-{uid}-enc-1-{'0' * 16}",
            f"epdq-{uid + 1}-enc-1-{'0' * 16}", "epdq-0-enc-1-0000000000000000", segment, segment + "\x00"]  # fmt: skip
    out = []
    for i in range(160):
        n = rng.choice([1, 1, 2])
        kw: dict[str, Any] = dict(segment=rng.choice(segs))
        r = rng.randrange(12)
        if r == 0:
            kw.update(offset=rng.choice([-64, 0, 63, 2**40, 2**63 - 1, 4 * 2**20 - 64]))
        elif r == 1:
            kw.update(nbytes=rng.choice([-1, 0, 1, 2**62]))
        elif r == 2:
            kw.update(shape=rng.choice([[], [1], [4, HIDDEN, 1], [-4, HIDDEN], [4, 127], [0, HIDDEN]]))
        elif r == 3:
            kw.update(grid=rng.choice([[], [1, 2], [0, 0, 0], [-1, 2, 2], [1, 2**31, 2**31], [1, 4, 4]]))
        elif r == 4:
            kw.update(key=rng.randbytes(rng.choice([0, 15, 17, 1000])))
        elif r == 5:
            kw.update(generation=rng.choice([0, 2**64 - 1, 2**63]))
        elif r == 6:
            kw.update(dtype=rng.choice(["float64", "", "torch.float32", "int8", "x" * 500]))
        elif r == 7:  # another node: the remote-fetch path, endpoints that are bogus or lead nowhere
            kw.update(node="other-node", fetch_endpoint=rng.choice(
                ["", "bogus://x", "inproc://nothing", f"ipc://{tmp}/sock/nobody-home", "tcp://"]))  # fmt: skip
        elif r == 8 and real is not None:  # the real entry, with one thing wrong
            base = msgspec.structs.asdict(real)
            base.update(rng.choice([dict(offset=real.offset + 64), dict(generation=real.generation + 1),
                                    dict(nbytes=real.nbytes - 4), dict(key=bytes(16)), dict(grid=[1, 2, 2]),
                                    dict(shape=[real.shape[0] - 1, HIDDEN])]))  # fmt: skip
            out.append(P.Prefill(f"hp-{i}", _messages(rng, 1, False), P.Sampling(max_tokens=2), 3.0,
                                 [P.EmbedRef(**base)]))  # fmt: skip
            continue
        msgs = _messages(rng, n, r == 9)
        sampling = _sampling(rng, r == 10)
        # (NaN: see test_pd_answers_nan_timeout_with_a_typed_error)
        timeout = rng.choice([-1.0, 0.0, -math.inf, -1e300]) if r == 11 else 3.0
        if r == 7:
            timeout = 2.0  # a fetch from nowhere times out within the request's deadline
        out.append(P.Prefill(f"hp-{i}", msgs, sampling, timeout, [_ref(rng, **kw) for _ in range(n)]))
    return out


async def test_workers_survive_fuzz_and_serve(workers, tmp_path):
    w, fb = workers, workers.fb
    rng = random.Random(0x5EED)
    to_worker = [T.REGISTERED, T.HEARTBEAT, T.BYE, T.ENCODE, T.PIN, T.UNPIN, T.PREFILL, T.ABORT]
    every = SCHEMA_TYPES
    t0 = time.monotonic()

    # ---- phase 1: malformed frames of every kind, to both workers, in bursts
    sent = undecodable_n = 0
    cases = []
    for _ in range(2400):
        frames = malformed(rng, to_worker if rng.random() < 0.7 else every)
        if decoded_type(frames) is P.Prefill:
            continue  # answered; hostile PREFILLs are checked one by one below
        if is_refusal(frames):
            continue  # a mutation that came out a valid refusal (a BYE + True): a worker must obey it
        cases.append(frames)
    cases += [[bytes([rng.choice(to_worker)]), rng.randbytes(3 << 20)] for _ in range(2)]  # MiB frames
    for frames in cases:
        ident = rng.choice([w.enc, w.pd])
        await fb.send_raw(ident, frames)
        sent += 1
        undecodable_n += undecodable(frames, 64)
        if sent % rng.choice([50, 400, 1000]) == 0:
            await asyncio.sleep(0.01)
    # the workers answer a few (EVICTED for pins, ENCODE_FAILED for bogus images): let them settle
    await asyncio.sleep(1.0)
    w.check_alive()

    # ---- phase 2: well-formed but hostile messages
    enc_jobs = {}
    bomb = io.BytesIO()
    Image.new("1", (9000, 9000)).save(bomb, format="PNG")  # 81 Mpx: over the pixel limit
    png = demo_image(5, (64, 64))
    for j in range(60):
        job_id = rng.choice([0, 2**64 - 1, 2**63]) + j if j < 3 else 10_000 + j
        job_id = min(job_id, 2**64 - 1 - j)
        image = rng.choice([b"", b"\x89PNG\r\n\x1a\n", png[:100], png[:-20], bomb.getvalue(), rng.randbytes(5000),
                            b"GIF89a" + b"\xff" * 20, b"\xff\xd8\xff" + rng.randbytes(100)])  # fmt: skip
        enc_jobs[job_id] = image
        await fb.send(w.enc, P.Encode(job_id, _key(rng)), [image])
    for _ in range(20):
        entries = [P.EntryId(rng.randbytes(rng.choice([0, 16, 17])), rng.choice([0, 1, 2**64 - 1]))
                   for _ in range(rng.choice([1, 10, 1000]))]  # fmt: skip
        await fb.send(w.enc, rng.choice([P.Pin, P.Unpin])(entries))

    def enc_answers():
        got = {m.job_id: m for m, _ in fb.inbox.get(w.enc, []) if isinstance(m, (P.Encoded, P.EncodeFailed))}
        return got if enc_jobs.keys() <= got.keys() else None

    answers = await fb.wait_for(
        enc_answers, 20, "an answer to every bogus ENCODE",
        lambda: sorted(enc_jobs.keys() - {m.job_id for m, _ in fb.inbox.get(w.enc, []) if hasattr(m, "job_id")}),
    )  # fmt: skip
    for job_id, image in enc_jobs.items():
        m = answers[job_id]
        if image != png[:-20]:  # a PNG missing its IEND chunk still decodes; the rest must not
            assert isinstance(m, P.EncodeFailed) and m.code in TYPED_CODES and m.message, (image[:16], m)

    # a real entry in the encoder's ring, then PREFILLs that point next to it, into nowhere, or at files
    await fb.send(w.enc, P.Encode(777, bytes(range(16))), [png])
    (real, _), *_ = await fb.wait_for(
        lambda: [(m, p) for m, p in fb.take(w.enc, P.Encoded) if m.job_id == 777], 10, "ENCODED 777"
    )
    prefills = hostile_prefills(rng, real.ref.segment, real.ref, tmp_path)
    for p in prefills:
        await fb.send(w.pd, p)
    for i in range(50):
        await fb.send(w.pd, P.Abort(rng.choice(["", "nope", "x" * 10_000, f"never-{i}"])))

    def answered():
        done = {}
        for m, _ in fb.inbox.get(w.pd, []):
            if isinstance(m, P.PdFailed) or (isinstance(m, P.Tokens) and m.finish_reason is not None):
                done.setdefault(m.request_id, m)
        return done if all(p.request_id in done for p in prefills) else None

    done = await fb.wait_for(answered, 30, "a final answer to every hostile PREFILL")
    codes = Counter()
    for p in prefills:
        m = done[p.request_id]
        if isinstance(m, P.PdFailed):
            assert m.code in TYPED_CODES and m.message, m
            codes[m.code] += 1
        else:
            codes["served"] += 1
    assert codes["served"] <= len(prefills) // 4, codes  # nearly all of them must be refused
    w.check_alive()

    # ---- phase 3: valid traffic is served
    n = len(fb.inbox.get(w.pd, []))
    good = P.Prefill("ok-epd", [P.ChatMessage("user", [P.Part("image"), P.Part("text", "what is it")])],
                     P.Sampling(max_tokens=3), 10.0, [real.ref])  # fmt: skip
    await fb.send(w.pd, good)
    await fb.send(
        w.pd,
        P.Prefill(
            "ok-text", [P.ChatMessage("user", [P.Part("text", "hi")])], P.Sampling(max_tokens=2), 10.0, []
        ),
    )

    def finals():
        got = {m.request_id: m for m, _ in fb.inbox.get(w.pd, [])[n:] if isinstance(m, (P.Tokens, P.PdFailed))
               and (isinstance(m, P.PdFailed) or m.finish_reason)}  # fmt: skip
        return got if {"ok-epd", "ok-text"} <= got.keys() else None

    got = await fb.wait_for(finals, 15, "answers to the valid PREFILLs")
    assert isinstance(got["ok-epd"], P.Tokens) and got["ok-epd"].finish_reason == "length", got["ok-epd"]
    assert isinstance(got["ok-text"], P.Tokens) and got["ok-text"].finish_reason == "length", got["ok-text"]
    await fb.send(w.enc, P.Encode(778, bytes(range(1, 17))), [demo_image(6, (64, 64))])
    await fb.wait_for(lambda: [m for m, _ in fb.take(w.enc, P.Encoded) if m.job_id == 778], 10, "ENCODED 778")

    # both still heartbeat (a hostile REGISTERED or BYE must not have stopped their links)
    now = time.monotonic()
    await fb.wait_for(lambda: all(fb.last_beat.get(i, 0) > now for i in (w.enc, w.pd)), 5, "fresh heartbeats")
    w.check_alive()
    rejected = 0
    for name in ("fuzz-enc", "fuzz-pd"):
        text = w.logs[name].read_text(errors="replace")
        assert "Traceback" not in text, tail(w.logs[name], 60)
        rejected += text.count("ignored a malformed message from the broker")  # BrokerLink.rejected
    assert rejected >= 0.95 * undecodable_n, (rejected, undecodable_n)
    print(f"worker fuzz: {sent} malformed ({undecodable_n} undecodable), {len(enc_jobs)} bogus encodes, "
          f"{len(prefills)} hostile prefills {dict(codes)} in {time.monotonic() - t0:.1f}s")  # fmt: skip


# ====================================================================== 3. the encoder's fetch socket


async def test_encoder_fetch_socket_survives_fuzz(workers):
    w, fb = workers, workers.fb
    rng = random.Random(0xFE7C4)
    endpoint = fb.registers[w.enc].fetch_endpoint
    assert endpoint.startswith(("tcp://127.0.0.1:", "ipc://"))
    key = hashlib.blake2b(b"fetch-fuzz", digest_size=16).digest()
    await fb.send(w.enc, P.Encode(4242, key), [demo_image(11, (96, 64))])
    (enc, _), *_ = await fb.wait_for(
        lambda: [(m, p) for m, p in fb.take(w.enc, P.Encoded) if m.job_id == 4242], 10, "ENCODED 4242"
    )
    ref = enc.ref
    assert ref.nbytes == math.prod(ref.shape) * 4 and ref.key == key

    ctx = zmq.Context()
    sock = raw_socket(ctx, zmq.DEALER, connect=endpoint)
    try:
        # random frames and wrong message types: ignored (a few are over the socket's 4 KiB cap,
        # which makes ZeroMQ drop the connection; the DEALER reconnects by itself)
        n_junk = 0
        for _ in range(1500):
            frames = malformed(rng, SCHEMA_TYPES)
            if decoded_type(frames) is P.Fetch or sum(map(len, frames)) > 4000:
                continue
            sock.send_multipart(frames, zmq.NOBLOCK)
            n_junk += 1
        for _ in range(3):
            sock.send_multipart([bytes([T.FETCH]), rng.randbytes(8192)])
        await asyncio.sleep(0.5)
        stray = drain(sock)
        assert all(undecodable(f, 1) is False and msgspec.msgpack.decode(f[1])[1] != "" for f in stray), (
            stray[:3]
        )

        # well-formed FETCHes for entries that are not there (or not quite): a typed refusal each
        nonces = {}
        bogus = [
            dict(key=rng.randbytes(16)), dict(key=b""), dict(key=rng.randbytes(17)), dict(key=b"x" * 1000),
            dict(generation=0), dict(generation=2**64 - 1), dict(generation=ref.generation + 1),
            dict(offset=-64), dict(offset=ref.offset + 64), dict(offset=2**63 - 1), dict(offset=0),
            dict(nbytes=-1), dict(nbytes=0), dict(nbytes=ref.nbytes + 1), dict(nbytes=2**62),
            dict(offset=ref.offset - 64, nbytes=ref.nbytes + 64),
        ]  # fmt: skip
        for i in range(400):
            f = dict(key=ref.key, generation=ref.generation, offset=ref.offset, nbytes=ref.nbytes)
            f.update(rng.choice(bogus))
            nonce = 10_000 + i if i % 50 else rng.choice([0, 2**64 - 1 - i])
            nonces[nonce] = f
            sock.send_multipart(P.encode(P.Fetch(nonce, **f)))
        replies: dict[int, P.Fetched] = {}
        end = time.monotonic() + 15
        while len(replies) < len(nonces) and time.monotonic() < end:
            for frames in drain(sock):
                msg, payload = P.decode(frames, max_payload_frames=2)
                assert isinstance(msg, P.Fetched)
                replies[msg.nonce] = msg
            await asyncio.sleep(0.02)
        assert replies.keys() == nonces.keys(), f"{len(nonces) - len(replies)} FETCHes unanswered"
        assert all(m.code in TYPED_CODES and m.message for m in replies.values()), [
            m for m in replies.values() if not m.code
        ][:3]

        # the real entry, byte for byte
        sock.send_multipart(P.encode(P.Fetch(1, ref.key, ref.generation, ref.offset, ref.nbytes)))
        frames = await recv_until(sock, lambda f: f[0] == bytes([T.FETCHED]), 10)
        msg, payload = P.decode(frames, max_payload_frames=2)
        assert msg.nonce == 1 and msg.code == "", msg
        assert len(payload[0]) == ref.nbytes and payload[1] == entry_seal(ref.key, ref.generation, ref.nbytes)
        reader = RingReader()
        try:
            local = reader.read(ref.segment, ref.offset, ref.nbytes, ref.key, ref.generation, torch.float32,
                                tuple(ref.shape))  # fmt: skip
        finally:
            reader.close()
        assert local.numpy().tobytes() == payload[0]

        # a peer that asks for the entry 20,000 times and never reads: each answer was a copy of it,
        # and they piled up in the encoder (+800 MiB here); then it kept FETCH_SEND_HWM of them, and
        # now those are views of its ring
        from epdq.worker.encoder import FETCH_SEND_HWM

        big_key = hashlib.blake2b(b"fetch-flood", digest_size=16).digest()
        await fb.send(w.enc, P.Encode(4343, big_key), [demo_image(12, (448, 448))])
        (big, _), *_ = await fb.wait_for(
            lambda: [(m, p) for m, p in fb.take(w.enc, P.Encoded) if m.job_id == 4343], 10, "ENCODED 4343"
        )
        big = big.ref
        pid = w.procs["fuzz-enc"].pid
        rss0 = _rss_mib(pid)
        deaf = raw_socket(ctx, zmq.DEALER)
        deaf.setsockopt(zmq.RCVHWM, 1)
        deaf.connect(endpoint)
        try:
            n = 5000  # x 128 KiB: 640 MiB of answers
            for i in range(n):
                deaf.send_multipart(P.encode(P.Fetch(i, big.key, big.generation, big.offset, big.nbytes)))
                if i % 500 == 0:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)
            grown = _rss_mib(pid) - rss0
            # answers are views of the ring now, not copies: FETCH_SEND_HWM of them queued (2.5 MiB
            # of growth measured) where copies would hold 1024 x 128 KiB
            assert grown < FETCH_SEND_HWM * big.nbytes / 2**20 / 4, f"encoder grew {grown:.0f} MiB"
            sock.send_multipart(P.encode(P.Fetch(2, ref.key, ref.generation, ref.offset, ref.nbytes)))
            frames = await recv_until(sock, lambda f: f[0] == bytes([T.FETCHED]), 10)  # others are served
            assert P.decode(frames, max_payload_frames=2)[0].nonce == 2
        finally:
            deaf.close(linger=0)
        w.check_alive()
        print(
            f"fetch fuzz: {n_junk} malformed, {len(nonces)} bogus FETCH answered {dict(Counter(m.code for m in replies.values()))}"
        )
    finally:
        sock.close(linger=0)
        ctx.term()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


# ====================================================================== 4. a key of the wrong length


async def test_encoder_survives_encode_with_bad_key(tmp_path):
    """A decodable image under a key that is not 16 bytes: ENCODE_FAILED, not a dead encoder."""
    w = await start_workers(tmp_path, roles=("encoder",))
    try:
        fb = w.fb
        png = demo_image(3, (64, 64))
        for job_id, key in enumerate([b"", b"k" * 15, b"k" * 17, b"k" * 4096], start=1):
            await fb.send(w.enc, P.Encode(job_id, key), [png])

        def answers():
            w.check_alive()  # an encoder that died on one of them fails here, with its log
            got = {m.job_id: m for m, _ in fb.take(w.enc, P.EncodeFailed)}
            return got if len(got) >= 4 else None

        failed = await fb.wait_for(answers, 10, "ENCODE_FAILED for every bad key")
        assert sorted(failed) == [1, 2, 3, 4] and all(m.code in TYPED_CODES for m in failed.values()), failed
        await fb.send(w.enc, P.Encode(9, bytes(16)), [png])
        await fb.wait_for(lambda: [m for m, _ in fb.take(w.enc, P.Encoded) if m.job_id == 9], 10, "ENCODED 9")
        w.check_alive()
    finally:
        await stop_workers(w)


# ====================================================================== 5. well-formed, hostile values


async def test_pd_answers_nan_timeout_with_a_typed_error(workers):
    """A PREFILL whose timeout is NaN: refused as invalid input (not an engine failure with a traceback)."""
    w, fb = workers, workers.fb
    msgs = [P.ChatMessage("user", [P.Part("text", "hi")])]
    await fb.send(w.pd, P.Prefill("nan-timeout", msgs, P.Sampling(max_tokens=2), math.nan, []))
    (m, _), *_ = await fb.wait_for(
        lambda: [(m, p) for m, p in fb.inbox.get(w.pd, []) if getattr(m, "request_id", "") == "nan-timeout"],
        10, "an answer to the NaN-timeout PREFILL",
    )  # fmt: skip
    assert isinstance(m, P.PdFailed) and m.code in ("invalid_input", "deadline"), m
    w.check_alive()


async def test_link_keeps_a_sane_heartbeat_after_hostile_registered(tmp_path):
    """REGISTERED with a heartbeat interval that is NaN, zero, negative or absurd must not stop the
    link's heartbeats, make it spin, or make it reconnect in a loop."""
    w = await start_workers(tmp_path, roles=("pd",))
    try:
        fb = w.fb
        for hb in (math.nan, 0.0, -1.0, 1e-300, -math.inf, math.inf, 1e300, 2.0**64):
            await fb.send(w.pd, P.Registered("fuzz-pd", hb))
        regs, beats = fb.registrations[w.pd], fb.beats[w.pd]
        await asyncio.sleep(4.0)
        w.check_alive()
        assert time.monotonic() - fb.last_beat.get(w.pd, 0) < 2.5, "the worker stopped heartbeating"
        assert fb.beats[w.pd] - beats <= 20, f"{fb.beats[w.pd] - beats} heartbeats in 4 s"
        assert fb.registrations[w.pd] - regs <= 2, f"{fb.registrations[w.pd] - regs} re-registrations in 4 s"
        msgs = [P.ChatMessage("user", [P.Part("text", "hi")])]
        await fb.send(w.pd, P.Prefill("after", msgs, P.Sampling(max_tokens=2), 10.0, []))
        await fb.wait_for(
            lambda: [m for m, _ in fb.inbox.get(w.pd, []) if isinstance(m, P.Tokens) and m.finish_reason],
            10,
            "TOKENS",
        )
    finally:
        await stop_workers(w)


async def test_registers_with_bad_ids_or_nodes_get_a_bye_naming_the_limits(tmp_path):
    ctx = zmq.Context()
    try:
        async with Cluster(noop_spec(tmp_path)) as cluster:
            for kw in (dict(node="n" * 129), dict(node=""), dict(worker_id="w" * 129)):
                sock = raw_socket(ctx, zmq.DEALER, connect=cluster.address)
                try:
                    reg = dict(worker_id="fuzz-node", role="pd", node="n", capacity=4, scope="", model="m", pid=1) | kw
                    sock.send_multipart(P.encode(P.Register(**reg)))
                    bye = await recv_until(sock, lambda f: f[0] == bytes([T.BYE]), timeout=10)
                    assert "worker_id and node 1..128 characters" in P.decode(bye)[0].reason, kw
                finally:
                    sock.close(0)
            async with AsyncClient(cluster.address) as c:
                assert {w["worker_id"] for w in (await c.stats())["workers"]} == {"encoder-0", "pd-0"}
    finally:
        ctx.term()


async def test_a_client_that_never_reads_is_cut_off_and_pongs_stay_small(tmp_path, monkeypatch):
    """A client that sent PINGs listing 4,096 long request ids and never read the PONGs (which
    echoed them all) grew the broker by gigabytes: PONGs now name at most MAX_PONG_UNKNOWN ids, and
    a peer with PEER_SEND_HWM messages unread is cut off as if it had disconnected (its requests
    cancelled). Others are served throughout."""
    from epdq import broker as B

    monkeypatch.setattr(B, "PEER_SEND_HWM", 50)
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/b.sock"
    broker = B.Broker(B.BrokerConfig(address=addr), ctx=ctx)
    serving = asyncio.create_task(broker.serve())
    deaf = raw_socket(ctx, zmq.DEALER)
    deaf.setsockopt(zmq.RCVHWM, 1)
    deaf.connect(addr)
    try:
        sub = P.Submit("deaf-1", [P.ChatMessage("user", [P.Part("text", "hi")])], P.Sampling(), 0.0, 0)
        deaf.send_multipart(P.encode(sub))  # queued: there are no workers
        ids = [f"{i:0128d}" for i in range(P.MAX_PING_IDS)]
        async with asyncio.timeout(60):
            while len(broker._clients) == 0:
                await asyncio.sleep(0.01)
            for n in range(2000):
                deaf.send_multipart(P.encode(P.Ping(n, ids)))
                await asyncio.sleep(0)
                if not broker._clients:
                    break
            assert not broker._clients, "the client that never reads was not cut off"
            assert broker.scheduler.gauges()["requests_queued"] == 0  # its request went with it
            async with AsyncClient(addr) as c:
                assert (await c.stats())["counters"]["cancelled"] == 1
        pong = P.decode(unbatch(deaf.recv_multipart())[0])[0]
        assert isinstance(pong, P.Pong) and len(pong.unknown) == B.MAX_PONG_UNKNOWN
    finally:
        deaf.close(0)
        broker.stop()
        await asyncio.wait_for(serving, 10)
        ctx.term()


async def test_a_peer_presenting_a_workers_id_does_not_take_over_its_link(tmp_path):
    """Workers connected with their worker_id as ZeroMQ identity, which `epdq status` shows to
    every client, and the broker hands an identity's link to whoever presents it last (so that a
    worker can reconnect): a client that connected as "pd-0" was sent pd-0's jobs, other clients'
    prompts and images. Worker identities are now random per process."""
    ctx = zmq.Context()
    thieves: list[zmq.Socket] = []
    try:
        async with Cluster(noop_spec(tmp_path)) as cluster, AsyncClient(cluster.address) as c:
            for w in (await c.stats())["workers"]:
                s = raw_socket(ctx, zmq.DEALER)
                s.setsockopt(zmq.IDENTITY, w["worker_id"].encode())
                s.connect(cluster.address)
                s.send_multipart(P.encode(P.Ping(1)))
                thieves.append(s)
            for s in thieves:  # connected, and heard by the broker under the worker's id
                await recv_until(s, lambda f: f[0] == bytes([T.PONG]), timeout=10)
            for i in range(3):
                r = await c.generate("secret", images=[demo_image(40 + i, (32, 32))], max_tokens=2, route="epd",
                                     timeout=20)  # fmt: skip
                assert len(r.token_ids) == 2
            for s in thieves:
                assert {decoded_type(f) for f in drain(s)} <= {P.Pong}
    finally:
        for s in thieves:
            s.close(0)
        ctx.term()


async def test_a_peer_taking_the_next_automatic_identities_cannot_abort_the_broker(tmp_path):
    """libzmq numbers a peer that names no identity from a counter that started at the same
    value in every process (0x6b8b4567: libc's unseeded rand()), and aborts (an assertion) when the
    number it hands out is already a peer's chosen identity: any client could kill the broker with
    64 connections under the next numbers and one without an identity. epdq's clients now name
    random identities, and the counter starts at a random value."""
    addr = f"ipc://{tmp_path}/b.sock"
    env = {**os.environ, "EPDQ_HOME": str(tmp_path / "home")}
    log = open(tmp_path / "broker.log", "w+")  # noqa: SIM115
    broker = subprocess.Popen([sys.executable, "-m", "cli.main", "broker", "--address", addr], env=env,
                              stdout=log, stderr=log)  # fmt: skip
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        async with AsyncClient(addr) as c:
            end = time.monotonic() + 60
            while True:
                try:
                    await c.stats(timeout=1.0)
                    break
                except Exception:
                    assert broker.poll() is None and time.monotonic() < end, "the broker did not come up"
            for k in range(64):
                s = raw_socket(ctx, zmq.DEALER)
                s.setsockopt(zmq.IDENTITY, b"\x00" + (0x6B8B4567 + k).to_bytes(4, "big"))
                s.connect(addr)
                s.send_multipart(P.encode(P.Ping(k)))
                socks.append(s)
            for s in socks:
                await recv_until(s, lambda f: f[0] == bytes([T.PONG]), timeout=10)
            for _ in range(3):  # connections that name no identity
                s = raw_socket(ctx, zmq.DEALER, connect=addr)
                socks.append(s)
                s.send_multipart(P.encode(P.Ping(99)))
                await recv_until(s, lambda f: f[0] == bytes([T.PONG]), timeout=10)
            assert broker.poll() is None, tail(tmp_path / "broker.log")
            assert "counters" in await c.stats()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        broker.terminate()
        broker.wait(30)
        log.close()
