"""What a submit carries besides the job: the idempotency key's rule, and the batch's shapes.

`POST /v1/jobs` takes one GPUJob and its key in the `Idempotency-Key` header; `POST
/v1/jobs:batch` takes up to `MAX_BATCH_ITEMS` of them in one body (`BatchSubmit`, at most
`MAX_BATCH_BYTES`), each item with its own key, and answers one `BatchItemAnswer` per item in
request order. The same rule holds a key wherever it comes from (`check_idempotency_key`).
The batch's models describe it in the OpenAPI document and write the answer; the broker reads
a batch item by item (`broker.http.admitting`), so that one bad item is that item's problem.

A request is bounded by what it expands to, not only by what it sends (`Bounds`, counted by
`Expansion` over its items in order): the jobs it stores (an array's `count` each), the bytes
of its arrays' jobs (count × the job's size), and the `dependsOn` entries it stores (each job
its own: an array of 10,000 with 3 entries stores 30,000). The item that would pass one is
refused (422, naming its field and the bound); those before it are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from broker.api import arrays, errors, jobs
from broker.api.status import JobState

MAX_KEY_LENGTH = 255
MAX_BATCH_ITEMS = 1000
MAX_BATCH_BYTES = 8 * 1024 * 1024  # the single route takes 1 MiB, one job
MAX_REQUEST_JOBS = arrays.MAX_COUNT  # --max-request-jobs
MAX_REQUEST_DEPENDENCIES = 100_000  # --max-request-dependencies
MAX_REQUEST_BYTES = arrays.MAX_ARRAY_BYTES


@dataclass(frozen=True)
class Bounds:
    """What one request may expand to (the broker's flags set them)."""

    max_jobs: int = MAX_REQUEST_JOBS
    max_dependencies: int = MAX_REQUEST_DEPENDENCIES
    max_bytes: int = MAX_REQUEST_BYTES


@dataclass(frozen=True)
class Expansion:
    """What a request's items read so far expand to."""

    job_count: int = 0
    dependency_count: int = 0
    byte_count: int = 0

    def check(self, job: jobs.GPUJob, bounds: Bounds, *, where: str = "") -> Expansion:
        """This expansion with `job`; Invalid naming the field and the bound it would pass."""
        spec = job.spec.array
        count = spec.count if spec is not None else 1
        entries = len(job.spec.depends_on or ())
        job_bytes = (
            len(job.model_dump_json(by_alias=True, context=jobs.AS_VALIDATED))
            if spec is not None
            else 0
        )
        after = Expansion(
            job_count=self.job_count + count,
            dependency_count=self.dependency_count + count * entries,
            byte_count=self.byte_count + count * job_bytes,
        )
        field, problem = "spec.array.count", None
        mib = 1024 * 1024
        if after.job_count > bounds.max_jobs:
            before = f"{self.job_count} jobs before it and " if self.job_count else ""
            problem = (
                f"{before}{count} of it; a request stores at most {bounds.max_jobs} jobs "
                "(--max-request-jobs): send fewer, or the array on its own"
            )
        elif after.byte_count > bounds.max_bytes:
            before = f" after {self.byte_count // mib} MiB before it" if self.byte_count else ""
            problem = (
                f"{count} jobs of {job_bytes} bytes each are {count * job_bytes // mib} MiB"
                f"{before}; a request stores at most {bounds.max_bytes // mib} MiB: fewer "
                "jobs, or a smaller job"
            )
        elif after.dependency_count > bounds.max_dependencies:
            field = "spec.dependsOn"
            before = f" after {self.dependency_count} before it" if self.dependency_count else ""
            problem = (
                f"{count} jobs × {entries} entries are {count * entries} dependencies{before}; "
                f"a request stores at most {bounds.max_dependencies} "
                "(--max-request-dependencies): fewer jobs, or fewer entries (an array is "
                "one entry, whatever its size)"
            )
        if problem is not None:
            named = f"{where}.{field}" if where else field
            raise errors.Invalid(f"{named}: {problem}", field=named, title="Invalid job")
        return after


def check_idempotency_key(key: object, *, field: str) -> str | None:
    """`key` if it keeps the rule (a string of 1 to 255 characters), None if absent;
    Malformed naming `field` if not."""
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH:
        kind = "" if isinstance(key, str) else "a string of "
        raise errors.Malformed(
            f"{field}: {kind}1 to {MAX_KEY_LENGTH} characters",
            field=field,
            title="Bad Idempotency-Key",
        )
    return key


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class BatchItem(_Model):
    """One job of a batch and its key (none: not idempotent, as without the header)."""

    idempotency_key: str | None = Field(
        None, alias="idempotencyKey", min_length=1, max_length=MAX_KEY_LENGTH
    )
    job: jobs.GPUJob


class BatchSubmit(_Model):
    """The body of `POST /v1/jobs:batch`."""

    items: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


class BatchItemAnswer(_Model):
    """What became of one item: 202 queued, 200 its key's job replayed (`id`, `state`,
    `traceId` of that job), or the 4xx/5xx a single submit would have had (`problem`, the
    field named from the batch's root: `items[3].job.spec.queue`), nothing stored for it."""

    index: int
    status: int
    id: str | None = None
    state: JobState | None = None
    trace_id: str | None = Field(None, alias="traceId")
    problem: dict[str, Any] | None = None


class BatchAnswer(_Model):
    """The answer of `POST /v1/jobs:batch`: every item in request order, and the counts."""

    items: list[BatchItemAnswer]
    accepted: int = Field(description="items queued (202)")
    replayed: int = Field(description="items whose key's job was answered again (200)")
    failed: int = Field(description="items refused (4xx, 5xx): nothing stored for them")
