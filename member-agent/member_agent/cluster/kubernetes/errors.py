"""Kubernetes API failures as the cluster boundary's errors: retryable or not is a type.

5xx, 429 (throttled), 408 and connection failures or timeouts are `TemporaryBackendError`,
carrying the server's `Retry-After` (seconds, or an HTTP date) when it sent one; any other 4xx
is `PermanentBackendError`: 403 Forbidden (RBAC, a ResourceQuota, an admission webhook's
denial) and 422 Invalid are `errors.RefusedError` with the server's message, 409 is `Conflict`
(a create's AlreadyExists, an update's stale resourceVersion). The library's exception is
chained. Calls made with `_preload_content=False` (the backend reads raw JSON) return the
aiohttp response without raising, so `check_response` applies the same rule to its status.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from kubernetes_asyncio.client import exceptions as k8s_exceptions

from member_agent.cluster import errors

NOT_FOUND = 404
CONFLICT = 409
GONE = 410
_TEMPORARY_4XX = frozenset({408, 429})
_REFUSED = frozenset({403, 422})
RETRY_AFTER = "Retry-After"


class WatchExpired(errors.TemporaryBackendError):
    """410 Gone: the resourceVersion is too old to resume from; list again."""


class Conflict(errors.PermanentBackendError):
    """409: the object exists already (a create), or changed since it was read (an update)."""


def is_temporary(status: int) -> bool:
    return status >= 500 or status in _TEMPORARY_4XX or status == 0


def retry_after(headers: Mapping[str, str] | None, *, now: float | None = None) -> float | None:
    """The seconds a `Retry-After` header asks to wait (delta-seconds or an HTTP date; None
    when absent or unreadable)."""
    raw = (headers or {}).get(RETRY_AFTER)
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        at = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, at.timestamp() - (time.time() if now is None else now))


def error_for_status(
    status: int, message: str, *, what: str, headers: Mapping[str, str] | None = None
) -> errors.BackendError:
    """The boundary error for an HTTP status of the API server (and its headers)."""
    text = f"{what}: HTTP {status}: {message}" if message else f"{what}: HTTP {status}"
    if status == GONE:
        return WatchExpired(text)
    if is_temporary(status):
        return errors.TemporaryBackendError(text, retry_after=retry_after(headers))
    if status == CONFLICT:
        return Conflict(text)
    if status in _REFUSED:
        return errors.RefusedError(text, detail=message or f"HTTP {status}")
    return errors.PermanentBackendError(text)


def message_of(body: bytes | str | None) -> str:
    """The `message` of a Kubernetes Status body, or the body itself, shortened."""
    if not body:
        return ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])[:300]
    return text[:300]


@asynccontextmanager
async def translating(what: str) -> AsyncIterator[None]:
    """Run API calls, turning the library's and aiohttp's exceptions into BackendErrors."""
    try:
        yield
    except errors.BackendError:
        raise
    except k8s_exceptions.ApiException as exc:
        status = int(exc.status or 0)
        raise error_for_status(
            status,
            message_of(exc.body) or str(exc.reason or ""),
            what=what,
            headers=exc.headers if isinstance(exc.headers, Mapping) else None,
        ) from exc
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise errors.TemporaryBackendError(f"{what}: {type(exc).__name__}: {exc}") from exc


async def check_response(response: aiohttp.ClientResponse, *, what: str) -> None:
    """Raise the boundary error when a raw response is not a success (the body is read)."""
    if response.status < 400:
        return
    body = await response.read()
    raise error_for_status(response.status, message_of(body), what=what, headers=response.headers)


async def read_json(response: aiohttp.ClientResponse, *, what: str) -> Any:
    """The JSON body of a successful raw response; a failed one raises the boundary error."""
    await check_response(response, what=what)
    body = await response.read()
    try:
        return json.loads(body)
    except ValueError as exc:
        raise errors.TemporaryBackendError(f"{what}: the response is not JSON") from exc
