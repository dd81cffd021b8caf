"""The book follows the store: every job change another replica commits reaches this one.

Run by `broker.app` as a background task when several replicas share the store (etcd). It
watches `/gpufed/jobs` from the revision after the book's load and applies each change
through `book.JobBook.apply_remote` (under the book's lock, so observers — accounting, the
cancels the leader forwards — see it as they see the replica's own commits), in batches: what
arrived while one batch was applied goes in the next, under one hold of the lock, so a busy
leader whose collaborators queue for the lock never falls behind its followers' submits. This
replica's own writes come back too and are skipped by revision, without being decoded. After a
compaction (CompactedError) the jobs are listed again and the book reconciled with the list.

`sync` is a read barrier: it writes this replica's marker under `/gpufed/jobsync/` (inside the
watched prefix, outside the jobs) and waits until the watch delivers it; etcd delivers events
in revision order, so by then every job change committed before the marker is in the book.
`synced` (`/readyz`, `GET /v1/status`) is set once the first barrier passed, and cleared while
the watch is broken or a barrier does not come back in time (every `check_every` seconds); a
barrier refused because the store is full (etcd's space alarm) leaves it as it was.
The new leader passes a barrier before it decides anything or accepts an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable

from broker.jobs import book
from broker.state import electing, errors, records, store

logger = logging.getLogger(__name__)

TASK = "jobs-watch"
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 2.0
MAX_BATCH = 1000  # watch events applied under one hold of the book's lock


class BookWatch:
    def __init__(
        self,
        jobs: book.JobBook,
        backing: store.Store,
        *,
        replica: str,
        on_error: Callable[[], None] | None = None,
        on_synced: Callable[[bool], None] | None = None,
        check_every: float = 5.0,
        barrier_timeout: float = 5.0,
    ) -> None:
        self.book = jobs
        self.backing = backing
        self.marker = f"{records.SYNC}{replica}"
        self.synced = False
        self.revision = 0  # the latest revision applied (or skipped as the replica's own)
        self.check_every = check_every
        self.barrier_timeout = barrier_timeout
        self.applied = 0  # changes of other replicas applied (tests, logs)
        self._on_error = on_error
        self._on_synced = on_synced
        self._barriers: dict[str, asyncio.Future[None]] = {}
        self._written: dict[str, int] = {}  # barrier token -> the revision of its marker
        self._watching = asyncio.Event()

    def _set_synced(self, synced: bool) -> None:
        if synced != self.synced:
            self.synced = synced
            logger.info("job cache %s", "synced with the store" if synced else "not synced")
            if self._on_synced is not None:
                self._on_synced(synced)

    # ---- the barrier ----------------------------------------------------------------------

    async def sync(self, *, timeout: float | None = None) -> None:
        """Return once every job change committed before the call is in the book;
        TimeoutError if the watch does not get there within `timeout` (default
        `barrier_timeout`), StoreError if the marker cannot be written."""
        limit = timeout or self.barrier_timeout
        if not await electing.wait_event(self._watching, limit):
            raise TimeoutError(f"the jobs watch is not running after {limit:g} s")
        token = secrets.token_hex(8)
        arrived: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers[token] = arrived
        try:
            self._written[token] = await self.backing.put(self.marker, token.encode())
            self._passed(self.revision)  # a relist may have gone past it already
            # not asyncio.wait_for: on Python 3.11 it may swallow a cancellation
            done, _ = await asyncio.wait({arrived}, timeout=limit)
            if not done:
                raise TimeoutError(f"the sync marker did not come back within {limit:g} s")
        finally:
            self._barriers.pop(token, None)
            self._written.pop(token, None)
        with contextlib.suppress(errors.StoreError):
            await self.backing.delete(self.marker)
        self._set_synced(True)

    def _passed(self, revision: int) -> None:
        """Every change up to `revision` is in the book: the barriers written by then pass."""
        for token, written in list(self._written.items()):
            arrived = self._barriers.get(token)
            if written <= revision and arrived is not None and not arrived.done():
                arrived.set_result(None)

    async def check(self) -> None:
        """A barrier every `check_every` seconds, until cancelled: `synced` says whether the
        book keeps up with the store."""
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except errors.StoreFullError as exc:
                # The marker cannot be written, and neither can any job change (etcd refuses
                # every write while its space alarm is raised): a book that was synced stays
                # so, and this replica keeps serving reads. Writes answer 507 meanwhile.
                logger.warning("the job cache cannot check its sync: %s", exc)
            except Exception as exc:
                self._set_synced(False)
                logger.warning("the job cache did not sync: %s", str(exc) or type(exc).__name__)
            await asyncio.sleep(self.check_every if self.synced else 0.5)

    # ---- the watch ------------------------------------------------------------------------

    async def run(self, start_revision: int) -> None:
        """Apply the changes after `start_revision - 1`, until cancelled; relist after a
        compaction; never dies of an error (logged, counted, backed off)."""
        self.revision = start_revision - 1
        delay = BACKOFF_INITIAL
        while True:
            try:
                watch = self.backing.watch(records.FOLLOWED, start_revision=self.revision + 1)
                self._watching.set()
                await self._follow(watch)
                raise errors.TemporaryStoreError("the watch of the jobs ended")
            except asyncio.CancelledError:
                raise
            except errors.CompactedError:
                self._set_synced(False)
                logger.warning("the jobs watch fell behind a compaction: listing them again")
                await self._relist_until_done()
                continue
            except Exception as exc:
                self._watching.clear()
                self._set_synced(False)
                if self._on_error is not None:
                    self._on_error()
                logger.warning("watching the jobs failed, again in %.2f s: %s", delay, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _follow(self, watch: AsyncIterator[store.WatchEvent]) -> None:
        """Apply the watch's events in batches: what arrived while the last batch was applied
        goes in the next, under one hold of the book's lock. A busy leader's collaborators
        queue for that lock all the time; one event per turn would fall behind them."""
        arrived: asyncio.Queue[store.WatchEvent | BaseException | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for event in watch:
                    arrived.put_nowait(event)
                arrived.put_nowait(None)
            except Exception as exc:  # handed over, raised by the applying side
                arrived.put_nowait(exc)

        reader = asyncio.create_task(read(), name="jobs-watch-reader")
        try:
            while True:
                batch = [await arrived.get()]
                while not arrived.empty() and len(batch) < MAX_BATCH:
                    batch.append(arrived.get_nowait())
                events = [e for e in batch if isinstance(e, store.WatchEvent)]
                if events:
                    await self._handle(events)
                ended = next((e for e in batch if not isinstance(e, store.WatchEvent)), False)
                if ended is None:
                    return
                if isinstance(ended, BaseException):
                    raise ended
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _handle(self, events: list[store.WatchEvent]) -> None:
        """Apply a batch of events in revision order; a barrier's marker passes once every
        event before it is applied."""
        todo: list[tuple[store.WatchEvent, str | None]] = []
        pending: set[asyncio.Future[None]] = set()
        for event in events:
            job_id = records.job_id_of(event.key)
            if job_id is not None:
                if event.revision <= self.book.revision_of(job_id):
                    continue  # this replica's own write, applied when it committed
                # the event may be of one of its writes in flight, whose answer is on its way
                pending.update(self.book.writes_in_flight(job_id))
            todo.append((event, job_id))
        if pending:
            await asyncio.wait(pending)
        async with self.book.lock:  # never between a collaborator's draft and its commit
            for event, job_id in todo:
                self.revision = max(self.revision, event.revision)
                if job_id is None:
                    self._marker(event)
                else:
                    self._apply(event, job_id)
        if events:
            self.revision = max(self.revision, events[-1].revision)

    def _marker(self, event: store.WatchEvent) -> None:
        if event.key == self.marker and event.type == store.EventType.PUT:
            arrived = self._barriers.get(event.value.decode(errors="replace"))
            if arrived is not None and not arrived.done():
                arrived.set_result(None)

    def _apply(self, event: store.WatchEvent, job_id: str) -> None:
        if event.type == store.EventType.DELETE:
            self.book.forget(job_id, event.revision)
            return
        if event.revision <= self.book.revision_of(job_id):
            return  # its own commit, which was in flight
        try:
            record = self.book.store.decode(
                event.key,
                event.value,
                known=self.book.get(job_id),
                spec=self.book.spec_of(job_id),
            )
        except ValueError as exc:  # the next load sets it aside
            logger.warning("job record %s does not parse, not applied: %s", event.key, exc)
            return
        if self.book.apply_remote(record, event.revision):
            self.applied += 1

    async def _relist_until_done(self) -> None:
        delay = BACKOFF_INITIAL
        while True:
            try:
                await self._relist()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._on_error is not None:
                    self._on_error()
                logger.warning("listing the jobs again failed, again in %.2f s: %s", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    async def _relist(self) -> None:
        """Reconcile the book with a full list: newer records applied, deleted ones out."""
        stored, revision = await self.book.store.load()
        async with self.book.lock:
            seen = set()
            for entry in stored:
                seen.add(entry.record.id)
                self.book.apply_remote(entry.record, entry.revision)
            for record in list(self.book):
                if record.id not in seen and self.book.revision_of(record.id) <= revision:
                    self.book.forget(record.id, revision + 1)  # deleted by `revision`
        self.revision = revision
        self._passed(revision)
