"""`spec.dependsOn`: the jobs a job waits for, and what it needs of each.

A job with dependencies is stored `Waiting` (never planned) until every one is met: a
dependency with condition `Succeeded` (the default) is met when its job succeeded and can no
longer be met when it ended Failed or Cancelled; `Finished` is met by any end. When one can
no longer be met, or names no job, the job fails with reason `DependencyFailed`.

`job` is a job id or a name of the submitter's own tenant. A submit resolves it once, and
the record keeps what it resolved to (`status.dependencies`): a job (or array) of the same
request (single or batch) by that name first, else a job id, else the newest job of that
name the broker holds live (not yet moved to history), else, when no job has that name,
the newest array of that name (`arrays`). A job in history is found by its id only. A job
naming itself is a cycle. An array is kept as a reference (`Resolved.array`: its id and
count), not as its jobs' ids, so that a dependent's record is as small for an array of
10,000 as for one job; it is resolved against the array's jobs when it is decided (`<id>-0`
to `<id>-<count-1>`, `member_ids`). Records that list an array's jobs in `ids`, as earlier
brokers wrote them, are read and decided as they were. What a
name resolved to never changes afterwards, so jobs can only depend on jobs that existed
before them or came with them: a cycle is possible only within one request, and a submit
that makes one is refused (422 naming the field, `planning.dependencies.find_cycle`).

Two readings, as for the rest of `GPUJob`: strict at submit, lenient from a record (an
unknown condition reads as `Succeeded`, the safe one: it never starts a job early).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from broker.api import arrays, policies

MAX_DEPENDENCIES = 64
DEPENDENCY_FAILED = "DependencyFailed"
DEPENDENCIES_MET = "DependenciesMet"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class Condition(StrEnum):
    SUCCEEDED = "Succeeded"  # met when the job succeeded; failed when it failed or was cancelled
    FINISHED = "Finished"  # met when the job ended, however


class Dependency(BaseModel):
    """One entry of `spec.dependsOn`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    job: Annotated[
        str,
        Field(
            min_length=1,
            max_length=63,
            json_schema_extra={"pattern": _DNS_LABEL.pattern},
            description="a job id, or a job (or array) name of the same tenant: the newest "
            "job of that name (a job of the same request first); a job moved to history is "
            "found by its id only",
        ),
    ]
    condition: Condition = Field(
        Condition.SUCCEEDED,
        description="Succeeded (default): start once it succeeded, fail (DependencyFailed) "
        "if it failed or was cancelled; Finished: start once it ended, however",
    )

    @field_validator("job")
    @classmethod
    def _job(cls, value: str, info: ValidationInfo) -> str:
        if policies.at_submit(info) and not _DNS_LABEL.match(value):
            raise ValueError("must be a job id or name: a DNS label")
        return value

    @field_validator("condition", mode="before")
    @classmethod
    def _condition(cls, value: object, info: ValidationInfo) -> object:
        known = {c.value for c in Condition}
        if not policies.at_submit(info) and (not isinstance(value, str) or value not in known):
            return Condition.SUCCEEDED
        return value


DependsOn = Annotated[
    list[Dependency] | None,
    Field(
        max_length=MAX_DEPENDENCIES,
        alias="dependsOn",
        description="jobs this one waits for (state Waiting) before it is queued; it fails "
        "with DependencyFailed when one can no longer be met or names no job",
    ),
]


class Resolved(BaseModel):
    """What one `spec.dependsOn` entry resolved to at submit (`status.dependencies`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    job: str = Field(description="the entry's job, as the submit gave it")
    condition: Condition = Condition.SUCCEEDED
    ids: list[str] = Field(
        default_factory=list,
        description="the job id it names (records of earlier brokers: each job of an "
        "array); empty, and no array: none was found, and the job fails with DependencyFailed",
    )
    array: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="the array it names: its id (its jobs are `<array>-0` to `<array>-<count-1>`)",
    )
    count: int | None = Field(
        None, exclude_if=lambda value: value is None, description="the array's count of jobs"
    )

    def member_ids(self) -> list[str]:
        """The job ids the entry names: its array's jobs, or `ids`."""
        if self.array is None:
            return list(self.ids)
        return [arrays.member_id(self.array, index) for index in range(self.count or 0)]

    @property
    def found(self) -> bool:
        """Whether it names any job (none: the job fails with DependencyFailed)."""
        return bool(self.ids) or (self.array is not None and bool(self.count))
