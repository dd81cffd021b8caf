"""What went wrong, as every layer of the broker says it: the domain errors.

Code anywhere in the broker raises one of these with a detail a person can act on (and the
field it is about); `broker.http.problems` maps each kind to its HTTP status and a problem
JSON body, in one place. Handlers never pick status codes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class GpufedError(Exception):
    """The base of the domain errors; `title` is the problem's short summary, `problem_type`
    its RFC 9457 `type` (a URI a client may branch on; `about:blank`: the status says it all)."""

    title = "Error"
    problem_type = "about:blank"

    def __init__(
        self,
        detail: str,
        *,
        field: str | None = None,
        title: str | None = None,
        errors: Sequence[Mapping[str, Any]] = (),
        headers: Mapping[str, str] | None = None,
        extensions: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field
        if title is not None:
            self.title = title
        self.errors = [dict(e) for e in errors]
        self.headers = dict(headers or {})
        # members of the problem body beyond the standard ones (RFC 9457 extensions)
        self.extensions = dict(extensions or {})


class Malformed(GpufedError):
    """The request cannot be read at all (not JSON, not UTF-8, a bad header or query)."""

    title = "Malformed request"


class Invalid(GpufedError):
    """The request reads, but what it asks for cannot work (a field is wrong)."""

    title = "Invalid request"


class IdempotencyKeyReused(Invalid):
    """An Idempotency-Key already used, within its window, for a job with another body."""

    title = "idempotency-key-reused"
    problem_type = "urn:gpufed:problem:idempotency-key-reused"


class Unauthenticated(GpufedError):
    """No credentials, or credentials the broker does not know."""

    title = "Unauthorized"


class Forbidden(GpufedError):
    """Who is asking may not do this."""

    title = "Forbidden"


class NotFound(GpufedError):
    """Nothing of that name (or nothing the caller may see)."""

    title = "Not found"


class Conflict(GpufedError):
    """The request contradicts the current state."""

    title = "Conflict"


class NotLeader(Conflict):
    """This broker replica does not lead: agents connect to the leader. The problem body's
    `leader` is the leader's advertise URL (null while none is known); `Retry-After: 1`."""

    title = "Not the leader"
    problem_type = "urn:gpufed:problem:not-leader"

    def __init__(self, detail: str, *, leader: str | None) -> None:
        super().__init__(detail, headers={"Retry-After": "1"}, extensions={"leader": leader})
        self.leader = leader


class TooLarge(GpufedError):
    """The request is larger than the broker takes."""

    title = "Too large"


class TooManyRequests(GpufedError):
    """The caller asks faster than its rate limit; `Retry-After` says when it may again."""

    title = "Too many requests"
    problem_type = "urn:gpufed:problem:rate-limited"


class RequestTimeout(GpufedError):
    """The client took too long to send its request; the connection is closed."""

    title = "Request timeout"


class Unavailable(GpufedError):
    """A part the broker needs does not answer now; the same request may work later."""

    title = "Unavailable"
