"""`ClusterSpec.role_options`: WorkerConfig fields for one role's workers, over `worker_defaults`,
checked before anything starts; an encoder-only field in `worker_defaults` does not break the
other roles."""

from __future__ import annotations

import pytest

from epdq.cluster import Cluster, ClusterSpec


def _spec(tmp_path, **kw) -> ClusterSpec:
    return ClusterSpec(address=f"ipc://{tmp_path}/b.sock", encoders=2, pds=1, both=1,
                       worker_defaults={"engine": "noop"} | kw.pop("defaults", {}), **kw)  # fmt: skip


def test_each_roles_options_reach_only_its_workers(tmp_path):
    spec = _spec(tmp_path, role_options={"encoder": {"capacity": 32, "max_batch": 4}, "pd": {"capacity": 3}})
    by_name = dict(Cluster(spec).worker_configs())
    for name in ("encoder-0", "encoder-1"):
        assert (by_name[name].capacity, by_name[name].max_batch) == (32, 4)
    assert by_name["pd-0"].capacity == 3
    assert by_name["both-0"].capacity == 16 and by_name["both-0"].max_batch == 0
    assert all(c.engine == "noop" for c in by_name.values())  # worker_defaults still apply


def test_a_roles_options_win_over_the_defaults_and_max_batch_there_is_the_encoders(tmp_path):
    spec = _spec(tmp_path, defaults={"capacity": 6, "max_batch": 2}, role_options={"both": {"capacity": 9}})
    by_name = dict(Cluster(spec).worker_configs())
    assert (by_name["encoder-0"].capacity, by_name["encoder-0"].max_batch) == (6, 2)
    assert (by_name["pd-0"].capacity, by_name["pd-0"].max_batch) == (6, 0)
    assert by_name["both-0"].capacity == 9


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("encoder", "role_options must map roles"),
        ({"broker": {}}, "'broker' is not a worker role"),
        ({"encoder": 4}, "role_options for the encoder: a dict of WorkerConfig fields, not int"),
        ({"pd": {"bogus": 1}}, "role_options for the pd: bogus cannot be set per role"),
        ({"pd": {"worker_id": "x", "role": "encoder"}}, "role, worker_id cannot be set per role"),
        ({"pd": {"max_batch": 4}}, "role_options for the pd: max_batch is an encoder's setting"),
        ({"encoder": {"capacity": 2, "max_batch": 4}}, "role_options for the encoder: max_batch (4) cannot exceed"),
        ({"encoder": {"capacity": -1}}, "role_options for the encoder: capacity must be in [0, 4096]"),
    ],
)
def test_bad_role_options_are_refused_before_anything_starts(tmp_path, options, message):
    with pytest.raises(ValueError) as exc:
        _spec(tmp_path, role_options=options)
    assert message in str(exc.value)
