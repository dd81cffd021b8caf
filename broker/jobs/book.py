"""The job book: every job the broker knows, as the store has it, with indices.

Changes never touch the book's records in place. A collaborator asks for a `draft` (a copy
of the latest version), changes the copy, and hands it to `commit` (now) or `commit_soon` (the
next group commit); the book writes it to the store with compare-and-swap and applies it only
once that write succeeded. A failed commit leaves the book exactly as it was: the jobs stay
what the store says they are, and the next cycle plans them again.

Applying a change updates the indices (queued, holding GPUs, per cluster) and then tells the
observers (`observe`): telemetry, quota accounting and preemption follow the book this way,
never the other way round. Read by `http/` through `broker.jobs.service.Jobs`.

Idempotency: a key replays its job for `idempotency_window` seconds from the job's creation
(24 h by default), and only for the same body (the digest stored with the key): another body
is `IdempotencyKeyReused` (422). Past the window the key is forgotten and makes a new job;
`expiring.sweep_keys` deletes expired keys in the background. A key stored before digests
were kept replays its job whatever the body, as it always did.

Several replicas (`state.electing`): the leader's commits carry its term's fence, so a deposed
leader's commit fails (and the replica steps down) instead of landing; submits and cancels,
from any replica, are plain compare-and-swap (`fenced=False`). Changes another replica
committed reach the book through `jobs.watching` (`apply_remote`, under the lock, so no
collaborator sees a record change between its draft and its commit); a job the watch has not
delivered yet is read from the store (`fetch`): a submitter reads its own write anywhere.

The lock: collaborators hold it from their draft to their commit, so what they decided on
does not change under them. Two writers let it go for the store's round trip, so that agents'
reports and the scheduler do not wait on it. The group commit (`grouping.GroupCommit`) writes
only drafts of `commit_soon`, which `latest` showed, so whatever a collaborator drafted of
those jobs builds on them. The dispatch drafts under the lock and writes without it (`launch`,
`land`: `launching.Launches`): `latest` shows its drafts while they are written, and a draft
built on one that does not land is refused (ConflictError). A commit of a job waits for this
replica's writes of it in flight (`writes.Writes`: its compare-and-swap is against the
revision they make); a draft given to `commit_soon` meanwhile goes with the next flush;
after a conflict the group commit reads the records again only once the lock is free.

The book owns the records and their indices and the commit that writes and applies them;
its collaborators own the rest, each given what it needs of the book: `Creation` (new jobs,
idempotency keys), `GroupCommit` (drafts waiting, callbacks after commit), `Launches` (drafts
written without the lock), `Writes` (this replica's writes in flight).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from broker.api import gangs, jobs, status
from broker.api.status import JobState
from broker.jobs import aging, creating, grouping, launching, writes
from broker.planning import planning
from broker.state import electing, errors, records
from broker.state.history import held
from broker.state.history import protocol as history_store
from kits import tables

logger = logging.getLogger(__name__)

# states in which a job holds GPUs on a cluster (what quotas count)
HOLDING = frozenset({JobState.DISPATCHED, JobState.RUNNING})
WAITING_KINDS = 4096  # reasons to wait kept one of each, forgotten wholesale past this many


@dataclass(frozen=True)
class Change:
    """One record as it was before a commit and as it is after (`before` None: new)."""

    before: status.JobRecord | None
    after: status.JobRecord
    remote: bool = False  # committed by another replica (or read again after a conflict)

    def new_events(self) -> list[status.JobEvent]:
        seen = len(self.before.status.events) if self.before is not None else 0
        return self.after.status.events[seen:]


Observer = Callable[[Change], None]


@dataclass(frozen=True)
class Waiting:
    """Why a queued job was not placed in the latest cycle (memory only, never stored)."""

    reasons: tuple[str, ...]
    details: tuple[planning.Reason, ...]


class _Entry:
    """A job as the book holds it: the record as committed, the store's revision of it, and
    what is read once off its job object (a job's spec never changes after submit) and kept
    while its records share that object (its drafts do): its gang (`JobBook.gang`) and its
    spec as the store writes it (`records.encode_job`), once known. Slotted: the book holds
    one for every live job."""

    __slots__ = ("gang", "record", "revision", "spec")

    def __init__(self, record: status.JobRecord, revision: int, spec: str | None) -> None:
        self.record = record
        self.revision = revision
        self.gang: gangs.GangRequest | None = None
        self.spec = spec


def _held_spec(entry: _Entry) -> str:
    """The held job's spec as the store writes it, written now if not known yet."""
    if entry.spec is None:
        entry.spec = records.encode_job(entry.record.job)
    return entry.spec


def draft_of(record: status.JobRecord) -> status.JobRecord:
    """A copy of `record` to change: its status and the status's lists are new objects, the
    job spec (never changed after submit) and the events already recorded are shared."""
    current = record.status
    copied = current.model_copy(
        update={
            "events": list(current.events),
            "pods": list(current.pods),
            "reasons": list(current.reasons),
        }
    )
    return record.model_copy(update={"status": copied})


class JobBook:
    """Records and revisions, indices, and the commits that change them."""

    def __init__(
        self,
        job_store: records.JobStore,
        *,
        idempotency_window: float = records.IDEMPOTENCY_WINDOW_SECONDS,
        leadership: electing.Leadership | None = None,
    ) -> None:
        self.store = job_store
        self.leadership = leadership  # None: no fence (one replica, tests)
        self.lock = asyncio.Lock()  # collaborators hold it to decide (the group commit: not)
        self.wakeup = asyncio.Event()  # a job became queued
        self._entries: dict[str, _Entry] = {}
        self._queued: set[str] = set()
        self._holding: set[str] = set()
        self._finished: set[str] = set()  # final, not yet retired to history
        self.aging = aging.Aging(self.get, lambda: len(self._finished))  # in retiring order
        self.held = held.Held(self.get)  # every job held, in the order lists show them
        self._by_cluster: dict[str, set[str]] = {}
        self._array_holding: dict[str, set[str]] = {}  # array id -> its jobs holding GPUs
        self._observers: list[Observer] = []
        self._waiting: dict[str, Waiting] = {}
        self._kinds_of_waiting: dict[Waiting, Waiting] = {}  # one of each (`note_waiting`)
        self.history: history_store.HistoryStore | None = None  # where retired jobs are
        self._writes = writes.Writes()  # this replica's writes in flight, per job
        self.grouped = grouping.GroupCommit(self._write_grouped)
        self.launches = launching.Launches(self._writes, get=self.get, write=self._write_launch)
        self.creation = creating.Creation(
            job_store,
            self._writes,
            get=self.get,
            find=self.find,
            apply=self._apply_created,
            idempotency_window=idempotency_window,
        )

    def gang(self, record: status.JobRecord) -> gangs.GangRequest:
        """The gang of `record`'s job (its first attempt's names: the broker's view); ShapeError
        if a task's shape is invalid. Read once for a job the book holds (`_Entry`): the
        planner, the accounting and the dispatcher read it cycle after cycle."""
        entry = self._entries.get(record.id)
        if entry is None or entry.record.job is not record.job:
            return gangs.gang_request(record.id, record.job, interning=self.store.interning)
        if entry.gang is None:
            entry.gang = gangs.gang_request(record.id, record.job, interning=self.store.interning)
        return entry.gang

    @property
    def idempotency_window(self) -> float:
        """How long an Idempotency-Key replays its job (seconds from the job's creation)."""
        return self.creation.idempotency_window

    def observe(self, observer: Observer) -> None:
        """Call `observer` with every change applied from now on (and with every job loaded)."""
        self._observers.append(observer)

    def unobserve(self, observer: Observer) -> None:
        """Stop calling `observer` (a scheduler whose term ended)."""
        if observer in self._observers:
            self._observers.remove(observer)

    async def load(self) -> int:
        stored, revision = await self.store.load()
        for entry in stored:
            self._apply(entry.record, entry.revision)
        return revision

    # ---- reading ------------------------------------------------------------------------

    def get(self, job_id: str) -> status.JobRecord | None:
        """The job as committed (what the store has)."""
        entry = self._entries.get(job_id)
        return entry.record if entry is not None else None

    async def fetch(self, job_id: str) -> status.JobRecord | None:
        """The job as committed; read from the store if the book has not seen it yet (one
        another replica committed that the watch has not delivered): read-your-write."""
        record = self.get(job_id)
        if record is not None:
            return record
        try:
            entry = await self.store.get(job_id)
        except errors.RecordDamagedError as exc:  # the next load sets it aside
            logger.warning("job %s not read: %s", job_id, exc)
            return None
        if entry is not None and job_id not in self._entries:
            self._apply(entry.record, entry.revision, remote=True)
        return self.get(job_id)

    async def find(self, job_id: str) -> status.JobRecord | None:
        """The job from the store (`fetch`), else from history once it was retired."""
        record = await self.fetch(job_id)
        if record is None and self.history is not None:
            record = await self.history.get(job_id)
        return record

    def writes_in_flight(self, job_id: str) -> list[asyncio.Future[None]]:
        """Futures done when this replica's writes of `job_id` in flight now have returned:
        the watch waits for them before it takes an event of that job for another replica's
        (and only for them: a busy leader's other writes never hold the watch up)."""
        return self._writes.of(job_id)

    def revision_of(self, job_id: str) -> int:
        """The store revision of the job as the book has it (0: unknown)."""
        return self._revision(job_id)

    def latest(self, job_id: str) -> status.JobRecord | None:
        """The job with the changes being written (`launch`) or waiting for the group commit
        (what it will be)."""
        return self.grouped.pending.get(job_id) or self.launches.flying(job_id) or self.get(job_id)

    def __iter__(self) -> Iterator[status.JobRecord]:
        return (entry.record for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def queued(self) -> frozenset[str]:
        return frozenset(self._queued)

    def queued_count(self) -> int:
        return len(self._queued)

    def holding(self) -> frozenset[str]:
        """Jobs holding GPUs on a cluster (Dispatched or Running)."""
        return frozenset(self._holding)

    def finished(self) -> list[status.JobRecord]:
        """The finished jobs the book holds (not yet retired to history)."""
        return [self._entries[job_id].record for job_id in self._finished]

    def on_cluster(self, cluster: str) -> list[status.JobRecord]:
        """The jobs not yet finished that the book places on `cluster`, latest versions."""
        out = []
        for job_id in self._by_cluster.get(cluster, ()):
            record = self.latest(job_id)
            if record is not None:
                out.append(record)
        return out

    def array_holding(self) -> dict[str, int]:
        """Per array id, how many of its jobs hold GPUs (what `spec.array.parallelism`
        bounds; the planner's `array_holding`)."""
        return {array_id: len(jobs) for array_id, jobs in self._array_holding.items() if jobs}

    def clusters(self) -> list[str]:
        """The clusters the book places unfinished jobs on."""
        return sorted(name for name, jobs in self._by_cluster.items() if jobs)

    def waiting(self, job_id: str) -> Waiting | None:
        return self._waiting.get(job_id)

    @property
    def pending_writes(self) -> int:
        return len(self.grouped.pending)

    # ---- annotations of the cycle (memory only) -------------------------------------------

    def note_waiting(self, job_id: str, waiting: Waiting) -> None:
        """Keep why the job waits; jobs told the same hold one `Waiting` (a cycle tells many
        queued jobs alike, each in objects of its own)."""
        if job_id in self._queued:
            kinds = self._kinds_of_waiting
            self._waiting[job_id] = tables.remember(kinds, waiting, waiting, limit=WAITING_KINDS)

    # ---- changing -----------------------------------------------------------------------

    def draft(self, job_id: str) -> status.JobRecord | None:
        """A copy of the job's latest version to change and commit."""
        record = self.latest(job_id)
        return draft_of(record) if record is not None else None

    # new jobs (`creating.Creation`)

    async def create(self, record: status.JobRecord) -> status.JobRecord:
        """Store a new job (see `creating.Creation.create`)."""
        return await self.creation.create(record)

    async def create_many(
        self, new: Sequence[status.JobRecord]
    ) -> list[status.JobRecord | Exception]:
        """Store new jobs together, each answered on its own (`creating.Creation`)."""
        return await self.creation.create_many(new)

    async def find_idempotent(
        self, tenant: str, key: str, job: jobs.GPUJob
    ) -> status.JobRecord | None:
        """The job of an Idempotency-Key within its window (`creating.Creation`)."""
        return await self.creation.find_idempotent(tenant, key, job)

    def idempotency_expired(self, entry: records.IdempotencyEntry, *, now: datetime) -> bool:
        """Whether an idempotency entry no longer counts (`creating.Creation`)."""
        return self.creation.idempotency_expired(entry, now=now)

    # the group commit (`grouping.GroupCommit`)

    def commit_soon(self, draft: status.JobRecord) -> None:
        """Write `draft` with the next group commit (`flush`): for what agents report, many
        updates share one transaction. Until then `latest` shows it and `get` does not; a
        broker that crashes first learns it again from the agent's hello."""
        self.grouped.put(draft)

    def after_commit(self, job_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once the job as `latest` shows it is in the store (see
        `grouping.GroupCommit.after_commit`): how agents' reports are acknowledged only once
        committed."""
        self.grouped.after_commit(job_id, callback)

    async def flush(self, *, locked: bool = True) -> None:
        """Commit every draft of `commit_soon` (see `grouping.GroupCommit.flush`)."""
        await self.grouped.flush(locked=locked)

    async def run_flusher(
        self, *, gather_seconds: float = 0.002, on_error: Callable[[], None] | None = None
    ) -> None:
        """The group commit, until cancelled (`grouping.GroupCommit.run`)."""
        await self.grouped.run(gather_seconds=gather_seconds, on_error=on_error)

    # commits written without the lock (`launching.Launches`)

    def settled(self, job_id: str) -> bool:
        """Whether nothing of the job waits to be written or is being written: a draft of it
        now is built on what the store has (what `launch` takes)."""
        return job_id not in self.grouped.pending and not self._writes.busy(job_id)

    def launch(self, drafts: Sequence[status.JobRecord]) -> launching.Launch:
        """Start a fenced commit of `drafts`, written once the caller lets the lock go
        (`land`; see `launching.Launches.launch`). How the scheduler's dispatch writes
        without holding agents' reports and cancels up for the store's round trip."""
        return self.launches.launch(drafts)

    async def land(self, launch: launching.Launch) -> None:
        """Write what `launch` started, without the lock; as `commit` (fenced)."""
        await self.launches.land(launch)

    # writing

    async def commit(self, drafts: Sequence[status.JobRecord], *, fenced: bool = True) -> None:
        """Write `drafts` now (compare-and-swap), then apply them; all or nothing per
        transaction (`JobStore.batches`: bounded in records and bytes).

        Every transaction is tried; on a store error nothing of the failed one is applied,
        the others are, and the first error is raised at the end; after a conflict the
        records involved are read again from the store. `fenced` (every leader decision):
        each transaction holds only within this replica's term; on a replica that does not
        lead it is NotLeaderError, and nothing is tried. A submit or a cancel, which any
        replica takes, is `fenced=False`.
        """
        await self._commit(drafts, fenced=fenced, grouped=False, locked=True)

    async def _write_grouped(self, drafts: Sequence[status.JobRecord], *, locked: bool) -> None:
        await self._commit(drafts, fenced=True, grouped=True, locked=locked)

    async def _write_launch(self, launch: launching.Launch) -> None:
        drafts = list(launch.drafts.values())
        await self._commit(drafts, fenced=True, grouped=False, locked=False, own=launch)

    async def _commit(
        self,
        drafts: Sequence[status.JobRecord],
        *,
        fenced: bool,
        grouped: bool,
        locked: bool,
        own: launching.Launch | None = None,
    ) -> None:
        """`commit`; `grouped`: the drafts of `commit_soon`, which `flush` may write while
        another holds the lock (`locked`: the caller holds it). Each transaction first waits
        for this replica's writes in flight of its jobs (its compare-and-swap is against the
        revision they make); a grouped draft that a collaborator's commit superseded meanwhile
        (built on it) is not written again. After a conflict the records are read again under
        the lock: never between a collaborator's draft and its commit, whose compare-and-swap
        must fail against the other writer's record, not pass against it once read. `own`:
        the launch these drafts are (its own writes are not waited for). A draft built on a
        launched one that did not land is not written (ConflictError)."""
        fence = None
        if fenced and self.leadership is not None:
            try:
                fence = self.leadership.fence()
            except errors.NotLeaderError:
                self._drop(d.id for d in drafts)  # the leader decides them again
                raise
        failure: errors.StoreError | None = None
        encoded = []
        for draft in drafts:
            spec = self._spec_of(draft)
            encoded.append(records.Encoded(draft, records.encode(draft, spec=spec), spec))
        for planned in self.store.batches(encoded):
            mine = frozenset(own.done.values()) if own is not None else frozenset()
            await self._writes.wait_for((item.record.id for item in planned), but=mine)
            batch = planned
            if grouped:  # what a collaborator's commit superseded meanwhile is not written
                pending = self.grouped.pending
                batch = [item for item in planned if pending.get(item.record.id) is item.record]
            if self.launches.any_lost():
                lost = [
                    item.record.id for item in batch if self.launches.built_on_lost(item.record)
                ]
                if lost:
                    self._drop(job_id for job_id in lost if grouped)
                    batch = [item for item in batch if item.record.id not in lost]
                    failure = failure or errors.ConflictError(
                        f"drafted on a write that did not land: {', '.join(lost)}"
                    )
            if not batch:
                continue
            changes = [(item, self._revision(item.record.id)) for item in batch]
            ids = [item.record.id for item in batch]
            try:
                if fence is None:
                    revision = await self._writes.run(ids, self.store.update(changes))
                else:
                    revision = await self._writes.run(ids, self.store.update(changes, fence=fence))
            except errors.ConflictError as exc:
                self.launches.settle(own, ids)  # before any wait: a collaborator may wait for them
                leadership = self.leadership if fence is not None else None
                if leadership is not None and leadership.lost_fence(exc):  # deposed
                    self._drop(d.id for d in drafts)
                    raise errors.NotLeaderError(str(exc), revisions=exc.revisions) from exc
                if locked:
                    await self.refresh(item.record.id for item in batch)
                else:
                    async with self.lock:
                        await self.refresh(item.record.id for item in batch)
                failure = failure or exc
                continue
            except errors.StoreError as exc:
                self.launches.settle(own, ids)
                failure = failure or exc
                continue
            for item in batch:
                job_id = item.record.id
                # a draft given to `commit_soon` while a grouped write of the job was in
                # flight builds on it and waits for the next group commit, with the
                # callbacks given since (`after_commit`): they wait for that one
                waiting = self.grouped.pending.get(job_id)
                newer = grouped and waiting is not None and waiting is not item.record
                if not newer:
                    self.grouped.pending.pop(job_id, None)
                self._apply(item.record, revision, spec=item.spec)
                if not newer:
                    self.grouped.committed(job_id)
            self.launches.settle(own, ids)
        if failure is not None:
            raise failure

    async def refresh(self, job_ids: Iterable[str]) -> None:
        """Read records again from the store (after a conflict: another writer won)."""
        for job_id in list(job_ids):
            self.grouped.drop([job_id])
            try:
                entry = await self.store.get(job_id)
            except errors.StoreError as exc:
                logger.warning("re-reading job %s failed, the book keeps it: %s", job_id, exc)
                continue
            if entry is not None and entry.revision > self._revision(job_id):
                self._apply(entry.record, entry.revision, remote=True)

    def _drop(self, job_ids: Iterable[str]) -> None:
        """Forget what waits for the group commit of these jobs (never acknowledged: agents
        send final reports again)."""
        self.grouped.drop(job_ids)

    def abandon(self) -> int:
        """Forget every draft waiting for the group commit (the replica stopped leading: the
        next leader learns it again from the agents' hello); returns how many."""
        dropped = len(self.grouped.pending)
        self._drop(list(self.grouped.pending))
        return dropped

    async def retire(self, finished: Sequence[status.JobRecord]) -> int:
        """Delete these finished jobs from the store (each compared with the revision the
        book has, fenced by the leader's term) and forget them; the number retired. A job
        the book has in another version than the one given, or one that changed in the store
        meanwhile, is kept. `jobs.retiring` writes them to history first."""
        fence = self.leadership.fence() if self.leadership is not None else None
        async with self.lock:
            stored = []
            for record in finished:
                entry = self._entries.get(record.id)
                if (
                    entry is not None
                    and entry.record is record
                    and record.id not in self.grouped.pending
                ):
                    stored.append((record.id, entry.revision))
            try:
                gone = await self._writes.run(
                    (job_id for job_id, _ in stored), self.store.retire(stored, fence=fence)
                )
            except errors.ConflictError as exc:
                if self.leadership is not None and self.leadership.lost_fence(exc):
                    raise errors.NotLeaderError(str(exc), revisions=exc.revisions) from exc
                raise
            revisions = dict(stored)
            for job_id in gone:
                self.forget(job_id, revisions[job_id] + 1)
        return len(gone)

    # ---- changes of other replicas (`jobs.watching`, under the lock) ----------------------

    def apply_remote(self, record: status.JobRecord, revision: int) -> bool:
        """Apply a record another replica committed at `revision`, if newer than the book's;
        a draft of it waiting for the group commit is dropped (as after a conflict)."""
        if revision <= self._revision(record.id):
            return False  # this replica's own write, or older
        if record.id in self.grouped.pending:
            logger.info("job %s changed on another replica: its pending report dropped", record.id)
            self._drop([record.id])
        self._apply(record, revision, remote=True)
        return True

    def forget(self, job_id: str, revision: int) -> bool:
        """A job record deleted from the store at `revision` (set aside): out of the book."""
        entry = self._entries.get(job_id)
        if entry is None or entry.revision >= revision:
            return False
        self._drop([job_id])
        del self._entries[job_id]
        self.launches.forget(job_id)
        self.held.drop(job_id)
        self._queued.discard(job_id)
        self._holding.discard(job_id)
        self._finished.discard(job_id)
        self._waiting.pop(job_id, None)
        self._index_array(entry.record, holding=False)
        if entry.record.status.cluster:
            self._by_cluster.get(entry.record.status.cluster, set()).discard(job_id)
        indices = (self._entries, self._queued, self._holding, self._finished, self._waiting)
        for table in indices:
            tables.shrink(table)
        return True

    # ---- applying -----------------------------------------------------------------------

    def _revision(self, job_id: str) -> int:
        entry = self._entries.get(job_id)
        return entry.revision if entry is not None else 0

    def spec_of(self, job_id: str) -> str | None:
        """The spec of the job the book holds as the store writes it (`records.encode_job`,
        kept with the job: see `_Entry`); None for a job it does not hold."""
        entry = self._entries.get(job_id)
        return _held_spec(entry) if entry is not None else None

    def _spec_of(self, draft: status.JobRecord) -> str:
        """`draft`'s spec as the store writes it: the held job's, if it is that job object."""
        entry = self._entries.get(draft.id)
        if entry is None or entry.record.job is not draft.job:
            return records.encode_job(draft.job)
        return _held_spec(entry)

    def _apply_created(self, item: records.Encoded, revision: int) -> None:
        self._apply(item.record, revision, spec=item.spec)

    def _apply(
        self,
        record: status.JobRecord,
        revision: int,
        *,
        remote: bool = False,
        spec: str | None = None,
    ) -> None:
        """Make a committed record the book's; indices and observers follow. `spec`: its
        job's spec as the store wrote it, if known."""
        entry = self._entries.get(record.id)
        before = entry.record if entry is not None else None
        # a draft of the book's record holds its keys as that one did (a copy keeps them)
        self._share_names(record, pack=before is None or remote)
        if entry is None:
            self._entries[record.id] = _Entry(record, revision, spec)
        else:
            if entry.record.job is not record.job:  # what was read off the old job is not kept
                entry.gang, entry.spec = None, spec
            elif spec is not None:
                entry.spec = spec
            entry.record, entry.revision = record, revision
        self.held.put(record)
        self._index(before, record)
        change = Change(before, record, remote)
        for observer in self._observers:
            try:
                observer(change)
            except Exception:  # an observer's bug must not undo a commit
                logger.exception("observer of job %s failed", record.id)

    def _share_names(self, record: status.JobRecord, *, pack: bool) -> None:
        """The record's models, held, share their class's set of field names (`Interning`):
        the book holds every live job, and drafts copy their own. With `pack` (a record not
        drafted from the book's: new, read from the store), their class's table of keys too."""
        interning = self.store.interning
        for model in (record, record.status, *record.status.pods):
            interning.fields(model)
            if pack:
                interning.pack(model)

    def _index(self, before: status.JobRecord | None, after: status.JobRecord) -> None:
        job_id = after.id
        state = after.status.state
        if before is not None and before.status.cluster:
            on = self._by_cluster.get(before.status.cluster)
            if on is not None:
                on.discard(job_id)
                tables.shrink(on)
        if after.status.cluster and not state.terminal:
            self._by_cluster.setdefault(after.status.cluster, set()).add(job_id)
        if state == JobState.QUEUED:
            if job_id not in self._queued:
                self._queued.add(job_id)
                self.wakeup.set()
        else:
            self._queued.discard(job_id)
            self._waiting.pop(job_id, None)
        if state in HOLDING:
            self._holding.add(job_id)
        else:
            self._holding.discard(job_id)
        self._index_array(after, holding=state in HOLDING)
        if state.terminal:
            self._finished.add(job_id)
            self.aging.note(before, after)
        else:
            self._finished.discard(job_id)

    def _index_array(self, record: status.JobRecord, *, holding: bool) -> None:
        if record.array is None:
            return
        members = self._array_holding.get(record.array.id)
        if holding:
            self._array_holding.setdefault(record.array.id, set()).add(record.id)
        elif members is not None and record.id in members:
            members.discard(record.id)
            self.wakeup.set()  # room in its array: the next job of it may go
            if not members:
                del self._array_holding[record.array.id]
