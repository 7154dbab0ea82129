"""The PD worker's remote fetch against endpoints that do not answer (real ZeroMQ sockets)."""

from __future__ import annotations

import pytest
import zmq

from epdq import protocol as P
from epdq.errors import FetchFailedError, StaleEmbeddingError
from epdq.worker.pd import RemoteFetcher

pytestmark = pytest.mark.timeout(30)


def ref(endpoint: str) -> P.EmbedRef:
    return P.EmbedRef(b"k" * 16, "enc-far", "node-a", "", 0, 16, 1, "float32", [4, 1], [1, 2, 2], endpoint)


async def test_an_endpoint_nobody_answers_is_a_fetch_failure_naming_it(unused_tcp_port):
    # it was a plain StaleEmbeddingError naming no endpoint: the broker re-encoded 8 times, then
    # blamed the rings' size
    ctx = zmq.Context()
    fetcher = RemoteFetcher(ctx, timeout_s=0.2)
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    try:
        with pytest.raises(FetchFailedError, match=f"enc-far at {endpoint} did not answer a fetch within 0.2 s"):
            await fetcher.fetch(ref(endpoint))
    finally:
        fetcher.close()
        ctx.term()
    assert issubclass(FetchFailedError, StaleEmbeddingError)  # the request's entries are re-encoded first


async def test_a_link_zeromq_gave_up_is_a_fetch_failure_not_a_traceback(unused_tcp_port, monkeypatch):
    # after a refused CURVE key ZeroMQ drops the pipe and a send raises EAGAIN: it escaped as a
    # traceback and reached the client as EngineError
    ctx = zmq.Context()
    fetcher = RemoteFetcher(ctx, timeout_s=5)
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    ch = fetcher._channel(endpoint)

    def gave_up(*_a, **_k):
        raise zmq.Again()

    monkeypatch.setattr(ch, "send", gave_up)
    try:
        with pytest.raises(FetchFailedError, match=f"cannot send a fetch to encoder enc-far at {endpoint}"):
            await fetcher.fetch(ref(endpoint))
        assert endpoint not in fetcher._channels  # the next fetch connects afresh
    finally:
        fetcher.close()
        ctx.term()


async def test_a_fetch_endpoint_this_worker_may_not_use_fails_the_fetch_not_the_client():
    # a PD worker without keys given a tcp endpoint off loopback: the ConfigError reached the client
    # as "error (config)", as if its own settings were wrong
    from epdq.security import SecurityConfig

    ctx = zmq.Context()
    fetcher = RemoteFetcher(ctx, timeout_s=1, security=SecurityConfig(insecure_ok=True))
    try:
        with pytest.raises(FetchFailedError, match="cannot fetch from 'tcp://10.1.2.3:7710'"):
            await fetcher.fetch(ref("tcp://10.1.2.3:7710"))
    finally:
        fetcher.close()
        ctx.term()


async def test_a_malformed_advertised_endpoint_fails_the_fetch_not_as_the_clients_input():
    # it was InvalidInputError: HTTP 400 and invalid_requests for an encoder's bad --fetch-advertise
    ctx = zmq.Context()
    fetcher = RemoteFetcher(ctx, timeout_s=1)
    try:
        with pytest.raises(FetchFailedError, match="bad fetch endpoint"):
            await fetcher.fetch(ref("udp://somewhere:1"))
    finally:
        fetcher.close()
        ctx.term()
