"""The job collaborators around one book, and the small read API `http/` uses.

`Jobs` wires the book's collaborators — `requests` (submit, cancel), `reports` (what agents
say, acknowledged through `acks` once committed), `dispatcher` (a plan made real), `victims`
(preemption), `accounts` (quota holdings), `deadlines` (active deadlines) —
and the observers that follow every committed change (telemetry, holdings, preemptions).
Handlers read through the methods here, never through the collaborators' attributes.

With several replicas (`leadership`): the leader's commits are fenced by its term, only the
leader's telemetry tells of job changes, and the leader forwards to agents the cancels that
followers commit (`requests.ForwardedCancels`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import datetime

from broker.api import errors as api_errors
from broker.api import jobs, status
from broker.api.status import JobState
from broker.jobs import (
    accounting,
    acknowledging,
    book,
    deadlines,
    dependents,
    dispatching,
    expiring,
    fleet,
    observing,
    preempting,
    reports,
    requests,
    retiring,
    starting,
)
from broker.planning import dependencies as planning_deps
from broker.planning import quotas, snapshot
from broker.state import electing, errors, records
from broker.state.history import protocol as history_store
from broker.telemetry import jobspans, metrics

logger = logging.getLogger(__name__)

# jobs a bulk cancel commits at once: a slice's records fit one store transaction, and the
# book's lock is held for one slice's round trip at a time
CANCEL_SLICE = 200


class Jobs:
    def __init__(
        self,
        job_store: records.JobStore,
        clusters: fleet.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        idempotency_window: float = records.IDEMPOTENCY_WINDOW_SECONDS,
        leadership: electing.Leadership | None = None,
    ) -> None:
        self.leadership = leadership
        self.book = book.JobBook(
            job_store, idempotency_window=idempotency_window, leadership=leadership
        )
        self.meters = meters
        self.fleet = clusters
        self.spans = jobspans.JobSpans()
        self.accounts = accounting.Accounting(
            self.book, clusters, is_preempting=lambda job: job in self.victims
        )
        self.victims = preempting.Preemptions(
            self.book, clusters, meters=meters, held_by=self.accounts.held_by
        )
        self.requests = requests.Requests(self.book, clusters, meters=meters)
        self.acks = acknowledging.Acknowledgements(self.book, clusters)
        self.reports = reports.AgentReports(
            self.book,
            clusters,
            victims=self.victims,
            spans=self.spans,
            meters=meters,
            acks=self.acks,
        )
        self.dispatcher = dispatching.Dispatcher(
            self.book, clusters, accounts=self.accounts, spans=self.spans
        )
        self.forwarded = requests.ForwardedCancels(self.book, clusters, leading=self.leading)
        self.deadlines = deadlines.Deadlines(self.book, clusters, meters=meters)
        self.starts = starting.Starts(self.book, clusters, meters=meters)
        self.dependents = dependents.Dependents(self.book, meters=meters)
        self.ttls = retiring.TTLs()
        self.book.observe(observing.JobTelemetry(self.spans, meters, active=self.leading))
        self.book.observe(self.accounts)
        self.book.observe(self.victims)
        self.book.observe(self.forwarded)
        self.book.observe(self.deadlines)
        self.book.observe(self.starts)
        self.book.observe(self.dependents)
        self.book.observe(self.ttls)

    @property
    def history(self) -> history_store.HistoryStore | None:
        """Where finished jobs go once retired (None: they stay in the store)."""
        return self.book.history

    def leading(self) -> bool:
        """Does this replica lead (always, without a leadership: one replica)?"""
        return self.leadership is None or self.leadership.is_leader

    async def load(self) -> int:
        """Read every job from the store; returns the revision read at."""
        return await self.book.load()

    # ---- reading ------------------------------------------------------------------------

    def get(self, job_id: str) -> status.JobRecord | None:
        return self.book.get(job_id)

    async def find(self, job_id: str) -> status.JobRecord | None:
        """The job, read from the store if this replica has not seen it yet (read-your-write
        on a replica the submit did not go to); from history once it was retired."""
        return await self.book.find(job_id)

    def __iter__(self) -> Iterator[status.JobRecord]:
        return iter(self.book)

    def __len__(self) -> int:
        return len(self.book)

    def select(
        self,
        *,
        tenant: str | None,
        queue: str | None = None,
        state: JobState | None = None,
        limit: int = 1000,
    ) -> list[status.JobRecord]:
        """Jobs newest first; `tenant` None: every tenant's."""
        items = [
            record
            for record in self.book
            if (tenant is None or record.tenant == tenant)
            and (queue is None or record.job.spec.queue == queue)
            and (state is None or record.status.state == state)
        ]
        items.sort(key=lambda r: r.created, reverse=True)
        return items[: max(0, limit)]

    def unfinished_in_queue(self, queue: str) -> Counter[JobState]:
        """The jobs of `queue` not finished yet, by state (what stops deleting the queue)."""
        return Counter(
            record.status.state
            for record in self.book
            if record.job.spec.queue == queue and not record.status.state.terminal
        )

    def unfinished_queues(self) -> Counter[str]:
        """Jobs not finished yet per queue name."""
        return Counter(
            record.job.spec.queue for record in self.book if not record.status.state.terminal
        )

    def waiting(self, job_id: str) -> book.Waiting | None:
        """Why a queued job was not placed in the latest cycle."""
        return self.book.waiting(job_id)

    def preempting_message(self, job_id: str) -> str | None:
        """How the job is being preempted, while it is."""
        return self.victims.message_of(job_id)

    def clusters_with_jobs(self) -> list[str]:
        """The clusters the book places unfinished jobs on."""
        return self.book.clusters()

    def holding_per_cluster(self) -> Counter[str]:
        """Jobs holding GPUs (Dispatched, Running) per cluster."""
        counts: Counter[str] = Counter()
        for job_id in self.book.holding():
            record = self.book.get(job_id)
            if record is not None and record.status.cluster:
                counts[record.status.cluster] += 1
        return counts

    def usage(self) -> quotas.Usage:
        return self.accounts.usage()

    def running_jobs(self) -> list[snapshot.RunningJob]:
        return self.accounts.running_jobs()

    def pending(self) -> list[snapshot.PendingJob]:
        return self.dispatcher.pending()

    def preemptions(self) -> Counter[str]:
        """Jobs preempted per victim's queue since the broker started."""
        return Counter(self.victims.counts)

    # ---- changing -----------------------------------------------------------------------

    def new_trace(self, *, own: bool = False) -> tuple[str, str | None]:
        return self.spans.new_trace(own=own)

    async def submit(self, record: status.JobRecord) -> status.JobRecord:
        return await self.requests.submit(record)

    async def submit_many(
        self, new: Sequence[status.JobRecord]
    ) -> list[status.JobRecord | Exception]:
        """A batch's jobs stored together; each the job stored or what refused it."""
        return await self.requests.submit_many(new)

    async def find_idempotent(
        self, tenant: str, key: str, job: jobs.GPUJob
    ) -> status.JobRecord | None:
        """The job to replay for this Idempotency-Key; IdempotencyKeyReused (422) if the key
        was used for another body within its window."""
        return await self.book.find_idempotent(tenant, key, job)

    async def cancel(self, job_id: str, *, by: str | None = None) -> status.JobRecord | None:
        return await self.requests.cancel(job_id, by=by)

    async def cancel_many(
        self, job_ids: Sequence[str], *, by: str | None = None
    ) -> list[status.JobRecord]:
        """Cancel many jobs (an array's), `CANCEL_SLICE` per commit with a turn of the event
        loop between two: the book's lock and the loop are never held for all of them, so
        other requests, agents' reports and the cycle go on meanwhile. Returns them as
        committed, in order (those the book does not have left out)."""
        out: list[status.JobRecord] = []
        for start in range(0, len(job_ids), CANCEL_SLICE):
            if start:
                await asyncio.sleep(0)
            chunk = job_ids[start : start + CANCEL_SLICE]
            out += await self.requests.cancel_many(chunk, by=by)
        return out

    async def run_flusher(self) -> None:
        errors_seen = self.meters.background_errors.labels(task="group-commit")
        await self.book.run_flusher(on_error=errors_seen.inc)

    async def run_key_sweeper(self) -> None:
        """Delete expired idempotency keys, until cancelled (`expiring`)."""
        await expiring.run_sweeper(self.book, meters=self.meters)

    async def run_dependencies(self) -> None:
        """Queue or fail the waiting jobs as their dependencies end, until cancelled."""
        await self.dependents.run()

    async def resolve_dependencies(
        self, new: Sequence[status.JobRecord]
    ) -> list[api_errors.Invalid | None]:
        """Resolve the `spec.dependsOn` of jobs about to be stored together; per job, the
        refusal of one that would close a cycle (`dependents.resolve`)."""
        return await self.dependents.resolve(new)

    async def dependency_verdict(self, record: status.JobRecord) -> planning_deps.Verdict:
        """What a waiting job's dependencies say now (`why`)."""
        return await self.dependents.verdict(record)

    def array_jobs(self, tenant: str | None, array: str) -> list[status.JobRecord]:
        """The jobs of the tenant's array of id `array`, else of its newest array named so,
        by index (the live ones: what the book holds); `tenant` None: any tenant's."""
        by_id: dict[str, list[status.JobRecord]] = {}
        newest: tuple[datetime, str] | None = None
        for record in self.book:
            member = record.array
            if member is None or (tenant is not None and record.tenant != tenant):
                continue
            by_id.setdefault(member.id, []).append(record)
            if member.name == array and (newest is None or newest[0] < record.created):
                newest = (record.created, member.id)
        chosen = by_id.get(array) or (by_id.get(newest[1], []) if newest else [])
        return sorted(chosen, key=lambda r: r.array.index if r.array else 0)

    async def run_deadlines(self) -> None:
        """Fail the jobs past their active deadline, until cancelled (`deadlines`)."""
        await self.deadlines.run()

    async def run_starts(self) -> None:
        """Withdraw the jobs not Running within the start timeout, until cancelled
        (`starting`)."""
        await self.starts.run()

    def end_term(self) -> None:
        """This replica stopped leading: what only the leader knew is dropped (the drafts
        waiting for the group commit, the victims being preempted); the next leader learns
        it again from the store and the agents' hello."""
        dropped = self.book.abandon()
        if dropped:
            logger.warning("stopped leading: %d reports not committed, left to the agents", dropped)
        self.victims.victims.clear()

    async def close(self) -> None:
        """Write what waits for the group commit (on the way out)."""
        async with self.book.lock:
            try:
                await self.book.flush()
            except errors.StoreError as exc:  # not leading any more, or the store is away
                logger.warning("reports not committed on the way out: %s", exc)
        await self.acks.close()
