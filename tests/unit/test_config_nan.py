"""NaN fails every range check of a config: `x <= 0` is False for NaN, so `--timeout nan` used
to pass the broker's check and then made every request fail with a puzzling timeout error."""

from __future__ import annotations

import math

import pytest

from epdq import AsyncClient
from epdq.broker import BrokerConfig
from epdq.scheduler import SchedulerConfig
from epdq.worker.runner import WorkerConfig

NAN = math.nan


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: BrokerConfig(address="ipc:///x/b.sock", default_timeout_s=NAN), "default_timeout_s"),
        (lambda: BrokerConfig(address="ipc:///x/b.sock", max_timeout_s=NAN), "max_timeout_s"),
        (lambda: BrokerConfig(address="ipc:///x/b.sock", client_liveness_s=NAN), "client_liveness_s"),
        (lambda: BrokerConfig(address="ipc:///x/b.sock", encode_lease_s=NAN), "encode_lease_s"),
        (lambda: BrokerConfig(address="ipc:///x/b.sock", busy_retry_after_s=NAN), "busy_retry_after_s"),
        (lambda: SchedulerConfig(encode_lease_s=NAN), "encode_lease_s"),
        (lambda: BrokerConfig(address="ipc:///x/b.sock", unpin_delay_s=NAN), "unpin_delay_s"),
        (lambda: SchedulerConfig(unpin_delay_s=NAN), "unpin_delay_s"),
        (lambda: SchedulerConfig(max_timeout_s=NAN), "max timeout"),
        (lambda: WorkerConfig(role="pd", noop_token_s=NAN), "noop delays"),
        (lambda: AsyncClient("ipc:///x/b.sock", timeout=NAN), "timeout must be a number of seconds"),
        (lambda: AsyncClient("ipc:///x/b.sock", heartbeat_s=math.inf), "heartbeat_s must be a number of seconds"),
    ],
)
def test_nan_is_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_gateway_timeouts_refuse_nan():
    pytest.importorskip("fastapi")
    from epdq.gateway import GatewayConfig

    for kw in ({"request_timeout_s": NAN}, {"remote_timeout_s": NAN}, {"stream_prime_s": NAN}):
        with pytest.raises(ValueError, match="timeout|prime"):
            GatewayConfig("ipc:///x/b.sock", **kw)


async def test_stats_timeout_must_be_a_number():
    from epdq import InvalidInputError

    c = AsyncClient("ipc:///x/b.sock")
    with pytest.raises(InvalidInputError, match="timeout must be a number"):
        await c.stats(timeout=NAN)
