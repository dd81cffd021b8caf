"""`GET /v1/events`: the job changes a caller may see, live, as server-sent events.

What the console's pages follow instead of polling. A `Hub` observes the job book
(`jobs.book.JobBook.observe`: every committed change, this replica's and, through the watch,
the other replicas'); each open stream is a `Subscription` that keeps the ids of the jobs that
changed since it last wrote, if its caller may see them (`auth.Principal.sees`). The stream
wakes on a change, waits `COALESCE_SECONDS` so that a burst becomes one write, and sends each
job once as it is then: a job changing a hundred times in that window costs one event. So a
stream costs O(jobs changed) per window, never O(jobs), and a slow reader never makes the
broker buffer more than one set of ids.

Events (`event:` name, `data:` one line of JSON):

    hello   {"principal": {...}, "coalesceSeconds": ...}  first, on every (re)connect
    job     a job record, as `GET /v1/jobs/{id}` shows it
    resync  {"changed": n}  more than `MAX_BATCH` jobs changed in one window: read the
            list again (`GET /v1/jobs`) rather than take them one by one
    bye     {"reason": ...}  the token is no longer valid (revoked, expired), or the broker
            is shutting down; the stream ends

A comment line every `KEEPALIVE_SECONDS` keeps proxies from closing an idle stream. A reader
that closes its connection frees its stream within `SWEEP_SECONDS` (the hub looks at its
streams' connections that often; one that lost its peer without a close is found by the next
keepalive's write). The token is checked again on every wake-up, as an agent's session is. A
client reconnecting after a break reads the list again: events are not replayed.

Streams are shared fairly (`Hub.subscribe`): a principal (one token, one OIDC user) holds at
most `--max-event-streams-per-principal` (one more is 429), a broker replica at most
`--max-event-streams`, of which the last tenth only go to principals that hold none (503
past it): a token opening streams until refused leaves one for every other tenant and the
admin.

Sent to a browser with `fetch()` and the `Authorization` header (the console does), never
with a token in the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web

from broker.api import errors
from broker.http import auth, keys
from broker.jobs import book
from kits import tasks

COALESCE_SECONDS = 0.25
KEEPALIVE_SECONDS = 15.0
MAX_BATCH = 200
MAX_STREAMS = 500
MAX_STREAMS_PER_PRINCIPAL = 8
SWEEP_SECONDS = 0.25


def _never_gone() -> bool:
    return False


class Subscription:
    """One open stream: the ids of the jobs changed since its last write."""

    def __init__(
        self, principal: auth.Principal, *, gone: Callable[[], bool] = _never_gone
    ) -> None:
        self.principal = principal
        self.changed: set[str] = set()
        self.closed: str | None = None  # why it ends, once it must
        self.gone = gone  # whether its reader closed the connection
        self.left = False  # it did: nothing more is written
        self._wake = asyncio.Event()

    def add(self, job_id: str) -> None:
        self.changed.add(job_id)
        self._wake.set()

    def take(self) -> set[str]:
        taken, self.changed = self.changed, set()
        if self.closed is None:  # a stream told to end stays woken
            self._wake.clear()
        return taken

    def close(self, reason: str, *, left: bool = False) -> None:
        self.closed = reason
        self.left = self.left or left
        self._wake.set()

    async def wait(self, timeout: float) -> bool:
        """Whether something changed (or the stream must end) within `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        return self._wake.is_set()


class Hub:
    """The open streams, fed by one observer of the book; at most `max_streams`, and
    `per_principal` of one principal."""

    def __init__(
        self, *, max_streams: int = MAX_STREAMS, per_principal: int = MAX_STREAMS_PER_PRINCIPAL
    ) -> None:
        self.max_streams = max_streams
        self.per_principal = per_principal
        # the last streams of the replica: for principals that hold none yet
        self.reserve = max_streams // 10
        self.subscriptions: set[Subscription] = set()
        self.held: Counter[auth.Principal] = Counter()
        self._book: book.JobBook | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def attach(self, jobs: book.JobBook) -> None:
        """Observe `jobs` (once: at the first stream)."""
        if self._book is None:
            jobs.observe(self)
            self._book = jobs

    def __call__(self, change: book.Change) -> None:
        record = change.after
        for subscription in self.subscriptions:
            if subscription.principal.sees(record.tenant):
                subscription.add(record.id)

    @contextlib.contextmanager
    def subscribe(
        self, principal: auth.Principal, *, gone: Callable[[], bool] = _never_gone
    ) -> Iterator[Subscription]:
        """A stream of `principal`'s, if its share and the replica's allow one (429: it
        holds its most; 503: the replica's are taken)."""
        held = self.held[principal]
        if held >= self.per_principal:
            raise errors.TooManyRequests(
                f"this token ({principal.describe()}) holds {held} event streams, its most; "
                "close one first",
                headers={"Retry-After": "5"},
            )
        limit = self.max_streams if held == 0 else self.max_streams - self.reserve
        if len(self.subscriptions) >= limit:
            raise errors.Unavailable(
                f"{len(self.subscriptions)} event streams are open on this broker replica"
                + (f" ({self.reserve} kept for callers holding none)" if held else "")
                + "; try again later",
                headers={"Retry-After": "5"},
            )
        subscription = Subscription(principal, gone=gone)
        self.subscriptions.add(subscription)
        self.held[principal] = held + 1
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep(), name="events-sweep")
        try:
            yield subscription
        finally:
            self.subscriptions.discard(subscription)
            self.held[principal] -= 1
            if self.held[principal] <= 0:
                del self.held[principal]

    async def _sweep(self) -> None:
        """End the streams whose reader went away, every SWEEP_SECONDS while any is open."""
        while self.subscriptions:
            await asyncio.sleep(SWEEP_SECONDS)
            for subscription in self.subscriptions:
                if subscription.closed is None and subscription.gone():
                    subscription.close("the reader went away", left=True)

    def close_all(self, reason: str) -> None:
        for subscription in self.subscriptions:
            subscription.close(reason)

    async def stop(self) -> None:
        if self._sweeper is not None:
            await tasks.stop_task(self._sweeper)


HUB = web.AppKey("events_hub", Hub)


def frame(event: str, data: Any) -> bytes:
    """One server-sent event: its name and one line of JSON."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def describe(principal: auth.Principal) -> dict[str, Any]:
    """Who the caller is, as `GET /v1/whoami` and the stream's hello say it."""
    return {
        "role": principal.role.value,
        "tenant": principal.tenant,
        "cluster": principal.cluster,
        "name": principal.name,
        "label": principal.label,
        "description": principal.describe(),
    }


async def _send_changes(
    response: web.StreamResponse, subscription: Subscription, jobs: book.JobBook
) -> None:
    changed = subscription.take()
    if len(changed) > MAX_BATCH:
        await response.write(frame("resync", {"changed": len(changed)}))
        return
    for job_id in sorted(changed):
        record = jobs.get(job_id)
        if record is not None and subscription.principal.sees(record.tenant):
            await response.write(frame("job", record.api_json()))


async def stream(request: web.Request) -> web.StreamResponse:
    principal = auth.caller(request)
    if keys.JOBS not in request.app:
        raise errors.Unavailable("the broker is starting", title="Not ready")
    jobs = request.app[keys.JOBS].book
    hub = request.app[HUB]
    hub.attach(jobs)
    header = request.headers.get("Authorization")
    authenticator = request.app[auth.AUTHENTICATOR]

    def gone() -> bool:
        transport = request.transport  # None once the connection is lost
        return transport is None or transport.is_closing()

    with hub.subscribe(principal, gone=gone) as subscription:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # a proxy in front must not hold the events back
            }
        )
        await response.prepare(request)
        hello = {"principal": describe(principal), "coalesceSeconds": COALESCE_SECONDS}
        with contextlib.suppress(ConnectionError):
            await response.write(frame("hello", hello))
            while True:
                woken = await subscription.wait(KEEPALIVE_SECONDS)
                if subscription.left:
                    break
                if subscription.closed is None and not authenticator.still_names(header, principal):
                    subscription.close("the token is no longer valid")
                if subscription.closed is not None:
                    await response.write(frame("bye", {"reason": subscription.closed}))
                    break
                if not woken:
                    await response.write(b": keepalive\n\n")
                    continue
                await asyncio.sleep(COALESCE_SECONDS)
                await _send_changes(response, subscription, jobs)
    return response


def add_routes(
    app: web.Application,
    *,
    max_streams: int = MAX_STREAMS,
    per_principal: int = MAX_STREAMS_PER_PRINCIPAL,
) -> None:
    hub = app[HUB] = Hub(max_streams=max_streams, per_principal=per_principal)

    async def closing(app: web.Application) -> None:  # before the server waits for handlers
        hub.close_all("the broker is shutting down")

    async def stopping(app: web.Application) -> None:
        await hub.stop()

    app.on_shutdown.append(closing)
    app.on_cleanup.append(stopping)
    app.router.add_get("/v1/events", stream)
