"""The agent's job table: the jobs it holds, their pods, and the job state pod phases imply.

Decides which state a job is in and how long its record is kept. Pure data and rules, no I/O,
no clock (`now` is passed in). `handling.JobHandler` changes it on offers, cancels and pod
events and lists it in `hello` after every (re)connect; `adopting` fills it at start.

A job is `Dispatched` once its pods are created, `Running` when at least `min_member` pods run
(or ran), `Succeeded` when every pod succeeded and `Failed` (with the pod's reason) when any pod
fails or disappears while it runs. States only move forward. A `Dispatched` job whose pod
stays Pending and says why (an image that cannot be pulled, unschedulable) is reported again
with that reason (`waiting_reason`). A terminal record is kept until
the broker acknowledged its final report (`updating.Updater`), however long the broker is
away, and `keep_reported` seconds more, so a re-sent offer stays idempotent; `hello` lists it
until acknowledged, so the broker never takes a finished job for a lost one.

The table holds one record per job, of the job's latest attempt (`TrackedJob.attempt`, the
broker's dispatch count): an offer of a later attempt replaces the record (`supersede`), one of
the same attempt is a re-send, and every update and hello entry says which attempt it is about.

A preempted job is `stopping` while its pods run through their grace period: it keeps its
state (Running), its pods' deletions fail nothing, and it is Cancelled once none is live.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from broker.api import jobs, messages, status

_RAN = frozenset({status.PodPhase.RUNNING, status.PodPhase.SUCCEEDED})
_LIVE = frozenset({status.PodPhase.PENDING, status.PodPhase.RUNNING})
KEEP_REPORTED_SECONDS = 60.0


@dataclass
class TrackedJob:
    """One job the agent holds, at its latest attempt: its pods and the state they imply."""

    job_id: str
    epoch: int
    namespace: str
    gpus: int
    min_member: int
    pods: dict[str, status.PodStatus]
    traceparent: str | None = None
    attempt: int = 1
    state: status.JobState = status.JobState.DISPATCHED
    reason: str = ""
    # pods still being created: pod events update phases, the job state waits
    binding: bool = True
    ran: int = 0  # pods Running or Succeeded
    succeeded: int = 0
    failure: str | None = None
    failure_message: str = ""
    terminal_at: float | None = None
    running_since_ns: int | None = None  # wall clock, for the job.running span
    report_seq: int | None = None  # its final report's seq, while not acknowledged
    acked_at: float | None = None  # when the broker acknowledged its final report
    # spec.failurePolicy.clusterLost: whether a fence (the cluster lease lapsed) stops it
    cluster_lost: jobs.ClusterLostPolicy = jobs.ClusterLostPolicy.REQUEUE
    queue: str = ""  # the job's spec.queue: what GPU utilisation is counted per ("": unknown)
    # why its pods are being deleted with a grace (Preempted): Cancelled once they are gone
    stopping: str | None = None
    stop_message: str = ""
    checkpoint: datetime | None = None  # the newest gpufed.io/last-checkpoint of its pods

    def set_phase(self, pod: status.PodStatus, phase: status.PodPhase, *, reason: str = "") -> None:
        """Move one pod to `phase`, keeping the counters right."""
        old = pod.phase
        if old == phase:
            if reason:
                pod.reason = reason
            return
        self.ran += (phase in _RAN) - (old in _RAN)
        self.succeeded += (phase == status.PodPhase.SUCCEEDED) - (old == status.PodPhase.SUCCEEDED)
        pod.phase = phase
        pod.reason = reason
        if self.failure is None and not self.state.terminal and self.stopping is None:
            if phase == status.PodPhase.FAILED:
                self.failure = reason or "Error"
            elif phase == status.PodPhase.DELETED and old in _LIVE:
                self.failure = "PodDeleted"
            if self.failure is not None:
                self.failure_message = f"pod {pod.name} on node {pod.node}: {self.failure}"

    def implied_state(self) -> tuple[status.JobState, str]:
        """The job state the pod phases imply."""
        if self.failure is not None:
            return status.JobState.FAILED, self.failure
        if self.succeeded == len(self.pods):
            return status.JobState.SUCCEEDED, "AllPodsSucceeded"
        if self.ran >= self.min_member:
            return status.JobState.RUNNING, "PodsRunning"
        return status.JobState.DISPATCHED, ""

    def advance(self, *, now: float) -> list[tuple[status.JobState, str]]:
        """Follow the pods: the (state, reason) steps taken, none while binding or stopping."""
        if self.binding or self.state.terminal or self.stopping is not None:
            return []
        state, reason = self.implied_state()
        if state == self.state == status.JobState.DISPATCHED:
            waiting = self.waiting_reason()
            if not waiting or waiting == self.reason:
                return []
            self._move(state, waiting)
            return [(state, waiting)]
        if state in (self.state, status.JobState.DISPATCHED):
            return []
        steps = []
        if state == status.JobState.SUCCEEDED and self.state == status.JobState.DISPATCHED:
            steps.append((status.JobState.RUNNING, "PodsRunning"))
        steps.append((state, reason))
        if state.terminal:
            self.finish(state, reason, now=now)
        else:
            self._move(state, reason)
        return steps

    def waiting_reason(self) -> str:
        """Why the job's pods do not start, as the first Pending pod that says so says it
        ("" when none does). Every pod event of a Dispatched job asks: one pass, no sort."""
        pending = status.PodPhase.PENDING
        first = min(
            (
                (pod.name, pod.reason)
                for pod in self.pods.values()
                if pod.phase == pending and pod.reason
            ),
            default=("", ""),
        )
        return first[1]

    def finish(self, state: status.JobState, reason: str, *, now: float) -> None:
        self._move(state, reason)
        self.terminal_at = now

    def _move(self, state: status.JobState, reason: str) -> None:
        self.state = state
        self.reason = reason

    def live_pods(self) -> list[status.PodStatus]:
        return [pod for pod in self.pods.values() if pod.phase in _LIVE]

    def placements(self) -> list[status.PodPlacement]:
        return [
            status.PodPlacement(name=p.name, task=p.task, node=p.node, gpus=p.gpus)
            for p in self.pods.values()
        ]

    def pod_statuses(self) -> list[status.PodStatus]:
        return [pod.model_copy() for pod in self.pods.values()]

    def accepted(self) -> messages.Accepted:
        return messages.Accepted(
            job_id=self.job_id,
            epoch=self.epoch,
            pods=self.placements(),
            traceparent=self.traceparent,
            attempt=self.attempt,
        )

    def agent_job(self) -> messages.AgentJob:
        return messages.AgentJob(
            job_id=self.job_id,
            epoch=self.epoch,
            state=self.state,
            pods=self.pod_statuses(),
            reason=self.reason if self.state.terminal else None,
            attempt=self.attempt,
        )

    def update(
        self, state: status.JobState | None = None, reason: str | None = None
    ) -> messages.JobUpdate:
        state = state or self.state
        return messages.JobUpdate(
            job_id=self.job_id,
            epoch=self.epoch,
            state=state,
            reason=self.reason if reason is None else reason,
            message=self.failure_message if state == status.JobState.FAILED else "",
            pods=self.pod_statuses(),
            traceparent=self.traceparent,
            attempt=self.attempt,
        )


@dataclass
class JobTable:
    records: dict[str, TrackedJob] = field(default_factory=dict)
    keep_reported: float = KEEP_REPORTED_SECONDS

    def __iter__(self) -> Iterator[TrackedJob]:
        return iter(self.records.values())

    def __len__(self) -> int:
        return len(self.records)

    def get(self, job_id: str) -> TrackedJob | None:
        return self.records.get(job_id)

    def add(self, record: TrackedJob) -> None:
        self.records[record.job_id] = record

    def remove(self, job_id: str) -> None:
        self.records.pop(job_id, None)

    def supersede(self, job_id: str, attempt: int) -> TrackedJob | None:
        """Make room for `attempt` of a job: the record of an earlier attempt is dropped (its
        final state was reported, or no longer matters: the broker has moved on) and returned,
        so its live pods can be deleted. None when the table holds no earlier attempt."""
        held = self.records.get(job_id)
        if held is None or held.attempt >= attempt:
            return None
        del self.records[job_id]
        return held

    def gpus_in_use(self, namespace: str) -> int:
        return sum(
            r.gpus
            for r in self.records.values()
            if r.namespace == namespace and not r.state.terminal
        )

    def prune(self, *, now: float) -> list[TrackedJob]:
        """Forget terminal records whose final report the broker acknowledged a while ago;
        returns them."""
        gone = [
            r
            for r in self.records.values()
            if r.state.terminal and r.acked_at is not None and now - r.acked_at > self.keep_reported
        ]
        for record in gone:
            del self.records[record.job_id]
        return gone

    def for_hello(self, *, now: float) -> list[TrackedJob]:
        """Every job the broker should hear about in `hello`: the ones not finished, and the
        finished ones whose final report it has not acknowledged."""
        self.prune(now=now)
        return [r for r in self.records.values() if not r.state.terminal or r.acked_at is None]
