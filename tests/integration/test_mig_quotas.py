"""MIG at the broker, end to end through its planning: MIG jobs count against their queue's
quota (a queue exhausted by them gets no more dispatched, and `why` says so), and
`GET /v1/clusters` shows each model's MIG devices per profile, as the OpenAPI document says."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import gangs, inventory, messages, mig
from tests.builders import JobBuilder, make_job, make_model_summary, make_summary
from tests.integration.test_queues_api import (
    ADMIN,
    H100,
    FakeAgent,
    clusters_ready,
    eventually,
    in_state,
    job,
    tenant,
    why,
)

PROFILE = "1g.10gb"
QUEUES = {
    "queues": [
        {"name": "m-q", "tenant": "team-a", "quotas": {H100: {"guaranteed": 1, "limit": 2}}},
    ],
}


class MigAgent(FakeAgent):
    """Cluster c1: 2 nodes of 8 H100, one GPU of each split into 7 slices of 1g.10gb."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        super().__init__(client)
        self.free = {"c1-n0": 7, "c1-n1": 7}  # whole GPUs
        self.slices_used: dict[str, int] = {}

    async def send_summary(self) -> None:
        self.seq += 1
        hist = [0] * 9
        for free in self.free.values():
            hist[free] += 1
        used = sum(self.slices_used.values())
        per_node = [max(0, 7 - used), 7] if used <= 7 else [0, 14 - used]
        by_free = [0] * 8
        for free in per_node:
            by_free[free] += 1
        slices = inventory.MIGSummary(total=14, free=sum(per_node), nodes_by_free=by_free)
        model = make_model_summary(H100, nodes_by_free=hist).model_copy(
            update={"mig": {PROFILE: slices}, "total_gpus": 16}
        )
        await self.send(messages.Summary(summary=make_summary("c1", model, seq=self.seq)))

    async def _offer(self, offer: messages.Offer) -> None:
        request = gangs.gang_request(offer.job_id, offer.job)
        self.slices_used[offer.job_id] = sum(r * s.mig_slices for _, r, s in request.tasks)
        await super()._offer(offer)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    tokens: list[dict[str, Any]] = [{"token": "team-a-token", "tenant": "team-a"}]
    tokens += [{"token": "admin-token", "admin": True}, {"token": "agent-token", "agent": "c1"}]
    (tmp_path / "tokens.yaml").write_text(yaml.safe_dump({"tokens": tokens}))
    (tmp_path / "queues.yaml").write_text(yaml.safe_dump(QUEUES))
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}",
        tokens_file=tmp_path / "tokens.yaml",
        queues_file=tmp_path / "queues.yaml",
    )
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def agent(api: TestClient[Any, Any]) -> AsyncIterator[MigAgent]:
    fake = MigAgent(api)
    await fake.start()
    await eventually(api, lambda: clusters_ready(api))
    try:
        yield fake
    finally:
        await fake.stop()


def mig_job(name: str, slices: int = 1) -> JobBuilder:
    return make_job(name, gpus=slices, queue="m-q").annotate(mig.MIG_PROFILE_ANNOTATION, PROFILE)


async def submitted(api: TestClient[Any, Any], builder: JobBuilder) -> str:
    body = io.BytesIO(json.dumps(builder.document()).encode())
    response = await api.post("/v1/jobs", data=body, headers=tenant("team-a"))
    assert response.status == 202, await response.text()
    return str((await response.json())["id"])


async def test_a_queue_exhausted_by_mig_jobs_gets_no_more_and_why_says_so(
    api: TestClient[Any, Any], agent: MigAgent
) -> None:
    first = await submitted(api, mig_job("m1"))
    second = await submitted(api, mig_job("m2"))
    for job_id in (first, second):
        await eventually(api, in_state(api, job_id, "Running"))
    third = await submitted(api, mig_job("m3"))

    async def explained() -> dict[str, Any] | None:
        answer = await why(api, third)
        return answer if answer["reasons"] else None

    answer = await eventually(api, explained)
    assert answer["state"] == "Queued"
    assert [(r["cluster"], r["code"]) for r in answer["reasons"]] == [("fleet", "BorrowingLimit")]
    assert "queue m-q holds 2 " in answer["reasons"][0]["message"]
    assert "this job needs 1 more" in answer["reasons"][0]["message"]
    record = await job(api, third)
    assert record["status"]["state"] == "Queued" and not record["status"].get("cluster")
    assert set(agent.slices_used) == {first, second}  # the third was never offered
    queues = await (await api.get("/v1/queues/m-q", headers=ADMIN)).json()
    assert [(g["model"], g["inUse"]) for g in queues["status"]["gpus"]] == [(H100, 2)]


async def test_the_clusters_answer_shows_mig_devices_per_profile_as_openapi_says(
    api: TestClient[Any, Any], agent: MigAgent
) -> None:
    job_id = await submitted(api, mig_job("m", slices=3))
    await eventually(api, in_state(api, job_id, "Running"))

    async def shown() -> dict[str, Any] | None:
        items = (await (await api.get("/v1/clusters", headers=ADMIN)).json())["items"]
        [model] = items[0]["models"]
        return model if model["mig"] and model["mig"][0]["free"] == 11 else None

    model = await eventually(api, shown)
    assert model["mig"] == [{"profile": PROFILE, "total": 14, "free": 11}]
    assert (model["total"], model["free"]) == (16, 14)

    spec = await (await api.get("/openapi.json")).json()
    answer = await (await api.get("/v1/clusters", headers=ADMIN)).json()
    schema = spec["paths"]["/v1/clusters"]["get"]["responses"]["200"]["content"][
        "application/json"
    ]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": spec["components"]}).validate(answer)
    bad = {"items": [{**answer["items"][0], "models": [{**model, "mig": [{"profile": 1}]}]}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator({**schema, "components": spec["components"]}).validate(bad)
