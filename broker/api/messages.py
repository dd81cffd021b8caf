"""Messages of the agent ↔ broker session (WebSocket, JSON text frames).

Every message is versioned (`v`) and may carry the W3C trace context (`traceparent`), so a
job's trace follows it across processes. The agent always starts with `hello`; the broker
answers `welcome` with the session epoch that fences every offer.
"""

from __future__ import annotations

from typing import Annotated, Literal

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


class Accepted(_Msg):
    type: Literal["accepted"] = "accepted"
    job_id: str
    epoch: int
    pods: list[status.PodPlacement]


class Rejected(_Msg):
    type: Literal["rejected"] = "rejected"
    job_id: str
    epoch: int
    reasons: list[str]


class JobUpdate(_Msg):
    """A state change of a job the agent runs (Running, Succeeded, Failed, Cancelled)."""

    type: Literal["job_status"] = "job_status"
    job_id: str
    epoch: int
    state: status.JobState
    reason: str = ""
    message: str = ""
    pods: list[status.PodStatus] = Field(default_factory=list)


class Cancel(_Msg):
    type: Literal["cancel"] = "cancel"
    job_id: str
    epoch: int
    reason: str = "Cancelled"
    grace_seconds: float = 30.0


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
    return message.model_dump_json(by_alias=True, exclude_none=True)
