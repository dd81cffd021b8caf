"""The Store protocol: a versioned key-value store with transactions and watch.

Both implementations (`etcd.EtcdStore`, `sqlite.SqliteStore`) pass the same conformance suite
(`tests/integration/test_store_conformance.py`). Keys and values are strings / bytes; every
write returns the store's new global revision, every entry carries the revision of its last
modification, and every write that depends on a read is a compare-and-swap on that revision.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int


class EventType(StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    key: str
    value: bytes  # empty for DELETE
    revision: int


@dataclass(frozen=True)
class Compare:
    """Holds when `key`'s mod revision equals `mod_revision`; 0 means the key must not exist."""

    key: str
    mod_revision: int


@dataclass(frozen=True)
class Txn:
    """All-or-nothing: if every compare holds, apply every put and delete."""

    compares: Sequence[Compare] = ()
    puts: Sequence[tuple[str, bytes]] = ()
    deletes: Sequence[str] = ()
    lease: int | None = field(default=None)  # attach the puts to this lease (DurableStore)
    # with `lease`: attach only these keys of `puts` (None: every put); the others stay
    # when the lease ends (the election's term counter beside its leased leader key)
    lease_keys: frozenset[str] | None = field(default=None)

    def lease_of(self, key: str) -> int:
        """The lease the put of `key` is attached to (0: none)."""
        if self.lease is None or (self.lease_keys is not None and key not in self.lease_keys):
            return 0
        return self.lease


class Shortcuts:
    """`put` and `delete`, written once over a store's own `commit`."""

    async def commit(self, txn: Txn) -> int:
        raise NotImplementedError

    async def put(self, key: str, value: bytes) -> int:
        return await self.commit(Txn(puts=[(key, value)]))

    async def delete(self, key: str) -> int:
        return await self.commit(Txn(deletes=[key]))


class Store(Protocol):
    async def get(self, key: str) -> Entry | None: ...

    async def list(self, prefix: str) -> tuple[list[Entry], int]:
        """Every entry under `prefix`, sorted by key, and the store revision they were read at."""
        ...

    async def commit(self, txn: Txn) -> int:
        """Apply `txn` atomically and return the new revision; ConflictError if a compare fails.
        Transactions committed together may land at one revision (as one's puts do)."""
        ...

    async def put(self, key: str, value: bytes) -> int: ...

    async def delete(self, key: str) -> int: ...

    def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Events under `prefix` from `start_revision` on, resuming across reconnects.

        Raises CompactedError if `start_revision` is older than the store keeps; the caller
        then lists again and watches from the list's revision + 1.
        """
        ...

    async def close(self) -> None: ...


class DurableStore(Store, Protocol):
    """A Store with leases and compaction: what `opening.open_store` returns.

    Leases carry leader election: `grant_lease` a TTL, attach keys with `Txn(lease=...)`,
    call `keep_alive` from a task of your own every TTL/3, and `revoke_lease` on the way out
    (revoking deletes the keys attached to the lease).
    """

    async def grant_lease(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; returns its id."""
        ...

    async def keep_alive(self, lease: int) -> int:
        """Refresh `lease` once; return its TTL. LeaseExpiredError if it is gone."""
        ...

    async def revoke_lease(self, lease: int) -> None:
        """End `lease` and delete the keys attached to it; a lease already gone is fine."""
        ...

    async def compact(self, revision: int) -> None:
        """Forget the change history before `revision`: watches from earlier revisions fail."""
        ...


def check_txn(txn: Txn) -> None:
    """Raise ValueError for a txn no store accepts: an empty key, or a key written twice."""
    written = [key for key, _ in txn.puts] + list(txn.deletes)
    if any(not key for key in written) or any(not compare.key for compare in txn.compares):
        raise ValueError("store keys must not be empty")
    if len(set(written)) != len(written):
        twice = sorted({key for key in written if written.count(key) > 1})
        raise ValueError(f"a transaction writes these keys more than once: {twice}")
