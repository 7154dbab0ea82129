"""The broker's embedding index: which image embeddings are resident in which encoder's ring, and
which of those the broker holds pinned.

Part of the pure scheduling logic (`epdq.scheduler` owns one): no I/O. The index only keeps its
own books (entries by key and by encoder, bytes resident, entries pinned); telling an encoder
that a pin starts or ends is the scheduler's decision, taken from what `pin` and `unpin` return.
An entry leaves when its encoder reports it evicted, when that encoder goes, or when a PD worker
finds it replaced.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, ValuesView
from dataclasses import dataclass

from epdq.protocol import EmbedRef, EntryId


@dataclass(slots=True)
class IndexEntry:
    ref: EmbedRef
    pinned: bool = True  # encoders write new entries pinned
    linger_since: float = 0.0  # when its last request ended, while its pin lingers (Scheduler)

    def entry_id(self) -> EntryId:
        return EntryId(self.ref.key, self.ref.generation)


class EmbedIndex:
    """Resident entries by image key. Read it as a mapping; change it only through `add`, `drop`,
    `pin` and `unpin`, which keep the per-encoder sets and the counts O(1) to read."""

    __slots__ = ("_entries", "_by_encoder", "nbytes", "pinned")

    def __init__(self) -> None:
        self._entries: dict[bytes, IndexEntry] = {}
        # encoder id -> keys resident in its ring, oldest first (a dict, not a set: a lost encoder's
        # images are encoded again in the order they came, not in an order of their hashes)
        self._by_encoder: dict[str, dict[bytes, None]] = {}
        self.nbytes = 0  # embedding bytes resident, over all rings
        self.pinned = 0  # entries pinned

    # -- reading -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: bytes) -> IndexEntry:
        return self._entries[key]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def get(self, key: bytes) -> IndexEntry | None:
        return self._entries.get(key)

    def values(self) -> ValuesView[IndexEntry]:
        return self._entries.values()

    def items(self) -> ItemsView[bytes, IndexEntry]:
        return self._entries.items()

    def keys_of(self, encoder_id: str) -> list[bytes]:
        """The keys of the entries in `encoder_id`'s ring, oldest first (a copy: safe to drop them
        meanwhile)."""
        return list(self._by_encoder.get(encoder_id, ()))

    # -- changing ----------------------------------------------------------------------------------

    def add(self, ref: EmbedRef, pinned: bool) -> IndexEntry:
        """A new resident entry (its key must not be resident)."""
        key = ref.key
        if key in self._entries:
            raise KeyError(f"entry {key.hex()} is already resident")
        entry = self._entries[key] = IndexEntry(ref, pinned)
        self.nbytes += ref.nbytes
        self.pinned += pinned
        owned = self._by_encoder.get(ref.encoder_id)
        if owned is None:
            owned = self._by_encoder[ref.encoder_id] = {}
        owned[key] = None
        return entry

    def drop(self, key: bytes) -> IndexEntry:
        """Forget a resident entry (KeyError if it is not); returns it."""
        entry = self._entries.pop(key)
        self.nbytes -= entry.ref.nbytes
        self.pinned -= entry.pinned
        owned = self._by_encoder.get(entry.ref.encoder_id)
        if owned is not None:
            owned.pop(key, None)
            if not owned:
                del self._by_encoder[entry.ref.encoder_id]
        return entry

    def pin(self, entry: IndexEntry) -> bool:
        """Mark a resident entry pinned; True if it was not (its encoder must be told)."""
        if entry.pinned:
            return False
        entry.pinned = True
        self.pinned += 1
        return True

    def unpin(self, entry: IndexEntry) -> bool:
        """Mark a resident entry unpinned; True if it was pinned (its encoder must be told)."""
        if not entry.pinned:
            return False
        entry.pinned = False
        self.pinned -= 1
        return True
