"""Job records in the store: keys, encoding and the compare-and-swap transactions.

No cache here: `broker.jobs.book.JobBook` keeps the records in memory and calls these to
persist its changes. Every update is a compare-and-swap on the revision the book last saw, so
two broker replicas (or a stale task) never overwrite each other's decision. A new job and its
idempotency key are stored in one transaction: the same key never makes a second job.

An idempotency entry (`/gpufed/idempotency/<sha256 of tenant and key>`) holds JSON: the job's
id, the sha256 of the job's canonical body (`body_digest`) and the job's creation time. Whether
a key still counts (its window) and what a different body means is the book's decision
(`broker.jobs.book`); entries written before digests were kept hold just the job id and decode
with `digest` and `created` None.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.api import errors as api_errors
from broker.api import jobs, status
from broker.state import errors, quarantine, store
from kits import interning, memo, packing, tables

logger = logging.getLogger(__name__)

JOBS = "/gpufed/jobs/"
# a replica's sync marker (`jobs.watching`): under the prefix the book watches
# (`FOLLOWED` covers JOBS and SYNC), never under JOBS, so no load ever reads one
SYNC = "/gpufed/jobsync/"
FOLLOWED = "/gpufed/jobs"
IDEMPOTENCY = "/gpufed/idempotency/"
CLUSTERS = "/gpufed/clusters/"
MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
CREATE_BATCH = MAX_TXN_OPS // 2  # a job and its idempotency key
DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024  # etcd's default --max-request-bytes (1.5 MiB)
REQUEST_HEADROOM = 16 * 1024  # what a transaction's framing and compares add, at most
OP_OVERHEAD = 64  # bytes of framing per compare and put
IDEMPOTENCY_ENTRY_BYTES = 1024  # an idempotency entry with its key and compare, at most
IDEMPOTENCY_WINDOW_SECONDS = 24 * 3600.0  # how long a key replays its job (BrokerSettings)


@dataclass(frozen=True)
class Stored:
    """A record as the store has it, with the revision of its last write."""

    record: status.JobRecord
    revision: int


def job_key(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def job_id_of(key: str) -> str | None:
    """The job id of a job record's key; None for any other key."""
    return key.removeprefix(JOBS) if key.startswith(JOBS) else None


def idempotency_key(tenant: str, key: str) -> str:
    digest = hashlib.sha256(f"{tenant}\x00{key}".encode()).hexdigest()
    return f"{IDEMPOTENCY}{digest}"


@dataclass(frozen=True)
class IdempotencyEntry:
    """An Idempotency-Key as the store has it. `digest` and `created` are None for an entry
    written before they were kept (the body is unknown); `job_id` is None for an entry that
    does not decode (it names no job)."""

    key: str  # the store key
    job_id: str | None
    digest: str | None
    created: datetime | None
    revision: int


def body_digest(job: jobs.GPUJob, *, spec: str | None = None) -> str:
    """sha256 of the job's canonical JSON (by alias, keys sorted, defaults left out): one
    digest for the same job sent as JSON or YAML, in any key order, with its defaults spelt out
    or not — and the same after an upgrade that adds a field with a default. Read from the
    spec's JSON the store's record is written with (`spec`, as `encode_job` writes it, if the
    caller has it; else `_SPECS`), not dumped again: the JSON's values are what
    `model_dump(mode="json")` gives, only their key order may differ, and sorting them is what
    makes the text canonical."""
    written = spec if spec is not None else _SPECS.get(job, encode_job)
    canonical = json.dumps(json.loads(written), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def encode_idempotency(record: status.JobRecord, *, spec: str | None = None) -> bytes:
    value = {
        "job": record.id,
        "digest": body_digest(record.job, spec=spec),
        "created": record.created.isoformat(),
    }
    return json.dumps(value, sort_keys=True).encode()


def decode_idempotency(key: str, value: bytes, revision: int) -> IdempotencyEntry:
    text = value.decode("utf-8", errors="replace").strip()
    if not text.startswith("{"):  # the format before digests: the job id alone
        return IdempotencyEntry(key, text or None, None, None, revision)
    try:
        data = json.loads(text)
        job_id, digest = str(data["job"]), data.get("digest")
        created = datetime.fromisoformat(data["created"]) if data.get("created") else None
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("idempotency entry %s does not decode, ignored: %s", key, exc)
        return IdempotencyEntry(key, None, None, None, revision)
    return IdempotencyEntry(
        key, job_id, str(digest) if digest is not None else None, created, revision
    )


# each job spec's JSON, written once: a record is written at submit, at dispatch and at every
# report, its spec (never changed after submit, shared by every draft) the same each time. For
# writers that do not hold it themselves (the job book holds its jobs' with them)
_SPECS: memo.PerObject[jobs.GPUJob, str] = memo.PerObject()
# each pod template's JSON as the store writes it (`encode_job`), by its full JSON: the jobs
# of one sweep share one template; forgotten wholesale past `MAX_TEMPLATES` kinds
_TEMPLATES: dict[str, str] = {}
MAX_TEMPLATES = 4096


_TOP = {"job", "status"}  # the record's fields written apart (`encode`)


def encode(record: status.JobRecord, *, spec: str | None = None) -> bytes:
    """The stored bytes, without the fields at their defaults: a record of a job that uses no
    newer feature stays readable by the previous release (a rolling upgrade runs both).
    The spec's part is written once per spec (`spec`, as `encode_job` wrote it, if the caller
    holds it; else `_SPECS`), the rest each time. The status is dumped on its own: as a field
    of the record, `exclude_defaults` compared it with a new default status first, a sizeable
    part of encoding a record (it is written `{}` when at its defaults, which reads back the
    same)."""
    top = record.model_dump_json(by_alias=True, exclude_defaults=True, exclude=_TOP)
    state = record.status.model_dump_json(by_alias=True, exclude_defaults=True)
    if spec is None:
        spec = _SPECS.get(record.job, encode_job)
    return f'{top[:-1]},"status":{state},"job":{spec}}}'.encode()


def encode_job(job: jobs.GPUJob) -> str:
    """A job's spec as the store writes it: JSON by alias, without the fields at their
    defaults, its pod templates too (each written once per kind of template)."""
    return job.model_dump_json(
        by_alias=True, exclude_defaults=True, context={jobs.TEMPLATE_JSON: _template_json}
    )


def _template_json(template: jobs.PodTemplate) -> str:
    written = _TEMPLATES.get(template.json)
    if written is None:
        written = template.model().model_dump_json(by_alias=True, exclude_defaults=True)
        tables.remember(_TEMPLATES, template.json, written, limit=MAX_TEMPLATES)
    return written


@dataclass(frozen=True)
class Encoded:
    """A record with its bytes in the store, encoded once, and its spec's part of them (as
    `encode_job` writes it; None: not kept apart)."""

    record: status.JobRecord
    value: bytes
    spec: str | None = None

    @property
    def cost(self) -> int:
        """Bytes it adds to a transaction request (key twice: the compare and the put)."""
        cost = len(self.value) + 2 * len(self.record.id) + 2 * len(JOBS) + OP_OVERHEAD
        if self.record.idempotency_key:  # its entry, written in the same transaction
            cost += IDEMPOTENCY_ENTRY_BYTES
        return cost


def batches(
    items: Sequence[Encoded], *, max_ops: int = MAX_TXN_OPS, max_bytes: int
) -> Iterator[list[Encoded]]:
    """`items` in order, in pieces of at most `max_ops` records and `max_bytes` bytes each
    (a record larger than `max_bytes` alone: the store refuses it, and only it)."""
    batch: list[Encoded] = []
    size = 0
    for item in items:
        if batch and (len(batch) >= max_ops or size + item.cost > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.cost
    if batch:
        yield batch


class JobStore:
    """Reads and writes job records; the caller keeps the revisions it compares against."""

    def __init__(
        self,
        backing: store.Store,
        *,
        observe: Callable[[str, float], None] | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.backing = backing
        self._observe = observe
        # the templates, shapes and gangs of the jobs read and submitted, one of each kind
        self.interning = Interners()
        # what one transaction may carry: the store's request limit less its framing
        self.budget = max(64 * 1024, max_request_bytes - REQUEST_HEADROOM)

    def decode(
        self,
        key: str,
        value: bytes,
        *,
        known: status.JobRecord | None = None,
        spec: str | None = None,
    ) -> status.JobRecord:
        """The record stored under `key` (`decode_record`), its job's parts kept in
        `interning`."""
        return decode_record(key, value, known=known, spec=spec, interning=self.interning)

    def encode(self, record: status.JobRecord, *, spec: str | None = None) -> Encoded:
        """The record's bytes, its spec's part kept apart (`spec` if the caller has it, else
        written now: a new job's, which its holder keeps); TooLarge if it could never be
        committed."""
        if spec is None:
            spec = encode_job(record.job)
        encoded = Encoded(record, encode(record, spec=spec), spec)
        if encoded.cost > self.budget:
            raise api_errors.TooLarge(
                f"the job would take {encoded.cost} bytes in the store, over the "
                f"{self.budget} a transaction may carry (--max-request-bytes)",
                title="Job too large",
            )
        return encoded

    def batches(
        self, items: Sequence[Encoded], *, max_ops: int = MAX_TXN_OPS
    ) -> Iterator[list[Encoded]]:
        return batches(items, max_ops=max_ops, max_bytes=self.budget)

    async def _commit(self, op: str, txn: store.Txn) -> int:
        started = time.perf_counter()
        try:
            return await self.backing.commit(txn)
        finally:
            if self._observe is not None:
                self._observe(op, time.perf_counter() - started)

    async def load(self) -> tuple[list[Stored], int]:
        """Every job record and the revision they were read at. A record that does not parse
        is set aside (`quarantine`), not loaded: one bad record never stops the broker."""
        entries, revision = await self.backing.list(JOBS)
        loaded = []
        for entry in entries:
            try:
                loaded.append(Stored(self.decode(entry.key, entry.value), entry.mod_revision))
            except ValueError as exc:  # pydantic's ValidationError is one
                await quarantine.set_aside(self.backing, entry, exc)
        return loaded, revision

    async def get(self, job_id: str) -> Stored | None:
        """The job as stored; RecordDamagedError if it does not parse (the next load sets it
        aside)."""
        entry = await self.backing.get(job_key(job_id))
        if entry is None:
            return None
        try:
            return Stored(self.decode(entry.key, entry.value), entry.mod_revision)
        except ValueError as exc:
            raise errors.RecordDamagedError(
                f"job record {entry.key} does not parse: {quarantine.describe(exc)}"
            ) from exc

    async def find_idempotent(self, tenant: str, key: str) -> IdempotencyEntry | None:
        """The entry of the Idempotency-Key `key` of `tenant`, if any (expired or not)."""
        entry = await self.backing.get(idempotency_key(tenant, key))
        if entry is None:
            return None
        return decode_idempotency(entry.key, entry.value, entry.mod_revision)

    async def list_idempotent(self, shard: str = "") -> list[IdempotencyEntry]:
        """The idempotency entries whose key digest starts with `shard` (hex digits; "": all).
        The sweep of expired keys reads one shard at a time, a bounded read."""
        entries, _ = await self.backing.list(f"{IDEMPOTENCY}{shard}")
        return [decode_idempotency(e.key, e.value, e.mod_revision) for e in entries]

    async def forget_idempotent(self, entries: Sequence[IdempotencyEntry]) -> int:
        """Delete `entries`, each only if unchanged since read (a key used again meanwhile is
        kept); returns how many were deleted. Store errors other than conflicts are raised."""
        deleted = 0
        for start in range(0, len(entries), MAX_TXN_OPS):
            chunk = entries[start : start + MAX_TXN_OPS]
            try:
                await self._commit("forget", _forgetting(chunk))
            except errors.ConflictError:
                for entry in chunk:  # one of them changed: the others one at a time
                    try:
                        await self._commit("forget", _forgetting([entry]))
                    except errors.ConflictError:
                        continue
                    deleted += 1
            else:
                deleted += len(chunk)
        return deleted

    async def create(self, records: Sequence[Encoded]) -> int:
        """Store new jobs (and their idempotency keys) in one transaction, all or nothing.

        ConflictError if one of them exists already or repeats a key in use.
        """
        compares: list[store.Compare] = []
        puts: list[tuple[str, bytes]] = []
        for item in records:
            record = item.record
            compares.append(store.Compare(job_key(record.id), 0))
            puts.append((job_key(record.id), item.value))
            if record.idempotency_key:
                key = idempotency_key(record.tenant, record.idempotency_key)
                compares.append(store.Compare(key, 0))
                puts.append((key, encode_idempotency(record, spec=item.spec)))
        return await self._commit("create", store.Txn(compares=compares, puts=puts))

    async def update(
        self, changes: Sequence[tuple[Encoded, int]], *, fence: store.Compare | None = None
    ) -> int:
        """Write changed records, each compared with the revision it was read at (0: new);
        all or nothing. One of `batches` at a time. With `fence` (the leader's term,
        `electing`), the transaction holds only while that compare does too."""
        compares = [store.Compare(job_key(e.record.id), revision) for e, revision in changes]
        if fence is not None:
            compares.append(fence)
        puts = [(job_key(e.record.id), e.value) for e, _ in changes]
        return await self._commit("update", store.Txn(compares=compares, puts=puts))

    async def retire(
        self, stored: Sequence[tuple[str, int]], *, fence: store.Compare | None = None
    ) -> list[str]:
        """Delete the records of finished jobs (moved to history), each only if unchanged
        since the revision given; the ids deleted. A job changed meanwhile is kept (for the
        next pass); with `fence`, ConflictError naming the fence key once another term
        began, and nothing more is deleted."""
        deleted: list[str] = []
        room = MAX_TXN_OPS - 1  # the fence is a compare too
        for start in range(0, len(stored), room):
            chunk = stored[start : start + room]
            try:
                await self._commit("retire", _retiring(chunk, fence))
            except errors.ConflictError as exc:
                if fence is not None and fence.key in exc.revisions:
                    raise
                for one in chunk:  # one of them changed: the others one at a time
                    try:
                        await self._commit("retire", _retiring([one], fence))
                    except errors.ConflictError as again:
                        if fence is not None and fence.key in again.revisions:
                            raise
                        continue
                    deleted.append(one[0])
            else:
                deleted.extend(job_id for job_id, _ in chunk)
        return deleted

    async def next_epoch(self, cluster: str, *, fence: store.Compare | None = None) -> int:
        """Bump and return the session epoch of a cluster (fences stale offers); with
        `fence`, only while this replica leads (ConflictError naming the fence key if not)."""
        key = f"{CLUSTERS}{cluster}/epoch"
        while True:
            entry = await self.backing.get(key)
            current = int(entry.value) if entry else 0
            compares = [store.Compare(key, entry.mod_revision if entry else 0)]
            try:
                await self.backing.commit(
                    store.Txn(
                        compares=[*compares, *([fence] if fence is not None else [])],
                        puts=[(key, str(current + 1).encode())],
                    )
                )
            except errors.ConflictError as exc:
                if fence is not None and fence.key in exc.revisions:
                    raise
                continue
            return current + 1


def _retiring(stored: Sequence[tuple[str, int]], fence: store.Compare | None) -> store.Txn:
    compares = [store.Compare(job_key(job_id), revision) for job_id, revision in stored]
    return store.Txn(
        compares=[*compares, *([fence] if fence is not None else [])],
        deletes=[job_key(job_id) for job_id, _ in stored],
    )


def _forgetting(entries: Sequence[IdempotencyEntry]) -> store.Txn:
    return store.Txn(
        compares=[store.Compare(e.key, e.revision) for e in entries],
        deletes=[e.key for e in entries],
    )


def decode_record(
    key: str,
    value: bytes,
    *,
    known: status.JobRecord | None = None,
    spec: str | None = None,
    interning: jobs.Interning | None = None,
) -> status.JobRecord:
    """The job record stored under `key`; ValueError (pydantic's is one) if it does not
    parse or names another job. `known`: the job's record as the reader holds it; a value
    whose spec is the same bytes (a dispatch, a report: the spec never changes after submit)
    shares its GPUJob, not validated again. A follower reads each job's every change, and
    validating the job is most of reading a record. `spec`: `known`'s spec as `encode_job`
    writes it, if the reader holds it. `interning`: where the jobs read keep their templates
    and shapes (`Interners`)."""
    record = _with_known_job(value, known, spec) if known is not None else None
    if record is None:
        context = None if interning is None else {jobs.INTERNING: interning}
        record = status.JobRecord.model_validate_json(value, context=context)
    if job_key(record.id) != key:
        raise ValueError(f"the record's id {record.id!r} does not match its key")
    return record


def _with_known_job(
    value: bytes, known: status.JobRecord, spec: str | None
) -> status.JobRecord | None:
    """`value` read with `known`'s GPUJob, if it ends with that job's spec as `encode` writes
    it (the same bytes: the same spec); None if not (another spec, another writer's format)."""
    if spec is None:
        spec = _SPECS.get(known.job, encode_job)
    tail = f',"job":{spec}}}'.encode()
    if not value.endswith(tail):
        return None
    head = value[: -len(tail)] + b',"job":null}'
    return status.JobRecord.model_validate_json(head, context={status.KNOWN_JOB: known.job})


# the templates, shapes and gangs' tasks of the jobs one book holds, one of each kind
Interners = interning.Interners[jobs.PodTemplate, jobs.PodShape, jobs.Tasks]

# the models a book holds of every live job keep their attributes in their class's one table
# of keys (`packing`): readied now, before the process has made many of them
HELD_MODELS = (
    status.JobRecord,
    status.JobStatus,
    status.PodStatus,
    jobs.GPUJob,
    jobs.ObjectMeta,
    jobs.JobSpec,
    jobs.Task,
)
packing.prime(*HELD_MODELS)
