"""How much one client may take: requests per token (a token bucket), requests in progress
per principal and per client address, and how long it may take to send a body.

`client_middleware` runs first. Served by `broker.http.listening` (as `gpufed broker`
serves), it names the client (the peer, or through a trusted proxy the `X-Forwarded-For`
client: `request.remote` is then that client for every later middleware, the audit log's
and the rate limits' included) and holds its requests in progress to the listener's
`--max-connections-per-client`: one more is 503 with `Retry-After`. The health probes and
the agents' sessions (`listening.EXEMPT_PATHS`) are never counted nor refused; any other
request on a connection admitted into the address's reserve is 503 and the connection is
closed.

`share_middleware` runs after `auth`: a principal (one token, one OIDC user) has at most
`--max-requests-per-principal` requests in progress, open event streams and slow bodies
included; one more is 429 with `Retry-After`. Agents are not counted: their session is
one per cluster. So one token cannot take its address's connections from the others.

`rate_middleware` runs before `auth` (a flood is turned away before its token is looked
up). A request carrying a bearer token takes one from that token's bucket (`--rate-limit
RATE/s`, refilled continuously, holding at most `--rate-burst`); an empty bucket is 429 with
`Retry-After` (whole seconds until a token is back). A request whose credential is refused
(401) takes one from its client address's failure bucket, of the same size: an address
that keeps sending bad tokens faster than the rate is answered 429 on everything until its
bucket refills, so guessing tokens costs the broker no lookups. Requests without a token
(probes, `/openapi.json`) are not limited. Off unless `--rate-limit` is given.

Buckets are kept per token digest (never the token) and address, at most `MAX_BUCKETS` of
each: past that, the full ones (the same as new) are dropped first, then the oldest.

`body_middleware` runs after `auth` (a caller that may not call is refused before its body
matters): a POST, PUT or PATCH body must arrive whole within `--body-timeout` of the
headers, else its handler's read fails, the answer is 408 and the connection is closed.
The header timeout and the connections per address are the listener's
(`broker.http.listening`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import streams, web

from broker.api import errors
from broker.http import auth, listening, problems, roles

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_BUCKETS = 100_000
MAX_REQUESTS_PER_PRINCIPAL = 64
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|sec|second|m|min|minute))?\s*$")


def parse_rate(text: str) -> float:
    """Requests per second from `50/s`, `50`, `600/m` (argparse's type for --rate-limit)."""
    found = _RATE.match(text.lower())
    if found is None or float(found.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a rate: N/s or N/m with N above 0 (50/s, 600/m)")
    per_minute = (found.group(2) or "s").startswith("m")
    return float(found.group(1)) / (60.0 if per_minute else 1.0)


@dataclass
class _Bucket:
    tokens: float
    at: float


class Buckets:
    """Token buckets by key: `rate` a second, at most `burst` held; a new key starts full."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_keys: int = MAX_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _refilled(self, key: str, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._sweep(now)
            bucket = self._buckets[key] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
        return bucket

    def take(self, key: str) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there is."""
        bucket = self._refilled(key, self._clock())
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    def wait(self, key: str) -> float:
        """The seconds until `key` has a token (0.0: it has one now); takes none."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return 0.0
        tokens = min(self.burst, bucket.tokens + (self._clock() - bucket.at) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def _sweep(self, now: float) -> None:
        full = [
            key
            for key, bucket in self._buckets.items()
            if bucket.tokens + (now - bucket.at) * self.rate >= self.burst
        ]
        for key in full:
            del self._buckets[key]
        excess = len(self._buckets) - self.max_keys // 2
        if excess > 0:  # all busy: the oldest go (they come back full: never stricter)
            for key in list(self._buckets)[:excess]:
                del self._buckets[key]


class RateLimiter:
    """The buckets of the broker's tokens and of the addresses refused a credential."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = Buckets(rate, burst)
        self.failures = Buckets(rate, burst)
        self.refused = 0  # requests answered 429, since the start

    def refuse(self, wait: float, *, what: str) -> errors.TooManyRequests:
        self.refused += 1
        seconds = max(1, math.ceil(wait))
        return errors.TooManyRequests(
            f"{what} is over its rate limit ({self.rate:g}/s, bursts of {self.burst:g}); "
            f"retry in {seconds} s",
            headers={"Retry-After": str(seconds)},
        )


class Shares:
    """Requests in progress per principal, at most `per_principal` each."""

    def __init__(self, per_principal: int) -> None:
        self.per_principal = per_principal
        self.in_progress: Counter[auth.Principal] = Counter()
        self.refused = 0


LIMITER = web.AppKey("rate_limiter", RateLimiter)
SHARES = web.AppKey("shares", Shares)
BODY_TIMEOUT = web.AppKey("body_timeout", float)


def install(
    app: web.Application,
    *,
    rate: float | None,
    burst: float | None,
    body_timeout: float | None,
    requests_per_principal: int | None = MAX_REQUESTS_PER_PRINCIPAL,
) -> None:
    """Rate limits (if `rate`: a second, `burst` held, default twice the rate), the requests
    in progress per principal (unless None) and the body read timeout (if given) on `app`'s
    requests; the middlewares read them."""
    if rate is not None:
        app[LIMITER] = RateLimiter(rate, burst if burst is not None else max(2 * rate, 1.0))
    if requests_per_principal is not None:
        app[SHARES] = Shares(requests_per_principal)
    if body_timeout is not None:
        app[BODY_TIMEOUT] = body_timeout


@web.middleware
async def client_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who the client is (through trusted proxies), and its requests in progress capped."""
    cap = request.app.get(listening.CONNECTIONS)
    if cap is None:  # not served by the capped listener (a test client)
        return await handler(request)
    peer = request.remote or "?"
    client = cap.client_of(peer, request.headers.get("X-Forwarded-For"))
    if client != peer:
        request = request.clone(remote=client)
    connection = cap.find(request.transport)
    exempt = request.path in listening.EXEMPT_PATHS
    if not exempt:
        refusal = None
        if connection is not None and connection.reserved:
            refusal = (
                f"client {client} holds {cap.per_address} connections, each with a request in "
                "progress: this one serves health probes and agents only"
            )
        elif cap.requests[client] >= cap.per_address:
            refusal = f"client {client} has {cap.per_address} requests in progress already"
        if refusal is not None:
            cap.refused += 1
            answer = problems.respond(
                errors.Unavailable(refusal, headers={"Retry-After": "1"}), request.path
            )
            if connection is not None and connection.reserved:
                answer.force_close()
            return answer
    cap.begin(connection, client, counted=not exempt)
    try:
        return await handler(request)
    finally:
        cap.end(connection, client, counted=not exempt)


@web.middleware
async def share_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A principal's requests in progress capped (agents' not counted)."""
    shares = request.app.get(SHARES)
    principal = request.get(auth.PRINCIPAL)
    if shares is None or principal is None or principal.role == roles.Role.AGENT:
        return await handler(request)
    held = shares.in_progress[principal]
    if held >= shares.per_principal:
        shares.refused += 1
        raise errors.TooManyRequests(
            f"this token ({principal.describe()}) has {held} requests in progress, its "
            f"most; wait for one to end (close an event stream it does not read)",
            headers={"Retry-After": "1"},
        )
    shares.in_progress[principal] = held + 1
    try:
        return await handler(request)
    finally:
        shares.in_progress[principal] -= 1
        if shares.in_progress[principal] <= 0:
            del shares.in_progress[principal]


def _credential_key(header: str) -> str:
    """The bucket of a credential: its digest, never the credential."""
    return hashlib.sha256(header.strip().encode()).hexdigest()


@web.middleware
async def rate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    limiter = request.app.get(LIMITER)
    if limiter is None:
        return await handler(request)
    address = request.remote or "?"
    header = request.headers.get("Authorization")
    if header:
        failing = limiter.failures.wait(address)
        if failing > 0.0:
            raise limiter.refuse(failing, what=f"client {address} (refused credentials)")
        wait = limiter.tokens.take(_credential_key(header))
        if wait > 0.0:
            raise limiter.refuse(wait, what="this token")
    try:
        return await handler(request)
    except errors.Unauthenticated:
        limiter.failures.take(address)
        raise


class BodyLate(Exception):
    """The request's body did not arrive in time (set on its stream: the handler's read
    raises it)."""


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    timeout = request.app.get(BODY_TIMEOUT)
    if timeout is None or request.method not in BODY_METHODS or not request.body_exists:
        return await handler(request)
    if request.content.is_eof():  # all of it came with the head (a small body): no wait
        return await handler(request)
    # a timer rather than reading the body here: each route reads its own, with its own
    # size limit (a batch's is larger)
    late = BodyLate(f"the request's body did not arrive within {timeout:g} s")
    timer = asyncio.get_running_loop().call_later(timeout, _cut, request.content, late)
    try:
        return await handler(request)
    except BodyLate as exc:
        answer = problems.respond(errors.RequestTimeout(str(exc)), request.path)
        answer.force_close()  # the rest of the body may still come: nothing reads it
        return answer
    finally:
        timer.cancel()


def _cut(content: streams.StreamReader, late: BodyLate) -> None:
    """The body is not all there yet: whoever reads it (or waits for it) gets `late`."""
    if not content.is_eof():
        content.set_exception(late)
