"""The job policies of the API (`broker.api.policies`): a submit is held to every bound and
refused naming the field; a stored record or an offer is read leniently (clamped, defaulted,
never a crash), a record stored before the fields existed loads with the defaults; an offer
carries only the policy the agent acts on."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from broker.api import jobs, messages, policies, status
from tests.builders import make_job


def document(**spec: Any) -> dict[str, Any]:
    doc = make_job("j", gpus=1).document()
    doc["spec"].update(spec)
    return doc


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param({"failurePolicy": {"backoffLimit": -1}}, "backoffLimit", id="negative"),
        pytest.param({"failurePolicy": {"backoffLimit": 1001}}, "backoffLimit", id="too many"),
        pytest.param({"failurePolicy": {"retryOn": "NodeLost"}}, "retryOn", id="not a list"),
        pytest.param({"failurePolicy": {"retryOn": ["no spaces"]}}, "retryOn", id="bad reason"),
        pytest.param({"failurePolicy": {"retryOn": ["A", "A"]}}, "retryOn", id="twice"),
        pytest.param(
            {"failurePolicy": {"activeDeadlineSeconds": 0}}, "activeDeadlineSeconds", id="0 s"
        ),
        pytest.param({"failurePolicy": {"backoff": 1}}, "backoff", id="unknown field"),
        pytest.param(
            {"preemption": {"gracePeriodSeconds": 3601}}, "gracePeriodSeconds", id="grace > 1 h"
        ),
        pytest.param(
            {"preemption": {"gracePeriodSeconds": -1}}, "gracePeriodSeconds", id="grace < 0"
        ),
        pytest.param({"ttlSecondsAfterFinished": -5}, "ttlSecondsAfterFinished", id="ttl < 0"),
    ],
)
def test_a_submit_out_of_bounds_is_refused_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        jobs.validate_submitted(document(**spec))
    locations = [".".join(str(p) for p in e["loc"]) for e in caught.value.errors()]
    assert any(field in where for where in locations), locations


def test_a_submit_within_bounds_reads_every_field() -> None:
    job = jobs.validate_submitted(
        document(
            failurePolicy={
                "backoffLimit": 1,
                "retryOn": ["NodeLost", "OutOfnvidia.com/gpu"],
                "activeDeadlineSeconds": 2,
            },
            preemption={"gracePeriodSeconds": 3600},
            ttlSecondsAfterFinished=0,
        )
    )
    policy = job.spec.failures
    assert (policy.backoff_limit, policy.active_deadline_seconds) == (1, 2)
    assert policy.retried == {"NodeLost", "OutOfnvidia.com/gpu"}
    assert job.spec.preemption is not None and job.spec.preemption.grace_period_seconds == 3600
    assert job.spec.ttl_seconds_after_finished == 0


def test_the_defaults_retry_infrastructure_failures_three_times() -> None:
    policy = jobs.validate_submitted(document()).spec.failures
    assert policy.backoff_limit == 3
    assert {"NodeLost", "GPUFailed", "Evicted"} <= policy.retried
    assert "Error" not in policy.retried and "OOMKilled" not in policy.retried
    assert policy.active_deadline_seconds is None


@pytest.mark.parametrize(
    ("stored", "read"),
    [
        pytest.param({"backoffLimit": 10**6}, ("backoff_limit", 1000), id="clamped"),
        pytest.param({"backoffLimit": "many"}, ("backoff_limit", 3), id="junk: default"),
        pytest.param({"retryOn": "NodeLost"}, ("retry_on", list(policies.DEFAULT_RETRY_ON))),
        pytest.param({"retryOn": ["A", 3, "a b", "A"]}, ("retry_on", ["A"]), id="bad dropped"),
        pytest.param({"activeDeadlineSeconds": -3}, ("active_deadline_seconds", None)),
        pytest.param({"clusterLost": "teleport"}, ("cluster_lost", "requeue")),
    ],
)
def test_a_stored_policy_out_of_bounds_is_made_safe(
    stored: dict[str, Any], read: tuple[str, Any]
) -> None:
    job = jobs.GPUJob.model_validate(document(failurePolicy=stored))
    assert getattr(job.spec.failures, read[0]) == read[1]


def test_stored_grace_and_ttl_out_of_bounds_are_clamped_or_dropped() -> None:
    job = jobs.GPUJob.model_validate(
        document(preemption={"gracePeriodSeconds": 10**9}, ttlSecondsAfterFinished="soon")
    )
    assert job.spec.preemption is not None and job.spec.preemption.grace_period_seconds == 3600
    assert job.spec.ttl_seconds_after_finished is None


def test_a_record_stored_before_the_policies_loads_with_the_defaults() -> None:
    old = {
        "id": "j",
        "tenant": "team-a",
        "job": make_job("j", gpus=1).document(),
        "status": {"state": "Running", "attempts": 1, "infraRetries": 1},
    }
    record = status.JobRecord.model_validate(old)
    assert record.job.spec.failures.backoff_limit == 3
    assert record.job.spec.preemption is None and record.status.last_checkpoint is None


def test_an_offer_carries_only_the_agents_part_of_the_policies() -> None:
    job = jobs.validate_submitted(
        document(
            failurePolicy={"clusterLost": "wait", "backoffLimit": 1, "activeDeadlineSeconds": 9},
            preemption={"gracePeriodSeconds": 5},
            ttlSecondsAfterFinished=3,
        )
    )
    frame = json.loads(messages.encode(messages.Offer(job_id="j", epoch=1, tenant="t", job=job)))
    spec = frame["job"]["spec"]
    assert spec["failurePolicy"] == {"clusterLost": "wait"}
    assert "preemption" not in spec and "ttlSecondsAfterFinished" not in spec
    decoded = messages.decode(json.dumps(frame))
    assert isinstance(decoded, messages.Offer)
    assert decoded.job.spec.cluster_lost == jobs.ClusterLostPolicy.WAIT
