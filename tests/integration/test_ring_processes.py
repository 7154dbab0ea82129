"""The embedding ring across real processes: a reader in another process, also while racing."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from epdq.ring import MIN_CAPACITY, SHM_DIR, RingWriter, cleanup_stale_segments
from tests.procs import readline

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# Reads the entries described on stdin (one JSON object per line) and prints one JSON line each.
_READ_ONCE = r"""
import hashlib, json, sys, torch
from epdq.errors import StaleEmbeddingError
from epdq.ring_reader import RingReader
r = RingReader()
for line in sys.stdin:
    m = json.loads(line)
    try:
        t = r.read(m["seg"], m["off"], m["nbytes"], bytes.fromhex(m["key"]), m["gen"],
                   getattr(torch, m["dtype"]), tuple(m["shape"]))
        out = {"sha": hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()}
    except StaleEmbeddingError:
        out = {"stale": True}
    print(json.dumps(out), flush=True)
"""

# Reads the most recently announced entries in a tight loop while the parent keeps overwriting;
# every successful read must be a whole entry (all elements equal to its fill value).
_RACE = r"""
import json, os, random, sys, torch
from epdq.errors import StaleEmbeddingError
from epdq.ring_reader import RingReader
torch.set_num_threads(1)  # on a busy 2-core box a 2-thread pool makes each copy ~25x slower
r, counts, recent, buf = RingReader(), {"ok": 0, "stale": 0, "torn": 0}, [], b""
fd = sys.stdin.fileno()
os.set_blocking(fd, False)  # poll for announcements between reads: no thread, no GIL ping-pong
print("ready", flush=True)
while True:
    try:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, buf = (buf + chunk).split(b"\n")
        recent = (recent + [json.loads(x) for x in lines])[-4:]
    except BlockingIOError:
        pass
    if not recent:
        continue
    m = random.choice(recent)
    try:
        t = r.read(m["seg"], m["off"], m["nbytes"], bytes.fromhex(m["key"]), m["gen"],
                   torch.float32, (m["nbytes"] // 4,))
    except StaleEmbeddingError:
        counts["stale"] += 1
        continue
    counts["ok" if bool((t == m["fill"]).all()) else "torn"] += 1
print(json.dumps(counts), flush=True)
"""


def child(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def describe(w: RingWriter, key: bytes, loc, t: torch.Tensor, **extra) -> str:
    return json.dumps(
        {
            "seg": w.name,
            "off": loc.offset,
            "nbytes": loc.nbytes,
            "key": key.hex(),
            "gen": loc.generation,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            **extra,
        }
    )


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_another_process_reads_identical_bytes():
    w = RingWriter(8 * MIN_CAPACITY, owner_tag="itest")
    try:
        tensors = [torch.randn(256, 1024), torch.randn(1196, 128).to(torch.bfloat16), torch.randn(3, 5, 7)]
        lines = []
        for t in tensors:
            k = secrets.token_bytes(16)
            lines.append(describe(w, k, w.write(k, t), t))
        gone = secrets.token_bytes(16)
        gone_loc = w.write(gone, tensors[2])
        w.unpin(gone, gone_loc.generation)
        assert w.evict_unpinned() == 1
        lines.append(describe(w, gone, gone_loc, tensors[2]))
        p = child(_READ_ONCE)
        out, err = p.communicate("\n".join(lines) + "\n", timeout=120)
        assert p.returncode == 0, err
        results = [json.loads(x) for x in out.splitlines()]
        assert results == [{"sha": sha(t)} for t in tensors] + [{"stale": True}]
    finally:
        w.close()


def test_reader_racing_an_overwriter_never_sees_torn_data():
    w = RingWriter(8 * MIN_CAPACITY, owner_tag="race")
    p = child(_RACE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert readline(p).strip() == "ready", p.stderr.read()
        gen = torch.Generator().manual_seed(0)
        deadline = time.monotonic() + 2.0
        written = 0
        while time.monotonic() < deadline:
            words = int(torch.randint(64 * 1024, 512 * 1024, (1,), generator=gen))
            k = secrets.token_bytes(16)
            fill = float(written % (1 << 20))
            t = torch.full((words,), fill)
            loc = w.write(k, t)
            assert loc is not None  # nothing stays pinned, so there is always room
            w.unpin(k, loc.generation)  # evictable at once: the next writes race the reader
            p.stdin.write(describe(w, k, loc, t, fill=fill) + "\n")
            p.stdin.flush()
            written += 1
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        counts = json.loads(out)
        assert counts["torn"] == 0, counts
        assert counts["ok"] > 0 and counts["stale"] > 0, counts
    finally:
        torch.set_num_threads(threads)
        if p.poll() is None:
            p.kill()
            p.wait()
        w.close()


# For each entry announced on stdin before its bytes are in: wait for them the way a PD worker
# does (busy-wait on the header), read, check every element, answer one line.
_EARLY = r"""
import json, sys, torch
from epdq.errors import StaleEmbeddingError
from epdq.ring_reader import RingReader
torch.set_num_threads(1)
r = RingReader()
print("ready", flush=True)
for line in sys.stdin:
    m = json.loads(line)
    args = (m["seg"], m["off"], m["nbytes"], bytes.fromhex(m["key"]), m["gen"])
    try:
        if not r.spin(*args, 5.0):
            out = "late"
        else:
            t = r.read(*args, torch.float32, (m["nbytes"] // 4,))
            out = "ok" if bool((t == m["fill"]).all()) else "torn"
    except StaleEmbeddingError as e:
        out = f"stale: {e}"
    print(out, flush=True)
"""


def _announce_then_fill(code: str, tag: str, count: int, seed: int, lo: int, hi: int, make, pause: float) -> list[str]:
    """As the encoder does, `count` times: reserve an entry of lo..hi float32 words, announce it to
    a reader running `code` in another process, copy it in (after `pause` every other time, so
    the reader is also waiting when the copy starts); the reader's answer for each."""
    w = RingWriter(64 * MIN_CAPACITY, owner_tag=tag)
    p = child(code)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert readline(p).strip() == "ready", p.stderr.read()
        gen = torch.Generator().manual_seed(seed)
        answers = []
        for i in range(count):
            t = make(int(torch.randint(lo, hi, (1,), generator=gen)), i)
            k = secrets.token_bytes(16)
            loc = w.reserve(k, t.nbytes)
            assert loc is not None
            p.stdin.write(describe(w, k, loc, t, fill=float(i)) + "\n")
            p.stdin.flush()
            if i % 2:
                time.sleep(pause)
            assert w.fill(k, loc.generation, t)
            answers.append(readline(p).strip())
            w.unpin(k, loc.generation)
        return answers
    finally:
        torch.set_num_threads(threads)
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=60)  # closes the pipes
        w.close()


def test_a_reader_waiting_on_an_announced_entry_gets_it_whole():
    """The encoder announces an entry, then copies it in: a reader in another process that spins on
    the header meanwhile must see "being written" until the bytes are all there, and never
    anything else (struct's pack_into clears a header before it writes its fields: publishing
    that way showed readers a header of zeros, taken as a replaced entry)."""
    answers = _announce_then_fill(
        _EARLY, "early", 300, 1, 16 * 1024, 256 * 1024, lambda words, i: torch.full((words,), float(i)), 0.0002
    )
    assert answers == ["ok"] * 300, [a for a in answers if a != "ok"][:5]


# For each entry announced on stdin before its bytes are in: copy it out behind the writer's fill
# mark, as a PD worker gathering several images does (read_as_filled), check every element.
_BEHIND = r"""
import asyncio, json, sys, torch
from epdq.errors import StaleEmbeddingError
from epdq.ring_reader import RingReader
torch.set_num_threads(1)
r = RingReader()
loop = asyncio.new_event_loop()
print("ready", flush=True)
for line in sys.stdin:
    m = json.loads(line)
    words = m["nbytes"] // 4
    try:
        t = loop.run_until_complete(r.read_as_filled(
            m["seg"], m["off"], m["nbytes"], bytes.fromhex(m["key"]), m["gen"], torch.float32, (words,)))
        want = torch.arange(words, dtype=torch.float32) + m["fill"]
        out = "ok" if torch.equal(t, want) else "torn"
    except StaleEmbeddingError as e:
        out = f"stale: {e}"
    print(out, flush=True)
"""


def test_a_reader_copying_behind_the_writer_gets_every_byte():
    """Entries of several fill chunks, announced and then copied in while a reader in another
    process copies each out as the fill mark passes: every element where it belongs (values
    distinct per position, so a chunk copied early, late or from the wrong place shows)."""
    answers = _announce_then_fill(  # 256 KiB to 4 MiB
        _BEHIND, "behind", 60, 2, 64 * 1024, 1024 * 1024,
        lambda words, i: torch.arange(words, dtype=torch.float32) + i, 0.0005,
    )  # fmt: skip
    assert answers == ["ok"] * 60, [a for a in answers if a != "ok"][:5]


_CRASH = r"""
import os, torch
from epdq.ring import RingWriter
w = RingWriter(1 << 20, owner_tag="crash")
w.write(bytes(16), torch.zeros(16))
print(w.name, flush=True)
os._exit(0)  # no close, no finalizers: as if killed
"""


@pytest.mark.parametrize("pid_now", ["dead", "alive"])
def test_cleanup_removes_segment_of_a_crashed_writer(pid_now):
    p = child(_CRASH)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    name = out.strip()
    path = os.path.join(SHM_DIR, name)
    assert os.path.exists(path)
    try:
        if pid_now == "alive":
            # A restarted container: the new encoder has the crashed one's pid (this process's,
            # here), and the sweep used to spare a segment whose pid was alive.
            assert f"-{p.pid}-" in name
            name = name.replace(f"-{p.pid}-", f"-{os.getpid()}-")
            os.rename(path, os.path.join(SHM_DIR, name))
            path = os.path.join(SHM_DIR, name)
        assert name in cleanup_stale_segments()
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
