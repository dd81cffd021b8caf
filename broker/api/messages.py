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

Final reports are acknowledged (protocol 2). A `job_status` with a final state (Succeeded,
Failed, Cancelled) carries a `seq`, unique within the agent process. The agent keeps the report
and sends it again (after every welcome, and on the live session while it stays unanswered)
until the broker answers `ack` with that `seq`; the broker does so only once the report is
committed to its store, or at once when it changes nothing (applied already, or about an
attempt the broker has moved past), so a report sent twice is applied once. Until then `hello`
lists the job in its final state. A report is never dropped for a broker away too long, and a
job never runs again because its report was lost. An `ack` names the session `epoch` it
answers; an agent ignores one of another session.

Versions: `v` is the sender's protocol version. A broker of protocol 2 acks only reports that
carry a `seq`, so agents of protocol 1 never see an `ack`. An agent of protocol 2 sends `seq`
only once a welcome with `v` >= `ACKS_SINCE` said the broker acks; with an older broker it
counts a final report delivered once written, as protocol 1 did.

The cluster lease (protocol 3, `leases`): every message of the broker on a live session renews
the agent's lease, and an agent that hears nothing for its fence time fences itself (no new
pods; the pods of jobs whose `clusterLost` policy is `requeue` deleted). A broker welcomes an
agent whose hello says `v` >= `LEASE_SINCE` with its grace (`lost_after_seconds`), from which
the agent takes its fence time; an older agent is not sent the field, which it would refuse.

Checkpoints (protocol 4): a workload may keep the annotation `gpufed.io/last-checkpoint` (an
RFC 3339 time) current on its pods; the agent reports the newest of a job's pods in a
`job_status` (`checkpoint`), only to a broker whose welcome says `v` >= `CHECKPOINTS_SINCE`,
and the broker prefers victims that lose the least work since theirs. A Cancel with reason
`Preempted` is a preemption: the agent first annotates the pods
`gpufed.io/preemption-notice` with the deadline (now + `grace_seconds`), then deletes them with
that grace, and reports the job Cancelled only once its pods are gone, so the broker never
counts their GPUs free before. An offer carries of the job's policies only `clusterLost`
(`policies.BROKER_ONLY` is left out of the frame): every agent version reads it.

Cluster labels (protocol 5): the agent's summaries carry the cluster's labels
(`ClusterSummary.labels`, `gpufed agent --cluster-label`), only to a broker whose welcome says
`v` >= `LABELS_SINCE`: an older broker, which forbids unknown fields, is sent none. A summary
without the field is a cluster without labels. An offer leaves `spec.clusters` out.

GPU health (protocol 6): the agent's summaries carry `ClusterSummary.gpu_health` (its
unhealthy GPUs and the nodes it cordoned for GPU failures) only to a broker whose welcome says
`v` >= `GPU_HEALTH_SINCE`; to an older one the field is left out (None is not encoded).

MIG (protocol 7): each model of a summary may carry `ModelSummary.mig`, its MIG devices per
profile (total, free, nodes by free), only to a broker whose welcome says `v` >= `MIG_SINCE`;
to an older one, which forbids unknown fields, the field is left out (None), and that broker
sends no MIG job anywhere (it cannot tell where the slices are). A summary without the field
is a model without MIG devices: a newer broker sends an older agent no MIG job.

Trusted images (protocol 8): an offer carries the image prefixes the job may run
(`Offer.allowed_images`, `broker.api.images`: its tenant's allotment narrowed by its queue, as
the broker has them when it offers), and the agent refuses an offer naming another image,
creating nothing. It is sent only to an agent whose hello says `v` >= `IMAGES_SINCE`
(`encode(..., peer=)`): an older one, which forbids unknown fields, is sent none and relies on
the broker's check at submit. An offer without the field restricts no image.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from broker.api import images, inventory, jobs, policies, status

# every number on the wire is bounded (int64): a frame with a larger one is refused
WireInt = Annotated[int, Field(ge=0, le=2**63 - 1)]
Positive = Annotated[int, Field(ge=1, le=2**63 - 1)]
PROTOCOL_VERSION = 8
ACKS_SINCE = 2  # the protocol version from which brokers acknowledge final reports
LEASE_SINCE = 3  # the protocol version from which agents read the broker's grace in welcome
CHECKPOINTS_SINCE = 4  # the protocol version from which brokers read `JobUpdate.checkpoint`
LABELS_SINCE = 5  # the protocol version from which brokers read `ClusterSummary.labels`
GPU_HEALTH_SINCE = 6  # the protocol version from which brokers read `ClusterSummary.gpu_health`
MIG_SINCE = 7  # the protocol version from which brokers read `ModelSummary.mig`
IMAGES_SINCE = 8  # the protocol version from which agents read `Offer.allowed_images`


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    v: Annotated[int, Field(ge=0, le=1000)] = PROTOCOL_VERSION
    traceparent: str | None = None


class AgentJob(BaseModel):
    """A job the agent holds, as it tells the broker in hello."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    epoch: WireInt
    state: status.JobState
    pods: list[status.PodStatus] = Field(default_factory=list)
    # why it reached its final state (NodeLost, OOMKilled, ...); None while it runs
    reason: str | None = None
    attempt: Positive = 1


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    cluster: str
    agent_version: str = "0.1.0"
    jobs: list[AgentJob] = Field(default_factory=list)


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    epoch: WireInt
    heartbeat_seconds: float = 5.0
    # the broker's lost-cluster grace (protocol 3): the agent fences itself before it ends
    lost_after_seconds: Annotated[float, Field(gt=0, le=10**9)] | None = None


class Summary(_Msg):
    """A full summary (`full`) or a delta that replaces the listed models only."""

    type: Literal["summary"] = "summary"
    full: bool = True
    summary: inventory.ClusterSummary


class Offer(_Msg):
    type: Literal["offer"] = "offer"
    job_id: str
    epoch: WireInt
    tenant: str
    job: jobs.GPUJob
    # the broker's dispatch count of the job: 2 and up when it runs again
    attempt: Positive = 1
    # the image prefixes the job may run, normalized (protocol 8; None: any image)
    allowed_images: Annotated[list[str], Field(max_length=images.MAX_PREFIXES)] | None = None


class Accepted(_Msg):
    type: Literal["accepted"] = "accepted"
    job_id: str
    epoch: WireInt
    pods: list[status.PodPlacement]
    attempt: Positive = 1


def accept_problem(message: Accepted, job: jobs.GPUJob) -> str | None:
    """What makes an accept of `job` void, or None: it must name the gang's pods it placed,
    at least `spec.gang.minMember` of them (every pod by default), each once. An accept that
    names fewer holds the job without saying where it runs: the broker takes it for a
    rejection."""
    total = sum(task.replicas for task in job.spec.tasks)
    need = min(job.spec.gang.min_member or total, total)
    named = len({pod.name for pod in message.pods})
    if named < need:
        every = "every pod" if need == total else f"the gang's minMember {need}"
        return f"accepted without naming {every} ({named} of {need} named)"
    return None


class Rejected(_Msg):
    type: Literal["rejected"] = "rejected"
    job_id: str
    epoch: WireInt
    reasons: list[str]
    attempt: Positive = 1


class JobUpdate(_Msg):
    """A state change of a job the agent runs (Running, Succeeded, Failed, Cancelled)."""

    type: Literal["job_status"] = "job_status"
    job_id: str
    epoch: WireInt
    state: status.JobState
    reason: str = ""
    message: str = ""
    pods: list[status.PodStatus] = Field(default_factory=list)
    attempt: Positive = 1
    # a final report's sequence number, kept by the agent until acked (protocol 2)
    seq: Positive | None = None
    # the newest `gpufed.io/last-checkpoint` of the job's pods (protocol 4)
    checkpoint: datetime | None = None


class Cancel(_Msg):
    type: Literal["cancel"] = "cancel"
    job_id: str
    epoch: WireInt
    reason: str = "Cancelled"
    grace_seconds: float = 30.0
    # the attempt to stop: an agent holding a later one keeps it
    attempt: Positive = 1


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    seq: WireInt = 0


class Ack(_Msg):
    """The final reports of session `epoch` the broker has committed (or had already)."""

    type: Literal["ack"] = "ack"
    epoch: WireInt
    seqs: list[Positive]


Message = Annotated[
    Hello | Welcome | Summary | Offer | Accepted | Rejected | JobUpdate | Cancel | Heartbeat | Ack,
    Field(discriminator="type"),
]
MESSAGE = TypeAdapter(Message)
_TYPES = frozenset(
    get_args(model.model_fields["type"].annotation)[0]
    for model in (
        Hello,
        Welcome,
        Summary,
        Offer,
        Accepted,
        Rejected,
        JobUpdate,
        Cancel,
        Heartbeat,
        Ack,
    )
)
_TYPE = re.compile(r'"type"\s*:\s*"([a-z_]{1,32})"')


def peek_type(text: str | bytes) -> str:
    """The `type` a frame claims, for a log line about a frame that does not decode."""
    match = _TYPE.search(text if isinstance(text, str) else text.decode("utf-8", "replace"))
    return match.group(1) if match and match.group(1) in _TYPES else "unknown"


def decode(text: str | bytes, *, interning: jobs.Interning | None = None) -> Message:
    """Parse one frame; raises pydantic.ValidationError (or ValueError, RecursionError) on
    anything malformed: the caller refuses the frame. `interning`: where the reader keeps one
    object per kind of the offered jobs' templates and shapes."""
    if interning is None:
        return MESSAGE.validate_json(text)
    return MESSAGE.validate_json(text, context={jobs.INTERNING: interning})


def encode(message: _Msg, *, peer: int = PROTOCOL_VERSION) -> str:
    """One frame of `message` for a peer of protocol `peer` (what its hello or welcome said)."""
    exclude = _first_attempts(message)
    if isinstance(message, Summary) and not message.summary.labels:
        exclude = {"summary": {"labels"}}  # no labels: a frame every broker version reads
    if isinstance(message, Offer):
        exclude = {"job": {"spec": policies.BROKER_ONLY}, **({"attempt": True} if exclude else {})}
        if peer < IMAGES_SINCE:
            exclude["allowed_images"] = True
    return message.model_dump_json(by_alias=True, exclude_none=True, exclude=exclude)


def welcome_for(
    hello: Hello, *, epoch: int, heartbeat_seconds: float, lost_after_seconds: float
) -> Welcome:
    """The welcome of a session opened by `hello`: the broker's grace only to an agent that
    reads it (see the module docstring)."""
    return Welcome(
        epoch=epoch,
        heartbeat_seconds=heartbeat_seconds,
        lost_after_seconds=lost_after_seconds if hello.v >= LEASE_SINCE else None,
    )


def _first_attempts(message: _Msg) -> dict[str, Any] | set[str] | None:
    """The `attempt` fields at 1, to leave out of the frame (see the module docstring)."""
    if isinstance(message, Hello):
        firsts = {i: {"attempt"} for i, job in enumerate(message.jobs) if job.attempt == 1}
        return {"jobs": firsts} if firsts else None
    if getattr(message, "attempt", None) == 1:
        return {"attempt"}
    return None
