"""E -> PD through real broker and worker processes, against the colocated engine.

One session cluster over ipc:// holds an encoder, a PD worker and a colocated (`both`) worker
on the same node; a second over tcp:// puts the PD worker on another node id, so embeddings
take the remote-fetch path. Greedy outputs must be token-identical to the colocated route.
"""

from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from epdq import AsyncClient, InvalidInputError
from epdq.cluster import Cluster, ClusterSpec
from epdq.demo import demo_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAX_TOKENS = 12
SIZES = [(112, 112), (160, 96), (84, 140), (196, 168)]


def img(seed: int, size=(112, 112)) -> bytes:
    return demo_image(seed, size)


def sideways_photo(seed: int, size=(160, 96)) -> bytes:
    """A JPEG whose EXIF says "turn me 90°", as phones save portrait photos."""
    im = Image.open(io.BytesIO(img(seed, size)))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()



@pytest.fixture(scope="session")
async def local_cluster(tmp_path_factory, model_dir):
    d = tmp_path_factory.mktemp("ipc-cluster")
    spec = ClusterSpec(address=f"ipc://{d}/broker.sock", encoders=1, pds=1, both=1, model=model_dir,
                       log_dir=str(d / "logs"), start_timeout_s=400)  # fmt: skip
    async with Cluster(spec) as c:
        yield c


@pytest.fixture(scope="session")
async def remote_cluster(tmp_path_factory, model_dir, unused_tcp_port_factory):
    d = tmp_path_factory.mktemp("tcp-cluster")
    spec = ClusterSpec(address=f"tcp://127.0.0.1:{unused_tcp_port_factory()}", encoders=1, pds=1, model=model_dir,
                       nodes={"encoder": "node-a", "pd": "node-b"}, log_dir=str(d / "logs"),
                       start_timeout_s=400)  # fmt: skip
    async with Cluster(spec) as c:
        yield c


async def both_routes(address: str, prompt: str, images: list[bytes], **kw):
    async with AsyncClient(address, timeout=120) as c:
        epd = await c.generate(prompt, images=images, max_tokens=MAX_TOKENS, route="epd", **kw)
        colo = await c.generate(prompt, images=images, max_tokens=MAX_TOKENS, route="colocated", **kw)
    return epd, colo


async def counters(address: str) -> dict:
    async with AsyncClient(address) as c:
        return (await c.stats())["counters"]


@pytest.mark.parametrize(
    "name, images",
    [
        ("text-only", []),
        ("one image", [img(11)]),
        ("two images", [img(12, SIZES[1]), img(13, SIZES[2])]),
        ("four images", [img(14 + i, s) for i, s in enumerate(SIZES)]),
        ("same image twice", [img(20, SIZES[1]), img(20, SIZES[1])]),
        ("sideways phone photo", [sideways_photo(21)]),  # vLLM turns it upright: so must the encoder
    ],
)
async def test_epd_is_token_identical_to_colocated(local_cluster, name, images):
    epd, colo = await both_routes(local_cluster.address, f"Describe: {name}.", images)
    assert epd.timings.route == "epd" and colo.timings.route == "colocated"
    assert len(epd.token_ids) > 0
    assert epd.token_ids == colo.token_ids, f"{name}: E->PD {epd.token_ids} != colocated {colo.token_ids}"
    assert epd.text == colo.text and epd.finish_reason == colo.finish_reason
    # usage: both engines saw prompts of the same length, image tokens expanded
    assert epd.prompt_tokens == colo.prompt_tokens > 0


async def test_prompt_tokens_count_each_image_row(local_cluster):
    async with AsyncClient(local_cluster.address) as c:
        text = await c.generate("Count me.", max_tokens=1, route="epd")
        one = await c.generate("Count me.", images=[img(71)], max_tokens=1, route="epd")
        two = await c.generate("Count me.", images=[img(71), img(72, SIZES[3])], max_tokens=1, route="epd")
    # a 112x112 image is an 8x8 grid of 14-px patches merged 2x2: 16 embedding rows, wrapped in
    # <|vision_start|> ... <|vision_end|>; 196x168 is 14x12 patches: 42 rows
    assert one.prompt_tokens - text.prompt_tokens == 16 + 2
    assert two.prompt_tokens - one.prompt_tokens == 42 + 2


async def test_the_image_matters(local_cluster):
    """Negative control: equality above is meaningless if the model ignored the image."""
    async with AsyncClient(local_cluster.address) as c:
        a = await c.generate("What is this?", images=[img(31)], max_tokens=MAX_TOKENS, route="epd")
        b = await c.generate("What is this?", images=[img(32)], max_tokens=MAX_TOKENS, route="epd")
    assert a.token_ids != b.token_ids


async def test_repeated_image_is_encoded_once(local_cluster):
    addr = local_cluster.address
    before = await counters(addr)
    async with AsyncClient(addr) as c:
        first = await c.generate("One.", images=[img(41)], max_tokens=4, route="epd")
        second = await c.generate("Two.", images=[img(41)], max_tokens=4, route="epd")
    after = await counters(addr)
    assert after["encodes_done"] - before["encodes_done"] == 1
    assert after["cache_hits"] - before["cache_hits"] == 1
    assert first.timings.cache_hits == 0 and second.timings.cache_hits == 1


async def test_concurrent_duplicates_are_encoded_once(local_cluster):
    addr = local_cluster.address
    before = await counters(addr)
    async with AsyncClient(addr) as c:
        outs = await asyncio.gather(
            *(
                c.generate(f"Prompt {i}.", images=[img(51, SIZES[3])], max_tokens=4, route="epd")
                for i in range(4)
            )
        )
    after = await counters(addr)
    assert all(o.token_ids for o in outs)
    assert after["encodes_done"] - before["encodes_done"] == 1
    assert (after["cache_hits"] + after["dedup_joins"]) - (before["cache_hits"] + before["dedup_joins"]) == 3


async def test_stream_matches_generate(local_cluster):
    async with AsyncClient(local_cluster.address) as c:
        full = await c.generate("Stream me.", images=[img(61)], max_tokens=MAX_TOKENS, route="epd")
        ids, text, deltas = [], [], []
        async for d in c.stream("Stream me.", images=[img(61)], max_tokens=MAX_TOKENS, route="epd"):
            ids += d.token_ids
            text.append(d.text)
            deltas.append(d)
    last = deltas[-1]
    assert ids == full.token_ids and "".join(text) == full.text and last.finish_reason == full.finish_reason
    assert all(d.finish_reason is None and d.timings is None for d in deltas[:-1])
    assert last.prompt_tokens == full.prompt_tokens > 0
    assert full.timings.ttft_s > 0 and full.timings.total_s >= full.timings.ttft_s
    # the last delta carries the timings generate() returns (streams used to get none)
    t = last.timings
    assert t is not None and 0 < t.ttft_s <= t.total_s and t.images == 1 and t.route == "epd"
    assert t.cache_hits == 1  # the same image as generate's, resident


async def test_cancel_reaches_the_pd_worker(local_cluster):
    addr = local_cluster.address
    before = await counters(addr)
    async with AsyncClient(addr) as c:
        agen = c.stream("Go on forever.", max_tokens=2000, ignore_eos=True, route="epd")
        async for _ in agen:
            break
        await agen.aclose()  # leaving the loop cancels the request
        for _ in range(100):
            s = await c.stats()
            pd = [w for w in s["workers"] if w["role"] == "pd"]
            if s["counters"]["aborts_confirmed"] > before["aborts_confirmed"] and all(
                w["inflight"] == 0 for w in pd
            ):
                break
            await asyncio.sleep(0.05)
    assert s["counters"]["cancelled"] == before["cancelled"] + 1
    assert s["counters"]["aborts_confirmed"] == before["aborts_confirmed"] + 1
    assert all(w["inflight"] == 0 for w in pd)


async def test_bad_image_is_a_typed_error(local_cluster):
    async with AsyncClient(local_cluster.address) as c:
        with pytest.raises(InvalidInputError, match="not a supported image"):
            await c.generate("x", images=[b"definitely not an image" * 10], route="epd")
        truncated = img(71)[:200]
        with pytest.raises(InvalidInputError):
            await c.generate("x", images=[truncated], route="epd")
        # the pipeline is still fine afterwards
        ok = await c.generate("still alive?", images=[img(72)], max_tokens=3, route="epd")
    assert ok.token_ids


async def test_stats_report_workers_by_role(local_cluster):
    async with AsyncClient(local_cluster.address) as c:
        s = await c.stats()
    roles = sorted(w["role"] for w in s["workers"])
    assert roles == ["both", "encoder", "pd"]
    for k in ("encodes_done", "cache_hits", "requests_completed"):
        assert k in s["counters"]
    for k in ("requests_queued", "requests_running", "workers_pd"):
        assert k in s["gauges"]


@pytest.mark.parametrize("images", [[img(81)], [img(82, SIZES[1]), img(83, SIZES[2]), img(82, SIZES[1])]])
async def test_remote_fetch_path_is_token_identical(local_cluster, remote_cluster, images):
    before = await counters(remote_cluster.address)
    async with AsyncClient(remote_cluster.address) as c:
        epd = await c.generate("Remote.", images=images, max_tokens=MAX_TOKENS, route="epd")
    async with AsyncClient(local_cluster.address) as c:
        colo = await c.generate("Remote.", images=images, max_tokens=MAX_TOKENS, route="colocated")
    after = await counters(remote_cluster.address)
    assert after["remote_handoffs"] == before["remote_handoffs"] + 1
    assert epd.token_ids == colo.token_ids


async def _wait_for(addr: str, pred, timeout: float = 20.0) -> dict:
    async with AsyncClient(addr) as c:
        end = asyncio.get_running_loop().time() + timeout
        while True:
            s = await c.stats()
            if pred(s) or asyncio.get_running_loop().time() > end:
                return s
            await asyncio.sleep(0.05)


def _pd_idle(s: dict) -> bool:
    return all(w["inflight"] == 0 for w in s["workers"] if w["role"] == "pd")


async def test_cancelled_task_aborts_the_sequence(local_cluster):
    addr = local_cluster.address
    before = await counters(addr)
    async with AsyncClient(addr) as c:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                c.generate("Keep talking.", max_tokens=2000, ignore_eos=True, route="epd"), 0.3
            )
    s = await _wait_for(
        addr, lambda s: s["counters"]["aborts_confirmed"] > before["aborts_confirmed"] and _pd_idle(s)
    )
    assert s["counters"]["cancelled"] == before["cancelled"] + 1
    assert s["counters"]["aborts_confirmed"] == before["aborts_confirmed"] + 1 and _pd_idle(s)


CLIENT_SCRIPT = """
import asyncio, sys
from epdq import AsyncClient

async def main():
    async with AsyncClient(sys.argv[1]) as c:
        async for d in c.stream("Talk for a long time.", max_tokens=3000, ignore_eos=True, route="epd"):
            print("streaming", flush=True)
            await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_client_gone_aborts_the_sequence(local_cluster, tmp_path):
    import signal
    import subprocess
    import sys

    addr = local_cluster.address
    before = await counters(addr)
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), addr], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "streaming"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    s = await _wait_for(
        addr, lambda s: s["counters"]["aborts_confirmed"] > before["aborts_confirmed"] and _pd_idle(s)
    )
    assert s["counters"]["cancelled"] == before["cancelled"] + 1
    assert s["counters"]["aborts_confirmed"] == before["aborts_confirmed"] + 1 and _pd_idle(s)


def _png_header_only(width: int, height: int) -> bytes:
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
        + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    )  # fmt: skip


async def test_oversized_images_are_typed_errors(local_cluster):
    async with AsyncClient(local_cluster.address) as c:
        with pytest.raises(InvalidInputError, match="pixel|large|bomb|dimension"):
            await c.generate("bomb", images=[_png_header_only(60_000, 60_000)], route="epd")
        with pytest.raises(InvalidInputError):
            await c.generate("huge file", images=[b"\x89PNG\r\n\x1a\n" + b"\0" * (21 * 2**20)], route="epd")
        ok = await c.generate("fine", images=[img(91)], max_tokens=3, route="epd")
    assert ok.token_ids


async def test_image_as_path_bytes_or_pil_is_the_same_request(local_cluster, tmp_path):
    from PIL import Image

    data = img(95, SIZES[1])
    path = tmp_path / "x.png"
    path.write_bytes(data)
    pil = Image.open(path)
    pil.load()
    async with AsyncClient(local_cluster.address) as c:
        outs = [
            await c.generate("Same?", images=[im], max_tokens=MAX_TOKENS, route="epd") for im in (data, path, str(path), pil)
        ]
    assert all(o.token_ids == outs[0].token_ids for o in outs)
