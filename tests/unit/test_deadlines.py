"""Many deadlines on one loop timer (epdq.deadlines), and the PD worker's runs bounded by them."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from epdq import protocol as P
from epdq.deadlines import Deadlines
from epdq.engines.base import Delta

pytestmark = pytest.mark.timeout(30)


class FakeLoop:
    """The two loop calls Deadlines makes, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[tuple[float, object]] = []  # (when, handle), the armed ones

    def time(self) -> float:
        return self.now

    def call_at(self, when, cb):
        loop = self

        class Handle:
            cancelled = False

            def cancel(self):
                self.cancelled = True
                loop.timers = [t for t in loop.timers if t[1] is not self]

        h = Handle()
        h.cb = cb
        self.timers.append((when, h))
        return h

    def run_until(self, t: float) -> None:
        """Advance the clock, running every timer due meanwhile, in order."""
        while True:
            due = sorted((w, i, h) for i, (w, h) in enumerate(self.timers) if w <= t)
            if not due:
                break
            when, _, h = due[0]
            self.timers.remove((when, h))
            self.now = max(self.now, when)
            h.cb()
        self.now = t


def test_keys_expire_at_their_deadline_in_order_and_discarded_ones_never():
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    d.add("c", 103.0)
    d.add("a", 101.0)
    d.add("b", 102.0)
    d.add_after("x", 1.5)  # 101.5
    d.discard("x")
    assert len(loop.timers) == 1 and loop.timers[0][0] == 101.0  # one timer, for the earliest
    loop.run_until(100.99)
    assert fired == []
    loop.run_until(102.5)
    assert fired == ["a", "b"] and len(d) == 1 and "c" in d
    loop.run_until(110)
    assert fired == ["a", "b", "c"] and len(d) == 0 and loop.timers == []


def test_adding_a_key_again_replaces_its_deadline():
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    d.add("k", 101.0)
    d.add("k", 105.0)
    loop.run_until(104)
    assert fired == []
    loop.run_until(105)
    assert fired == ["k"]


def test_equal_timeouts_never_move_the_timer_and_finished_keys_do_not_pile_up():
    # a PD worker's requests: the same timeout, each done long before it
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    first = None
    for i in range(20_000):
        loop.now += 0.001
        d.add(i, loop.now + 120)
        if first is None:
            first = loop.timers[0][1]
        assert loop.timers[0][1] is first  # never re-armed
        d.discard(i)
    assert len(d) == 0 and len(d._heap) <= 1024 + 2  # rebuilt as dead entries outgrow live ones
    loop.run_until(loop.now + 200)
    assert fired == [] and loop.timers == []


def test_an_earlier_deadline_moves_the_timer_and_a_dead_head_is_skipped():
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    d.add("late", 150.0)
    d.add("early", 101.0)
    assert [w for w, _ in loop.timers] == [101.0]
    d.add("mid", 120.0)
    d.discard("mid")
    loop.run_until(101.0)
    # the next timer is for the next live key, not for the finished one in between
    assert fired == ["early"] and [w for w, _ in loop.timers] == [150.0]


def test_a_timer_run_a_little_early_still_expires_what_is_due():
    # libuv's timers have a 1 ms resolution: one may run before loop.time() reaches its instant
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    d.add("k", 101.0)
    loop.now = 100.9995
    loop.timers.pop()[1].cb()
    assert fired == ["k"] and loop.timers == []


def test_a_failing_callback_does_not_keep_other_keys_from_expiring(caplog):
    loop, fired = FakeLoop(), []

    def cb(key):
        fired.append(key)
        if key == "bad":
            raise RuntimeError("boom")

    d = Deadlines(loop, cb)
    d.add("bad", 101.0)
    d.add("good", 101.0)
    with caplog.at_level(logging.ERROR, logger="epdq.deadlines"):
        loop.run_until(101)
    assert fired == ["bad", "good"] and "deadline callback failed" in caplog.text


def test_callbacks_may_add_and_discard_deadlines():
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, lambda k: (fired.append(k), d.add(k + "'", loop.now + 1), d.discard("other")))
    d.add("a", 101.0)
    d.add("other", 101.5)
    loop.run_until(103)
    assert fired == ["a", "a'", "a''"]


def test_nan_is_refused_and_close_stops_the_timer():
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    with pytest.raises(ValueError, match="NaN"):
        d.add("k", float("nan"))
    d.add("k", 101.0)
    d.close()
    assert loop.timers == [] and len(d) == 0
    loop.run_until(200)
    assert fired == []


def test_against_a_brute_force_model():
    rng = random.Random(7)
    loop, fired = FakeLoop(), []
    d = Deadlines(loop, fired.append)
    model: dict[int, float] = {}
    expected: list[int] = []
    for _ in range(5_000):
        op = rng.random()
        if op < 0.5:
            k = rng.randrange(300)
            model[k] = loop.now + rng.uniform(0.01, 5)
            d.add(k, model[k])
        elif op < 0.8:
            k = rng.randrange(300)
            model.pop(k, None)
            d.discard(k)
        else:
            t = loop.now + rng.uniform(0, 1)
            expected += [k for k, w in sorted(model.items(), key=lambda kv: (kv[1], kv[0])) if w <= t]
            model = {k: w for k, w in model.items() if w > t}
            before = len(fired)
            loop.run_until(t)
            assert sorted(fired[before:]) == sorted(expected[before:])
            fired[before:] = expected[before:] = sorted(fired[before:])
            assert len(d) == len(model)


async def test_on_a_real_loop():
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    d = Deadlines(loop, lambda k: got.set())
    t0 = loop.time()
    d.add_after("k", 0.05)
    await asyncio.wait_for(got.wait(), 5)
    assert loop.time() - t0 >= 0.05 - 0.0011
    d.close()


# ---------------------------------------------------------------- the PD worker's deadlines


class SlowEngine:
    """Streams its first token, then waits on `gate` for the rest."""

    hidden_size = 8

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.events: list[str] = []

    def render_prompt(self, messages):
        return "hi"

    async def generate(self, request_id, prompt, sampling, **kwargs):
        self.events.append(f"start {request_id}")
        yield Delta([1], "a")
        await self.gate.wait()
        yield Delta([2], "b", "length", 2)

    async def abort(self, request_id):
        self.events.append(f"abort {request_id}")


def make_pd(engine):
    from epdq.worker.pd import PDWorker

    w = PDWorker(engine, worker_id="pd-0", node="n", colocated=False, max_image_bytes=1 << 20,
                 max_image_pixels=1 << 20)  # fmt: skip
    w.sent = []
    w.link = type("Link", (), {"send": lambda self, m, payload=(), copy=True: w.sent.append(m)})()
    return w


def prefill(rid: str, timeout_s: float) -> P.Prefill:
    return P.Prefill(rid, [P.ChatMessage("user", [P.Part("text", "hi")])], P.Sampling(max_tokens=2), timeout_s, [])


async def test_a_run_past_its_deadline_is_aborted_and_answered_deadline():
    engine = SlowEngine()
    w = make_pd(engine)
    try:
        w.handle(prefill("slow", 0.05), [])
        w.handle(prefill("fast", 30.0), [])
        task = w._tasks["slow"]
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
        assert not task.cancelled() and task.cancelling() == 0  # answered, the cancellation undone
        slow = [m for m in w.sent if getattr(m, "request_id", "") == "slow"]
        assert [type(m) for m in slow] == [P.Tokens, P.PdFailed]
        assert slow[-1].code == "deadline" and "abort slow" in engine.events
        assert "slow" not in w._tasks and not w._expired
        # the other run, still within its own deadline, goes on
        assert "fast" in w._tasks and "abort fast" not in engine.events
        engine.gate.set()
        await asyncio.wait_for(w._tasks["fast"], 5)
        fast = [m for m in w.sent if getattr(m, "request_id", "") == "fast"]
        assert fast[-1].finish_reason == "length" and len(w._deadlines) == 0
    finally:
        w.close()


async def test_the_brokers_abort_is_still_cancelled_not_deadline():
    engine = SlowEngine()
    w = make_pd(engine)
    try:
        w.handle(prefill("r", 30.0), [])
        while not w.sent:
            await asyncio.sleep(0.001)
        w.handle(P.Abort("r"), [])
        await asyncio.wait_for(asyncio.gather(*w._tasks.values(), return_exceptions=True), 5)
        assert w.sent[-1].code == "cancelled" and len(w._deadlines) == 0
    finally:
        w.close()


async def test_a_run_that_ends_in_time_leaves_no_deadline_behind():
    engine = SlowEngine()
    engine.gate.set()
    w = make_pd(engine)
    try:
        for i in range(50):
            w.handle(prefill(f"r{i}", 0.5), [])
        await asyncio.wait_for(asyncio.gather(*w._tasks.values()), 5)
        assert all(m.finish_reason == "length" for m in w.sent if m.finish_reason)
        assert len(w._deadlines) == 0
        await asyncio.sleep(0.6)  # past every deadline: nothing fires late
        assert not any(isinstance(m, P.PdFailed) for m in w.sent) and not any("abort" in e for e in engine.events)
    finally:
        w.close()
