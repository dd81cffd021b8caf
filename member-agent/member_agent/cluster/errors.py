"""Errors of the cluster boundary. Retryable vs permanent is a type."""


class BackendError(Exception):
    """The cluster refused or failed an operation."""


class TemporaryBackendError(BackendError):
    """The API server is unreachable or overloaded; the same call may succeed later."""


class PermanentBackendError(BackendError):
    """The request itself is wrong (invalid pod, forbidden, quota exceeded)."""
