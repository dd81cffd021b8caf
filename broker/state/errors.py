"""Errors of the store boundary. Retryable vs permanent is a type."""


class StoreError(Exception):
    """Something broke talking to the store."""


class TemporaryStoreError(StoreError):
    """The store is unreachable or timed out; the same call may succeed later."""


class ConflictError(StoreError):
    """A compare-and-swap lost: a key's revision was not the expected one."""


class CompactedError(StoreError):
    """A watch asked for a revision the store no longer keeps; resync from a full list."""
