"""Addresses other processes connect to: a worker's broker, `epdq up`'s broker, an encoder's fetch
socket. A wildcard, port 0 or inproc:// there was accepted and then failed with a ZeroMQ traceback
(`epdq worker --broker 'tcp://127.0.0.1:*'`), or waited for ever for a broker it could never find
(`--broker inproc://x`), or was advertised to PD workers that refused it (`--fetch-bind inproc://`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from epdq.cluster import ClusterSpec
from epdq.transport import process_endpoint_problem
from epdq.worker.runner import WorkerConfig

BAD_CONNECT = ["tcp://127.0.0.1:*", "tcp://*:7700", "tcp://127.0.0.1:0", "inproc://x"]


@pytest.mark.parametrize("address", BAD_CONNECT)
def test_a_worker_refuses_a_broker_address_it_cannot_reach(address):
    with pytest.raises(ValueError, match="wildcard|same process"):
        WorkerConfig(role="pd", broker=address)


def test_an_encoder_may_listen_on_a_wildcard_for_fetches_but_not_on_inproc():
    WorkerConfig(role="encoder", broker="tcp://127.0.0.1:7700", fetch_bind="tcp://*:7701")
    with pytest.raises(ValueError, match="same process"):
        WorkerConfig(role="encoder", broker="tcp://127.0.0.1:7700", fetch_bind="inproc://f")


@pytest.mark.parametrize("address", BAD_CONNECT)
def test_up_refuses_a_broker_address_its_workers_cannot_reach(address):
    with pytest.raises(ValueError, match="wildcard|same process"):
        ClusterSpec(address=address)


def test_good_addresses_pass():
    for address in ("tcp://127.0.0.1:7700", "ipc:///tmp/x/b.sock", "tcp://[::1]:7700"):
        assert process_endpoint_problem(address, connect=True) is None


@pytest.mark.parametrize("argv", [
    ["worker", "--role", "pd", "--engine", "noop", "--broker", "tcp://127.0.0.1:*", "--insecure"],
    ["worker", "--role", "pd", "--engine", "noop", "--broker", "inproc://x"],
    ["up", "--address", "tcp://127.0.0.1:*"],
])  # fmt: skip
def test_the_cli_says_so_in_one_line_and_exits_2(argv):
    from cli.main import app

    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and ("wildcard" in r.output or "same process" in r.output)
