"""Job records in the store: keys, encoding and the compare-and-swap transactions.

No cache here: `broker.jobs.book.JobBook` keeps the records in memory and calls these to
persist its changes. Every update is a compare-and-swap on the revision the book last saw, so
two broker replicas (or a stale task) never overwrite each other's decision. A new job and its
idempotency key are stored in one transaction: the same key never makes a second job.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from broker.api import status
from broker.state import errors, store

logger = logging.getLogger(__name__)

JOBS = "/gpufed/jobs/"
IDEMPOTENCY = "/gpufed/idempotency/"
CLUSTERS = "/gpufed/clusters/"
MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
CREATE_BATCH = MAX_TXN_OPS // 2  # a job and its idempotency key


@dataclass(frozen=True)
class Stored:
    """A record as the store has it, with the revision of its last write."""

    record: status.JobRecord
    revision: int


def job_key(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def idempotency_key(tenant: str, key: str) -> str:
    digest = hashlib.sha256(f"{tenant}\x00{key}".encode()).hexdigest()
    return f"{IDEMPOTENCY}{digest}"


def encode(record: status.JobRecord) -> bytes:
    return record.model_dump_json(by_alias=True).encode()


def chunked(
    items: Sequence[status.JobRecord], size: int = MAX_TXN_OPS
) -> Iterator[Sequence[status.JobRecord]]:
    """Pieces of `items` small enough for one transaction each."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class JobStore:
    """Reads and writes job records; the caller keeps the revisions it compares against."""

    def __init__(
        self, backing: store.Store, *, observe: Callable[[str, float], None] | None = None
    ) -> None:
        self.backing = backing
        self._observe = observe

    async def _commit(self, op: str, txn: store.Txn) -> int:
        started = time.perf_counter()
        try:
            return await self.backing.commit(txn)
        finally:
            if self._observe is not None:
                self._observe(op, time.perf_counter() - started)

    async def load(self) -> tuple[list[Stored], int]:
        """Every job record and the revision they were read at."""
        entries, revision = await self.backing.list(JOBS)
        return [Stored(_decode(e.value), e.mod_revision) for e in entries], revision

    async def get(self, job_id: str) -> Stored | None:
        entry = await self.backing.get(job_key(job_id))
        return Stored(_decode(entry.value), entry.mod_revision) if entry is not None else None

    async def find_idempotent(self, tenant: str, key: str) -> str | None:
        """The id of the job `tenant` submitted with Idempotency-Key `key`, if any."""
        entry = await self.backing.get(idempotency_key(tenant, key))
        return entry.value.decode() if entry is not None else None

    async def create(self, records: Sequence[status.JobRecord]) -> int:
        """Store new jobs (and their idempotency keys) in one transaction, all or nothing.

        ConflictError if one of them exists already or repeats a key in use.
        """
        compares: list[store.Compare] = []
        puts: list[tuple[str, bytes]] = []
        for record in records:
            compares.append(store.Compare(job_key(record.id), 0))
            puts.append((job_key(record.id), encode(record)))
            if record.idempotency_key:
                key = idempotency_key(record.tenant, record.idempotency_key)
                compares.append(store.Compare(key, 0))
                puts.append((key, record.id.encode()))
        return await self._commit("create", store.Txn(compares=compares, puts=puts))

    async def update(self, changes: Sequence[tuple[status.JobRecord, int]]) -> int:
        """Write changed records, each compared with the revision it was read at (0: new);
        all or nothing. At most MAX_TXN_OPS records (see `chunked`)."""
        compares = [store.Compare(job_key(r.id), revision) for r, revision in changes]
        puts = [(job_key(r.id), encode(r)) for r, _ in changes]
        return await self._commit("update", store.Txn(compares=compares, puts=puts))

    async def next_epoch(self, cluster: str) -> int:
        """Bump and return the session epoch of a cluster (fences stale offers)."""
        key = f"{CLUSTERS}{cluster}/epoch"
        while True:
            entry = await self.backing.get(key)
            current = int(entry.value) if entry else 0
            try:
                await self.backing.commit(
                    store.Txn(
                        compares=[store.Compare(key, entry.mod_revision if entry else 0)],
                        puts=[(key, str(current + 1).encode())],
                    )
                )
            except errors.ConflictError:
                continue
            return current + 1


def _decode(value: bytes) -> status.JobRecord:
    return status.JobRecord.model_validate_json(value)
