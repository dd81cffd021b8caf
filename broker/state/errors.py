"""Errors of the store boundary. Retryable vs permanent is a type."""

from __future__ import annotations

from collections.abc import Mapping


class StoreError(Exception):
    """Something broke talking to the store."""


class TemporaryStoreError(StoreError):
    """The store is unreachable or timed out; the same call may succeed later."""


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
