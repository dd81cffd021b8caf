"""`spec.array`: one submit that makes `count` indexed jobs, at most `parallelism` at a time.

A submit with `spec.array: {count, parallelism}` stores `count` jobs (`jobs.submitting.
new_records`): job `i` (0 to count - 1) is named `<name>-<i>`, has the id `<array id>-<i>`
(the array's id is made like a job's, from its name), carries the labels `gpufed.io/array`
(the array's name) and `gpufed.io/array-index`, and its record says its array
(`JobRecord.array`). Index 0 is stored first, with the Idempotency-Key, so that a replay
stores none again; then the others a batch's worth at a time, which a store fault can cut
short (the answer is that fault; the jobs stored so far stay, to cancel as an array). Each
is a job of its own (queued, planned, retried, cancelled, listed), except that the planner
lets at most `parallelism` jobs of one array hold GPUs (Dispatched or Running) at once
(`planning.planning`, reason `ArrayParallelism`). The agent gives every pod of job `i` the
environment variable `GPUFED_ARRAY_INDEX=i` (read from the job's `gpufed.io/array-index`
label, `member_agent.binding.binding`); `spec.array` itself is not sent to agents.

One request stores at most `MAX_COUNT` jobs and `MAX_ARRAY_BYTES` of them (count × the
job's size; 422 naming `spec.array.count`; `api.submits.Bounds`).
`GET /v1/jobs?labelSelector=gpufed.io/array=NAME` lists the arrays of that name
(`,gpufed.io/array-index=3`: one index); `DELETE /v1/arrays/{array}` cancels the newest
array of that name (or the array of that id), `?index=i` one of its jobs.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from broker.api import policies

MAX_COUNT = 10_000
ARRAY_LABEL = "gpufed.io/array"
INDEX_LABEL = "gpufed.io/array-index"
INDEX_ENV = "GPUFED_ARRAY_INDEX"
LABELS = frozenset({ARRAY_LABEL, INDEX_LABEL})  # set by the broker only
MAX_ARRAY_ID = 53  # so that `<array id>-<index>` is at most 58 characters, as job ids are
MAX_ARRAY_BYTES = 64 * 1024 * 1024  # the store holds every job of it: count × the job's size


class ArraySpec(BaseModel):
    """`spec.array`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    count: Annotated[
        int,
        Field(
            ge=1,
            le=MAX_COUNT,
            description=f"how many indexed jobs (1 to {MAX_COUNT}): `<name>-0` to "
            "`<name>-<count-1>`, each pod with GPUFED_ARRAY_INDEX set to its index",
        ),
    ]
    parallelism: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_COUNT,
            description="at most this many of them hold GPUs (Dispatched or Running) at "
            "once; absent: no bound",
        ),
    ] = None

    @property
    def limit(self) -> int:
        """The parallelism in effect (the count when none is given)."""
        return self.count if self.parallelism is None else min(self.parallelism, self.count)

    @field_validator("count", "parallelism", mode="before")
    @classmethod
    def _lenient(cls, value: object, info: ValidationInfo) -> object:
        whole = isinstance(value, int) and not isinstance(value, bool)
        if policies.at_submit(info) and value is not None and not whole:
            raise ValueError(f"must be a whole number, got {value!r}")
        return policies.lenient_int(value, info, low=1, high=MAX_COUNT, default=1)


class ArrayMember(BaseModel):
    """Which array a job belongs to (`JobRecord.array`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    id: str = Field(description="the array's id: its jobs' ids are `<id>-<index>`")
    name: str = Field(description="the array's name: its jobs are named `<name>-<index>`")
    index: int
    count: int
    parallelism: int = Field(description="the parallelism in effect")


def member_name(name: str, index: int) -> str:
    return f"{name}-{index}"


def member_id(array_id: str, index: int) -> str:
    """The id of the array's job of `index`."""
    return f"{array_id}-{index}"


def name_problem(name: str, count: int) -> str | None:
    """Why `<name>-<count-1>` would not be a job name (a DNS label of at most 63), or None."""
    longest = member_name(name, count - 1)
    if len(longest) > 63:
        return (
            f"{len(longest)} characters in {longest!r}, the name of the array's last job; "
            "at most 63: shorten the name"
        )
    return None


def index_of(labels: dict[str, str]) -> int | None:
    """The array index a job's labels give, None for a job of no array."""
    raw = labels.get(INDEX_LABEL)
    return int(raw) if raw is not None and raw.isdigit() else None
