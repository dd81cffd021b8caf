"""How a draft of a job record changes state: the rules every collaborator of the book shares.

Functions over a draft (`book.JobBook.draft`), nothing else: they record the event and the
fields that go with it, and the book applies the draft once it is committed. What a move
causes (metrics, spans, log lines, quota holdings) follows from the committed change, in the
book's observers (`observing`, `accounting`, `preempting`).
"""

from __future__ import annotations

from broker.api import status
from broker.api.status import JobState

# reasons a gang failed that are not the workload's fault: the job is retried elsewhere
INFRA_REASONS = frozenset({"NodeLost", "Evicted", "PodDeleted", "ClusterLost", "LostByAgent"})
MAX_INFRA_RETRIES = 3
PREEMPTED = "Preempted"
# an offer neither accepted nor rejected in time: withdrawn, the job queued again
OFFER_TIMEOUT = "OfferTimeout"
CLUSTER_LOST = "ClusterLost"
# a job of `failurePolicy.clusterLost: wait` on a lost cluster, and that cluster's return
WAITING_FOR_CLUSTER = "WaitingForCluster"
CLUSTER_RETURNED = "ClusterReturned"


def move(draft: status.JobRecord, state: JobState, reason: str, message: str = "") -> None:
    draft.record(state, reason, message)


def requeue(draft: status.JobRecord, reason: str, message: str) -> None:
    """Back to the queue: off its cluster, its pods forgotten."""
    draft.status.cluster = None
    draft.status.pods = []
    draft.record(JobState.QUEUED, reason, message)


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
