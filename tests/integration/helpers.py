"""Helpers shared by the integration tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from epdq import AsyncClient, BrokerUnavailableError
from epdq.cluster import ClusterSpec


def noop_spec(tmp_path, **kw: Any) -> ClusterSpec:
    """A cluster of no-op engines (real broker, worker and ring code, no model) over ipc."""
    defaults = dict(
        address=f"ipc://{tmp_path}/sock/broker", encoders=1, pds=1, log_dir=str(tmp_path / "logs"),
        worker_defaults={"engine": "noop"}, start_timeout_s=60,
    )  # fmt: skip
    defaults.update(kw)
    return ClusterSpec(**defaults)


async def wait_stats(addr: str, pred, timeout: float = 20.0) -> dict:
    """Poll the broker's stats until `pred(stats)`; AssertionError after `timeout` seconds."""
    async with AsyncClient(addr) as c:
        end = time.monotonic() + timeout
        s = None
        while True:
            try:
                s = await c.stats(timeout=1.0)
                if pred(s):
                    return s
            except BrokerUnavailableError:
                s = None
            if time.monotonic() > end:
                raise AssertionError(f"condition not met within {timeout}s; last stats: {s}")
            await asyncio.sleep(0.05)


ENGINE_REQUEST_TIMEOUT_S = 60
_engine_ids = itertools.count()


def chat(n_images: int, text: str = "Describe the picture.") -> list[dict]:
    """One user turn: `n_images` image parts, then the text."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


async def collect(
    engine, prompt: str, spec, rid: str | None = None, *, usage: bool = False, **kwargs
) -> tuple[list[int], str, str | None] | tuple[list[int], str, str | None, int]:
    """Run one generate() to the end: (token ids, text, finish reason[, prompt tokens when
    `usage`]); bounded by a timeout. The last delta must carry the prompt's length."""

    async def run():
        tokens, text, reason, n_prompt = [], "", None, 0
        async for delta in engine.generate(rid or f"req-{next(_engine_ids)}", prompt, spec, **kwargs):
            assert reason is None, "no delta may follow the one carrying finish_reason"
            tokens += delta.token_ids
            text += delta.text
            reason, n_prompt = delta.finish_reason, delta.prompt_tokens
        assert reason is None or n_prompt > 0, "the last delta must carry prompt_tokens"
        return (tokens, text, reason, n_prompt) if usage else (tokens, text, reason)

    return await asyncio.wait_for(run(), ENGINE_REQUEST_TIMEOUT_S)


async def abort_mid_stream(engine, prompt: str, spec, rid: str = "abort-me") -> list[int]:
    """Stream one request, abort it once tokens flow; the stream must end in CancelledError.
    Returns the tokens seen before the abort took effect."""
    import pytest

    from epdq.errors import CancelledError

    seen: list[int] = []

    async def consume():
        async for delta in engine.generate(rid, prompt, spec):
            seen.extend(delta.token_ids)

    task = asyncio.create_task(consume())
    deadline = time.monotonic() + ENGINE_REQUEST_TIMEOUT_S
    while not seen and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    await engine.abort(rid)
    with pytest.raises(CancelledError):
        await asyncio.wait_for(task, ENGINE_REQUEST_TIMEOUT_S)
    return seen
