"""How a draft of a job record changes state: the rules every collaborator of the book shares.

Functions over a draft (`book.JobBook.draft`), nothing else: they record the event and the
fields that go with it, and the book applies the draft once it is committed. What a move
causes (metrics, spans, log lines, quota holdings) follows from the committed change, in the
book's observers (`observing`, `accounting`, `preempting`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from broker.api import policies, status
from broker.api.status import JobState

# reasons a gang failed that are not the workload's fault: retried by default (`retryOn`)
INFRA_REASONS = frozenset(policies.DEFAULT_RETRY_ON)
MAX_INFRA_RETRIES = policies.DEFAULT_BACKOFF_LIMIT
DEADLINE_EXCEEDED = policies.DEADLINE_EXCEEDED
PREEMPTED = "Preempted"
# an offer neither accepted nor rejected in time: withdrawn, the job queued again
OFFER_TIMEOUT = "OfferTimeout"
CLUSTER_LOST = "ClusterLost"
# a job the broker places on a cluster whose agent, saying hello, does not hold it
LOST_BY_AGENT = "LostByAgent"
# a job of `failurePolicy.clusterLost: wait` on a lost cluster, and that cluster's return
WAITING_FOR_CLUSTER = "WaitingForCluster"
CLUSTER_RETURNED = "ClusterReturned"


def move(
    draft: status.JobRecord,
    state: JobState,
    reason: str,
    message: str = "",
    *,
    by: str | None = None,
) -> None:
    draft.record(state, reason, message, by=by)


def requeue(draft: status.JobRecord, reason: str, message: str) -> None:
    """Back to the queue: off its cluster, its pods forgotten."""
    draft.status.cluster = None
    draft.status.pods = []
    draft.record(JobState.QUEUED, reason, message)


def fail_or_retry(draft: status.JobRecord, reason: str, message: str) -> bool:
    """An attempt failed with `reason`: queued again if the job's `failurePolicy` retries it
    (the reason in `retryOn`, fewer than `backoffLimit` retries made), else Failed. True if
    it was retried."""
    policy = draft.job.spec.failures
    if reason in policy.retried and draft.status.infra_retries < policy.backoff_limit:
        draft.status.infra_retries += 1
        retry = f"retry {draft.status.infra_retries} of {policy.backoff_limit}"
        requeue(draft, reason, f"{retry}: {message}" if message else retry)
        return True
    if reason in policy.retried:
        message = f"{message}; " if message else ""
        message += f"backoffLimit {policy.backoff_limit} reached"
    move(draft, JobState.FAILED, reason or "Failed", message)
    return False


def first_started(record: status.JobRecord) -> datetime | None:
    """When the job first ran (its first Running event, over all attempts)."""
    return record.event_time(JobState.RUNNING)


def active_deadline(record: status.JobRecord) -> datetime | None:
    """When the job's `failurePolicy.activeDeadlineSeconds` ends it: counted from its first
    start, from the times stored with it (so a restarted or new leader computes the same).
    None: no deadline, or it has not started yet."""
    policy = record.job.spec.failure_policy
    if policy is None or policy.active_deadline_seconds is None:
        return None
    started = first_started(record)
    if started is None:
        return None
    return started + timedelta(seconds=policy.active_deadline_seconds)


def exceed_deadline(draft: status.JobRecord, *, now: datetime) -> None:
    """The job ran past its active deadline: Failed (DeadlineExceeded). Its pods, if it has
    any, are for the caller to have deleted (a Cancel to its agent once committed)."""
    seconds = draft.job.spec.failures.active_deadline_seconds
    started = first_started(draft)
    ran = (now - started).total_seconds() if started is not None else 0.0
    move(
        draft,
        JobState.FAILED,
        DEADLINE_EXCEEDED,
        f"spec.failurePolicy.activeDeadlineSeconds {seconds} passed ({ran:.0f} s since its "
        "first start)",
    )


def wait_for_cluster(draft: status.JobRecord, message: str) -> None:
    """Its cluster is lost and the job waits for it there: the state stays, the event says
    so (`why` shows it)."""
    draft.record(draft.status.state, WAITING_FOR_CLUSTER, message)


def is_waiting_for_cluster(record: status.JobRecord) -> bool:
    events = record.status.events
    return bool(events) and events[-1].reason == WAITING_FOR_CLUSTER


def dispatch(draft: status.JobRecord, *, cluster: str, epoch: int) -> None:
    """A new attempt offered to `cluster` in its session `epoch`."""
    draft.status.cluster = cluster
    draft.status.epoch = epoch
    draft.status.attempts += 1
    draft.status.reasons = []
    draft.record(JobState.DISPATCHED, "Dispatched", f"offered to {cluster}")


def attempt_of(record: status.JobRecord) -> int:
    """The attempt of the job's latest dispatch, as the agent is told it."""
    return max(record.status.attempts, 1)


def is_stale(record: status.JobRecord, attempt: int) -> bool:
    """A message about an attempt before the job's latest dispatch: it changes nothing."""
    return attempt < record.status.attempts
