"""Each client's share of the broker's request queue (`--max-queued`).

Alone, a client may fill the whole queue. When the queue is full and a client that holds less
than an equal share asks for room, a client over its share gives up its newest queued request
(which gets BusyError, as if it had come a moment later). So one client sending faster than the
workers serve can no longer lock every other client out with BusyError, and nothing changes
while there is room or a single client. A client is one connection to the broker (the HTTP
gateway spreads its users over several: `epdq.gateway_clients`).
"""

from __future__ import annotations


class QueueShares:
    """How many queued (waiting or ready) requests each client holds."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[bytes, int] = {}

    def add(self, client: bytes) -> None:
        held = self.held
        held[client] = held.get(client, 0) + 1

    def remove(self, client: bytes) -> None:
        held = self.held
        n = held[client] - 1
        if n:
            held[client] = n
        else:
            del held[client]

    def share(self, client: bytes, limit: int) -> int:
        """An equal share of `limit` among the clients holding requests, `client` included."""
        n = len(self.held) + (client not in self.held)
        return max(1, limit // n)

    def over_share(self, client: bytes, limit: int) -> bytes | None:
        """The client that should make room for `client` in a full queue of `limit`: the one
        holding the most, if it holds more than its share while `client` holds less. None: `client`
        is told the queue is full."""
        share = self.share(client, limit)
        if self.held.get(client, 0) >= share:
            return None
        heaviest = max(self.held, key=self.held.__getitem__)
        return heaviest if self.held[heaviest] > share else None
