"""A request is bounded by what it expands to, and a list page by its bytes (a real aiohttp
server on SQLite): the dependencies an array multiplies, the bytes of a batch's arrays
together, the flags that set the bounds, and a page of large jobs that stops early."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.http import keys
from tests.builders import make_job

TEAM_A = {"Authorization": "Bearer dev-team-a"}
REPO = Path(__file__).resolve().parents[2]

Client = TestClient[Any, Any]
Start = Callable[..., Awaitable[Client]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    clients: list[Client] = []

    async def started(**settings: Any) -> Client:
        config = broker_app.BrokerSettings(
            store=f"sqlite:///{tmp_path / 'broker.db'}",
            tokens_file=REPO / "config" / "tokens.yaml",
            **settings,
        )
        client = TestClient(TestServer(broker_app.create_app(config)))
        await client.start_server()
        clients.append(client)
        return client

    yield started
    for client in clients:
        await client.close()


def job(name: str, **spec: Any) -> dict[str, Any]:
    document = make_job(name, gpus=1).document()
    document["spec"].update(spec)
    return document


async def post(api: Client, path: str, doc: Any) -> Any:
    body = io.BytesIO(json.dumps(doc).encode())
    return await api.post(path, data=body, headers=TEAM_A)


async def stored(api: Client) -> int:
    return len(api.server.app[keys.JOBS])


async def test_an_array_multiplying_its_dependencies_past_the_bound_is_refused(
    start: Start,
) -> None:
    api = await start()
    assert (await post(api, "/v1/jobs", job("prep"))).status == 202
    entries = [{"job": "prep"}] * 11  # 10,000 jobs × 11 entries: 110,000 dependencies
    response = await post(api, "/v1/jobs", job("sweep", array={"count": 10_000}, dependsOn=entries))
    assert response.status == 422
    problem = await response.json()
    assert problem["field"] == "spec.dependsOn"
    assert "110000 dependencies" in problem["detail"]
    assert "at most 100000 (--max-request-dependencies)" in problem["detail"]
    assert await stored(api) == 1


async def test_the_bounds_follow_the_brokers_settings(start: Start) -> None:
    api = await start(max_request_dependencies=10, max_request_jobs=20)
    many = job("sweep", array={"count": 6}, dependsOn=[{"job": "a"}, {"job": "b"}])
    response = await post(api, "/v1/jobs", many)
    assert response.status == 422
    assert (await response.json())["field"] == "spec.dependsOn"
    items = [{"job": job("one", array={"count": 15})}, {"job": job("two", array={"count": 6})}]
    answer = await (await post(api, "/v1/jobs:batch", {"items": items})).json()
    assert [item["status"] for item in answer["items"]] == [202, 422]
    problem = answer["items"][1]["problem"]
    assert problem["field"] == "items[1].job.spec.array.count"
    assert "15 jobs before it and 6 of it" in problem["detail"]
    assert "at most 20 jobs (--max-request-jobs)" in problem["detail"]
    assert await stored(api) == 15


async def test_a_batchs_arrays_are_bounded_in_bytes_together(start: Start) -> None:
    big = job("big", array={"count": 1_000})
    big["metadata"]["annotations"] = {"notes": "x" * 34_000}  # 1,000 × 35 kB: 33 MiB each
    again = json.loads(json.dumps(big))
    again["metadata"]["name"] = "again"
    api = await start()
    answer = await post(api, "/v1/jobs:batch", {"items": [{"job": big}, {"job": again}]})
    body = await answer.json()
    assert [item["status"] for item in body["items"]] == [202, 422]
    problem = body["items"][1]["problem"]
    assert problem["field"] == "items[1].job.spec.array.count"
    assert "after 33 MiB before it" in problem["detail"] and "at most 64 MiB" in problem["detail"]
    assert await stored(api) == 1_000


async def test_a_page_of_large_jobs_stops_at_its_byte_bound(start: Start) -> None:
    api = await start(max_page_bytes=64 * 1024)
    doc = job("large")
    doc["metadata"]["annotations"] = {"notes": "x" * 4_000}  # about 5 kB a job
    items = [{"job": doc} for _ in range(60)]
    answer = await (await post(api, "/v1/jobs:batch", {"items": items})).json()
    assert answer["accepted"] == 60
    seen: list[str] = []
    pages = []
    cont = ""
    while True:
        response = await api.get(f"/v1/jobs?limit=1000{cont}", headers=TEAM_A)
        raw = await response.read()
        page = json.loads(raw)
        pages.append((len(raw), len(page["items"])))
        seen += [item["id"] for item in page["items"]]
        token = page["metadata"]["continue"]
        if token is None:
            break
        cont = f"&continue={token}"
    assert all(size <= 64 * 1024 for size, _ in pages), pages
    assert len(pages) > 1 and all(count > 0 for _, count in pages), pages
    assert len(seen) == len(set(seen)) == 60  # every job once, newest first
