"""MIG jobs at the broker's API: a good one is accepted, a bad one is a 422 naming the field,
and nothing of it is stored."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from broker.api import jobs, mig
from tests.builders import make_job
from tests.integration.test_broker_api import api, count_jobs, submit

__all__ = ["api"]  # the fixture, shared with the API tests

LIMITS = "spec.tasks[0].template.spec.containers[0].resources.limits"
ANNOTATIONS = "spec.tasks[0].template.metadata.annotations"


def with_limits(limits: dict[str, Any], **annotations: str) -> dict[str, Any]:
    doc = make_job("m", gpus=0).document()
    template = doc["spec"]["tasks"][0]["template"]
    template["spec"]["containers"][0]["resources"]["limits"] = limits
    template["metadata"]["annotations"] = dict(annotations)
    return doc


async def test_a_mig_job_is_accepted(api: TestClient[Any, Any]) -> None:
    response = await submit(api, with_limits({mig.resource_of("1g.10gb"): 2}))
    assert response.status == 202, await response.text()
    doc = make_job("n", gpus=1).annotate(mig.MIG_PROFILE_ANNOTATION, "3g.40gb").document()
    assert (await submit(api, doc)).status == 202


@pytest.mark.parametrize(
    ("doc", "field", "says"),
    [
        pytest.param(
            with_limits({"nvidia.com/mig-7x": 1}), f"{LIMITS}[nvidia.com/mig-7x]",
            "not a MIG profile", id="unknown profile",
        ),
        pytest.param(
            with_limits({jobs.GPU_RESOURCE: 1, "nvidia.com/mig-1g.10gb": 1}),
            f"{LIMITS}[nvidia.com/mig-1g.10gb]", "not both", id="MIG plus whole GPUs",
        ),
        pytest.param(
            with_limits({jobs.GPU_RESOURCE: 1}, **{mig.MIG_PROFILE_ANNOTATION: "1g.10gb",
                        jobs.GPU_MILLI_ANNOTATION: "500"}),
            f"{ANNOTATIONS}[{jobs.GPU_MILLI_ANNOTATION}]", "not a share", id="MIG plus gpu-milli",
        ),
        pytest.param(
            with_limits({jobs.GPU_RESOURCE: 1}, **{mig.MIG_PROFILE_ANNOTATION: "small"}),
            f"{ANNOTATIONS}[{mig.MIG_PROFILE_ANNOTATION}]", "not a MIG profile",
            id="a bad annotation",
        ),
    ],
)  # fmt: skip
async def test_a_bad_mig_job_is_a_422_naming_the_field(
    api: TestClient[Any, Any], doc: dict[str, Any], field: str, says: str
) -> None:
    response = await submit(api, doc)
    assert response.status == 422, await response.text()
    problem = await response.json()
    assert field in problem["field"], problem
    assert says in problem["detail"], problem
    assert await count_jobs(api) == 0
