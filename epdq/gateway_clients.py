"""The HTTP gateway's connections to the broker, and which of its users goes over which.

The broker shares a full request queue among its clients (`epdq.queue_share`), and a client is
one connection. Over a single connection every HTTP user of a gateway was one client: one user
sending faster than the workers serve filled the queue and every other user got 429. So the
gateway spreads its users over up to `share_connections` connections, by the address the HTTP
request came from (`share_by="address"`) or by the request's OpenAI `user` field (`"user"`, the
address where a request names none); a user keeps its connection (the same hash, salted per
process so that nobody can pick names that collide with another's). Users that land on the same
connection share its share; `"none"` keeps one connection for all, as before.

Connections open on first use: an idle gateway holds one.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

SHARE_BY = ("address", "user", "none")
MAX_SHARE_CONNECTIONS = 64
_USER_CHARS = 256  # of a `user` field that are hashed: it is the caller's string, of any length


def check_share(share_by: str, n: int) -> None:
    """ValueError unless (`share_by`, `n`) is a setting `BrokerConnections` takes."""
    if share_by not in SHARE_BY:
        raise ValueError(f"share_by must be one of {', '.join(SHARE_BY)}, not {share_by!r}")
    if not 1 <= n <= MAX_SHARE_CONNECTIONS:
        raise ValueError(f"share_connections must be in [1, {MAX_SHARE_CONNECTIONS}]")


class BrokerConnections:
    """Up to `n` `AsyncClient`s to one broker, made by `factory()` when first needed."""

    def __init__(self, factory: Any, share_by: str, n: int):
        check_share(share_by, n)
        self._factory = factory
        self.share_by = share_by
        self.n = 1 if share_by == "none" else n
        self._salt = secrets.token_bytes(16)
        self._clients: list[Any] = [None] * self.n

    def tenant(self, address: str | None, user: Any) -> str:
        """Whose share a request counts against."""
        if self.share_by == "user" and isinstance(user, str) and user:
            return "u:" + user[:_USER_CHARS]
        return "a:" + (address or "")

    def slot(self, tenant: str) -> int:
        if self.n == 1:
            return 0
        h = hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=8, key=self._salt)
        return int.from_bytes(h.digest(), "little") % self.n

    async def get(self, tenant: str = "") -> Any:
        """The connection for `tenant`, opened now if it is the first request over it."""
        i = self.slot(tenant)
        client = self._clients[i]
        if client is None:
            client = self._factory()
            try:
                await client.connect()  # sets up the socket and pings: it does not wait for the broker
            except BaseException:
                # Kept in its slot, a client whose connect failed (EMFILE, a key file being
                # replaced) was handed to every later request of its users, which all failed with
                # "not connected": the next request makes a new one instead.
                await client.close()
                raise
            if self._clients[i] is not None:  # another request filled the slot while this one awaited
                await client.close()
                return self._clients[i]
            self._clients[i] = client
        return client

    @property
    def open(self) -> int:
        return sum(c is not None for c in self._clients)

    async def close(self) -> None:
        clients, self._clients = [c for c in self._clients if c is not None], [None] * self.n
        for c in clients:
            await c.close()
