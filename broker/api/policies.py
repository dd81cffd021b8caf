"""What a job asks of the broker and its agent when something goes wrong or it must make room:
`spec.failurePolicy` (retries, the active deadline, a lost cluster), `spec.preemption` (the
grace its pods get) and `spec.ttlSecondsAfterFinished` (how long it stays once finished).

Two readings, as for the rest of `GPUJob` (`jobs`): a submit (`validate_submitted`, the
context `SUBMIT_CONTEXT`) is held to every bound and names the field it refuses; a stored
record or an offer is read leniently: a value out of range is clamped, one of the wrong kind
or one this version does not know becomes the default, so a record written by another
version always loads. Absent fields are the defaults, and a record stored before a field
existed reads as if it had the default.

An offer carries of these only what the agent acts on: `clusterLost` (whether a fence stops
the job); `messages.encode` leaves the broker's part (`BROKER_ONLY`) out of the frame, so an
agent that knows fewer fields still reads it. The preemption grace reaches the agent in the
Cancel that preempts (`messages.Cancel.grace_seconds`).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

SUBMIT_CONTEXT = "gpufed.submit"
MAX_INT32 = 2**31 - 1  # Kubernetes' bound on these counts and seconds
MAX_BACKOFF_LIMIT = 1000
MAX_GRACE_SECONDS = 3600
MAX_RETRY_REASONS = 32
DEFAULT_BACKOFF_LIMIT = 3
# what fails a pod or loses a job that is not the workload's fault: retried by default
DEFAULT_RETRY_ON = (
    "ClusterLost",
    "Evicted",
    "GPUFailed",
    "LostByAgent",
    "NodeLost",
    "PodDeleted",
)
DEADLINE_EXCEEDED = "DeadlineExceeded"
# a reason as agents and Kubernetes spell them (OOMKilled, OutOfnvidia.com/gpu, NodeLost)
_REASON = re.compile(r"^[A-Za-z][A-Za-z0-9./_-]{0,127}$")


def at_submit(info: ValidationInfo) -> bool:
    """Is the model read as a submit (every rule), rather than a stored record or offer?"""
    context = info.context
    return isinstance(context, dict) and context.get(SUBMIT_CONTEXT) is True


def lenient_int(
    value: object, info: ValidationInfo, *, low: int, high: int, default: int | None
) -> object:
    """At submit the value as given (the field's bounds refuse it); stored: clamped into
    [low, high], or `default` when it is not a whole number."""
    if at_submit(info) or value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    if isinstance(value, float) and not value.is_integer():
        return default
    return min(max(int(value), low), high)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ClusterLostPolicy(StrEnum):
    """What happens to a job whose cluster is lost (its agent away past the broker's grace)."""

    REQUEUE = "requeue"  # its agent deletes the pods (fencing); the broker runs it elsewhere
    WAIT = "wait"  # its pods keep running; the broker waits for the cluster to return


class FailurePolicy(_Strict):
    """What the broker and the agent do when something fails under a job."""

    cluster_lost: Annotated[
        ClusterLostPolicy,
        Field(
            alias="clusterLost",
            description=(
                "requeue (default): once its cluster is away past the broker's --lost-after "
                "grace the job runs elsewhere, its agent having deleted the pods first; wait: "
                "the pods keep running through the partition and the job stays on its cluster "
                "until it returns (a long training run that would rather wait than restart)"
            ),
        ),
    ] = ClusterLostPolicy.REQUEUE
    backoff_limit: Annotated[
        int,
        Field(
            ge=0,
            le=MAX_BACKOFF_LIMIT,
            alias="backoffLimit",
            description=(
                "how many times a failed attempt is retried (default 3): a failure whose "
                "reason is in retryOn queues the job again while fewer retries were made; "
                "0: the first failure fails the job"
            ),
        ),
    ] = DEFAULT_BACKOFF_LIMIT
    retry_on: Annotated[
        list[str],
        Field(
            max_length=MAX_RETRY_REASONS,
            alias="retryOn",
            description=(
                "the failure reasons that retry (within backoffLimit); a failure with any "
                "other reason (Error, OOMKilled, ...) fails the job at once. Default: the "
                "infrastructure reasons " + ", ".join(DEFAULT_RETRY_ON) + "; [] retries nothing"
            ),
        ),
    ] = Field(default_factory=lambda: list(DEFAULT_RETRY_ON))
    active_deadline_seconds: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_INT32,
            alias="activeDeadlineSeconds",
            description=(
                "seconds from the job's first start (its first Running, over all attempts) "
                "after which it fails with reason DeadlineExceeded and its pods are deleted; "
                "absent: no deadline"
            ),
        ),
    ] = None

    @property
    def retried(self) -> frozenset[str]:
        return frozenset(self.retry_on)

    @field_validator("cluster_lost", mode="before")
    @classmethod
    def _cluster_lost(cls, value: object, info: ValidationInfo) -> object:
        # a stored record or offer with a value this version does not know: the safe default
        known = {policy.value for policy in ClusterLostPolicy}
        if not at_submit(info) and isinstance(value, str) and value not in known:
            return ClusterLostPolicy.REQUEUE
        return value

    @field_validator("backoff_limit", mode="before")
    @classmethod
    def _backoff_limit(cls, value: object, info: ValidationInfo) -> object:
        return lenient_int(
            value, info, low=0, high=MAX_BACKOFF_LIMIT, default=DEFAULT_BACKOFF_LIMIT
        )

    @field_validator("active_deadline_seconds", mode="before")
    @classmethod
    def _deadline(cls, value: object, info: ValidationInfo) -> object:
        if at_submit(info):
            return value
        read = lenient_int(value, info, low=0, high=MAX_INT32, default=None)
        return None if read == 0 else read  # stored nonsense: no deadline, never a kill

    @field_validator("retry_on", mode="before")
    @classmethod
    def _retry_on_read(cls, value: object, info: ValidationInfo) -> object:
        if at_submit(info):
            return value
        if not isinstance(value, list):
            return list(DEFAULT_RETRY_ON)
        kept = [r for r in value if isinstance(r, str) and _REASON.match(r)]
        return list(dict.fromkeys(kept))[:MAX_RETRY_REASONS]

    @field_validator("retry_on")
    @classmethod
    def _retry_on(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if at_submit(info):
            for index, reason in enumerate(value):
                if not _REASON.match(reason):
                    raise ValueError(
                        f"[{index}]: {reason!r} is not a reason (a letter, then letters, "
                        "digits, '.', '/', '_' or '-', at most 128)"
                    )
            if len(set(value)) != len(value):
                raise ValueError("reasons must be unique")
        return value


class PreemptionPolicy(_Strict):
    """How the job's pods are stopped when the broker preempts it."""

    grace_period_seconds: Annotated[
        int,
        Field(
            ge=0,
            le=MAX_GRACE_SECONDS,
            alias="gracePeriodSeconds",
            description=(
                "seconds between the preemption notice and the kill (0 to 3600, default 30): "
                "the agent annotates the pods gpufed.io/preemption-notice with the deadline "
                "(RFC 3339) and deletes them with this grace period, so the workload gets "
                "SIGTERM in time to checkpoint; their GPUs count as taken until the pods are "
                "gone"
            ),
        ),
    ] = 30

    @field_validator("grace_period_seconds", mode="before")
    @classmethod
    def _grace(cls, value: object, info: ValidationInfo) -> object:
        return lenient_int(value, info, low=0, high=MAX_GRACE_SECONDS, default=30)


TTLSeconds = Annotated[
    int | None,
    Field(
        ge=0,
        le=MAX_INT32,
        alias="ttlSecondsAfterFinished",
        description=(
            "seconds the finished job stays in the broker's live store, when shorter than the "
            "broker's --retain-finished; then it moves to history, as every finished job does "
            "(without a history it is deleted). Absent: --retain-finished"
        ),
    ),
]


# the fields of a spec the agent has no use for: left out of offers (`messages.encode`)
BROKER_ONLY: dict[str, object] = {
    "failure_policy": {"backoff_limit": True, "retry_on": True, "active_deadline_seconds": True},
    "preemption": True,
    "ttl_seconds_after_finished": True,
    "clusters": True,  # spec.clusters: the broker's choice of cluster (`clusterchoice`)
    "depends_on": True,  # spec.dependsOn: when the broker queues the job (`dependencies`)
    "array": True,  # spec.array: the agent reads the index from the job's labels (`arrays`)
}


def read_ttl(value: object, info: ValidationInfo) -> object:
    """`spec.ttlSecondsAfterFinished`, as `lenient_int` reads it."""
    return lenient_int(value, info, low=0, high=MAX_INT32, default=None)
