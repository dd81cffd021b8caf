"""Errors of the cluster boundary. Retryable vs permanent is a type."""


class BackendError(Exception):
    """The cluster refused or failed an operation."""


class TemporaryBackendError(BackendError):
    """The API server is unreachable or overloaded; the same call may succeed later (after
    `retry_after` seconds, when the server said how long: a 429's or 503's Retry-After).

    A write that failed this way may have been applied all the same (its response was lost)."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermanentBackendError(BackendError):
    """The request itself is wrong (invalid pod, forbidden, quota exceeded, the name taken);
    a write that failed this way left nothing of its own behind."""


class RefusedError(PermanentBackendError):
    """The API server would not admit the object: forbidden (RBAC, a ResourceQuota, an
    admission webhook's denial) or invalid. `detail` is what it said, for the user."""

    def __init__(self, message: str, *, detail: str) -> None:
        super().__init__(message)
        self.detail = detail
