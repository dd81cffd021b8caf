"""A cycle's plan made real: the queued jobs as the planner sees them, and the dispatch of
its assignments. Called by `scheduling.Scheduler`.

`dispatch` drafts every assignment as Dispatched (a new attempt, the cluster's epoch) under
the book's lock, commits them with compare-and-swap once it let the lock go
(`JobBook.launch`), and only then records the offers in flight and sends them. A commit that
fails changes nothing: the jobs stay Queued in the book as in the store, their GPUs are not
taken from any cluster, and the next cycle plans them again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.api import clusterchoice, gangs, messages, status
from broker.api.status import JobState
from broker.jobs import accounting, book, fleet, transitions
from broker.planning import fitting, planning, snapshot
from broker.state import errors
from broker.telemetry import jobspans

logger = logging.getLogger(__name__)

ImagesOf = Callable[[str, str], list[str] | None]  # (tenant, queue) → allowed image prefixes


@dataclass(frozen=True)
class Dispatched:
    """What one dispatch did: offers committed and sent, and whether the commit failed."""

    committed: int = 0
    sent: int = 0
    failed: str | None = None  # the store's error, if the commit failed


class Dispatcher:
    def __init__(
        self,
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        accounts: accounting.Accounting,
        spans: jobspans.JobSpans,
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.accounts = accounts
        self.spans = spans
        self._requests: dict[str, gangs.GangRequest] = {}  # queued jobs' parsed shapes

    def pending(self) -> list[snapshot.PendingJob]:
        """The queued jobs as the planner sees them; runs every cycle, so it only looks up."""
        excluded: dict[str, set[str]] = {}
        for cluster in self.fleet.clusters.values():
            for job_id in cluster.rejected:
                excluded.setdefault(job_id, set()).add(cluster.name)
        queued = self.book.queued()
        out = []
        for job_id in queued:
            request = self._requests.get(job_id)
            view = self.view(job_id, frozenset(excluded.get(job_id, ())), request=request)
            if view is None:
                continue
            if request is None:  # a job's spec never changes: parse its shapes once
                self._requests[job_id] = view.request
            out.append(view)
        if len(self._requests) > 2 * len(queued) + 64:
            self._requests = {k: v for k, v in self._requests.items() if k in queued}
        return out

    def view(
        self,
        job_id: str,
        excluded: frozenset[str] = frozenset(),
        *,
        request: gangs.GangRequest | None = None,
    ) -> snapshot.PendingJob | None:
        """One job as the planner sees it, None if it is not pending (`request`: its shapes,
        parsed before; the scheduler keeps its pending jobs between cycles)."""
        record = self.book.get(job_id)
        if (
            record is None
            or record.status.state != JobState.QUEUED
            or record.status.cancel_requested
        ):
            return None
        return snapshot.PendingJob(
            job_id=job_id,
            queue=record.job.spec.queue,
            priority=record.job.spec.priority,
            created=record.created,
            request=request or self.book.gang(record),
            excluded=excluded,
            priority_class=record.job.spec.priority_class,
            queued_since=record.status.events[-1].time if record.status.events else None,
            clusters=clusterchoice.choice_of(record.job.spec.clusters),
            array=None
            if record.array is None
            else snapshot.ArrayLimit(record.array.id, record.array.parallelism),
        )

    def note_unplaced(self, plan: planning.CyclePlan) -> None:
        now = status.utcnow()
        for miss in plan.unplaceable:
            self.book.note_waiting(miss.job_id, book.Waiting(miss.reasons, miss.details))
            self.spans.waiting(miss.job_id, miss.reasons, now=now)

    async def dispatch(
        self, plan: planning.CyclePlan, *, images: ImagesOf | None = None
    ) -> Dispatched:
        """Commit a cycle's assignments (Dispatched) and send the offers; each offer carries
        the image prefixes `images` says its job may run (tenant, queue → prefixes; None: any
        image), as they are now: a job submitted before they were narrowed is refused by the
        agent.

        The drafts are made under the book's lock and written without it (`JobBook.launch`):
        agents' reports, cancels and the group commit go on during the store's round trip,
        and whatever touches one of these jobs meanwhile waits for its write. A job with a
        write pending (a report's draft, a commit in flight) is left to the next cycle."""
        self.note_unplaced(plan)
        async with self.book.lock:
            chosen: list[tuple[status.JobRecord, fitting.Fit, fleet.Cluster]] = []
            for assignment in plan.assignments:
                record = self.book.get(assignment.job_id)
                cluster = self.fleet.clusters.get(assignment.cluster)
                if (
                    record is None
                    or record.status.state != JobState.QUEUED
                    or cluster is None
                    or not self.book.settled(record.id)
                ):
                    continue
                draft = book.draft_of(record)
                transitions.dispatch(draft, cluster=cluster.name, epoch=cluster.epoch)
                fit = fitting.Fit(cluster.name, assignment.takes, leftover=0)
                self.accounts.expect(draft.id, fit.gpus_by_model)
                chosen.append((draft, fit, cluster))
            if not chosen:
                return Dispatched()
            launch = self.book.launch([draft for draft, _, _ in chosen])
        failed = None
        try:
            await self.book.land(launch)
        except errors.StoreError as exc:
            failed = str(exc) or type(exc).__name__
        # the transactions that went through (all of them, unless one failed)
        committed = [item for item in chosen if self.book.get(item[0].id) is item[0]]
        if failed is not None:
            logger.warning(
                "dispatch of %d of %d jobs not committed, they stay queued: %s",
                len(chosen) - len(committed),
                len(chosen),
                failed,
            )
            for draft, _, _ in chosen:
                self.accounts.forget(draft.id)
        chosen = committed
        sent_at = time.monotonic()
        for draft, fit, cluster in chosen:
            cluster.inflight[draft.id] = fleet.InFlight(
                fit=fit, sent_at=sent_at, attempt=transitions.attempt_of(draft)
            )
        sent = 0
        for draft, _, cluster in chosen:
            offer = messages.Offer(
                job_id=draft.id,
                epoch=draft.status.epoch,
                tenant=draft.tenant,
                job=draft.job,
                traceparent=self.spans.offer_traceparent(draft),
                attempt=transitions.attempt_of(draft),
                allowed_images=images(draft.tenant, draft.job.spec.queue) if images else None,
            )
            if await self.fleet.send(cluster.name, offer):
                sent += 1
        return Dispatched(committed=len(chosen), sent=sent, failed=failed)
