"""Adopting the jobs a restarted agent finds in its cluster, so that none of them runs twice.

Decides, for each job found, the attempt it is taken in at and the state its pods imply. An
agent that restarts has an empty job table, but its pods may still run. At start (after
`backend.start()`, before the first hello) `app.run_agent` hands `backend.held_jobs()` to
`handling.JobHandler.adopt`, which takes each job into the table through `record_of`: the pods
as the cluster reports them, the job state they imply (the same rules as for a live job:
`Running` once `min_member` pods run or ran, `Succeeded` when all succeeded, `Failed` when one
failed), and `Dispatched` while too few run yet. A gang that lost pods while the agent was away
(fewer pods than its `gpufed.io/gang-size`) failed with `PodDeleted`, unless every pod left
succeeded (the missing ones were cleaned up after they finished).

A job the broker ran again on this cluster may have pods of several attempts (a failed pod
stays for its logs). Each pod's attempt is in its name (`broker.api.gangs.pod_name`, `-a{n}`
from the second attempt on; the `gpufed.io/attempt` annotation says the same, 1 when absent,
for pods named otherwise): the job is adopted at its latest attempt, and the handler deletes
the pods of the earlier ones (`earlier_pods`).

The hello then lists them and the broker reconciles: it adopts the jobs it still has on this
cluster and cancels those it moved elsewhere meanwhile, whose pods the agent then deletes
(fencing). Pure: no I/O here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from broker.api import gangs, jobs, status
from member_agent.cluster import base
from member_agent.jobs import table

logger = logging.getLogger(__name__)

POD_DELETED = "PodDeleted"


def split_attempts(
    held: base.HeldJob,
) -> tuple[int, list[status.PodStatus], list[status.PodStatus]]:
    """The job's latest attempt, its pods, and the pods of earlier attempts."""
    by_attempt: dict[int, list[status.PodStatus]] = {}
    for pod in held.pods:
        by_attempt.setdefault(gangs.attempt_of_pod(pod.name), []).append(pod)
    if len(by_attempt) <= 1:  # one attempt: the annotation may know it when the names do not
        latest = max([*by_attempt, held.attempt])
        return latest, list(held.pods), []
    latest = max(by_attempt)
    earlier = [pod for attempt, pods in by_attempt.items() if attempt != latest for pod in pods]
    return latest, by_attempt[latest], earlier


def earlier_pods(held: base.HeldJob) -> list[status.PodStatus]:
    """The pods of a found job's earlier attempts still in the cluster: to delete."""
    return [pod for pod in split_attempts(held)[2] if pod.phase != status.PodPhase.DELETED]


def record_of(held: base.HeldJob, *, now: float) -> table.TrackedJob:
    """The job table's record of a job found in the cluster, at its latest attempt, in the
    state that attempt's pods imply."""
    attempt, pods, earlier = split_attempts(held)
    record = table.TrackedJob(
        job_id=held.job_id,
        epoch=held.epoch,
        namespace=held.namespace,
        # a shared-GPU pod holds one slot and counts one GPU, as in `held.gpus`
        gpus=sum(len(pod.gpus) for pod in pods) if earlier else held.gpus,
        min_member=held.min_member,
        pods={
            pod.name: status.PodStatus(name=pod.name, task=pod.task, node=pod.node, gpus=pod.gpus)
            for pod in pods
        },
        traceparent=held.traceparent,
        attempt=attempt,
        binding=False,
        cluster_lost=_cluster_lost(held.cluster_lost),
        queue=held.queue,
    )
    for pod in pods:
        record.set_phase(record.pods[pod.name], pod.phase, reason=pod.reason)
    missing = held.gang_size - len(pods)
    if missing > 0 and record.failure is None and record.succeeded < len(record.pods):
        record.failure = POD_DELETED
        record.failure_message = (
            f"{missing} of the gang's {held.gang_size} pods disappeared while the agent was away"
        )
    record.advance(now=now)
    return record


def _cluster_lost(value: str) -> jobs.ClusterLostPolicy:
    """The policy a pod's annotation names; requeue (the fence stops it) if it names none."""
    try:
        return jobs.ClusterLostPolicy(value)
    except ValueError:
        return jobs.ClusterLostPolicy.REQUEUE


def adopt_jobs(
    jobs: table.JobTable, held: Mapping[str, base.HeldJob], *, now: float
) -> list[table.TrackedJob]:
    """Add the held jobs the table does not know yet; returns the records added."""
    adopted = [record_of(job, now=now) for job_id, job in held.items() if not jobs.get(job_id)]
    for record in adopted:
        jobs.add(record)
    if adopted:
        states = Counter(record.state.value for record in adopted)
        logger.info(
            "adopted %d jobs found in the cluster: %s",
            len(adopted),
            ", ".join(f"{count} {state}" for state, count in sorted(states.items())),
        )
    return adopted
