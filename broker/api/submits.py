"""What a submit carries besides the job: the idempotency key's rule, and the batch's shapes.

`POST /v1/jobs` takes one GPUJob and its key in the `Idempotency-Key` header; `POST
/v1/jobs:batch` takes up to `MAX_BATCH_ITEMS` of them in one body (`BatchSubmit`, at most
`MAX_BATCH_BYTES`), each item with its own key, and answers one `BatchItemAnswer` per item in
request order. The same rule holds a key wherever it comes from (`check_idempotency_key`).
The batch's models describe it in the OpenAPI document and write the answer; the broker reads
a batch item by item (`broker.http.submitting`), so that one bad item is that item's problem.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from broker.api import errors, jobs
from broker.api.status import JobState

MAX_KEY_LENGTH = 255
MAX_BATCH_ITEMS = 1000
MAX_BATCH_BYTES = 8 * 1024 * 1024  # the single route takes 1 MiB, one job


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
