"""A worker told to stop while it starts (loading a model: seconds to minutes) stops then: the
start-up step is cancelled and the worker never registers (`epdq.worker.runner._unless_stopped`)."""

from __future__ import annotations

import asyncio

import pytest

from epdq.worker.runner import _unless_stopped

pytestmark = pytest.mark.timeout(10)


class _Load:
    """A start-up step that runs until released, recording how it ended."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.began = asyncio.Event()
        self.cancelled = False

    async def __call__(self) -> str:
        self.began.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "engine"


async def test_a_stop_while_loading_cancels_the_load():
    stop, load = asyncio.Event(), _Load()
    task = asyncio.create_task(_unless_stopped(stop, load()))
    await asyncio.wait_for(load.began.wait(), 2)
    stop.set()
    assert await asyncio.wait_for(task, 2) is None
    assert load.cancelled


async def test_a_load_that_ends_first_gives_its_result():
    stop, load = asyncio.Event(), _Load()
    load.release.set()
    assert await asyncio.wait_for(_unless_stopped(stop, load()), 2) == "engine"
    assert not load.cancelled


async def test_a_stop_that_came_before_the_load_means_no_load():
    stop, load = asyncio.Event(), _Load()
    stop.set()
    assert await asyncio.wait_for(_unless_stopped(stop, load()), 2) is None
    assert not load.began.is_set()


async def test_a_failed_load_raises_unless_stopped():
    async def broken() -> None:
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        await asyncio.wait_for(_unless_stopped(asyncio.Event(), broken()), 2)


async def test_cancelling_the_worker_cancels_its_load():
    stop, load = asyncio.Event(), _Load()
    task = asyncio.create_task(_unless_stopped(stop, load()))
    await asyncio.wait_for(load.began.wait(), 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert load.cancelled
