"""New jobs into the book: group commits of submits, and idempotency keys.

`Creation` stores new jobs: submits that arrive together share one transaction (group
commit) in as few transactions as the store's bounds allow, a batch that fails as a whole is
retried one job at a time, and an Idempotency-Key replays its job within the window (for the
same body) or is refused (another body). It owns the submits waiting and the task that
commits them; it is given the book's store, its writes in flight, and how the book reads a
job (`get`, `find`) and takes one in (`apply`), so a job is in the book only once its commit
succeeded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime

from broker.api import jobs, status
from broker.api.errors import IdempotencyKeyReused, TooLarge
from broker.jobs import writes
from broker.state import errors, records


class Creation:
    """Submits into the book, and the idempotency keys that replay them."""

    def __init__(
        self,
        store: records.JobStore,
        in_flight: writes.Writes,
        *,
        get: Callable[[str], status.JobRecord | None],
        find: Callable[[str], Awaitable[status.JobRecord | None]],
        apply: Callable[[records.Encoded, int], None],
        idempotency_window: float,
    ) -> None:
        self.store = store
        self._writes = in_flight
        self._get = get  # the job as the book has it
        self._find = find  # the job from the store, else history
        self._apply = apply  # the book takes in a committed record (and its spec's JSON)
        self.idempotency_window = idempotency_window
        self._creating: list[tuple[records.Encoded, asyncio.Future[status.JobRecord]]] = []
        self._committer: asyncio.Task[None] | None = None

    async def find_idempotent(
        self, tenant: str, key: str, job: jobs.GPUJob
    ) -> status.JobRecord | None:
        """The job `tenant` submitted with Idempotency-Key `key` within the window, to replay;
        IdempotencyKeyReused if it was submitted with another body than `job`. A key past its
        window is forgotten here (compare-and-delete), so the caller makes a new job."""
        entry = await self.store.find_idempotent(tenant, key)
        if entry is None:
            return None
        if self.idempotency_expired(entry, now=status.utcnow()):
            await self.store.forget_idempotent([entry])
            return None
        # the job may come from another replica, not delivered by the watch yet: the store
        record = await self._find(entry.job_id) if entry.job_id is not None else None
        if record is None:
            return None  # a job the store does not have: creating conflicts, and says so
        if entry.digest is not None and entry.digest != records.body_digest(job):
            raise IdempotencyKeyReused(
                f"Idempotency-Key: {key!r} was used for job {record.id} with another body; "
                f"use a new key for a new job (a key is kept {self.idempotency_window:g} s)",
                field="Idempotency-Key",
            )
        return record

    def idempotency_expired(self, entry: records.IdempotencyEntry, *, now: datetime) -> bool:
        """True if `entry` no longer counts: past its window, or naming no job. A key of the
        old format counts from its job's creation (and is kept while the job is unknown)."""
        if entry.job_id is None:
            return True
        created = entry.created
        if created is None:
            record = self._get(entry.job_id)
            if record is None:
                return False
            created = record.created
        return (now - created).total_seconds() >= self.idempotency_window

    async def create(self, record: status.JobRecord) -> status.JobRecord:
        """Store a new job; with an idempotency key already used, return that job instead
        (IdempotencyKeyReused if it was used for another body).

        Submits that arrive together share one transaction (group commit): the first caller
        commits for everyone waiting, each gets its own answer, and a batch that fails as a
        whole is retried one job at a time so one conflict does not fail the others.
        """
        [result] = await self.create_many([record])
        if isinstance(result, Exception):
            raise result
        return result

    async def create_many(
        self, new: Sequence[status.JobRecord]
    ) -> list[status.JobRecord | Exception]:
        """`create` for many jobs at once (a batch submit), each answered on its own, in
        order: the job stored (or its key's job), or what refused it (TooLarge,
        IdempotencyKeyReused, a store error). They join one group commit, in as few
        transactions as the store's bounds allow (`JobStore.batches`: records and bytes).
        Two records with one key: give the second after the first is answered (its
        conflict replays or refuses it), never in the same call."""
        loop = asyncio.get_running_loop()
        waiting: list[asyncio.Future[status.JobRecord] | Exception] = []
        for record in new:
            try:
                encoded = self.store.encode(record)  # TooLarge: no transaction can carry it
            except TooLarge as exc:
                waiting.append(exc)
                continue
            done: asyncio.Future[status.JobRecord] = loop.create_future()
            self._creating.append((encoded, done))
            waiting.append(done)
        if self._creating and (self._committer is None or self._committer.done()):
            # a task of its own: a submitter that goes away does not strand the others
            self._committer = asyncio.create_task(self._drain_creates())
        results: list[status.JobRecord | Exception] = []
        for item in waiting:
            if isinstance(item, Exception):
                results.append(item)
                continue
            try:
                results.append(await item)
            except Exception as exc:  # this job's answer; the others go on
                results.append(exc)
        return results

    async def _drain_creates(self) -> None:
        await asyncio.sleep(0)  # let the submits of this loop turn join the batch
        while self._creating:
            waiting = list(self._creating)
            self._creating.clear()
            futures = dict(zip((id(e) for e, _ in waiting), (f for _, f in waiting), strict=True))
            for group in self.store.batches([e for e, _ in waiting], max_ops=records.CREATE_BATCH):
                await self._create_batch([(item, futures[id(item)]) for item in group])

    async def _create_batch(
        self, batch: list[tuple[records.Encoded, asyncio.Future[status.JobRecord]]]
    ) -> None:
        if len(batch) > 1:
            try:
                revision = await self._writes.run(
                    (item.record.id for item, _ in batch),
                    self.store.create([item for item, _ in batch]),
                )
            except errors.TemporaryStoreError as exc:  # the store did not answer: no one
                for _, done in batch:  # at a time, each waiting out the store again
                    if not done.done():
                        done.set_exception(exc)
                return
            except (errors.StoreError, ValueError):
                pass  # one of them conflicts (or repeats a key): one at a time below
            else:
                for item, done in batch:
                    self._apply(item, revision)
                    if not done.done():
                        done.set_result(item.record)
                return
        for item, done in batch:
            try:
                result = await self._create_one(item)
            except Exception as exc:  # the submitter's answer, raised in its handler
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)

    async def _create_one(self, item: records.Encoded) -> status.JobRecord:
        record = item.record
        try:
            revision = await self._writes.run([record.id], self.store.create([item]))
        except errors.ConflictError:
            if not record.idempotency_key:
                raise
            existing = await self.find_idempotent(record.tenant, record.idempotency_key, record.job)
            if existing is not None:
                return existing
            # the key had expired and is forgotten now: once more (a key naming a job the
            # book cannot read conflicts again, and that is raised)
            revision = await self._writes.run([record.id], self.store.create([item]))
        self._apply(item, revision)
        return record
