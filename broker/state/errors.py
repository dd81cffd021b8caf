"""Errors of the store boundary. Retryable vs permanent is a type."""

from __future__ import annotations

from collections.abc import Mapping


class StoreError(Exception):
    """Something broke talking to the store."""


class TemporaryStoreError(StoreError):
    """The store is unreachable or timed out; the same call may succeed later."""


class StoreFullError(StoreError):
    """The store has no room for the write (SQLite: the disk or its size cap is full).

    Not temporary: the same write fails until an operator frees space. Nothing of the failed
    transaction was written.
    """


class StoreReadOnlyError(StoreError):
    """The store refuses writes (SQLite: the file, its directory or the connection is
    read-only, or the file was moved away under the broker). Not temporary: an operator must
    act. Nothing of the failed transaction was written."""


class StoreDamagedError(StoreError):
    """The store's data is damaged (SQLite: the integrity check failed, or the file is not a
    database); the broker refuses to start on it. Restore from a backup."""


class RecordDamagedError(StoreError):
    """One stored record does not parse. `load` sets such records aside (`quarantine`);
    a single read raises this, naming the key."""


class ConflictError(StoreError):
    """A compare-and-swap lost: a key's revision was not the expected one.

    `revisions` maps each key whose compare failed to its current mod revision (0: absent),
    so the caller can tell "someone else wrote it" from "it was deleted" without a read.
    """

    def __init__(self, message: str = "", *, revisions: Mapping[str, int] | None = None) -> None:
        super().__init__(message)
        self.revisions: dict[str, int] = dict(revisions or {})


class CompactedError(StoreError):
    """A watch asked for a revision the store no longer keeps; resync from a full list."""


class LeaseExpiredError(StoreError):
    """The lease is gone (expired or revoked); the keys attached to it have been deleted."""


class NotLeaderError(ConflictError):
    """A write only the leader makes (a dispatch, what agents report), refused: this replica
    is not the leader, or no longer. Nothing was written; the leader decides it again."""
