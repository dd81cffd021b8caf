"""Messages of the agent ↔ broker session (WebSocket, JSON text frames).

Every message is versioned (`v`) and may carry the W3C trace context (`traceparent`), so a
job's trace follows it across processes. The agent always starts with `hello`; the broker
answers `welcome` with the session epoch that fences every offer.

A job the broker runs again (a retry after an infrastructure failure, a preemption, a lost
cluster, a rejection) is offered with the next `attempt`, and every message about the job says
which attempt it is about: an agent that still holds an earlier attempt starts the new one
instead of taking the offer for a re-send, and the broker ignores what is said about an
attempt it has moved past. An `attempt` of 1 is left out on the wire (`encode`), so brokers and
agents from before attempts existed, which forbid unknown fields, still read first attempts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from broker.api import inventory, jobs, status

PROTOCOL_VERSION = 1


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    v: int = PROTOCOL_VERSION
    traceparent: str | None = None


class AgentJob(BaseModel):
    """A job the agent holds, as it tells the broker in hello."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    epoch: int
    state: status.JobState
    pods: list[status.PodStatus] = Field(default_factory=list)
    # why it reached its final state (NodeLost, OOMKilled, ...); None while it runs
    reason: str | None = None
    attempt: Annotated[int, Field(ge=1)] = 1


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    cluster: str
    agent_version: str = "0.1.0"
    jobs: list[AgentJob] = Field(default_factory=list)


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    epoch: int
    heartbeat_seconds: float = 5.0


class Summary(_Msg):
    """A full summary (`full`) or a delta that replaces the listed models only."""

    type: Literal["summary"] = "summary"
    full: bool = True
    summary: inventory.ClusterSummary


class Offer(_Msg):
    type: Literal["offer"] = "offer"
    job_id: str
    epoch: int
    tenant: str
    job: jobs.GPUJob
    # the broker's dispatch count of the job: 2 and up when it runs again
    attempt: Annotated[int, Field(ge=1)] = 1


class Accepted(_Msg):
    type: Literal["accepted"] = "accepted"
    job_id: str
    epoch: int
    pods: list[status.PodPlacement]
    attempt: Annotated[int, Field(ge=1)] = 1


class Rejected(_Msg):
    type: Literal["rejected"] = "rejected"
    job_id: str
    epoch: int
    reasons: list[str]
    attempt: Annotated[int, Field(ge=1)] = 1


class JobUpdate(_Msg):
    """A state change of a job the agent runs (Running, Succeeded, Failed, Cancelled)."""

    type: Literal["job_status"] = "job_status"
    job_id: str
    epoch: int
    state: status.JobState
    reason: str = ""
    message: str = ""
    pods: list[status.PodStatus] = Field(default_factory=list)
    attempt: Annotated[int, Field(ge=1)] = 1


class Cancel(_Msg):
    type: Literal["cancel"] = "cancel"
    job_id: str
    epoch: int
    reason: str = "Cancelled"
    grace_seconds: float = 30.0
    # the attempt to stop: an agent holding a later one keeps it
    attempt: Annotated[int, Field(ge=1)] = 1


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    seq: int = 0


Message = Annotated[
    Hello | Welcome | Summary | Offer | Accepted | Rejected | JobUpdate | Cancel | Heartbeat,
    Field(discriminator="type"),
]
MESSAGE = TypeAdapter(Message)


def decode(text: str | bytes) -> Message:
    """Parse one frame; raises pydantic.ValidationError on anything malformed."""
    return MESSAGE.validate_json(text)


def encode(message: _Msg) -> str:
    return message.model_dump_json(
        by_alias=True, exclude_none=True, exclude=_first_attempts(message)
    )


def _first_attempts(message: _Msg) -> dict[str, Any] | set[str] | None:
    """The `attempt` fields at 1, to leave out of the frame (see the module docstring)."""
    if isinstance(message, Hello):
        firsts = {i: {"attempt"} for i, job in enumerate(message.jobs) if job.attempt == 1}
        return {"jobs": firsts} if firsts else None
    if getattr(message, "attempt", None) == 1:
        return {"attempt"}
    return None
