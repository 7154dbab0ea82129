"""`epdq demo`: start a local cluster, send a few multimodal requests, print what happened."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

from epdq.client import AsyncClient
from epdq.cluster import Cluster, ClusterSpec


def demo_image(seed: int, size: tuple[int, int]) -> bytes:
    """A deterministic synthetic picture (stripes and a disc), as PNG bytes; distinct seeds
    (0 <= seed < 2**48) give distinct pictures of any size with at least two pixels."""
    from PIL import Image, ImageDraw

    if not 0 <= seed < 2**48:
        raise ValueError(f"seed must be in [0, 2**48), got {seed}")
    w, h = size
    img = Image.new("RGB", size, ((seed * 67) % 256, (seed * 131) % 256, (seed * 199) % 256))
    d = ImageDraw.Draw(img)
    for x in range(0, w, 8 + seed % 7):
        d.line([(x, 0), (x, h)], fill=((x * 3 + seed) % 256, 40, 200 - seed % 100), width=2)
    d.ellipse([w // 4, h // 4, 3 * w // 4, 3 * h // 4], fill=(255 - seed % 256, 200, (seed * 17) % 256))
    # the pattern repeats every 44,800 seeds: the seed itself, in the first two pixels, keeps
    # every picture distinct (benchmarks draw tens of thousands of "never seen" images)
    stamp = seed.to_bytes(6, "little")
    for i in range(min(2, w * h)):
        img.putpixel((i % w, i // w), tuple(stamp[3 * i : 3 * i + 3]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


async def run_demo(
    *, address: str = "tcp://127.0.0.1:7700", model: str = "", compare: bool = True,
    max_tokens: int = 12, out: Callable[[str], None] = print,
) -> bool:  # fmt: skip
    """Returns True when every E->PD output equals the colocated one (or compare is off)."""
    spec = ClusterSpec(address=address, encoders=1, pds=1, both=1 if compare else 0, model=model)
    cat, dog, chart = demo_image(1, (112, 112)), demo_image(2, (160, 96)), demo_image(3, (84, 140))
    jobs = [
        ("text only", "Write a haiku about queues.", []),
        ("one image", "Describe this image.", [cat]),
        ("two images", "Compare the two images.", [dog, chart]),
        ("repeated image", "Describe this image again.", [cat]),
        ("same image twice", "Are these the same?", [dog, dog]),
    ]
    cluster = Cluster(spec)
    t0 = time.monotonic()
    out(f"epdq demo: starting broker, 1 encoder, 1 PD worker{' and 1 colocated worker' if compare else ''}")
    try:
        await cluster.start(progress=lambda m: out(f"  {m}"))
    except BaseException:
        cluster.stop(now=True)  # what did start must not outlive a failed start
        raise
    out(f"cluster ready in {time.monotonic() - t0:.1f}s at {address}\n")
    all_equal = True
    try:
        async with AsyncClient(address) as c:
            out(
                f"{'request':<18} {'imgs':>4} {'hits':>4} {'TTFT ms':>8} {'TPOT ms':>8} {'enc ms':>7}  {'=colo':<5} output"
            )
            for name, prompt, imgs in jobs:
                r = await c.generate(prompt, images=imgs, max_tokens=max_tokens, route="epd")
                same = ""
                if compare:
                    ref = await c.generate(prompt, images=imgs, max_tokens=max_tokens, route="colocated")
                    same = "yes" if ref.token_ids == r.token_ids else "NO"
                    all_equal &= same == "yes"
                t = r.timings
                out(
                    f"{name:<18} {len(imgs):>4} {t.cache_hits:>4} {t.ttft_s * 1e3:>8.1f} {t.tpot_s * 1e3:>8.1f} "
                    f"{t.encode_s * 1e3:>7.1f}  {same:<5} {r.text[:60]!r}"
                )
            s = await c.stats()
        k = s["counters"]
        out(
            f"\nbroker: {k['requests_completed']} requests completed, {k['encodes_done']} images encoded, "
            f"{k['cache_hits']} served from the embedding cache, {k['dedup_joins']} joined a running encode"
        )
        out("(the model is a tiny randomly initialised Qwen2-VL: text is meaningless; equality is the point)")
    finally:
        out("stopping the cluster")
        cluster.stop()
    return all_equal
