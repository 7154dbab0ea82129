"""Addresses are checked before ZeroMQ sees them: it would take tcp://host:70000 as port 4464."""

from __future__ import annotations

import pytest
import zmq

from epdq.errors import ConfigError
from epdq.transport import endpoint_problem, host_port_problem, make_socket


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:7700", "tcp://*:0", "tcp://127.0.0.1:*", "tcp://[::1]:65535", "ipc:///tmp/x/b.sock",
     "ipc://@abstract", "inproc://pipe"],
)  # fmt: skip
def test_good_endpoints(address):
    assert endpoint_problem(address) is None


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:70000", "tcp://127.0.0.1", "tcp://:7700", "tcp://h:-1", "tcp://h:7x", "http://h:80", "ipc://",
     "127.0.0.1:7700", "", 7700, "ipc:///tmp/" + "a" * 120],
)  # fmt: skip
def test_bad_endpoints(address):
    assert endpoint_problem(address)


def test_host_port():
    assert host_port_problem("127.0.0.1:9100", "metrics") is None
    for bad in ("localhost", ":9100", "h:0", "h:65536", "h:x"):
        assert "metrics must be HOST:PORT" in host_port_problem(bad, "metrics")


def test_make_socket_refuses_a_bad_endpoint_and_closes_it():
    ctx = zmq.Context()
    try:
        with pytest.raises(ConfigError, match="port in 0..65535"):
            make_socket(ctx, zmq.DEALER, connect="tcp://127.0.0.1:70000")
        with pytest.raises(ConfigError, match="port in 0..65535"):
            make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:70000")
    finally:
        ctx.term()  # would hang if a socket had been left open


def test_a_503_tells_the_client_nothing_of_the_brokers_address():
    # "broker ipc:///tmp/.../b.sock silent for 5.0s" went to any HTTP client; it stays in the log
    from epdq.chat_request import http_error
    from epdq.errors import BrokerUnavailableError

    err = http_error(BrokerUnavailableError("broker ipc:///tmp/x/b.sock silent for 5.0s"))
    assert err.status == 503 and "ipc://" not in err.message and "ipc:///tmp/x/b.sock" in err.detail


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", True), ("max_tokens", 2.5), ("stream", 1), ("temperature", "0.5"), ("seed", "3")],
)
def test_known_fields_are_strictly_typed(field, value):
    # lax pydantic took `"max_tokens": true` as 1 token, `"stream": 1` as a stream, "0.5" as 0.5
    import json

    from epdq.chat_request import HTTPError, parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(HTTPError) as ei:
        parse_request(json.dumps(body).encode())
    assert ei.value.status == 400 and field in ei.value.message
    ok = parse_request(json.dumps({**body, field: None} if field != "stream" else {**body, field: True}).encode())
    assert ok.model == "m"
