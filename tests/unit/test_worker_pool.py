import pytest

from epdq.jobs import Role, WorkerState
from epdq.worker_pool import WorkerPool


def test_round_robin_by_credit_and_slots():
    pool = WorkerPool(locality_scan=8)
    a, b = WorkerState("a", Role.PD, "n0", 2), WorkerState("b", Role.PD, "n1", 1)
    pool.add(a)
    pool.add(b)
    assert pool.count[Role.PD] == 2 and pool.pop_free(Role.ENCODER) is None
    w = pool.pop_free(Role.PD)
    assert w is a
    pool.take_slot(a, "r1")  # back of the line, credit 1 left
    assert pool.pop_free(Role.PD) is b
    pool.take_slot(b, "r2")  # no credit: not listed again
    assert pool.pop_free(Role.PD) is a
    pool.take_slot(a, "r3")
    assert pool.pop_free(Role.PD) is None
    pool.release_slot(b, "r2")
    pool.release_slot(b, "r2")  # twice: listed once
    assert pool.pop_free(Role.PD) is b and pool.pop_free(Role.PD) is None


def test_prefers_a_node_within_the_scan_and_skips_workers_that_left():
    pool = WorkerPool(locality_scan=2)
    for i in range(4):
        pool.add(WorkerState(f"w{i}", Role.PD, f"n{i}", 1))
    assert pool.pop_free(Role.PD, prefer_node="n1").worker_id == "w1"
    assert pool.pop_free(Role.PD, prefer_node="n3").worker_id == "w0"  # n3 lies beyond the scan
    assert pool.remove("w2").worker_id == "w2" and pool.remove("w2") is None
    assert pool.count[Role.PD] == 3
    assert pool.pop_free(Role.PD).worker_id == "w3"  # w2's stale slot is skipped


def test_an_id_is_registered_once():
    pool = WorkerPool(locality_scan=8)
    pool.add(WorkerState("a", Role.ENCODER, "n0", 1))
    with pytest.raises(KeyError):
        pool.add(WorkerState("a", Role.PD, "n0", 1))
    assert pool.count == {Role.ENCODER: 1, Role.PD: 0, Role.BOTH: 0}
