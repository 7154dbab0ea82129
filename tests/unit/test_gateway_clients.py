"""Which broker connection the gateway sends a user's request over (gateway_clients.py)."""

from __future__ import annotations

import pytest

from epdq.gateway_clients import MAX_SHARE_CONNECTIONS, BrokerConnections


class FakeClient:
    def __init__(self) -> None:
        self.connected = self.closed = False

    async def connect(self) -> None:
        self.connected = True

    async def close(self) -> None:
        self.closed = True


def test_settings_are_checked():
    with pytest.raises(ValueError, match="share_by"):
        BrokerConnections(FakeClient, "ip", 8)
    for n in (0, MAX_SHARE_CONNECTIONS + 1):
        with pytest.raises(ValueError, match="share_connections"):
            BrokerConnections(FakeClient, "address", n)
    assert BrokerConnections(FakeClient, "none", 8).n == 1  # one connection for all, as before


def test_whose_share_a_request_counts_against():
    by_user = BrokerConnections(FakeClient, "user", 8)
    assert by_user.tenant("10.0.0.1", "alice") == "u:alice"
    # no user, an empty one, or one that is not a string: the address
    for user in (None, "", 7, ["alice"]):
        assert by_user.tenant("10.0.0.1", user) == "a:10.0.0.1"
    assert by_user.tenant("10.0.0.1", "x" * 10_000) == "u:" + "x" * 256  # the caller's string, bounded
    by_address = BrokerConnections(FakeClient, "address", 8)
    assert by_address.tenant("10.0.0.1", "alice") == by_address.tenant("10.0.0.1", "bob") == "a:10.0.0.1"
    assert by_address.tenant(None, None) == "a:"


def test_users_keep_their_slot_and_spread_over_all():
    conns = BrokerConnections(FakeClient, "address", 8)
    slots = [conns.slot(f"a:10.0.0.{i}") for i in range(200)]
    assert slots == [conns.slot(f"a:10.0.0.{i}") for i in range(200)]  # stable
    assert set(slots) == set(range(8))
    assert all(BrokerConnections(FakeClient, "none", 8).slot(f"a:{i}") == 0 for i in range(20))
    assert conns.slot("u:\ud800") in range(8)  # a lone surrogate from JSON does not break the hash


async def test_connections_open_on_first_use_and_all_close():
    made: list[FakeClient] = []

    def factory() -> FakeClient:
        made.append(FakeClient())
        return made[-1]

    conns = BrokerConnections(factory, "user", 4)
    assert conns.open == 0
    a = await conns.get("u:alice")
    assert a.connected and conns.open == 1 and await conns.get("u:alice") is a
    tenants = [f"u:user-{i}" for i in range(50)]
    for t in tenants:
        assert await conns.get(t) is await conns.get(t)
    assert conns.open == len(made) == len({conns.slot(t) for t in [*tenants, "u:alice"]})
    await conns.close()
    assert all(c.closed for c in made) and conns.open == 0
