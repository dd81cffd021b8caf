"""The broker's job records: an in-memory cache written through to the Store.

Every write is a compare-and-swap on the record's last revision, so two broker replicas (or a
stale task) never overwrite each other's decision. Submission stores the job and its
idempotency key in one transaction: the same key never makes a second job.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from broker.api import status
from broker.state import errors, store

logger = logging.getLogger(__name__)

JOBS = "/gpufed/jobs/"
IDEMPOTENCY = "/gpufed/idempotency/"
CLUSTERS = "/gpufed/clusters/"
MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
CREATE_BATCH = MAX_TXN_OPS // 2  # a job and its idempotency key


def _job_key(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def _idem_key(tenant: str, key: str) -> str:
    digest = hashlib.sha256(f"{tenant}\x00{key}".encode()).hexdigest()
    return f"{IDEMPOTENCY}{digest}"


def _create_compares(record: status.JobRecord) -> list[store.Compare]:
    compares = [store.Compare(_job_key(record.id), 0)]
    if record.idempotency_key:
        compares.append(store.Compare(_idem_key(record.tenant, record.idempotency_key), 0))
    return compares


def _create_puts(record: status.JobRecord) -> list[tuple[str, bytes]]:
    puts = [(_job_key(record.id), _dump(record))]
    if record.idempotency_key:
        puts.append((_idem_key(record.tenant, record.idempotency_key), record.id.encode()))
    return puts


@dataclass
class Cached:
    record: status.JobRecord
    revision: int


def _dump(record: status.JobRecord) -> bytes:
    return record.model_dump_json(by_alias=True).encode()


class JobRecords:
    """All jobs, cached; the store is the source of truth on start."""

    def __init__(
        self, backing: store.Store, *, observe: Callable[[str, float], None] | None = None
    ) -> None:
        self.store = backing
        self._jobs: dict[str, Cached] = {}
        self._observe = observe
        # changed in memory, written by the next flush (group commit)
        self._dirty: dict[str, status.JobRecord] = {}
        # submits waiting for the group commit of new jobs
        self._creating: list[tuple[status.JobRecord, asyncio.Future[status.JobRecord]]] = []
        self._committer: asyncio.Task[None] | None = None

    async def _commit(self, op: str, txn: store.Txn) -> int:
        started = time.perf_counter()
        try:
            return await self.store.commit(txn)
        finally:
            if self._observe is not None:
                self._observe(op, time.perf_counter() - started)

    async def load(self) -> int:
        entries, revision = await self.store.list(JOBS)
        for entry in entries:
            record = status.JobRecord.model_validate_json(entry.value)
            self._jobs[record.id] = Cached(record, entry.mod_revision)
        return revision

    def get(self, job_id: str) -> status.JobRecord | None:
        cached = self._jobs.get(job_id)
        return cached.record if cached else None

    def __iter__(self) -> Iterator[status.JobRecord]:
        return (c.record for c in self._jobs.values())

    def __len__(self) -> int:
        return len(self._jobs)

    async def find_idempotent(self, tenant: str, key: str) -> status.JobRecord | None:
        entry = await self.store.get(_idem_key(tenant, key))
        if entry is None:
            return None
        return self.get(entry.value.decode())

    async def create(self, record: status.JobRecord) -> status.JobRecord:
        """Store a new job; with an idempotency key already used, return that job instead.

        Submits that arrive together share one transaction (group commit): the first caller
        commits for everyone waiting, each gets its own answer, and a batch that fails as a
        whole is retried one job at a time so one conflict does not fail the others.
        """
        done: asyncio.Future[status.JobRecord] = asyncio.get_running_loop().create_future()
        self._creating.append((record, done))
        if self._committer is None or self._committer.done():
            # a task of its own: a submitter that goes away does not strand the others
            self._committer = asyncio.create_task(self._drain_creates())
        return await done

    async def _drain_creates(self) -> None:
        await asyncio.sleep(0)  # let the submits of this loop turn join the batch
        while self._creating:
            batch = self._creating[:CREATE_BATCH]
            del self._creating[:CREATE_BATCH]
            await self._create_batch(batch)

    async def _create_batch(
        self, batch: list[tuple[status.JobRecord, asyncio.Future[status.JobRecord]]]
    ) -> None:
        if len(batch) > 1:
            txn = store.Txn(
                compares=[c for record, _ in batch for c in _create_compares(record)],
                puts=[p for record, _ in batch for p in _create_puts(record)],
            )
            try:
                revision = await self._commit("create", txn)
            except (errors.StoreError, ValueError):
                pass  # one of them conflicts (or repeats a key): one at a time below
            else:
                for record, done in batch:
                    self._jobs[record.id] = Cached(record, revision)
                    if not done.done():
                        done.set_result(record)
                return
        for record, done in batch:
            try:
                result = await self._create_one(record)
            except Exception as exc:  # the submitter's answer, raised in its handler
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)

    async def _create_one(self, record: status.JobRecord) -> status.JobRecord:
        txn = store.Txn(compares=_create_compares(record), puts=_create_puts(record))
        try:
            revision = await self._commit("create", txn)
        except errors.ConflictError:
            if record.idempotency_key:
                existing = await self.find_idempotent(record.tenant, record.idempotency_key)
                if existing is not None:
                    return existing
            raise
        self._jobs[record.id] = Cached(record, revision)
        return record

    async def save(self, record: status.JobRecord) -> None:
        """Write one changed record now (compare-and-swap on its cached revision)."""
        await self.save_many([record])

    def save_soon(self, record: status.JobRecord) -> None:
        """Write a changed record with the next group commit (`flush`).

        For what agents report: a broker that crashes before the flush learns it again from
        the agent's hello, so durability is not lost, and many updates share one transaction.
        """
        self._dirty[record.id] = record

    @property
    def dirty(self) -> int:
        return len(self._dirty)

    async def flush(self) -> None:
        """Write every record changed by `save_soon` since the last flush.

        On a temporary store error the records stay dirty (the cache is ahead of the store)
        and the next flush tries again; on a conflict the cache is refreshed.
        """
        if not self._dirty:
            return
        batch = list(self._dirty.values())
        self._dirty.clear()
        try:
            await self.save_many(batch, refresh=False)
        except errors.ConflictError:
            await self.refresh(r.id for r in batch)
            raise
        except errors.StoreError:
            for record in batch:
                self._dirty.setdefault(record.id, record)
            raise

    async def save_many(self, records: Sequence[status.JobRecord], *, refresh: bool = True) -> None:
        """Write changed records in as few transactions as possible, all-or-nothing per chunk.

        On a store error the cache is refreshed from the store for the records involved (with
        `refresh`) and the error is raised: the caller decides again from fresh state.
        """
        for record in records:
            self._dirty.pop(record.id, None)
        for start in range(0, len(records), MAX_TXN_OPS):
            chunk = records[start : start + MAX_TXN_OPS]
            compares = []
            puts = []
            for record in chunk:
                cached = self._jobs.get(record.id)
                compares.append(
                    store.Compare(_job_key(record.id), cached.revision if cached else 0)
                )
                puts.append((_job_key(record.id), _dump(record)))
            try:
                revision = await self._commit("update", store.Txn(compares=compares, puts=puts))
            except errors.StoreError:
                # the cache holds the changed objects: put it back to what the store has
                if refresh:
                    await self.refresh(r.id for r in chunk)
                raise
            for record in chunk:
                self._jobs[record.id] = Cached(record, revision)

    async def refresh(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            entry = await self.store.get(_job_key(job_id))
            if entry is None:
                self._jobs.pop(job_id, None)
            else:
                record = status.JobRecord.model_validate_json(entry.value)
                self._jobs[job_id] = Cached(record, entry.mod_revision)

    async def next_epoch(self, cluster: str) -> int:
        """Bump and return the session epoch of a cluster (fences stale offers)."""
        key = f"{CLUSTERS}{cluster}/epoch"
        while True:
            entry = await self.store.get(key)
            current = int(entry.value) if entry else 0
            try:
                await self.store.commit(
                    store.Txn(
                        compares=[store.Compare(key, entry.mod_revision if entry else 0)],
                        puts=[(key, str(current + 1).encode())],
                    )
                )
            except errors.ConflictError:
                continue
            return current + 1
