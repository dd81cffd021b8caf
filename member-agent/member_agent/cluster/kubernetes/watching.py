"""List, then watch, one Kubernetes kind for as long as the agent runs.

`ListWatch.relist` lists every object (in pages) and hands them to the sink, which *replaces*
its state with them; `ListWatch.run` then watches from the list's resourceVersion, forever:

- a watch that ends (the server's `timeoutSeconds`, a proxy, a dropped connection) resumes
  from the resourceVersion of the last event or bookmark, so nothing is replayed or missed;
- 410 Gone (that resourceVersion was compacted away) lists again at once: a relist replaces
  the sink's state, so objects deleted meanwhile disappear and nothing is counted twice; a
  list whose `continue` token expires between pages starts over;
- other failures reconnect after an exponential backoff with jitter, reset by a good watch.

kubernetes-asyncio's own `Watch` helper is not used: it resumes a 410 with the same stale
resourceVersion, hides stream ends, and deserializes every event into client models; here the
generated `list_*` call is made with `watch=True, _preload_content=False` and the JSON lines
are read directly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from member_agent.cluster import errors
from member_agent.cluster.kubernetes import errors as k8s_errors

logger = logging.getLogger(__name__)

ListCall = Callable[..., Awaitable[Any]]
RELIST_ATTEMPTS = 3  # lists started over when a page's continue token expired


class Sink(Protocol):
    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        """Everything that exists now (`started`: monotonic time the list was asked for)."""

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED or DELETED."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt n waits initial·factor^(n-1), capped at
    `maximum`, minus up to `jitter` of it at random (so agents do not reconnect in step)."""

    initial: float = 0.5
    maximum: float = 30.0
    factor: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int, *, rng: random.Random) -> float:
        base = min(self.maximum, self.initial * self.factor ** max(attempt - 1, 0))
        return base * (1.0 - self.jitter * rng.random())


class ListWatch:
    """The list+watch loop of one kind (nodes, or pods of all namespaces)."""

    def __init__(
        self,
        kind: str,
        call: ListCall,
        sink: Sink,
        *,
        backoff: Backoff = Backoff(),
        timeout_seconds: int = 300,
        page_size: int = 500,
        rng: random.Random | None = None,
    ) -> None:
        self.kind = kind
        self._call = call
        self._sink = sink
        self._backoff = backoff
        self._timeout = timeout_seconds
        self._page_size = page_size
        self._rng = rng or random.Random()
        self.resource_version: str | None = None
        self.relists = 0
        self.watches = 0

    async def relist(self) -> None:
        """List everything (page by page) and replace the sink's state with it. A `continue`
        token that expired (410: the list's resourceVersion was compacted while paging) starts
        the list over, a few times."""
        for attempt in range(1, RELIST_ATTEMPTS + 1):
            try:
                await self._list()
                return
            except k8s_errors.WatchExpired:
                if attempt == RELIST_ATTEMPTS:
                    raise
                logger.info("list %s: continue token expired (410), listing again", self.kind)

    async def _list(self) -> None:
        started = time.monotonic()
        items: list[dict[str, Any]] = []
        token: str | None = None
        version = ""
        while True:
            kwargs: dict[str, Any] = {"limit": self._page_size}
            if token:
                kwargs["_continue"] = token
            what = f"list {self.kind}"
            async with k8s_errors.translating(what):
                response = await self._call(_preload_content=False, **kwargs)
                async with response:
                    page = await k8s_errors.read_json(response, what=what)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            token = meta.get("continue") or None
            if not token:
                break
        self._sink.replace(items, started=started)
        self.resource_version = version or None
        self.relists += 1
        logger.info("listed %d %s at resourceVersion %s", len(items), self.kind, version)

    async def run(self) -> None:
        """Watch forever from the current resourceVersion (relisting when there is none)."""
        failures = 0
        while True:
            listed = False
            try:
                if self.resource_version is None:
                    await self.relist()
                    listed = True
                began = time.monotonic()
                events = await self._watch_once()
                if not events and time.monotonic() - began < 1.0:
                    # an empty watch that ended at once: do not spin on a broken proxy
                    raise errors.TemporaryBackendError(f"watch {self.kind} ended at once")
                failures = 0
            except k8s_errors.WatchExpired as exc:
                logger.info("watch %s: resourceVersion expired (410), listing again", self.kind)
                self.resource_version = None
                if listed:  # even a fresh list's version expired: back off, do not spin
                    failures += 1
                    await self._pause(exc, failures)
            except errors.BackendError as exc:
                failures += 1
                await self._pause(exc, failures)

    async def _pause(self, exc: Exception, failures: int) -> None:
        delay = self._backoff.delay(failures, rng=self._rng)
        level = logging.WARNING if failures < 5 else logging.ERROR
        logger.log(level, "watch %s failed (%s); again in %.2fs", self.kind, exc, delay)
        await asyncio.sleep(delay)

    async def _watch_once(self) -> int:
        """One watch request; returns the number of events seen when the stream ends."""
        what = f"watch {self.kind}"
        seen = 0
        self.watches += 1
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self._timeout + 60)
        async with k8s_errors.translating(what):
            response = await self._call(
                watch=True,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._timeout,
                _preload_content=False,
                _request_timeout=timeout,
            )
            async with response:
                await k8s_errors.check_response(response, what=what)
                try:
                    async for line in response.content:
                        if line.strip():
                            self._handle(line, what=what)
                            seen += 1
                except TimeoutError:
                    logger.debug("%s: quiet for %ds, resuming", what, self._timeout + 60)
        return seen

    def _handle(self, line: bytes, *, what: str) -> None:
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise errors.TemporaryBackendError(f"{what}: a line is not JSON") from exc
        kind = str(event.get("type", ""))
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = int(obj.get("code") or 500)
            raise k8s_errors.error_for_status(code, str(obj.get("message", "")), what=what)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind != "BOOKMARK":
            try:
                self._sink.apply(kind, obj)
            except Exception:  # one odd object must not stop the watch
                logger.exception("%s: cannot apply a %s event", what, kind)
        if version:
            self.resource_version = str(version)
