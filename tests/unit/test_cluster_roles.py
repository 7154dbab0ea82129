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


def test_up_turns_capacity_and_max_batch_into_role_options():
    from cli.main import _role_options

    assert _role_options([], 0) == {}
    assert _role_options(["encoder=32", " pd = 8"], 4) == {"encoder": {"capacity": 32, "max_batch": 4}, "pd": {"capacity": 8}}
    assert _role_options([], 16) == {"encoder": {"max_batch": 16}}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity", "pd"], "--capacity takes ROLE=N (e.g. encoder=32 or pd=8), got 'pd'"),
        (["--capacity", "pd=x"], "--capacity for the pd: a whole number of jobs, at least 1, not 'x'"),
        (["--capacity", "pd=0"], "--capacity for the pd: a whole number of jobs, at least 1, not '0'"),
        (["--capacity", "pd=2", "--capacity", "pd=3"], "--capacity names the pd twice"),
        (["--capacity", "gpu=3"], "worker settings: 'gpu' is not a worker role (encoder, pd, both)"),
        (["--capacity", "encoder=4", "--max-batch", "8"],
         "worker settings for the encoder: --max-batch (8) cannot exceed --capacity (4)"),
        # a message that names its flag already is not given a second pair of dashes ("----cpus")
        (["--cpus", "x"], "--cpus takes ROLE=CPUS (e.g. broker=0 or pd=1-3), got 'x'"),
    ],
)
def test_up_refuses_bad_worker_settings_before_anything_starts(argv, message):
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, ["up", "--address", "ipc:///nonexistent-epdq-dir/b.sock", *argv])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())
    assert message in text and "----" not in text, text
