"""Job records across broker versions (a rolling upgrade runs two at once on one store).

A record is written without the fields at their defaults, so a job that uses no feature newer
than the previous release is readable by it: its strict models refuse any key they do not
know, and they did refuse every record the next version wrote while that one wrote
`"clusters": null` and the like. `data/job-record-53a2470.json` is a running gang's record as
the broker of commit 53a2470 wrote it (every field, defaults included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.api import jobs, status
from broker.state import records
from tests.builders import make_job

PREVIOUS = Path(__file__).parent / "data" / "job-record-53a2470.json"


def key_paths(data: Any, prefix: str = "") -> set[str]:
    """Every key of a JSON document as a path (`/status/pods[]/gpus[]/index`)."""
    out: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            out.add(f"{prefix}/{key}")
            out |= key_paths(value, f"{prefix}/{key}")
    elif isinstance(data, list):
        for value in data:
            out |= key_paths(value, f"{prefix}[]")
    return out


def previous() -> tuple[dict[str, Any], status.JobRecord]:
    raw = PREVIOUS.read_bytes()
    data = json.loads(raw)
    return data, records.decode_record(records.job_key(data["id"]), raw)


def test_a_record_the_previous_release_wrote_is_read_as_it_was() -> None:
    _, record = previous()
    assert record.status.state == status.JobState.RUNNING
    assert (record.status.cluster, record.status.epoch, record.status.attempts) == ("east", 3, 1)
    assert record.job.spec.tasks[0].replicas == 2
    assert [pod.node for pod in record.status.pods] == ["n0"]


def test_a_plain_job_is_written_with_only_keys_the_previous_release_knows() -> None:
    data, record = previous()
    written = json.loads(records.encode(record))
    assert key_paths(written) <= key_paths(data)
    assert "clusters" not in written["job"]["spec"]  # what the previous one wrote as null
    again = records.decode_record(records.job_key(record.id), records.encode(record))
    assert again == record


def test_a_field_set_away_from_its_default_is_written_and_read_back() -> None:
    job = make_job("policy", gpus=1).build()
    job.spec.priority = 5
    record = status.JobRecord(id="policy-1", tenant="team-a", job=job)
    record.status.cancel_requested = True
    written = json.loads(records.encode(record))
    assert written["job"]["spec"]["priority"] == 5
    assert written["status"]["cancelRequested"] is True
    assert records.decode_record(records.job_key(record.id), records.encode(record)) == record


# Digests the broker of commit a8fede6 (before they were read from the spec's stored JSON)
# computed: an Idempotency-Key stored by it must replay, not refuse, the same body after an
# upgrade (`creating`: a key with another body's digest is IdempotencyKeyReused).
PREVIOUS_DIGEST = "85745c94927f386cecd4f5368c1e626b01a510139f86122bef0791b7bda4ebe8"
ANNOTATED_DIGEST = "676cacf531d7c930201e5273cf88b7afd432f9ed06c2f8780041f3c4a5e08be3"


def test_a_body_digest_is_what_the_previous_release_stored() -> None:
    _, record = previous()
    assert records.body_digest(record.job) == PREVIOUS_DIGEST
    document = make_job("gold", gpus=2).document()
    document["spec"]["priority"] = 7
    template = document["spec"]["tasks"][0]["template"]
    template.setdefault("metadata", {})["annotations"] = {"note": 'Zürich ✓ "quoted"'}
    job = jobs.GPUJob.model_validate(document)
    assert records.body_digest(job) == ANNOTATED_DIGEST
    records.encode(status.JobRecord(id="gold-1", tenant="t", job=job))  # the spec's JSON memoized
    assert records.body_digest(job) == ANNOTATED_DIGEST
