"""The state of the broker's job life cycle and its transitions (shared by `lifecycle`).

`Transitions` holds what every part of the life cycle reads and writes: the job records, the
queued set, quota holdings, jobs being preempted, open spans; `_move` is the one place a job
changes state (event, metrics, spans, log line, holdings). Nothing here awaits an agent.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

from broker.api import jobs as jobs_api
from broker.api import messages, status
from broker.api.status import JobState
from broker.dispatch import fleet as fleet_
from broker.scheduler import holdings, occupancy, planning, quotas, snapshot
from broker.state import errors, records
from broker.telemetry import jobspans, metrics

logger = logging.getLogger(__name__)

# reasons a gang failed that are not the workload's fault: the job is retried elsewhere
INFRA_REASONS = frozenset({"NodeLost", "Evicted", "PodDeleted", "ClusterLost", "LostByAgent"})
MAX_INFRA_RETRIES = 3
# states in which a job holds GPUs on a cluster (what quotas count)
HOLDING = frozenset({JobState.DISPATCHED, JobState.RUNNING})
PREEMPTED = "Preempted"


@dataclass
class Preempting:
    """A victim the broker asked its agent to stop, until its GPUs show free in a summary."""

    preemptor: str
    cluster: str
    reason: str
    message: str
    since: float  # monotonic
    confirmed: bool = False  # the agent reported the job gone
    summary_at: object | None = None  # the cluster's summary when it did
    handed: bool = False  # reported released to one planning cycle


class Transitions:
    def __init__(
        self,
        jobs: records.JobRecords,
        fleet: fleet_.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        cancel_grace_seconds: float = 30.0,
    ) -> None:
        self.jobs = jobs
        self.fleet = fleet
        self.meters = meters
        self.cancel_grace = cancel_grace_seconds
        self.lock = asyncio.Lock()
        self.queued: set[str] = {r.id for r in jobs if r.status.state == JobState.QUEUED}
        self.why: dict[str, tuple[str, ...]] = {}
        self.wakeup = asyncio.Event()
        self.spans = jobspans.JobSpans()
        self.requests: dict[str, jobs_api.GangRequest] = {}  # queued jobs' parsed shapes
        self.flush_needed = asyncio.Event()
        # tenancy: jobs holding GPUs, victims being preempted, why-reasons with their codes
        self.active: set[str] = {r.id for r in jobs if r.status.state in HOLDING}
        self.preempting: dict[str, Preempting] = {}
        self.preemptions: Counter[str] = Counter()  # victim's queue -> jobs preempted
        self.why_details: dict[str, tuple[planning.Reason, ...]] = {}
        self._models_of: dict[str, dict[str, int]] = {}
        self._views: dict[str, tuple[tuple[object, ...], snapshot.RunningJob]] = {}
        self.preempt_timeout = 2 * cancel_grace_seconds + 30.0
        # GPUs held per queue and model, kept on every transition (see `usage`)
        self.holdings = holdings.Holdings()
        for record in jobs:
            if record.status.state in HOLDING:
                self._hold(record)

    # ---- transitions ------------------------------------------------------------------

    def _move(self, record: status.JobRecord, state: JobState, reason: str, msg: str = "") -> None:
        before = record.status.state
        queued_at = record.status.events[-1].time if record.status.events else record.created
        record.record(state, reason, msg)
        now = record.status.events[-1].time
        logger.info(
            "job %s: %s -> %s (%s)",
            record.id,
            before.value,
            state.value,
            reason,
            extra={
                "job_id": record.id,
                "cluster": record.status.cluster or "",
                "trace_id": record.trace_id or "",
                "state": state.value,
            },
        )
        if state == JobState.DISPATCHED:
            self.spans.dispatched(record, queued_at=queued_at, now=now)
        elif state.terminal:
            self.spans.finished(record, now=now)
            self.requests.pop(record.id, None)
        if state == JobState.QUEUED:
            self.queued.add(record.id)
            self.wakeup.set()
        else:
            self.queued.discard(record.id)
            self.why.pop(record.id, None)
        if state.terminal:
            self.meters.jobs_finished.labels(state=state.value).inc()
        if state == JobState.RUNNING and before != JobState.RUNNING:
            started = record.event_time(JobState.QUEUED) or record.created
            latency = (record.status.events[-1].time - started).total_seconds()
            self.meters.submit_to_running.observe(latency)
        self._track(record, state)

    def _track(self, record: status.JobRecord, state: JobState) -> None:
        """Keep the jobs holding GPUs and their usage; a victim leaving them has stopped."""
        if state in HOLDING:
            self.active.add(record.id)
            self._hold(record)
            return
        self.active.discard(record.id)
        self._unhold(record.id)
        self._models_of.pop(record.id, None)
        if state != JobState.QUEUED:
            self.why_details.pop(record.id, None)
        entry = self.preempting.get(record.id)
        if entry is not None and not entry.confirmed:
            entry.confirmed = True
            cluster = self.fleet.clusters.get(entry.cluster)
            entry.summary_at = cluster.summary if cluster is not None else None

    def _hold(self, record: status.JobRecord) -> None:
        if record.id in self.holdings:
            return
        gpus = self._models_of.get(record.id)
        if gpus is None:
            cluster = self.fleet.clusters.get(record.status.cluster or "")
            summary = cluster.summary if cluster is not None else None
            gpus = occupancy.infer_models(
                jobs_api.gang_request(record.id, record.job),
                [m.model for m in summary.models] if summary else [],
            )
        spec = record.job.spec
        key = (spec.queue, spec.priority, spec.priority_class)
        self.holdings.hold(record.id, spec.queue, gpus, key)

    def _unhold(self, job_id: str) -> None:
        self.holdings.release(job_id)

    def usage(self) -> quotas.Usage:
        """GPUs held per queue and model (Dispatched and Running jobs), without a walk."""
        return self.holdings.usage()

    def running_jobs(self) -> list[snapshot.RunningJob]:
        """Jobs holding GPUs, as the planner sees them (`lifecycle.Lifecycle` builds them)."""
        raise NotImplementedError

    def resync_usage(self) -> None:
        """Recount the usage from the jobs themselves (models inferred from fresh summaries;
        store conflicts that put records back): the scheduler calls it every few seconds."""
        self.holdings.reset(self.running_jobs())

    def _requeue(self, record: status.JobRecord, reason: str, msg: str) -> None:
        record.status.cluster = None
        record.status.pods = []
        self._move(record, JobState.QUEUED, reason, msg)

    async def _send_cancel(
        self, cluster_name: str | None, job_id: str, epoch: int, reason: str, *, attempt: int
    ) -> None:
        if cluster_name is None:
            return
        cluster = self.fleet.clusters.get(cluster_name)
        if cluster is None or cluster.link is None:
            return
        message = messages.Cancel(
            job_id=job_id,
            epoch=epoch,
            reason=reason,
            grace_seconds=self.cancel_grace,
            attempt=attempt,
        )
        try:
            await cluster.link.send(message)
        except ConnectionError:
            logger.warning("cancel of %s not sent: %s disconnected", job_id, cluster_name)

    def _save_soon(self, record: status.JobRecord) -> None:
        self.jobs.save_soon(record)
        self.flush_needed.set()

    async def run_flusher(self, *, gather_seconds: float = 0.002) -> None:
        """Group commit of what agents report: one transaction for many updates."""
        while True:
            await self.flush_needed.wait()
            self.flush_needed.clear()
            await asyncio.sleep(gather_seconds)
            async with self.lock:
                try:
                    await self.jobs.flush()
                except errors.StoreError as exc:
                    logger.warning("group commit of %d jobs failed: %s", self.jobs.dirty, exc)
                    self.flush_needed.set()
                    await asyncio.sleep(0.5)


def attempt_of(record: status.JobRecord) -> int:
    """The attempt of the job's latest dispatch, as the agent is told it."""
    return max(record.status.attempts, 1)


def is_stale(record: status.JobRecord, attempt: int) -> bool:
    """A message about an attempt before the job's latest dispatch: it changes nothing."""
    return attempt < record.status.attempts
