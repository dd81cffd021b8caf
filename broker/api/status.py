"""A job's state, its pods and its history, as the API shows them."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from broker.api import jobs


class JobState(StrEnum):
    QUEUED = "Queued"
    DISPATCHED = "Dispatched"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class PodPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    DELETED = "Deleted"


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JobEvent(_Model):
    time: datetime
    state: JobState
    reason: str
    message: str = ""
    cluster: str | None = None


class GPUSlot(_Model):
    """One GPU a pod holds: its index on the node and the milli-GPU taken."""

    index: int
    milli: int = 1000


class PodPlacement(_Model):
    name: str
    task: str
    node: str
    gpus: list[GPUSlot] = Field(default_factory=list)


class PodStatus(_Model):
    name: str
    task: str
    node: str
    gpus: list[GPUSlot] = Field(default_factory=list)
    phase: PodPhase = PodPhase.PENDING
    reason: str = ""


class JobStatus(_Model):
    state: JobState = JobState.QUEUED
    cluster: str | None = None
    epoch: int = 0
    attempts: int = 0
    pods: list[PodStatus] = Field(default_factory=list)
    events: list[JobEvent] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list, description="why it is not placed yet")
    cancel_requested: bool = Field(False, alias="cancelRequested")
    infra_retries: int = Field(0, alias="infraRetries")


class JobRecord(_Model):
    """A job as the broker stores it and the API returns it."""

    id: str
    tenant: str
    job: jobs.GPUJob
    status: JobStatus = Field(default_factory=JobStatus)
    created: datetime = Field(default_factory=utcnow)
    traceparent: str | None = None
    trace_parent: str | None = Field(None, alias="traceParent")
    trace_id: str | None = Field(None, alias="traceId")
    idempotency_key: str | None = Field(None, alias="idempotencyKey")

    def record(
        self, state: JobState, reason: str, message: str = "", *, now: datetime | None = None
    ) -> None:
        """Move to `state`, keeping the transition in the history."""
        self.status.state = state
        self.status.events.append(
            JobEvent(
                time=now or utcnow(),
                state=state,
                reason=reason,
                message=message,
                cluster=self.status.cluster,
            )
        )

    def event_time(self, state: JobState) -> datetime | None:
        for event in self.status.events:
            if event.state == state:
                return event.time
        return None


class ListMeta(_Model):
    # the token of the next page (`GET /v1/jobs?continue=`); absent on the last page
    continue_: str | None = Field(None, alias="continue")


class JobList(_Model):
    items: list[JobRecord]
    metadata: ListMeta = Field(default_factory=ListMeta)


class SubmitResponse(_Model):
    id: str
    state: JobState
    trace_id: str | None = Field(None, alias="traceId")
