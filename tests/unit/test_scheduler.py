"""Scheduling decisions, with an injected clock and no sockets."""

import pytest

from epdq.errors import BusyError, DeadlineExceededError, InvalidInputError, RingFullError, WorkerLostError
from epdq.jobs import Fail, ReqState, Role, SendAbort, SendEncode, SendPin, SendPrefill, SendUnpin
from epdq.protocol import EmbedRef, EntryId
from epdq.scheduler import Scheduler, SchedulerConfig


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def K(i):
    return bytes([i]) * 16


def ref_for(job_key, worker="enc-0", node="n1", gen=1, nbytes=1024):
    return EmbedRef(job_key, worker, node, "seg", 0, nbytes, gen, "float32", [2, 128], [1, 2, 4], "")


@pytest.fixture
def clock():
    return Clock()


def make(clock, enc=1, pd=1, enc_cap=4, pd_cap=4, **cfg):
    # unpins at once unless a test asks for lingering pins: the pin protocol step by step
    cfg.setdefault("unpin_delay_s", 0.0)
    s = Scheduler(SchedulerConfig(**cfg), clock=clock)
    for i in range(enc):
        s.add_worker(f"enc-{i}", Role.ENCODER, "n1", enc_cap)
    for i in range(pd):
        s.add_worker(f"pd-{i}", Role.PD, "n1", pd_cap)
    return s


def submit(s, rid, keys, timeout=10.0, route="auto"):
    s.submit(rid, b"client", list(keys), [b"img-" + k for k in keys], timeout, payload=None, route=route)
    return s.take_actions()


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def finish_encode(s, action, gen=1, node="n1"):
    s.on_encoded(action.worker_id, action.job.job_id, ref_for(action.job.key, action.worker_id, node, gen))
    return s.take_actions()


def test_text_only_goes_straight_to_pd(clock):
    s = make(clock)
    acts = submit(s, "r1", [])
    assert [type(a) for a in acts] == [SendPrefill]
    assert acts[0].refs == []


def test_encoder_credit_is_never_exceeded(clock):
    s = make(clock, enc_cap=2)
    encodes = []
    for i in range(5):
        encodes += of(submit(s, f"r{i}", [K(i)]), SendEncode)
    assert len(encodes) == 2
    assert s.workers["enc-0"].credit == 0
    acts = finish_encode(s, encodes[0])
    assert len(of(acts, SendEncode)) == 1  # one credit came back, one job went out
    assert len(of(acts, SendPrefill)) == 1


def test_round_robin_across_encoders(clock):
    s = make(clock, enc=2, enc_cap=2)
    workers = [a.worker_id for i in range(4) for a in of(submit(s, f"r{i}", [K(i)]), SendEncode)]
    assert sorted(workers) == ["enc-0", "enc-0", "enc-1", "enc-1"]


def test_concurrent_duplicates_are_encoded_once(clock):
    s = make(clock)
    a1 = submit(s, "r1", [K(1)])
    a2 = submit(s, "r2", [K(1)])
    assert len(of(a1, SendEncode)) == 1 and not of(a2, SendEncode)
    assert s.counters["dedup_joins"] == 1
    acts = finish_encode(s, of(a1, SendEncode)[0])
    assert {a.request.rid for a in of(acts, SendPrefill)} == {"r1", "r2"}


def test_requests_joined_on_one_image_become_ready_first_come_first_served(clock):
    # they were kept in a set of request ids, whose order follows str hashes: the order of
    # dispatch (and the cost-model goodput's figures) changed with PYTHONHASHSEED
    s = make(clock, pd_cap=1)
    rids = [f"r{i}-{'x' * i}" for i in range(12)]
    enc = of(submit(s, rids[0], [K(1)]), SendEncode)[0]
    for rid in rids[1:]:
        assert not of(submit(s, rid, [K(1)]), SendEncode)  # each joins the one encode
    order = [a.request.rid for a in of(finish_encode(s, enc), SendPrefill)]
    for _ in rids[1:]:
        s.on_tokens("pd-0", order[-1], finished=True)
        order += [a.request.rid for a in of(s.take_actions(), SendPrefill)]
    assert order == rids


def test_a_lost_encoders_images_are_encoded_again_in_the_order_they_came(clock):
    # its keys were a set of bytes, iterated in hash order: the re-encodes, and the requests
    # waiting on them, went out in an order that changed with PYTHONHASHSEED
    s = make(clock, enc=2, enc_cap=64, pd_cap=1)
    s.drain_worker("enc-1")  # every first encode goes to enc-0
    keys = [bytes([i]) * 8 + bytes([255 - i]) * 8 for i in range(40)]
    s.submit("busy", b"client", [], [], 10.0, payload=None)  # holds the one PD slot: all wait
    s.take_actions()
    for i, k in enumerate(keys):
        for a in of(submit(s, f"r{i}", [k]), SendEncode):
            finish_encode(s, a)
    s.add_worker("enc-2", Role.ENCODER, "n1", 64)
    s.take_actions()
    s.remove_worker("enc-0")
    again = [a.job.key for a in of(s.take_actions(), SendEncode)]
    assert again == keys


def test_same_image_twice_in_one_request(clock):
    s = make(clock)
    acts = submit(s, "r1", [K(1), K(1)])
    assert len(of(acts, SendEncode)) == 1
    acts = finish_encode(s, of(acts, SendEncode)[0])
    (pf,) = of(acts, SendPrefill)
    assert [r.key for r in pf.refs] == [K(1), K(1)]


def test_resident_hit_skips_encoder_and_pins_again(clock):
    s = make(clock)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    finish_encode(s, enc, gen=7)
    s.on_tokens("pd-0", "r1", finished=True)
    acts = s.take_actions()
    assert of(acts, SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 7)])]
    acts = submit(s, "r2", [K(1)])
    assert not of(acts, SendEncode)
    assert of(acts, SendPin) == [SendPin("enc-0", [EntryId(K(1), 7)])]
    assert len(of(acts, SendPrefill)) == 1
    assert s.counters["cache_hits"] == 1 and s.counters["encodes_queued"] == 1


def test_busy_when_queue_full(clock):
    s = make(clock, pd=0, enc=0, max_queued_requests=2, busy_retry_after_s=0.25)
    submit(s, "r1", [])
    submit(s, "r2", [])
    with pytest.raises(BusyError) as ei:
        submit(s, "r3", [])
    assert ei.value.retry_after == 0.25
    assert s.counters["busy_rejections"] == 1


def submit_as(s, client, rid, keys=()):
    s.submit(rid, client, list(keys), [b"img-" + k for k in keys], 10.0, payload=None)
    return s.take_actions()


def test_a_client_under_its_share_of_a_full_queue_gets_room_from_the_one_over_it(clock):
    # one client filled the whole queue; every other client used to get BusyError until it drained
    s = make(clock, pd=0, enc=0, max_queued_requests=4, busy_retry_after_s=0.25)
    for i in range(4):
        submit_as(s, b"flood", f"f{i}")
    acts = submit_as(s, b"other", "o1")
    (fail,) = of(acts, Fail)
    assert fail.rid == "f3" and fail.client == b"flood"  # its newest
    assert isinstance(fail.error, BusyError) and fail.error.retry_after == 0.25
    assert "over its share of 2" in fail.error.message
    assert s.shares.held == {b"flood": 3, b"other": 1} and s.queued == 4
    submit_as(s, b"other", "o2")  # still under its share: f2 goes
    assert s.shares.held == {b"flood": 2, b"other": 2}
    with pytest.raises(BusyError, match="4 requests queued"):
        submit_as(s, b"other", "o3")  # at its share now: told busy, as the flood is
    with pytest.raises(BusyError):
        submit_as(s, b"flood", "f9")
    assert s.counters["share_preemptions"] == 2 and s.counters["busy_rejections"] == 2
    # a third client: shares of 4 // 3 = 1; the heaviest (a tie: the first found) makes room
    submit_as(s, b"third", "t1")
    assert sum(s.shares.held.values()) == 4 and s.shares.held[b"third"] == 1


def test_a_request_refused_for_another_reason_makes_no_room(clock):
    s = make(clock, pd=0, enc=0, max_queued_requests=2, max_held_image_bytes=100)
    submit_as(s, b"flood", "f1")
    submit_as(s, b"flood", "f2")
    with pytest.raises(BusyError, match="MiB of images held"):
        s.submit("o1", b"other", [K(1)], [b"x" * 101], 10.0, payload=None)
    with pytest.raises(InvalidInputError, match="unknown route"):
        s.submit("o2", b"other", [], [], 10.0, payload=None, route="sideways")
    assert set(s.requests) == {"f1", "f2"} and s.counters["share_preemptions"] == 0


def test_a_request_that_already_ran_is_never_turned_away_for_room(clock):
    # re-queued after its PD worker died, it may have streamed tokens: BusyError would be a lie
    s = make(clock, enc=0, pd=1, pd_cap=2, max_queued_requests=1)
    submit_as(s, b"flood", "r1")
    submit_as(s, b"flood", "r2")  # both dispatched
    s.remove_worker("pd-0")  # both back in the queue, over its limit
    s.take_actions()
    assert s.shares.held == {b"flood": 2} and s.requests["r2"].state is ReqState.READY
    with pytest.raises(BusyError, match="2 requests queued"):
        submit_as(s, b"other", "o1")
    assert s.counters["share_preemptions"] == 0 and set(s.requests) == {"r1", "r2"}


def test_running_requests_do_not_count_as_queued(clock):
    s = make(clock, pd_cap=1, max_queued_requests=1)
    submit(s, "r1", [])  # running
    submit(s, "r2", [])  # queued
    with pytest.raises(BusyError):
        submit(s, "r3", [])
    s.on_tokens("pd-0", "r1", finished=True)
    assert of(s.take_actions(), SendPrefill)[0].request.rid == "r2"
    submit(s, "r3", [])


def test_deadline_fails_waiting_and_aborts_running(clock):
    s = make(clock, pd_cap=1)
    submit(s, "run", [], timeout=5)
    submit(s, "wait", [K(1)], timeout=5)
    clock.t += 6
    s.expire()
    acts = s.take_actions()
    fails = {a.rid: a.error for a in of(acts, Fail)}
    assert set(fails) == {"run", "wait"}
    assert all(isinstance(e, DeadlineExceededError) for e in fails.values())
    assert of(acts, SendAbort) == [SendAbort("pd-0", "run")]
    # the PD slot is only free once the worker acknowledges the abort
    assert s.workers["pd-0"].credit == 0
    s.on_pd_failed("pd-0", "run", "cancelled", "aborted", [])
    assert s.workers["pd-0"].credit == 1


def test_a_deadline_says_when_no_registered_worker_could_take_the_request(clock):
    s = make(clock, enc=0, pd=1)
    submit(s, "colo", [], timeout=5, route="colocated")
    submit(s, "img", [K(1)], timeout=5)
    submit(s, "text", [], timeout=5)
    clock.t += 6
    s.expire()
    msgs = {a.rid: a.error.message for a in of(s.take_actions(), Fail)}
    assert msgs["colo"] == "deadline passed while ready: no colocated ('both') worker is registered for route 'colocated'"
    assert msgs["img"] == "deadline passed while waiting: no encoder is registered"
    assert msgs["text"] == "deadline passed while running"  # a PD worker took it: nothing was missing


def test_prefers_pd_on_the_embeddings_node(clock):
    s = Scheduler(clock=clock)
    s.add_worker("enc-b", Role.ENCODER, "B", 4)
    s.add_worker("pd-a", Role.PD, "A", 4)
    s.add_worker("pd-b", Role.PD, "B", 4)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    acts = finish_encode(s, enc, node="B")
    assert of(acts, SendPrefill)[0].worker_id == "pd-b"


def test_dead_encoder_jobs_requeue_then_fail_after_cap(clock):
    s = make(clock, enc=1, max_encode_attempts=2)
    submit(s, "r1", [K(1)])
    s.remove_worker("enc-0")
    s.add_worker("enc-1", Role.ENCODER, "n1", 4)
    assert of(s.take_actions(), SendEncode)[0].worker_id == "enc-1"
    s.remove_worker("enc-1")
    (fail,) = of(s.take_actions(), Fail)
    assert isinstance(fail.error, WorkerLostError)
    assert not s.requests and not s.jobs


def test_dead_pd_requeues_unless_streamed(clock):
    s = make(clock, pd=2, pd_cap=1)
    submit(s, "r1", [])
    submit(s, "r2", [])
    s.on_tokens("pd-0", "r1", finished=False)  # r1 has streamed
    s.remove_worker("pd-0")
    s.remove_worker("pd-1")
    fails = of(s.take_actions(), Fail)
    assert [f.rid for f in fails] == ["r1"] and isinstance(fails[0].error, WorkerLostError)
    assert s.requests["r2"].state is ReqState.READY
    s.add_worker("pd-2", Role.PD, "n1", 1)
    assert of(s.take_actions(), SendPrefill)[0].request.rid == "r2"


def test_a_lost_workers_work_goes_back_oldest_first(clock):
    # a worker's jobs and requests were a set: a lost encoder's jobs went back to the head of the
    # queue newest first (ids iterated ascending, each put at the head), a lost PD worker's
    # requests in an order of their ids' hashes
    s = make(clock, enc=1, pd=1, enc_cap=20, pd_cap=20)
    keys = [bytes([i]) * 16 for i in range(1, 16)]
    for i, k in enumerate(keys):
        submit(s, f"m{i}", [k])
    for i in range(15):
        submit(s, f"t{i}-{'y' * i}", [])
    s.remove_worker("enc-0")
    s.remove_worker("pd-0")
    s.take_actions()
    s.add_worker("enc-1", Role.ENCODER, "n1", 20)
    assert [a.job.key for a in of(s.take_actions(), SendEncode)] == keys
    s.add_worker("pd-1", Role.PD, "n1", 20)
    assert [a.request.rid for a in of(s.take_actions(), SendPrefill)] == [f"t{i}-{'y' * i}" for i in range(15)]


def test_eviction_forgets_entry_and_next_request_reencodes(clock):
    s = make(clock)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    finish_encode(s, enc, gen=3)
    s.on_tokens("pd-0", "r1", finished=True)
    s.on_evicted("enc-0", [EntryId(K(1), 3)])
    assert K(1) not in s.index
    assert len(of(submit(s, "r2", [K(1)]), SendEncode)) == 1


def test_stale_read_reencodes_and_retries(clock):
    s = make(clock)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    finish_encode(s, enc, gen=3)
    s.on_pd_failed("pd-0", "r1", "stale", "overwritten", [EntryId(K(1), 3)])
    acts = s.take_actions()
    enc2 = of(acts, SendEncode)
    assert len(enc2) == 1 and s.requests["r1"].state is ReqState.WAITING
    acts = finish_encode(s, enc2[0], gen=4)
    assert of(acts, SendPrefill)[0].refs[0].generation == 4
    assert s.counters["stale_reads"] == 1


def test_cancel_waiting_request_drops_unneeded_job(clock):
    s = make(clock, enc_cap=1)
    submit(s, "r1", [K(1)])  # takes the only encoder slot
    submit(s, "r2", [K(2)])  # queued encode
    assert s.cancel("r2", b"client")
    enc = of(s.take_actions(), SendEncode)
    assert not enc
    # when r1's encode finishes, the freed credit is not spent on the cancelled image
    s.on_encoded("enc-0", 1, ref_for(K(1)))
    assert not of(s.take_actions(), SendEncode)
    assert K(2) not in s.jobs


def test_encoded_after_everyone_left_is_unpinned(clock):
    s = make(clock)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    s.cancel("r1")
    acts = finish_encode(s, enc, gen=9)
    assert of(acts, SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 9)])]
    assert s.index[K(1)].pinned is False  # still resident for later hits


def test_invalid_encode_fails_every_waiter(clock):
    s = make(clock)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    submit(s, "r2", [K(1), K(2)])
    s.on_encode_failed("enc-0", enc.job.job_id, "invalid_input", "not an image")
    fails = of(s.take_actions(), Fail)
    assert {f.rid for f in fails} == {"r1", "r2"}
    assert all(isinstance(f.error, InvalidInputError) for f in fails)


def test_colocated_route(clock):
    s = Scheduler(clock=clock)
    s.add_worker("both-0", Role.BOTH, "n1", 2)
    acts = submit(s, "r1", [K(1)])
    (pf,) = of(acts, SendPrefill)
    assert pf.worker_id == "both-0" and pf.refs == [] and pf.request.route == "colocated"
    assert s.counters["encodes_queued"] == 0


def test_duplicate_request_id_rejected(clock):
    s = make(clock)
    submit(s, "r1", [])
    with pytest.raises(InvalidInputError):
        submit(s, "r1", [])


def test_no_leak_after_many_requests(clock):
    s = make(clock, enc=2, pd=2)
    for i in range(2000):
        acts = submit(s, f"r{i}", [K(i % 50), K((i * 7) % 50)])
        while True:
            encs = of(acts, SendEncode)
            pfs = of(acts, SendPrefill)
            acts = []
            for e in encs:
                acts += finish_encode(s, e, gen=i + 1)
            for p in pfs:
                s.on_tokens(p.worker_id, p.request.rid, finished=True)
                acts += s.take_actions()
            if not acts:
                break
    assert not s.requests and not s.users and not s.jobs and s.queued == 0
    assert all(w.credit == w.capacity for w in s.workers.values())
    assert all(not e.pinned for e in s.index.values())
    assert s.counters["encodes_done"] == 50


def test_held_image_bytes_are_bounded(clock):
    s = make(clock, enc_cap=1, max_held_image_bytes=100)
    s.submit("r1", b"c", [K(1)], [b"x" * 60], 10, None)
    with pytest.raises(BusyError, match="held"):
        s.submit("r2", b"c", [K(2)], [b"y" * 60], 10, None)
    assert s.held_image_bytes == 60
    s.cancel("r1")
    assert s.held_image_bytes == 0
    s.submit("r2", b"c", [K(2)], [b"y" * 60], 10, None)


def test_encode_lease_expiry_requeues_to_another_encoder(clock):
    s = make(clock, enc=2, enc_cap=1, encode_lease_s=5.0)
    first = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    clock.t += 4.9
    s.expire()
    assert not of(s.take_actions(), SendEncode)  # lease not over yet
    clock.t += 0.2
    s.expire()
    (again,) = of(s.take_actions(), SendEncode)
    assert again.worker_id != first.worker_id and again.job.key == first.job.key
    assert again.job.job_id != first.job.job_id  # a new attempt, a new id (see the test below)
    assert s.counters["leases_expired"] == 1
    # the stuck encoder's slot stays taken until it answers; its late answer is unpinned, not used
    assert s.workers[first.worker_id].credit == 0
    s.on_encoded(first.worker_id, first.job.job_id, ref_for(K(1), first.worker_id, gen=1))
    acts = s.take_actions()
    assert of(acts, SendUnpin) and not of(acts, SendPrefill)
    assert s.workers[first.worker_id].credit == 1
    acts = finish_encode(s, again, gen=2)
    assert of(acts, SendPrefill)[0].refs[0].generation == 2


def test_a_job_sent_again_to_the_encoder_that_still_holds_it_takes_a_slot_of_its_own(clock):
    """The lease of a job on an encoder with credit to spare expires: the next attempt may go to
    that same encoder. Both attempts hold a slot until answered (one id for both counted one, and
    over-issued the credit), and the late answer to the first names the entry the second one
    pins (a ring holds one entry per key; a pin is a flag): it must not unpin it."""
    s = make(clock, enc=1, enc_cap=2, pd_cap=1, encode_lease_s=1.0)
    submit(s, "busy", [])  # holds the PD worker: r1 stays ready, its entry pinned
    (first,) = of(submit(s, "r1", [K(1)]), SendEncode)
    clock.t += 1.5
    s.expire()
    (again,) = of(s.take_actions(), SendEncode)
    assert again.worker_id == "enc-0" and again.job.job_id != first.job.job_id
    assert s.workers["enc-0"].credit == 0  # two jobs held, two slots
    s.on_encoded("enc-0", first.job.job_id, ref_for(K(1), "enc-0", gen=5))  # the late answer
    assert not of(s.take_actions(), SendUnpin) and s.workers["enc-0"].credit == 1
    s.on_encoded("enc-0", again.job.job_id, ref_for(K(1), "enc-0", gen=5))  # the same entry
    acts = s.take_actions()
    assert not of(acts, SendUnpin) and s.index[K(1)].pinned and s.requests["r1"].state is ReqState.READY
    assert s.workers["enc-0"].credit == 2
    s.on_tokens("pd-0", "busy", finished=True)
    (p,) = of(s.take_actions(), SendPrefill)
    assert p.request.rid == "r1" and p.refs[0].generation == 5
    s.on_tokens("pd-0", "r1", finished=True)
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 5)])]  # once, at its end


def test_a_draining_encoders_entries_serve_no_new_request(clock):
    """README: a draining encoder is sent nothing new, so that no new request comes to need its
    ring. A hot image resident there used to be served from it (pinned again and again by
    overlapping requests, its drain lasted until --drain-timeout); now a new request waits for
    an encode elsewhere, and the old entry's pin goes when the request running on it ends."""
    s = make(clock, enc=2, pd_cap=8)
    (e,) = of(submit(s, "r1", [K(1)]), SendEncode)
    finish_encode(s, e, gen=7)
    old = e.worker_id
    assert s.drain_worker(old)
    s.take_actions()
    acts = submit(s, "r2", [K(1)])
    (again,) = of(acts, SendEncode)
    assert again.worker_id != old and not of(acts, SendPin) and not of(acts, SendPrefill)
    assert s.counters["cache_misses"] == 2 and K(1) not in s.index
    acts = finish_encode(s, again, gen=9)
    (p,) = of(acts, SendPrefill)
    assert p.request.rid == "r2" and p.refs[0].encoder_id == again.worker_id
    assert not [u for u in of(acts, SendUnpin) if u.worker_id == old]  # r1 still runs on it
    s.on_tokens("pd-0", "r1", finished=True)
    assert of(s.take_actions(), SendUnpin) == [SendUnpin(old, [EntryId(K(1), 7)])]  # the drain can end


def test_an_entry_released_on_a_draining_encoder_leaves_the_index(clock):
    # its last request ends during the drain: unpinned, and no later hit pins it there again
    s = make(clock, enc=2)
    (e,) = of(submit(s, "r1", [K(1)]), SendEncode)
    finish_encode(s, e, gen=3)
    s.drain_worker(e.worker_id)
    s.on_tokens("pd-0", "r1", finished=True)
    assert of(s.take_actions(), SendUnpin) == [SendUnpin(e.worker_id, [EntryId(K(1), 3)])]
    assert K(1) not in s.index
    acts = submit(s, "r2", [K(1)])
    assert not of(acts, SendPin) and [a.worker_id for a in of(acts, SendEncode)] != [e.worker_id]


def test_lease_expiry_respects_attempt_cap(clock):
    s = make(clock, enc=1, enc_cap=2, encode_lease_s=1.0, max_encode_attempts=2)
    submit(s, "r1", [K(1)])
    clock.t += 1.1
    s.expire()
    assert len(of(s.take_actions(), SendEncode)) == 1  # second attempt on the remaining credit
    clock.t += 1.1
    s.expire()
    (fail,) = of(s.take_actions(), Fail)
    assert isinstance(fail.error, WorkerLostError) and fail.rid == "r1"


def test_deadline_and_lease_heaps_stay_proportional_to_live_work(clock):
    s = make(clock, enc=1, pd=1, enc_cap=8, pd_cap=8)
    for i in range(5000):
        acts = submit(s, f"r{i}", [K(i % 200)] if i % 2 else [])
        for e in of(acts, SendEncode):
            acts += finish_encode(s, e)
        for p in of(acts, SendPrefill):
            s.on_tokens(p.worker_id, p.request.rid, finished=True)
    assert not s.requests
    assert len(s._deadlines) <= 1024 + 2 and len(s._leases) <= 1024 + 2


@pytest.mark.parametrize("unpin_delay", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_gauges_and_invariants_and_ends_clean(clock, seed, unpin_delay):
    """Random traffic with every kind of event (encodes, failures, evictions, stale reads, lease
    and deadline expiry, dead and draining workers, cancels): the O(1) gauges never drift from a recount, no
    worker is over its credit, a waiting request always has an encode coming, a ready one has
    every embedding, pins follow live users; then, with every job answered, everything ends and
    nothing leaks. (Set iteration order follows the hash seed: each run explores other orders.)"""
    import random

    rng = random.Random(seed)
    s = make(clock, enc=2, pd=2, enc_cap=2, pd_cap=2, max_queued_requests=40, encode_lease_s=3.0,
             unpin_delay_s=unpin_delay)  # fmt: skip
    encodes: dict[tuple[str, int], SendEncode] = {}  # a job re-sent after its lease: two entries
    draining: dict[str, set] = {}  # worker -> what it held when it began to drain
    running: dict[str, str] = {}  # rid -> pd worker
    gens = iter(range(1, 10**9))
    next_rid = iter(range(10**9))
    n_workers = iter(range(2, 10**9))

    def absorb(actions):
        for a in actions:
            if isinstance(a, SendEncode):
                encodes[a.worker_id, a.job.job_id] = a
            elif isinstance(a, SendPrefill):
                running[a.request.rid] = a.worker_id

    for _ in range(1500):
        op = rng.random()
        try:
            if op < 0.25:
                keys = [K(rng.randrange(1, 12)) for _ in range(rng.randrange(0, 4))]
                client = rng.choice([b"c1", b"c1", b"c1", b"c2", b"c3"])  # one sends most
                s.submit(f"r{next(next_rid)}", client, keys, [b"img" + k for k in keys], rng.uniform(1, 8), None)
            elif op < 0.45 and encodes:
                a = encodes.pop(rng.choice(list(encodes)))
                if rng.random() < 0.85:
                    s.on_encoded(a.worker_id, a.job.job_id, ref_for(a.job.key, a.worker_id, "n1", next(gens)))
                else:
                    s.on_encode_failed(a.worker_id, a.job.job_id, rng.choice(["internal", "invalid_input"]), "x")
            elif op < 0.65 and running:
                rid = rng.choice(list(running))
                w = running.pop(rid)
                if rng.random() < 0.8:
                    s.on_tokens(w, rid, finished=True)
                else:
                    req = s.requests.get(rid)
                    stale = [EntryId(k, s.index[k].ref.generation) for k in (req.keys if req else []) if k in s.index]
                    s.on_pd_failed(w, rid, "stale", "overwritten", stale)
            elif op < 0.72 and s.index:
                k = rng.choice(list(s.index))
                e = s.index[k]
                s.on_evicted(e.ref.encoder_id, [EntryId(k, e.ref.generation)])
            elif op < 0.74 and encodes:  # the job's result does not fit in its encoder's ring yet
                a = rng.choice(list(encodes.values()))
                s.on_ring_blocked(a.worker_id, a.job.job_id, 1024)
            elif op < 0.78 and s.requests:
                s.cancel(rng.choice(list(s.requests)))
            elif op < 0.82:
                w = rng.choice([x for x in s.workers if x not in draining] or [None])
                if w is not None:
                    role = s.workers[w].role
                    if rng.random() < 0.5:  # a planned leave: it finishes what it holds first
                        assert s.drain_worker(w)
                        draining[w] = set(s.workers[w].inflight)
                    else:
                        s.remove_worker(w)
                        running = {r: x for r, x in running.items() if x != w}
                        encodes = {j: a for j, a in encodes.items() if a.worker_id != w}
                    s.add_worker(f"{role.value}-{next(n_workers)}", role, "n1", 2)
            else:
                clock.t += rng.uniform(0, 1.5)
                s.expire()
        except (BusyError, InvalidInputError):
            pass
        absorb(s.take_actions())
        for w in [w for w in draining if w in s.workers]:
            assert s.workers[w].inflight.keys() <= draining[w], w  # a draining worker gets nothing new
            if not s.workers[w].inflight:  # done: it says BYE
                s.remove_worker(w, "left")
                absorb(s.take_actions())
        assert s.gauges() == s.gauges_by_scan()
        _check_invariants(s)
    assert s.counters["requests_completed"] > 50 and s.counters["encodes_done"] > 50
    assert s.counters["ring_blocks"] > 0 and (s.counters["pins_reused"] > 0) == (unpin_delay > 0)

    # liveness: with no new requests and every job answered, everything ends and nothing leaks
    for _ in range(200):
        if not (encodes or running or s.requests):
            break
        for a in list(encodes.values()):
            s.on_encoded(a.worker_id, a.job.job_id, ref_for(a.job.key, a.worker_id, "n1", next(gens)))
        encodes.clear()
        for rid, w in list(running.items()):
            s.on_tokens(w, rid, finished=True)
        running.clear()
        clock.t += 1.0
        s.expire()
        absorb(s.take_actions())
        _check_invariants(s)
    assert not s.requests and not s.jobs and not s.users
    assert s.gauges() == s.gauges_by_scan() and s.gauges()["index_pinned"] == 0 and s.queued == 0
    assert all(not w.inflight for w in s.workers.values())


def _check_invariants(s):
    for w in s.workers.values():
        assert len(w.inflight) <= w.capacity, w
    for r in s.requests.values():
        if r.state is ReqState.WAITING:
            assert r.pending and all(k in s.jobs for k in r.pending), r  # something will wake it
        elif r.state is ReqState.READY and r.route == "epd":
            assert not r.pending and all(k in s.index for k in r.keys), r
    for k, e in s.index.items():
        # pinned while a live request needs it (but a full ring's pins that only waiting requests
        # hold are released), and otherwise only while lingering, for at most unpin_delay_s
        users = s.users.get(k)
        lingering = s._lingering.get(k) is e
        if users:
            assert e.pinned or all(s.requests[r].state is ReqState.WAITING for r in users), k
            assert not lingering, k
        else:
            assert e.pinned == lingering, k
            assert not lingering or s.clock() - e.linger_since <= s.cfg.unpin_delay_s, k
    assert all(e is s.index.get(k) for k, e in s._lingering.items())  # no record outlives its entry
    held: dict[bytes, int] = {}
    for r in s.requests.values():
        if r.state in (ReqState.WAITING, ReqState.READY):
            held[r.client] = held.get(r.client, 0) + 1
    assert s.shares.held == held


def test_requeued_request_reencodes_embeddings_dropped_while_it_ran(clock):
    # Found by the randomized gauges test: the encoder holding r1's embedding dies while r1 runs
    # (its entries leave the index, but a running request is not sent back to waiting); then
    # the PD worker fails the read. The request must wait for a new encode, not be dispatched
    # with a missing embedding (which raised KeyError inside dispatch, wedging the ready queue).
    s = make(clock, enc=1, pd=1)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    acts = finish_encode(s, enc, gen=3)
    assert of(acts, SendPrefill) and s.requests["r1"].state is ReqState.RUNNING
    s.remove_worker("enc-0")
    s.add_worker("enc-1", Role.ENCODER, "n1", 4)
    s.take_actions()
    s.on_pd_failed("pd-0", "r1", "stale", "segment gone", [EntryId(K(1), 3)])
    acts = s.take_actions()
    (enc2,) = of(acts, SendEncode)
    assert enc2.worker_id == "enc-1" and s.requests["r1"].state is ReqState.WAITING
    acts = finish_encode(s, enc2, gen=4, node="n1")
    assert of(acts, SendPrefill)[0].refs[0].generation == 4
    assert s.gauges() == s.gauges_by_scan()


def test_requeue_after_dead_pd_waits_for_a_dropped_embedding(clock):
    s = make(clock, enc=1, pd=2, pd_cap=1)
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    prefill = of(finish_encode(s, enc, gen=3), SendPrefill)[0]
    s.remove_worker("enc-0")  # r1's embedding leaves the index while r1 runs
    s.remove_worker(prefill.worker_id)  # then its PD worker dies before streaming
    s.add_worker("enc-1", Role.ENCODER, "n1", 4)
    acts = s.take_actions()
    assert not of(acts, SendPrefill) and len(of(acts, SendEncode)) == 1
    assert s.requests["r1"].state is ReqState.WAITING and s.counters["pd_requeues"] == 1


def test_a_ready_request_missing_an_embedding_waits_instead_of_wedging_dispatch(clock):
    s = make(clock, enc=1, pd=1, pd_cap=1)
    submit(s, "r0", [])  # occupies the only PD slot
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    finish_encode(s, enc, gen=3)
    assert s.requests["r1"].state is ReqState.READY
    s.index.drop(K(1))  # behind the scheduler's back: an inconsistency no event path should cause
    s.on_tokens("pd-0", "r0", finished=True)  # frees the slot: dispatch must not raise
    acts = s.take_actions()
    assert len(of(acts, SendEncode)) == 1 and s.requests["r1"].state is ReqState.WAITING
    assert s.gauges() == s.gauges_by_scan()


def test_draining_pd_finishes_its_requests_and_gets_no_new_ones(clock):
    s = make(clock, pd=2, pd_cap=2)
    first = [of(submit(s, f"r{i}", []), SendPrefill)[0] for i in range(2)]
    on_pd0 = [a.request.rid for a in first if a.worker_id == "pd-0"]
    assert on_pd0 and s.drain_worker("pd-0") and not s.drain_worker("pd-0")  # once
    assert not s.drain_worker("nobody")
    later = [of(submit(s, f"x{i}", []), SendPrefill) for i in range(2)]
    assert [a[0].worker_id for a in later if a] == ["pd-1"]  # pd-1's second slot; then the queue
    assert s.gauges()["requests_ready"] == 1
    for rid in on_pd0:  # what pd-0 holds still completes
        s.on_tokens("pd-0", rid, finished=True)
    assert not of(s.take_actions(), SendPrefill)  # its freed slot is not reused
    assert s.workers["pd-0"].credit == 0 and not s.workers["pd-0"].inflight
    s.remove_worker("pd-0", "left")  # its BYE: nothing to re-queue
    assert not of(s.take_actions(), Fail)
    s.on_tokens("pd-1", later[0][0].request.rid, finished=True)
    assert len(of(s.take_actions(), SendPrefill)) == 1  # the queued one goes to pd-1


def test_draining_encoder_gets_no_jobs_and_its_idle_entries_leave_the_index(clock):
    s = make(clock, enc=2, enc_cap=1)
    e1 = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    e2 = of(submit(s, "r2", [K(2)]), SendEncode)[0]
    assert {e1.worker_id, e2.worker_id} == {"enc-0", "enc-1"}
    mine = e1 if e1.worker_id == "enc-0" else e2
    other = e2 if mine is e1 else e1
    finish_encode(s, mine, gen=5)
    s.on_tokens("pd-0", "r1" if mine is e1 else "r2", finished=True)  # enc-0's entry is unpinned
    s.take_actions()
    assert mine.job.key in s.index
    assert s.drain_worker("enc-0")
    assert mine.job.key not in s.index  # no new request comes to depend on a leaving ring
    acts = submit(s, "r3", [mine.job.key, K(3)])  # a miss now; both jobs wait for enc-1
    assert not of(acts, SendEncode) and s.gauges()["encode_queue"] == 2
    jobs = of(finish_encode(s, other), SendEncode)  # enc-1's credit came back: one of them
    assert [j.worker_id for j in jobs] == ["enc-1"]
    jobs += of(finish_encode(s, jobs[0]), SendEncode)
    assert [j.worker_id for j in jobs] == ["enc-1", "enc-1"]
    assert {j.job.key for j in jobs} == {mine.job.key, K(3)}  # enc-0's old image is encoded again


def test_draining_encoder_keeps_entries_that_requests_hold(clock):
    s = make(clock, enc=1, pd=1, pd_cap=1)
    submit(s, "busy", [])  # occupies the only PD slot: r1 will wait READY with its entry pinned
    enc = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    finish_encode(s, enc, gen=3)
    assert s.requests["r1"].state is ReqState.READY
    s.drain_worker("enc-0")
    assert K(1) in s.index and s.index[K(1)].pinned  # r1 still reads it from enc-0's ring
    s.on_tokens("pd-0", "busy", finished=True)
    acts = s.take_actions()
    assert [a.request.rid for a in of(acts, SendPrefill)] == ["r1"]


def test_an_encode_finished_while_draining_is_cached_only_if_someone_waits(clock):
    s = make(clock, enc=1, enc_cap=2)
    waited = of(submit(s, "r1", [K(1)]), SendEncode)[0]
    orphan = of(submit(s, "r2", [K(2)]), SendEncode)[0]
    s.cancel("r2")  # nobody waits for K(2) any more; its job is already on the encoder
    s.take_actions()
    s.drain_worker("enc-0")
    finish_encode(s, waited)
    assert K(1) in s.index and s.index[K(1)].pinned  # r1 reads it
    acts = finish_encode(s, orphan)
    assert K(2) not in s.index  # not a cache entry on a leaving ring
    assert of(acts, SendUnpin) == [SendUnpin("enc-0", [EntryId(K(2), 1)])]


def ring_sched(clock, ring=8192):
    s = Scheduler(clock=clock)
    s.add_worker("enc-0", Role.ENCODER, "n1", 4, ring)
    s.add_worker("pd-0", Role.PD, "n1", 4)
    return s


def test_a_blocked_ring_releases_pins_that_only_waiting_requests_hold(clock):
    """Two requests, each with one image in the ring and one still to store: a ring full of
    halves. The pins of the other waiting request are released (its entry may be evicted and is
    re-encoded later); the blocked job's own request keeps its pins and gets room."""
    s = ring_sched(clock)
    acts = submit(s, "A", [K(1), K(2)]) + submit(s, "B", [K(3), K(4)])
    jobs = {e.job.key: e for e in of(acts, SendEncode)}
    s.on_encoded("enc-0", jobs[K(1)].job.job_id, ref_for(K(1), nbytes=1024))
    s.on_encoded("enc-0", jobs[K(3)].job.job_id, ref_for(K(3), nbytes=1024))
    s.take_actions()
    s.on_ring_blocked("enc-0", jobs[K(2)].job.job_id, 3000)
    acts = s.take_actions()
    assert of(acts, SendUnpin) == [SendUnpin("enc-0", [EntryId(K(3), 1)])]
    assert not s.index[K(3)].pinned and s.index[K(1)].pinned and s.counters["pins_released"] == 1
    assert s.gauges()["index_pinned"] == 1
    # A's second image lands: A is dispatched with both entries pinned
    s.on_encoded("enc-0", jobs[K(2)].job.job_id, ref_for(K(2), nbytes=3000))
    assert [p.request.rid for p in of(s.take_actions(), SendPrefill)] == ["A"]
    # B's released entry is evicted to make that room: B waits for it again, a new encode
    s.on_evicted("enc-0", [EntryId(K(3), 1)])
    assert [e.job.key for e in of(s.take_actions(), SendEncode)] == [K(3)]
    assert s.requests["B"].state is ReqState.WAITING and s.requests["B"].pending == {K(3), K(4)}


def test_a_released_entry_is_pinned_again_when_its_request_becomes_ready(clock):
    s = ring_sched(clock)
    acts = submit(s, "A", [K(1), K(2)]) + submit(s, "B", [K(3), K(4)])
    jobs = {e.job.key: e for e in of(acts, SendEncode)}
    s.on_encoded("enc-0", jobs[K(3)].job.job_id, ref_for(K(3), nbytes=1024))
    s.on_ring_blocked("enc-0", jobs[K(1)].job.job_id, 1024)
    assert not s.index[K(3)].pinned
    s.take_actions()
    s.on_encoded("enc-0", jobs[K(4)].job.job_id, ref_for(K(4), nbytes=1024))
    acts = s.take_actions()
    assert SendPin("enc-0", [EntryId(K(3), 1)]) in acts and s.index[K(3)].pinned
    assert [p.request.rid for p in of(acts, SendPrefill)] == ["B"]


def test_a_request_whose_images_cannot_share_the_ring_fails_at_once(clock):
    # each image fits; together they never will, while the request holds the first ones
    s = ring_sched(clock, ring=4096)
    acts = submit(s, "A", [K(1), K(2), K(3)])
    submit(s, "C", [K(9)])
    jobs = {e.job.key: e for e in of(acts, SendEncode)}
    s.on_encoded("enc-0", jobs[K(1)].job.job_id, ref_for(K(1), nbytes=1500))
    s.on_encoded("enc-0", jobs[K(2)].job.job_id, ref_for(K(2), nbytes=1500))
    s.take_actions()
    s.on_ring_blocked("enc-0", jobs[K(3)].job.job_id, 1500)
    (fail,) = of(s.take_actions(), Fail)
    assert fail.rid == "A" and isinstance(fail.error, RingFullError) and "4800 bytes at once" in fail.error.message
    assert "A" not in s.requests and s.workers["enc-0"].credit >= 1  # the slot is free for C


def test_requests_sharing_an_image_are_measured_on_their_own_images_when_the_ring_is_blocked(clock):
    """A = [U1, H], C = [U2, H]: each needs two entries of a ring that holds three, so each fits,
    though not both with H. The oldest (A) keeps its pins and gets the room; C's pin is released
    (its image may be evicted and encoded again); neither is told its images can never fit."""
    s = ring_sched(clock, ring=3200)
    acts = submit(s, "A", [K(1), K(9)]) + submit(s, "C", [K(2), K(9)])
    jobs = {e.job.key: e for e in of(acts, SendEncode)}
    s.on_encoded("enc-0", jobs[K(1)].job.job_id, ref_for(K(1), nbytes=1000))
    s.on_encoded("enc-0", jobs[K(2)].job.job_id, ref_for(K(2), nbytes=1000))
    s.take_actions()
    s.on_ring_blocked("enc-0", jobs[K(9)].job.job_id, 1000)
    acts = s.take_actions()
    assert not of(acts, Fail) and set(s.requests) == {"A", "C"}
    assert of(acts, SendUnpin) == [SendUnpin("enc-0", [EntryId(K(2), 1)])]
    assert s.index[K(1)].pinned and not s.index[K(2)].pinned
    # H lands (U2 evicted for it): A runs, C waits for U2 again
    s.on_evicted("enc-0", [EntryId(K(2), 1)])
    s.on_encoded("enc-0", jobs[K(9)].job.job_id, ref_for(K(9), nbytes=1000))
    acts = s.take_actions()
    assert [p.request.rid for p in of(acts, SendPrefill)] == ["A"]
    assert s.requests["C"].state is ReqState.WAITING and s.requests["C"].pending == {K(2)}


def test_only_the_request_that_cannot_fit_fails_when_others_share_the_blocked_image(clock):
    # B's own images and H can never share the ring; A's can: B fails alone, A keeps going
    s = ring_sched(clock, ring=4096)
    acts = submit(s, "A", [K(9)]) + submit(s, "B", [K(1), K(2), K(9)])
    jobs = {e.job.key: e for e in of(acts, SendEncode)}
    s.on_encoded("enc-0", jobs[K(1)].job.job_id, ref_for(K(1), nbytes=1500))
    s.on_encoded("enc-0", jobs[K(2)].job.job_id, ref_for(K(2), nbytes=1500))
    s.take_actions()
    s.on_ring_blocked("enc-0", jobs[K(9)].job.job_id, 1500)
    acts = s.take_actions()
    assert [(f.rid, type(f.error)) for f in of(acts, Fail)] == [("B", RingFullError)]
    assert "A" in s.requests and s.jobs[K(9)].worker == "enc-0"  # the encode goes on, for A
    assert of(acts, SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 1), EntryId(K(2), 1)])]
    s.on_encoded("enc-0", jobs[K(9)].job.job_id, ref_for(K(9), nbytes=1500))
    assert [p.request.rid for p in of(s.take_actions(), SendPrefill)] == ["A"]


def test_a_failed_re_encode_fails_only_the_requests_waiting_for_it(clock):
    """r1 runs on an embedding of K1 whose encoder is gone since; r2 sends the same image and
    its encode fails: r2 fails, r1 (bytes copied long ago) keeps streaming."""
    s = make(clock)
    finish_encode(s, of(submit(s, "r1", [K(1)]), SendEncode)[0], gen=3)
    s.on_tokens("pd-0", "r1", finished=False)
    s.remove_worker("enc-0", "lost")
    s.add_worker("enc-1", Role.ENCODER, "n1", 4)
    s.take_actions()
    (e2,) = of(submit(s, "r2", [K(1)]), SendEncode)
    s.on_encode_failed("enc-1", e2.job.job_id, "engine", "CUDA out of memory")
    acts = s.take_actions()
    assert [f.rid for f in of(acts, Fail)] == ["r2"] and not of(acts, SendAbort)
    assert s.requests["r1"].state is ReqState.RUNNING


def test_a_blocked_re_encode_never_counts_a_running_request_as_waiting_for_it(clock):
    # r1 runs holding K2; r3's stale read of K1 makes a re-encode that r2 joins; the ring (K2 of
    # r1, K3 of r2) has no room for K1 until r1 ends: r2 keeps its pin and waits, nobody fails
    s = ring_sched(clock, ring=3200)
    gen = iter(range(10, 100))

    def enc(acts, keys=None):
        for a in of(acts, SendEncode):
            if keys is None or a.job.key in keys:
                s.on_encoded(a.worker_id, a.job.job_id, ref_for(a.job.key, a.worker_id, gen=next(gen), nbytes=1000))
        return s.take_actions()

    enc(submit(s, "r1", [K(1), K(2)]))
    s.on_tokens("pd-0", "r1", finished=False)
    s.take_actions()
    submit(s, "r3", [K(1)])
    s.on_pd_failed("pd-0", "r3", "stale", "overwritten", [EntryId(K(1), s.index[K(1)].ref.generation)])
    (j1,) = [a for a in of(s.take_actions(), SendEncode) if a.job.key == K(1)]
    enc(submit(s, "r2", [K(1), K(3)]), {K(3)})
    s.on_ring_blocked("enc-0", j1.job.job_id, 1000)
    acts = s.take_actions()
    assert not of(acts, Fail) and not of(acts, SendAbort)
    assert {r: q.state for r, q in s.requests.items()} == {
        "r1": ReqState.RUNNING, "r3": ReqState.WAITING, "r2": ReqState.WAITING,
    }  # fmt: skip
    assert s.index[K(3)].pinned  # r2's own entry, kept beside the one it waits for


def test_a_pin_lingers_and_the_unpins_of_many_requests_leave_together(clock):
    s = make(clock, unpin_delay_s=0.05)
    encs = of(submit(s, "r1", [K(1)]) + submit(s, "r2", [K(2)]), SendEncode)
    for e in encs:
        finish_encode(s, e, gen=4)
    s.on_tokens("pd-0", "r1", finished=True)
    clock.t += 0.03
    s.on_tokens("pd-0", "r2", finished=True)
    assert not of(s.take_actions(), SendUnpin) and s.gauges()["index_pinned"] == 2
    assert s.expire() == pytest.approx(clock.t - 0.03 + 0.05)  # when r1's pin is due
    clock.t += 0.021
    s.expire()
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 4)])]
    clock.t += 0.03
    s.expire()
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(2), 4)])]
    assert s.gauges()["index_pinned"] == 0 and not s._linger_since and not s._lingering
    assert K(1) in s.index and K(2) in s.index  # resident for later hits


def test_an_image_asked_for_again_while_its_pin_lingers_costs_the_encoder_nothing(clock):
    s = make(clock, unpin_delay_s=0.05)
    finish_encode(s, of(submit(s, "r1", [K(1)]), SendEncode)[0], gen=2)
    s.on_tokens("pd-0", "r1", finished=True)
    clock.t += 0.04
    acts = submit(s, "r2", [K(1)])
    assert not of(acts, SendPin) and [p.request.rid for p in of(acts, SendPrefill)] == ["r2"]
    assert s.counters["pins_reused"] == 1
    clock.t += 0.04  # r1's linger would be over: r2 holds the pin now
    s.expire()
    assert not of(s.take_actions(), SendUnpin) and s.index[K(1)].pinned
    s.on_tokens("pd-0", "r2", finished=True)
    clock.t += 0.049
    s.expire()
    assert not of(s.take_actions(), SendUnpin)  # r2's own linger runs from its end
    clock.t += 0.002
    s.expire()
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 2)])]
    # unpinned now: a hit pins it again with a message
    assert of(submit(s, "r3", [K(1)]), SendPin) == [SendPin("enc-0", [EntryId(K(1), 2)])]


def test_a_full_ring_gets_its_lingering_unpins_at_once(clock):
    s = ring_sched(clock)  # the default delay
    assert s.cfg.unpin_delay_s > 0
    acts = submit(s, "A", [K(1)]) + submit(s, "B", [K(2)])
    jobs = {e.job.key: e for e in of(acts, SendEncode)}
    s.on_encoded("enc-0", jobs[K(1)].job.job_id, ref_for(K(1), nbytes=4096))
    s.on_tokens("pd-0", "A", finished=True)
    assert not of(s.take_actions(), SendUnpin)
    s.on_ring_blocked("enc-0", jobs[K(2)].job.job_id, 4096)
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 1)])]
    assert not s.index[K(1)].pinned and s.counters["pins_released"] == 0  # nobody's pin: not a release
    clock.t += 1
    s.expire()
    assert not of(s.take_actions(), SendUnpin)  # nothing left to unpin twice


def test_a_draining_encoder_gets_its_lingering_unpins_at_once_and_later_ones_without_delay(clock):
    s = make(clock, unpin_delay_s=0.05, pd_cap=1)
    finish_encode(s, of(submit(s, "r1", [K(1)]), SendEncode)[0])
    s.on_tokens("pd-0", "r1", finished=True)
    submit(s, "busy", [])
    finish_encode(s, of(submit(s, "r2", [K(2)]), SendEncode)[0])  # READY behind "busy", holding K(2)
    s.take_actions()
    assert s.drain_worker("enc-0")
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 1)])]
    assert K(1) not in s.index and K(2) in s.index  # a leaving ring caches nothing new
    s.on_tokens("pd-0", "busy", finished=True)
    s.on_tokens("pd-0", "r2", finished=True)
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(2), 1)])]  # not lingering


def test_a_lingering_record_of_a_dropped_entry_never_unpins_its_successor_early(clock):
    s = make(clock, unpin_delay_s=0.05)
    finish_encode(s, of(submit(s, "r1", [K(1)]), SendEncode)[0], gen=1)
    s.on_tokens("pd-0", "r1", finished=True)
    s.on_evicted("enc-0", [EntryId(K(1), 1)])  # gone (a confused encoder: it was pinned)
    finish_encode(s, of(submit(s, "r2", [K(1)]), SendEncode)[0], gen=2)
    s.on_tokens("pd-0", "r2", finished=True)
    clock.t += 0.03
    s.expire()  # r1's record is stale; r2's entry lingers on
    assert not of(s.take_actions(), SendUnpin) and s.index[K(1)].pinned
    clock.t += 0.03
    s.expire()
    assert of(s.take_actions(), SendUnpin) == [SendUnpin("enc-0", [EntryId(K(1), 2)])]


def test_a_hit_on_an_entry_that_replaced_a_lingering_one_pins_it(clock):
    s = make(clock, unpin_delay_s=0.05)
    finish_encode(s, of(submit(s, "r1", [K(1)]), SendEncode)[0], gen=1)
    s.on_tokens("pd-0", "r1", finished=True)  # gen 1 lingers
    s.on_evicted("enc-0", [EntryId(K(1), 1)])
    enc = of(submit(s, "r2", [K(1)]), SendEncode)[0]
    s.cancel("r2")
    s.take_actions()
    finish_encode(s, enc, gen=2)  # nobody waits: resident, unpinned
    assert not s.index[K(1)].pinned
    assert of(submit(s, "r3", [K(1)]), SendPin) == [SendPin("enc-0", [EntryId(K(1), 2)])]
    assert s.counters["pins_reused"] == 0


def test_unpin_delay_is_validated():
    for bad in (-0.1, 61.0, float("nan")):
        with pytest.raises(ValueError, match="unpin_delay_s"):
            SchedulerConfig(unpin_delay_s=bad)


def fail_reads_until_it_fails(s, code: str, message: str) -> tuple[int, Fail]:
    """Every PD read of r1's one image fails with `code` (re-encoded each time) until the request
    fails; returns how many encodes it took and the Fail."""
    acts = submit(s, "r1", [K(1)])
    for gen in range(1, 20):
        (enc,) = of(acts, SendEncode)
        (pre,) = of(finish_encode(s, enc, gen=gen), SendPrefill)
        s.on_pd_failed(pre.worker_id, "r1", code, message, [EntryId(K(1), gen)])
        acts = s.take_actions()
        if of(acts, Fail):
            break
    (fail,) = of(acts, Fail)
    return gen, fail


def test_stale_reads_are_retried_apart_from_pd_attempts_then_fail_as_busy(clock):
    # ring pressure, not a failing worker: a request used to fail with a raw StaleEmbeddingError
    # ("stale", in no table of README) after max_pd_attempts (3) replaced entries
    s = make(clock)
    gen, fail = fail_reads_until_it_fails(s, "stale", "overwritten")
    assert gen == 9 and s.counters["stale_reads"] == 8
    assert isinstance(fail.error, BusyError) and "rings are too small" in fail.error.message


def test_an_encoder_pd_workers_cannot_reach_fails_its_requests_as_worker_lost(clock):
    # a wrong --fetch-advertise used to cost 8 re-encodes of 10 s each, then a BusyError blaming
    # the rings' size, and no warning in the broker's log
    s = make(clock)
    gen, fail = fail_reads_until_it_fails(s, "fetch_failed", "encoder enc-0 at tcp://10.9.9.9:1 did not answer")
    assert gen == 3 and s.counters["fetch_failures"] == 3 and s.counters["stale_reads"] == 0
    assert isinstance(fail.error, WorkerLostError)
    assert "tcp://10.9.9.9:1" in fail.error.message and "--fetch-advertise" in fail.error.message


def test_a_request_the_engine_aborted_is_failed_to_its_client(clock):
    # a PD worker's "cancelled" for a request its client did not cancel (vLLM aborted it) finished
    # it as a cancel: no error went to the client, which waited for its deadline
    s = make(clock)
    acts = submit(s, "r1", [K(1)])
    (enc,) = of(acts, SendEncode)
    (pre,) = of(finish_encode(s, enc, gen=1), SendPrefill)
    s.on_pd_failed(pre.worker_id, "r1", "cancelled", "request aborted", [])
    (fail,) = of(s.take_actions(), Fail)
    assert fail.rid == "r1" and fail.error.code == "engine" and "aborted" in fail.error.message


def test_dead_requests_release_their_queued_images_and_slots_at_once(clock):
    # with no encoder free, jobs of requests that had ended kept their images (past
    # max_held_image_bytes) and their queue slots until an encoder freed up
    s = make(clock)
    (enc,) = of(submit(s, "busy", [K(0)]), SendEncode)  # takes the only encoder slot
    for i in range(1, 3001):
        submit(s, f"r{i}", [i.to_bytes(16, "big")])
        s.cancel(f"r{i}")
    s.take_actions()
    assert s.gauges()["encode_queue"] == 0 and s.held_image_bytes == len(b"img-" + K(0))
    assert all(j.worker is not None for j in s.jobs.values())  # what is left was handed to encoders
    assert all(j.image is None for j in s._encode_queue) and len(s._encode_queue) <= 2 * len(s.jobs) + 1024


def test_a_deadline_the_pd_worker_reports_is_counted(clock):
    s = make(clock)
    (enc,) = of(submit(s, "r1", [K(1)]), SendEncode)
    (pre,) = of(finish_encode(s, enc, gen=1), SendPrefill)
    s.on_pd_failed(pre.worker_id, "r1", "deadline", "deadline passed on the PD worker", [])
    (fail,) = of(s.take_actions(), Fail)
    assert fail.error.code == "deadline" and s.counters["deadline_exceeded"] == 1
