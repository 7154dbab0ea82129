"""The PD worker's remote fetch against endpoints that do not answer (real ZeroMQ sockets)."""

from __future__ import annotations

import pytest
import zmq

from epdq import protocol as P
from epdq.errors import FetchFailedError, StaleEmbeddingError
from epdq.security import SecurityConfig
from epdq.worker.pd import RemoteFetcher

pytestmark = pytest.mark.timeout(30)


def ref(endpoint: str) -> P.EmbedRef:
    return P.EmbedRef(b"k" * 16, "enc-far", "node-a", "", 0, 16, 1, "float32", [4, 1], [1, 2, 2], endpoint)


@pytest.fixture
def make_fetcher():
    """RemoteFetcher(ctx, **kw) on a context of its own; every one closed at the end."""
    ctx = zmq.Context()
    made: list[RemoteFetcher] = []

    def make(**kw) -> RemoteFetcher:
        made.append(RemoteFetcher(ctx, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()
    ctx.term()


async def test_an_endpoint_nobody_answers_is_a_fetch_failure_naming_it(make_fetcher, unused_tcp_port):
    # it was a plain StaleEmbeddingError naming no endpoint: the broker re-encoded 8 times, then
    # blamed the rings' size
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    with pytest.raises(FetchFailedError, match=f"enc-far at {endpoint} did not answer a fetch within 0.2 s"):
        await make_fetcher(timeout_s=0.2).fetch(ref(endpoint))
    assert issubclass(FetchFailedError, StaleEmbeddingError)  # the request's entries are re-encoded first


async def test_a_link_zeromq_gave_up_is_a_fetch_failure_not_a_traceback(make_fetcher, unused_tcp_port, monkeypatch):
    # after a refused CURVE key ZeroMQ drops the pipe and a send raises EAGAIN: it escaped as a
    # traceback and reached the client as EngineError
    fetcher = make_fetcher(timeout_s=5)
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    ch = fetcher._channel(endpoint)

    def gave_up(*_a, **_k):
        raise zmq.Again()

    monkeypatch.setattr(ch, "send", gave_up)
    with pytest.raises(FetchFailedError, match=f"cannot send a fetch to encoder enc-far at {endpoint}"):
        await fetcher.fetch(ref(endpoint))
    assert endpoint not in fetcher._channels  # the next fetch connects afresh


@pytest.mark.parametrize(
    ("endpoint", "match"),
    [
        # a PD worker without keys given a tcp endpoint off loopback: the ConfigError reached the
        # client as "error (config)", as if its own settings were wrong
        ("tcp://10.1.2.3:7710", "cannot fetch from 'tcp://10.1.2.3:7710'"),
        # an encoder's malformed --fetch-advertise: it was InvalidInputError (HTTP 400, invalid_requests)
        ("udp://somewhere:1", "bad fetch endpoint"),
    ],
)
async def test_an_endpoint_this_worker_cannot_use_fails_the_fetch_not_the_client(make_fetcher, endpoint, match):
    with pytest.raises(FetchFailedError, match=match):
        await make_fetcher(timeout_s=1, security=SecurityConfig(insecure_ok=True)).fetch(ref(endpoint))
