"""Victims of preemption, from the cycle's choice until their GPUs show free.

`preempt` marks a cycle's victims (an event, committed) and sends their agents a Cancel
with reason Preempted and the victim's grace (`spec.preemption.gracePeriodSeconds`, else the
broker's cancel grace); each goes back to the queue when its agent reports it cancelled
(`reports`), which the agent does only once its pods are gone: through the grace the victim
still holds its GPUs (Running, `preempting`), its preemptor waits for it and nothing else is
preempted in its place (a victim not confirmed within twice its grace and 30 s is forgotten).
A `book.JobBook` observer notes when a victim stops holding GPUs; `releasing` tells the
planner which victims' GPUs their preemptors may count on (released once a summary newer than
that confirmation arrived; reported to one cycle, then forgotten).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.api import status
from broker.jobs import book, fleet, transitions
from broker.planning import planning, snapshot
from broker.state import errors
from broker.telemetry import metrics

logger = logging.getLogger(__name__)


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
    timeout: float = 0.0  # forgotten if not confirmed this long after `since` (0: the default)


class Preemptions:
    def __init__(
        self,
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        meters: metrics.BrokerMetrics,
        held_by: Callable[[str], tuple[str, dict[str, int]] | None],
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self.meters = meters
        self._held_by = held_by
        self.victims: dict[str, Preempting] = {}
        self.counts: Counter[str] = Counter()  # victim's queue -> jobs preempted
        self.timeout = 2 * clusters.cancel_grace + 30.0

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.victims

    def message_of(self, job_id: str) -> str | None:
        entry = self.victims.get(job_id)
        return entry.message if entry is not None else None

    def __call__(self, change: book.Change) -> None:
        """A victim that stops holding GPUs has stopped: wait for a summary that shows it."""
        if change.after.status.state in book.HOLDING:
            return
        entry = self.victims.get(change.after.id)
        if entry is not None and not entry.confirmed:
            entry.confirmed = True
            cluster = self.fleet.clusters.get(entry.cluster)
            entry.summary_at = cluster.summary if cluster is not None else None

    def releasing(self) -> list[snapshot.Releasing]:
        now = time.monotonic()
        out = []
        for victim, entry in list(self.victims.items()):
            cluster = self.fleet.clusters.get(entry.cluster)
            if entry.handed or cluster is None or cluster.lost:
                del self.victims[victim]
                continue
            if now - entry.since > max(self.timeout, entry.timeout):
                logger.warning("preemption of %s not confirmed in time: forgotten", victim)
                del self.victims[victim]
                continue
            released = (
                entry.confirmed
                and cluster.summary is not None
                and cluster.summary is not entry.summary_at
            )
            entry.handed = released
            held = self._held_by(victim)
            out.append(
                snapshot.Releasing(
                    victim,
                    entry.preemptor,
                    entry.cluster,
                    released,
                    queue=held[0] if held else "",
                    gpus=dict(held[1]) if held and not entry.confirmed else {},
                )
            )
        return out

    async def preempt(self, preemptions: Sequence[planning.Preemption]) -> int:
        """Stop a cycle's victims: a Cancel (reason Preempted, with the grace period) to their
        agents, once the Preempting event is committed. Returns the victims stopped."""
        if not preemptions:
            return 0
        async with self.book.lock:
            chosen: list[tuple[planning.Preemption, status.JobRecord]] = []
            for item in preemptions:
                record = self.book.latest(item.job_id)
                if (
                    record is None
                    or record.status.cluster != item.cluster
                    or record.status.state not in book.HOLDING
                    or record.status.cancel_requested
                    or record.id in self.victims
                ):
                    continue
                draft = self.book.draft(record.id)
                assert draft is not None
                draft.record(draft.status.state, "Preempting", item.message)
                chosen.append((item, draft))
            if not chosen:
                return 0
            try:
                await self.book.commit([draft for _, draft in chosen])
            except errors.StoreError as exc:
                logger.warning("preemption commit failed, victims keep running: %s", exc)
                return 0
            for item, draft in chosen:
                grace = self.grace_of(draft)
                self.victims[draft.id] = Preempting(
                    preemptor=item.preemptor,
                    cluster=item.cluster,
                    reason=item.reason,
                    message=item.message,
                    since=time.monotonic(),
                    timeout=2 * grace + 30.0,
                )
                queue = draft.job.spec.queue
                self.counts[queue] += 1
                label = self.meters.queue_label(queue)
                self.meters.preemptions.labels(queue=label, reason=item.reason).inc()
                await self.fleet.send_cancel(
                    draft.status.cluster,
                    draft.id,
                    epoch=draft.status.epoch,
                    reason=transitions.PREEMPTED,
                    attempt=transitions.attempt_of(draft),
                    grace_seconds=grace,
                )
        return len(chosen)

    def grace_of(self, record: status.JobRecord) -> float:
        """The grace a victim's pods get: its `spec.preemption.gracePeriodSeconds`, else the
        broker's cancel grace."""
        policy = record.job.spec.preemption
        return self.fleet.cancel_grace if policy is None else float(policy.grace_period_seconds)
