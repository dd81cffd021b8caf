"""Jobs that wait for others (`spec.dependsOn`): resolved at submit, queued or failed by the
leader as their dependencies end.

At submit (`resolve`, before the job is stored) each `dependsOn` entry is resolved once to
job ids (`api.dependencies`: a job of the same request by that name, an id, the newest live
job of that name, the newest array of that name) and the record keeps them
(`status.dependencies`); a request whose jobs would close a cycle is refused, naming the
entry (`planning.dependencies.find_cycle`). The job is stored `Waiting` (`requests.submit`).

`Dependents` is a book observer on every replica (the waiting jobs and, per job, the waiting
jobs that depend on it: O(waiting jobs)) and, on the leader (`dispatch.leading`), a task: a
waiting job is decided when it is stored and again whenever a job it depends on ends
(`planning.dependencies.decide`): met, it is committed `Queued` (`DependenciesMet`); one can
never be met (it ended Failed or Cancelled for `Succeeded`, or names no job), it is committed
`Failed` (`DependencyFailed`), which decides the jobs waiting for it in turn. A dependency
the book no longer holds is read from the store, then from history (`book.find`), so one
retired meanwhile still counts by its final state. A new term decides every waiting job
once. Store errors back off; the task never dies of one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

from broker.api import dependencies, errors, status
from broker.api.status import JobState
from broker.jobs import book, transitions
from broker.planning import dependencies as deciding
from broker.state import errors as store_errors
from broker.telemetry import metrics

logger = logging.getLogger(__name__)

TASK = "dependencies"
BATCH = 500  # waiting jobs decided per commit, at most
MAX_BACKOFF_SECONDS = 30.0


class Dependents:
    """The waiting jobs and what they wait for, and the leader's task that releases them."""

    def __init__(self, jobs: book.JobBook, *, meters: metrics.BrokerMetrics) -> None:
        self.book = jobs
        self.meters = meters
        self.waiting: dict[str, tuple[str, ...]] = {}  # waiting job -> the ids it names
        self.dependents: dict[str, set[str]] = {}  # job id -> waiting jobs naming it
        self._noted: set[str] = set()
        self._wake = asyncio.Event()
        self.released = 0  # queued by this replica
        self.failed = 0  # failed DependencyFailed by this replica

    # ---- the observer ---------------------------------------------------------------

    def __call__(self, change: book.Change) -> None:
        record = change.after
        if record.status.state == JobState.WAITING:
            if record.id not in self.waiting:
                ids = tuple(i for d in record.status.dependencies or () for i in d.ids)
                self.waiting[record.id] = ids
                for job_id in ids:
                    self.dependents.setdefault(job_id, set()).add(record.id)
            self._note(record.id)
        elif record.id in self.waiting:
            self._forget(record.id)
        self.meters.waiting_jobs.set(len(self.waiting))  # every replica's book has them all
        before = change.before
        if record.status.state.terminal and (before is None or not before.status.state.terminal):
            for waiting in self.dependents.get(record.id, ()):
                self._note(waiting)

    def _note(self, job_id: str) -> None:
        self._noted.add(job_id)
        self._wake.set()

    def _forget(self, job_id: str) -> None:
        for dep in self.waiting.pop(job_id, ()):
            named = self.dependents.get(dep)
            if named is not None:
                named.discard(job_id)
                if not named:
                    del self.dependents[dep]
        self._noted.discard(job_id)

    # ---- deciding -------------------------------------------------------------------

    async def _states(self, ids: Sequence[str]) -> dict[str, JobState | None]:
        """The states of these jobs: the book's, else the store's or history's."""
        out: dict[str, JobState | None] = {}
        for job_id in ids:
            if job_id in out:
                continue
            record = self.book.get(job_id)
            if record is None:
                record = await self.book.find(job_id)
            out[job_id] = record.status.state if record is not None else None
        return out

    async def verdict(self, record: status.JobRecord) -> deciding.Verdict:
        """What the job's dependencies say now (`why` of a waiting job)."""
        resolved = record.status.dependencies or []
        states = await self._states([i for d in resolved for i in d.ids])
        return deciding.decide(resolved, states)

    async def settle_once(self) -> int:
        """Queue or fail the noted waiting jobs whose dependencies say so; how many moved."""
        noted = sorted(self._noted)[:BATCH]
        self._noted.difference_update(noted)
        if not noted:
            return 0
        if len(self._noted):
            self._wake.set()
        states = await self._states([i for job_id in noted for i in self.waiting.get(job_id, ())])
        async with self.book.lock:
            drafts: list[status.JobRecord] = []
            for job_id in noted:
                record = self.book.latest(job_id)
                if record is None or record.status.state != JobState.WAITING:
                    continue
                resolved = record.status.dependencies or []
                now = {i: self._state_now(i, states) for d in resolved for i in d.ids}
                verdict = deciding.decide(resolved, now)
                if not verdict.met and verdict.failed is None:
                    continue
                draft = book.draft_of(record)
                if verdict.met:
                    text = "its dependencies are met: " + ", ".join(d.job for d in resolved)
                    transitions.move(draft, JobState.QUEUED, dependencies.DEPENDENCIES_MET, text)
                else:
                    assert verdict.failed is not None
                    transitions.move(
                        draft, JobState.FAILED, dependencies.DEPENDENCY_FAILED, verdict.failed
                    )
                drafts.append(draft)
            if not drafts:
                return 0
            try:
                await self.book.commit(drafts)
            except store_errors.StoreError:
                self._noted.update(d.id for d in drafts if self.book.get(d.id) is not d)
                raise
            finally:
                for draft in drafts:
                    if self.book.get(draft.id) is draft:
                        if draft.status.state == JobState.QUEUED:
                            self.released += 1
                        else:
                            self.failed += 1
        return len(drafts)

    def _state_now(self, job_id: str, read: dict[str, JobState | None]) -> JobState | None:
        """As committed (`get`, not `latest`: a report waiting for the group commit may
        still be dropped), else as read before the lock."""
        record = self.book.get(job_id)
        return record.status.state if record is not None else read.get(job_id)

    async def run(self) -> None:
        """Decide waiting jobs until cancelled (the leader's task): every one once at the
        start of the term, then those whose dependencies changed."""
        self._noted.update(self.waiting)
        self._wake.set()
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while await self.settle_once():
                    pass
                failures = 0
            except store_errors.NotLeaderError:
                raise  # the term ended: the leader's work stops this task
            except Exception as exc:  # the store, or a bug: the noted jobs are tried again
                failures += 1
                logger.warning("deciding waiting jobs (%d in a row): %s", failures, exc)
                self.meters.background_errors.labels(task=TASK).inc()
                self._wake.set()
                await asyncio.sleep(min(MAX_BACKOFF_SECONDS, 2.0**failures / 4))

    # ---- at submit ------------------------------------------------------------------

    async def resolve(self, new: Sequence[status.JobRecord]) -> list[errors.Invalid | None]:
        """Resolve the `spec.dependsOn` of jobs about to be stored together (one tenant's:
        a submit, an array's jobs, a batch), setting `status.dependencies`; per job, the
        refusal of a job that would close a cycle (its field named from the job's root)."""
        if not any(r.job.spec.depends_on for r in new):
            return [None] * len(new)
        tenant = new[0].tenant
        names = _Names(list(self.book), tenant=tenant)
        local = _Names(list(new), tenant=tenant)
        known: dict[str, list[str]] = {}  # an array's jobs name the same jobs: once each
        for record in new:
            entries = record.job.spec.depends_on
            if not entries:
                continue
            record.status.dependencies = []
            for entry in entries:
                if entry.job not in known:
                    ids = local.ids_of(entry.job) or names.ids_of(entry.job)
                    if not ids:  # an id the book does not hold: the store's, history's
                        found = await self.book.find(entry.job)
                        if found is not None and found.tenant == tenant:
                            ids = [found.id]
                    known[entry.job] = ids
                record.status.dependencies.append(
                    dependencies.Resolved(
                        job=entry.job, condition=entry.condition, ids=list(known[entry.job])
                    )
                )
        return self._refuse_cycles(new)

    def _refuse_cycles(self, new: Sequence[status.JobRecord]) -> list[errors.Invalid | None]:
        by_id = {r.id: r for r in new}

        def edges(job_id: str) -> list[str]:
            record = by_id.get(job_id) or self.book.get(job_id)
            if record is None:
                return []
            return [i for d in record.status.dependencies or () for i in d.ids]

        out: list[errors.Invalid | None] = [None] * len(new)
        refused: set[str] = set()
        while True:
            starts = [r.id for r in new if r.id not in refused and r.status.dependencies]
            cycle = deciding.find_cycle(starts, lambda j: [] if j in refused else edges(j))
            if cycle is None:
                return out
            names = " → ".join(by_id[j].job.metadata.name if j in by_id else j for j in cycle)
            for here, there in itertools.pairwise(cycle):
                record = by_id.get(here)
                if record is None or here in refused:
                    continue
                refused.add(here)
                entry = next(
                    k for k, d in enumerate(record.status.dependencies or ()) if there in d.ids
                )
                field = f"spec.dependsOn[{entry}].job"
                out[new.index(record)] = errors.Invalid(
                    f"{field}: a dependency cycle ({names}): a job cannot wait for itself",
                    field=field,
                    title="Invalid job",
                )


class _Names:
    """A tenant's jobs by name (the newest of each) and its arrays by name (the newest)."""

    def __init__(self, records: Sequence[status.JobRecord], *, tenant: str) -> None:
        self.jobs: dict[str, status.JobRecord] = {}
        self.arrays: dict[str, tuple[str, status.JobRecord]] = {}  # name -> newest array
        self.members: dict[str, list[str]] = {}  # array id -> its jobs
        for record in records:
            if record.tenant != tenant:
                continue
            name = record.job.metadata.name
            if name not in self.jobs or self.jobs[name].created <= record.created:
                self.jobs[name] = record
            if record.array is not None:
                self.members.setdefault(record.array.id, []).append(record.id)
                array = self.arrays.get(record.array.name)
                if array is None or array[1].created <= record.created:
                    self.arrays[record.array.name] = (record.array.id, record)
        self.ids = {r.id for r in records if r.tenant == tenant}

    def ids_of(self, name: str) -> list[str]:
        if name in self.ids:
            return [name]
        if name in self.jobs:
            return [self.jobs[name].id]
        if name in self.arrays:
            return sorted(self.members[self.arrays[name][0]], key=_index_order)
        return []


def _index_order(job_id: str) -> tuple[int, str]:
    tail = job_id.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, job_id)
