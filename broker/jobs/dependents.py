"""Jobs that wait for others (`spec.dependsOn`): resolved at submit, queued or failed by the
leader as their dependencies end.

At submit (`resolve`, before the job is stored) each `dependsOn` entry is resolved once
(`api.dependencies`: a job of the same request by that name, an id, the newest live job of
that name, the newest array of that name) and the record keeps what it found
(`status.dependencies`): a job id, or a reference to an array (its id and count), never the
array's jobs one by one; a request whose jobs would close a cycle is refused, naming the
entry (`planning.dependencies.find_cycle`). The job is stored `Waiting` (`requests.submit`).

`Dependents` is a book observer on every replica (the waiting jobs and, per job or array
they name, the waiting jobs naming it: O(waiting jobs × entries), whatever the arrays'
sizes) and, on the leader (`dispatch.leading`), a task: a waiting job is decided when it is
stored and again whenever what it waits for may have changed its verdict
(`planning.dependencies.decide`): met, it is committed `Queued` (`DependenciesMet`); one can
never be met (it ended Failed or Cancelled for `Succeeded`, or names no job), it is committed
`Failed` (`DependencyFailed`), which decides the jobs waiting for it in turn. An array some
waiting job names has a tally (`_Tally`: its jobs' states, kept by the observer), so the
jobs waiting for it are decided when one of its jobs ends otherwise than Succeeded or the
last one ends, not on every end, and the array's jobs are read once per change of them, not
once per job waiting. A dependency the book no longer holds is read from the store, then
from history (`book.find`), so one retired meanwhile still counts by its final state. A new
term decides every waiting job once. Store errors back off; the task never dies of one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

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


ARRAY_NODE = "array:"  # an array some waiting job names, among job ids (no id holds ':')


def _node(entry: dependencies.Resolved) -> list[str]:
    """What an entry waits for: its array (one node), or its job ids."""
    return [ARRAY_NODE + entry.array] if entry.array is not None else list(entry.ids)


def _nodes(record: status.JobRecord) -> list[str]:
    return [n for d in record.status.dependencies or () for n in _node(d)]


class _Tally:
    """The states of the jobs of one array that waiting jobs name, kept by the observer;
    `ends` sums them up once per change."""

    def __init__(self, member_ids: list[str]) -> None:
        self.member_ids = member_ids
        self.states: dict[str, JobState | None] = {}
        self.unfinished: set[str] = set()
        self.complete = False  # every job's state read once
        self._ends: deciding.ArrayEnds | None = None

    def put(self, job_id: str, state: JobState | None) -> None:
        if self.states.get(job_id, "absent") == state:
            return
        self.states[job_id] = state
        if state is not None and not state.terminal:
            self.unfinished.add(job_id)
        else:
            self.unfinished.discard(job_id)
        self._ends = None

    def ends(self) -> deciding.ArrayEnds:
        if self._ends is None:
            self._ends = deciding.summarize(self.member_ids, self.states)
        return self._ends


class Dependents:
    """The waiting jobs and what they wait for, and the leader's task that releases them."""

    def __init__(self, jobs: book.JobBook, *, meters: metrics.BrokerMetrics) -> None:
        self.book = jobs
        self.meters = meters
        self.waiting: dict[str, tuple[str, ...]] = {}  # waiting job -> the ids, arrays it names
        self.dependents: dict[str, set[str]] = {}  # job id, array node -> waiting jobs naming it
        self.tallies: dict[str, _Tally] = {}  # array id (named by a waiting job) -> its tally
        self._noted: set[str] = set()
        self._wake = asyncio.Event()
        self.released = 0  # queued by this replica
        self.failed = 0  # failed DependencyFailed by this replica

    # ---- the observer ---------------------------------------------------------------

    def __call__(self, change: book.Change) -> None:
        record = change.after
        if record.status.state == JobState.WAITING:
            if record.id not in self.waiting:
                nodes = tuple(dict.fromkeys(_nodes(record)))
                self.waiting[record.id] = nodes
                for node in nodes:
                    self.dependents.setdefault(node, set()).add(record.id)
            self._note(record.id)
        elif record.id in self.waiting:
            self._forget(record.id)
        self.meters.waiting_jobs.set(len(self.waiting))  # every replica's book has them all
        before = change.before
        ended = record.status.state.terminal and (
            before is None or not before.status.state.terminal
        )
        if ended:
            for waiting in self.dependents.get(record.id, ()):
                self._note(waiting)
        if record.array is not None and ARRAY_NODE + record.array.id in self.dependents:
            self._count(record, ended=ended)

    def _count(self, record: status.JobRecord, *, ended: bool) -> None:
        """A job of an array that waiting jobs name changed: its tally follows, and they are
        decided again if that may change their verdict."""
        assert record.array is not None
        state = record.status.state
        tally = self.tallies.get(record.array.id)
        if tally is not None:
            tally.put(record.id, state)
        if not ended:
            return
        telling = tally is None or not tally.complete or not tally.unfinished
        if telling or state != JobState.SUCCEEDED:
            for waiting in self.dependents.get(ARRAY_NODE + record.array.id, ()):
                self._note(waiting)

    def _note(self, job_id: str) -> None:
        self._noted.add(job_id)
        self._wake.set()

    def _forget(self, job_id: str) -> None:
        for node in self.waiting.pop(job_id, ()):
            named = self.dependents.get(node)
            if named is not None:
                named.discard(job_id)
                if not named:
                    del self.dependents[node]
                    if node.startswith(ARRAY_NODE):
                        self.tallies.pop(node.removeprefix(ARRAY_NODE), None)
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

    async def _tally(self, entry: dependencies.Resolved) -> _Tally:
        """The tally of the array `entry` names, its jobs' states read once (kept while a
        waiting job names it; else made for this one question)."""
        assert entry.array is not None
        tally = self.tallies.get(entry.array)
        if tally is not None and tally.complete:
            return tally
        tally = _Tally(entry.member_ids())
        if ARRAY_NODE + entry.array in self.dependents:
            self.tallies[entry.array] = tally  # the observer keeps it from now on
        missing = []
        for job_id in tally.member_ids:
            record = self.book.get(job_id)
            if record is None:
                missing.append(job_id)
            else:
                tally.put(job_id, record.status.state)
        for job_id in missing:
            if job_id not in tally.states:  # not told by the observer meanwhile
                found = await self.book.find(job_id)
                if job_id not in tally.states:
                    tally.put(job_id, found.status.state if found is not None else None)
        tally.complete = True
        return tally

    async def _read(
        self, entries: Sequence[dependencies.Resolved]
    ) -> tuple[dict[str, JobState | None], dict[str, _Tally]]:
        """The states of the jobs `entries` name, and the tallies of the arrays they name
        (each read once however many entries name it)."""
        tallies: dict[str, _Tally] = {}
        for entry in entries:
            if entry.array is not None and entry.array not in tallies:
                tallies[entry.array] = await self._tally(entry)
        states = await self._states([i for e in entries if e.array is None for i in e.ids])
        return states, tallies

    async def verdict(self, record: status.JobRecord) -> deciding.Verdict:
        """What the job's dependencies say now (`why` of a waiting job)."""
        resolved = record.status.dependencies or []
        states, tallies = await self._read(resolved)
        return deciding.decide(resolved, states, {a: t.ends() for a, t in tallies.items()})

    async def settle_once(self) -> int:
        """Queue or fail the noted waiting jobs whose dependencies say so; how many moved."""
        noted = sorted(self._noted)[:BATCH]
        self._noted.difference_update(noted)
        if not noted:
            return 0
        if len(self._noted):
            self._wake.set()
        entries: list[dependencies.Resolved] = []
        for job_id in noted:
            record = self.book.latest(job_id)
            if record is not None and record.status.state == JobState.WAITING:
                entries += record.status.dependencies or ()
        states, tallies = await self._read(entries)
        async with self.book.lock:
            ends = {a: t.ends() for a, t in tallies.items()}  # as the observer keeps them
            drafts: list[status.JobRecord] = []
            for job_id in noted:
                record = self.book.latest(job_id)
                if record is None or record.status.state != JobState.WAITING:
                    continue
                resolved = record.status.dependencies or []
                now = {i: self._state_now(i, states) for d in resolved for i in d.ids}
                verdict = deciding.decide(resolved, now, ends)
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
        known: dict[str, _Target] = {}  # an array's jobs name the same jobs: once each
        for record in new:
            entries = record.job.spec.depends_on
            if not entries:
                continue
            record.status.dependencies = []
            for entry in entries:
                if entry.job not in known:
                    target = local.target(entry.job) or names.target(entry.job)
                    if target is None:  # an id the book does not hold: the store's, history's
                        found = await self.book.find(entry.job)
                        ok = found is not None and found.tenant == tenant
                        target = _Target(ids=[found.id] if found is not None and ok else [])
                    known[entry.job] = target
                target = known[entry.job]
                record.status.dependencies.append(
                    dependencies.Resolved(
                        job=entry.job,
                        condition=entry.condition,
                        ids=list(target.ids),
                        array=target.array,
                        count=target.count,
                    )
                )
        return self._refuse_cycles(new)

    def _refuse_cycles(self, new: Sequence[status.JobRecord]) -> list[errors.Invalid | None]:
        """Per job of `new`, the refusal of one on a cycle. The graph's nodes are jobs and
        arrays: an array waits for what its jobs of this request wait for (they all name
        the same), and an array stored before waits for nothing new."""
        by_id = {r.id: r for r in new}
        first_of: dict[str, status.JobRecord] = {}  # array node -> its first job of this request
        for record in new:
            if record.array is not None:
                first_of.setdefault(ARRAY_NODE + record.array.id, record)

        def holder(node: str) -> status.JobRecord | None:
            """The record of this request whose entries are the node's edges."""
            return first_of.get(node) or by_id.get(node)

        def edges(node: str) -> list[str]:
            record = holder(node)
            if record is None and not node.startswith(ARRAY_NODE):
                record = self.book.get(node)
            return _nodes(record) if record is not None else []

        def label(node: str) -> str:
            record = holder(node)
            if record is None:
                return node.removeprefix(ARRAY_NODE)
            if node.startswith(ARRAY_NODE) and record.array is not None:
                return record.array.name
            return record.job.metadata.name

        out: list[errors.Invalid | None] = [None] * len(new)
        refused: set[str] = set()
        while True:
            starts = [r.id for r in new if r.id not in refused and r.status.dependencies]
            cycle = deciding.find_cycle(starts, lambda j: [] if j in refused else edges(j))
            if cycle is None:
                return out
            names = " → ".join(label(node) for node in cycle)
            for here, there in itertools.pairwise(cycle):
                holding = holder(here)
                if holding is None or holding.id in refused:
                    continue
                record = holding
                refused.update((here, record.id))
                entry = next(
                    k for k, d in enumerate(record.status.dependencies or ()) if there in _node(d)
                )
                field = f"spec.dependsOn[{entry}].job"
                out[new.index(record)] = errors.Invalid(
                    f"{field}: a dependency cycle ({names}): a job cannot wait for itself",
                    field=field,
                    title="Invalid job",
                )


@dataclass(frozen=True)
class _Target:
    """What a `dependsOn` entry resolved to: job ids, or an array (its id and count)."""

    ids: list[str] = field(default_factory=list)
    array: str | None = None
    count: int | None = None


class _Names:
    """A tenant's jobs by name (the newest of each) and its arrays by name (the newest)."""

    def __init__(self, records: Sequence[status.JobRecord], *, tenant: str) -> None:
        self.jobs: dict[str, status.JobRecord] = {}
        self.arrays: dict[str, status.JobRecord] = {}  # name -> a job of the newest array
        for record in records:
            if record.tenant != tenant:
                continue
            name = record.job.metadata.name
            if name not in self.jobs or self.jobs[name].created <= record.created:
                self.jobs[name] = record
            if record.array is not None:
                array = self.arrays.get(record.array.name)
                if array is None or array.created <= record.created:
                    self.arrays[record.array.name] = record
        self.ids = {r.id for r in records if r.tenant == tenant}

    def target(self, name: str) -> _Target | None:
        if name in self.ids:
            return _Target(ids=[name])
        if name in self.jobs:
            return _Target(ids=[self.jobs[name].id])
        member = self.arrays[name].array if name in self.arrays else None
        if member is not None:
            return _Target(array=member.id, count=member.count)
        return None
