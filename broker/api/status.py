"""A job's state, its pods and its history, as the API shows them."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.json_schema import SkipJsonSchema

from broker.api import arrays, dependencies, jobs

ResolvedDependency = dependencies.Resolved  # a field of JobStatus is named `dependencies`


class JobState(StrEnum):
    WAITING = "Waiting"  # for its spec.dependsOn: not planned until they are met
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


# one transition of a job; a slotted dataclass, not a model: a job keeps every one of them,
# and a model's own dictionary and set would make each several times larger (no docstring:
# it would become the API schema's description)
@pydantic_dataclass(frozen=True, slots=True, config=_Model.model_config)
class JobEvent:
    time: datetime
    state: JobState
    reason: str
    message: str = ""
    cluster: str | None = None
    # who asked for it (a cancel: `submitter of tenant team-a (token 'ci-a')`); left out if none
    by: Annotated[str | None, Field(exclude_if=lambda value: value is None)] = None


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
    # failed attempts retried so far (what `failurePolicy.backoffLimit` bounds)
    infra_retries: int = Field(0, alias="infraRetries")
    # the newest `gpufed.io/last-checkpoint` its pods showed (the agents report it)
    last_checkpoint: datetime | None = Field(None, alias="lastCheckpoint")
    # what each spec.dependsOn entry resolved to at submit; left out if the job has none
    dependencies: list[ResolvedDependency] | None = Field(
        None, exclude_if=lambda value: value is None
    )


STORED_ONLY = frozenset({"trace_parent"})  # JobRecord fields the API does not show
# validation context: the GPUJob a record read with `"job": null` has (`records.decode_record`)
KNOWN_JOB = "gpufed.known-job"


class JobRecord(_Model):
    """A job as the broker stores it and the API returns it."""

    id: str
    tenant: str
    job: jobs.GPUJob
    status: JobStatus = Field(default_factory=JobStatus)
    created: datetime = Field(default_factory=utcnow)
    # the job's trace context (W3C: the `job` span of trace `traceId`): the one job JSON shows
    traceparent: str | None = None
    # the submit request's span, the `job` span's parent: kept in the store, never shown
    trace_parent: SkipJsonSchema[str | None] = Field(None, alias="traceParent")
    trace_id: str | None = Field(None, alias="traceId")
    idempotency_key: str | None = Field(None, alias="idempotencyKey")
    # the array the job is one index of (spec.array); left out for a job of no array
    array: arrays.ArrayMember | None = Field(None, exclude_if=lambda value: value is None)

    @field_validator("job", mode="wrap")
    @classmethod
    def _known_job(
        cls, value: object, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> jobs.GPUJob:
        """The job a reader already has (context `KNOWN_JOB`) for a record read without it."""
        if value is None and isinstance(info.context, dict):
            known = info.context.get(KNOWN_JOB)
            if isinstance(known, jobs.GPUJob):
                return known
        job: jobs.GPUJob = handler(value)
        return job

    def api_json(self) -> dict[str, Any]:
        """The job as the API shows it: as stored, less what only the store keeps."""
        return self.model_dump(
            mode="json", by_alias=True, exclude=set(STORED_ONLY), context=jobs.AS_VALIDATED
        )

    def record(
        self,
        state: JobState,
        reason: str,
        message: str = "",
        *,
        now: datetime | None = None,
        by: str | None = None,
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
                by=by,
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

    def api_json(self) -> dict[str, Any]:
        """The page as the API shows it (each job's `JobRecord.api_json`)."""
        hidden = {"items": {"__all__": set(STORED_ONLY)}}
        return self.model_dump(
            mode="json", by_alias=True, exclude=hidden, context=jobs.AS_VALIDATED
        )


class SubmitResponse(_Model):
    id: str
    state: JobState
    trace_id: str | None = Field(None, alias="traceId")
    # an array's submit: the array (its jobs are `<array.id>-<index>`; `id` is index 0's)
    array: arrays.ArrayMember | None = Field(None, exclude_if=lambda value: value is None)
