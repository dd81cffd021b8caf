"""Allotments through the broker's HTTP API (a real broker app on loopback, SQLite store): a
tenant-admin's queues stay within its tenant's allotment, added over all its queues; a refusal
is 403 naming the field and stores nothing; lowering is always allowed; the admin is not bound;
each tenant reads its own allotment."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests import brokerapps
from tests.builders import make_job

H100 = "NVIDIA-H100-80GB-HBM3"
TOKENS: list[dict[str, Any]] = [
    {"token": "admin", "admin": True},
    {"token": "a-admin", "tenant": "team-a", "role": "tenant-admin"},
    {"token": "b-admin", "tenant": "team-b", "role": "tenant-admin"},
    {"token": "team-a", "tenant": "team-a"},
    {"token": "fleet-viewer", "role": "viewer"},
]
QUEUES = {
    "priorityClasses": [{"name": "normal", "value": 0}, {"name": "high", "value": 100}],
    "queues": [  # team-a has no allotment declared: its queues here are its allotment
        {"name": "a-q", "tenant": "team-a", "quotas": {H100: {"guaranteed": 8, "limit": 16}}},
        {"name": "b-q", "tenant": "team-b", "quotas": {H100: {"guaranteed": 0, "limit": 16}}},
    ],
    "allotments": [
        {
            "tenant": "team-b",
            "quotas": {H100: {"guaranteed": 8, "limit": 32}},
            "maxWeight": 2,
            "maxPriorityClass": "high",
        }
    ],
}


TENANT_OF = {"a-admin": "team-a", "b-admin": "team-b"}


def h100(guaranteed: int, limit: int | None = 16, **fields: Any) -> dict[str, Any]:
    return {"quotas": {H100: {"guaranteed": guaranteed, "limit": limit}}, **fields}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with brokerapps.served(tmp_path, tokens=TOKENS, queues=QUEUES) as client:
        yield client


async def put(
    api: TestClient[Any, Any], token: str, name: str, spec: dict[str, Any], *, tenant: str = ""
) -> tuple[int, dict[str, Any]]:
    """PUT queue `name` with `token`, for its tenant (the admin: for `tenant`)."""
    body = json.dumps({"tenant": tenant or TENANT_OF[token], **spec})
    async with api.put(f"/v1/queues/{name}", data=body, headers=bearer(token)) as answer:
        return answer.status, await answer.json()


async def listing(api: TestClient[Any, Any], token: str = "admin") -> dict[str, Any]:
    async with api.get("/v1/queues", headers=bearer(token)) as answer:
        assert answer.status == 200
        return dict(await answer.json())


async def guaranteed(api: TestClient[Any, Any]) -> dict[str, int]:
    """Every declared queue's H100 guarantee, as the admin reads them."""
    items = (await listing(api))["items"]
    return {q["name"]: q["spec"]["quotas"][H100]["guaranteed"] for q in items}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    ("token", "name", "spec", "field"),
    [
        pytest.param(
            "a-admin",
            "grab",
            h100(16, None),
            f"quotas.{H100}.guaranteed",
            id="a queue guaranteeing more than the file gives the tenant",
        ),
        pytest.param(
            "a-admin",
            "a-q",
            h100(12),
            f"quotas.{H100}.guaranteed",
            id="the file's queue raised",
        ),
        pytest.param(
            "b-admin",
            "b-wide",
            h100(0, None),
            f"quotas.{H100}.limit",
            id="no limit where the declared allotment bounds limits",
        ),
        pytest.param("b-admin", "b-q", h100(0, weight=3), "weight", id="weight above the most"),
        pytest.param(
            "a-admin",
            "a-urgent",
            h100(0, priorityClass="high"),
            "priorityClass",
            id="a priority class above the file's",
        ),
        pytest.param(
            "a-admin",
            "a-elsewhere",
            h100(0, cohort="serving"),
            "cohort",
            id="a cohort the tenant's queues are not in",
        ),
    ],
)
async def test_a_tenant_admin_is_refused_beyond_its_allotment_and_nothing_is_stored(
    api: TestClient[Any, Any],
    token: str,
    name: str,
    spec: dict[str, Any],
    field: str,
) -> None:
    before = await listing(api)
    status, problem = await put(api, token, name, spec)
    assert status == 403, problem
    assert problem["field"] == field
    assert "allotment" in problem["detail"] and "fleet admin" in problem["detail"]
    assert (await listing(api))["items"] == before["items"]


async def test_many_small_queues_add_up_to_the_allotment_and_no_further(
    api: TestClient[Any, Any],
) -> None:
    answers = [(await put(api, "b-admin", f"b-{i}", h100(3, 8)))[0] for i in range(1, 5)]
    assert answers == [201, 201, 403, 403]
    assert await guaranteed(api) == {"a-q": 8, "b-q": 0, "b-1": 3, "b-2": 3}
    [share] = (await listing(api, "b-admin"))["allotments"]
    assert share["declared"] is True
    assert share["uses"] == [
        {"model": "*", "guaranteed": 0, "allottedGuaranteed": 0, "limit": 0, "allottedLimit": 0},
        {
            "model": H100,
            "guaranteed": 6,
            "allottedGuaranteed": 8,
            "limit": 32,
            "allottedLimit": 32,
        },
    ]


async def test_two_puts_at_once_cannot_overdraw_together(api: TestClient[Any, Any]) -> None:
    answers = await asyncio.gather(
        put(api, "b-admin", "b-x", h100(6, 8)),
        put(api, "b-admin", "b-y", h100(6, 8)),
    )
    assert sorted(status for status, _ in answers) == [201, 403]
    stored = await guaranteed(api)
    assert stored.get("b-x", 0) + stored.get("b-y", 0) == 6


async def test_lowering_is_allowed_and_the_admin_is_not_bound(api: TestClient[Any, Any]) -> None:
    assert (await put(api, "a-admin", "a-q", h100(4)))[0] == 200
    assert (await put(api, "a-admin", "a-q", h100(8)))[0] == 200, "back to the file's"
    status, _ = await put(api, "admin", "a-big", h100(64, 64, weight=9), tenant="team-a")
    assert status == 201, "the admin puts beyond any allotment"
    [share] = (await listing(api, "a-admin"))["allotments"]
    assert share["declared"] is False and share["warnings"], "above it now: said"
    assert (await put(api, "a-admin", "a-big", h100(32, 64, weight=9)))[0] == 200
    status, problem = await put(api, "a-admin", "a-big", h100(40, 64, weight=9))
    assert (status, problem["field"]) == (403, f"quotas.{H100}.guaranteed")
    assert (await guaranteed(api))["a-big"] == 32


async def test_each_tenant_reads_its_own_allotment_and_the_admin_every_one(
    api: TestClient[Any, Any],
) -> None:
    tenants = {
        token: [a["tenant"] for a in (await listing(api, token))["allotments"]]
        for token in ("admin", "fleet-viewer", "a-admin", "team-a", "b-admin")
    }
    assert tenants == {
        "admin": ["team-a", "team-b"],
        "fleet-viewer": ["team-a", "team-b"],
        "a-admin": ["team-a"],
        "team-a": ["team-a"],
        "b-admin": ["team-b"],
    }
    [share] = (await listing(api, "team-a"))["allotments"]
    assert share["allotment"] == {
        "tenant": "team-a",
        "quotas": {
            "*": {"guaranteed": 0, "limit": None},
            H100: {"guaranteed": 8, "limit": None},
        },
        "maxWeight": 1.0,
        "maxPriorityClass": None,
        "cohorts": ["default"],
        "allowedImages": None,  # any image
    }


PRIORITY_QUEUES = {
    "priorityClasses": [
        {"name": "normal", "value": 0},
        {"name": "high", "value": 100},
        {"name": "critical", "value": 1000},
    ],
    "queues": [
        {"name": "a-q", "tenant": "team-a"},  # team-a: no allotment declared
        {"name": "b-q", "tenant": "team-b"},
        {"name": "c-q", "tenant": "team-c"},
    ],
    "allotments": [
        {"tenant": "team-b", "maxPriorityClass": "high"},
        {"tenant": "team-c"},  # no class: nothing above value 0
    ],
}


@pytest.fixture
async def submit_api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    tokens = [{"token": "admin", "admin": True}] + [
        {"token": tenant, "tenant": tenant} for tenant in ("team-a", "team-b", "team-c")
    ]
    async with brokerapps.served(tmp_path, tokens=tokens, queues=PRIORITY_QUEUES) as client:
        yield client


@pytest.mark.parametrize(
    ("tenant", "spec", "status", "field"),
    [
        pytest.param("team-c", {"priorityClass": "high"}, 403, "spec.priorityClass", id="class"),
        pytest.param("team-c", {"priority": 5}, 403, "spec.priority", id="a number above 0"),
        pytest.param(
            "team-b",
            {"priorityClass": "critical"},
            403,
            "spec.priorityClass",
            id="above the declared highest class",
        ),
        pytest.param("team-c", {"priorityClass": "normal"}, 202, None, id="at the ceiling"),
        pytest.param("team-b", {"priorityClass": "high"}, 202, None, id="the declared class"),
        pytest.param(
            "team-a",
            {"priorityClass": "critical"},
            202,
            None,
            id="no allotment declared: as before",
        ),
    ],
)
async def test_a_submitter_picks_no_priority_above_its_tenants_declared_allotment(
    submit_api: TestClient[Any, Any],
    tenant: str,
    spec: dict[str, Any],
    status: int,
    field: str | None,
) -> None:
    """A job's priority decides whom it preempts: a submitter may not pick more than the fleet
    admin allotted its tenant; a refusal names the field and stores nothing."""
    queue = {"team-a": "a-q", "team-b": "b-q", "team-c": "c-q"}[tenant]
    job = make_job("urgent", gpus=1, queue=queue).document()
    job["spec"].update(spec)
    async with submit_api.post("/v1/jobs", data=json.dumps(job), headers=bearer(tenant)) as answer:
        body = await answer.json()
        assert answer.status == status, body
    if field is not None:
        assert body["field"] == field and "only the fleet admin" in body["detail"], body
        async with submit_api.get("/v1/jobs", headers=bearer("admin")) as listed:
            assert (await listed.json())["items"] == []
