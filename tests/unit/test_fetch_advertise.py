"""Which fetch address an encoder tells PD workers on other nodes (and what it refuses)."""

from __future__ import annotations

import pytest

from epdq.worker.runner import WorkerConfig, advertised_fetch_endpoint


def test_bound_address_is_kept_when_routable():
    assert advertised_fetch_endpoint("tcp://10.1.2.3:7710", "", "tcp://10.1.2.1:7700") == "tcp://10.1.2.3:7710"
    assert advertised_fetch_endpoint("ipc:///tmp/x/fetch", "", "tcp://10.1.2.1:7700") == "ipc:///tmp/x/fetch"


def test_advertise_host_keeps_the_bound_port_and_full_endpoint_replaces_it():
    assert advertised_fetch_endpoint("tcp://0.0.0.0:7710", "enc-a.internal", "tcp://b:7700") == (
        "tcp://enc-a.internal:7710"
    )
    assert advertised_fetch_endpoint("tcp://0.0.0.0:7710", "tcp://203.0.113.9:31710", "tcp://b:7700") == (
        "tcp://203.0.113.9:31710"
    )


def test_wildcard_bind_advertises_the_interface_that_routes_to_the_broker():
    # loopback broker: the route to it is loopback (no packet is sent by a UDP connect)
    assert advertised_fetch_endpoint("tcp://0.0.0.0:7710", "", "tcp://127.0.0.1:7700") == "tcp://127.0.0.1:7710"
    assert advertised_fetch_endpoint("tcp://0.0.0.0:7710", "", "ipc:///tmp/b") == "tcp://127.0.0.1:7710"
    got = advertised_fetch_endpoint("tcp://0.0.0.0:7710", "", "tcp://127.0.0.2:7700")
    assert got.startswith("tcp://127.") and got.endswith(":7710") and "0.0.0.0" not in got


@pytest.mark.parametrize(
    "bad", ["0.0.0.0", "*", "tcp://0.0.0.0:80", "tcp://host", "tcp://host:0", "tcp://host:99999", "a b", "../x", "-x"]
)
def test_bad_advertise_values_are_refused_at_start(bad):
    with pytest.raises(ValueError, match="fetch_advertise"):
        WorkerConfig(role="encoder", engine="noop", fetch_advertise=bad)


def test_good_advertise_values_are_accepted():
    for ok in ("10.0.0.5", "enc-0.epdq.svc.cluster.local", "tcp://10.0.0.5:7710", "[fd00::5]"):
        assert WorkerConfig(role="encoder", engine="noop", fetch_advertise=ok).fetch_advertise == ok
