"""What the web console reads, against a real broker (aiohttp server, SQLite store): its files
at /ui/, who a token names, the job change stream (server-sent events) and a cluster's GPU
map with a real simulated agent placing pods."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.http import events
from member_agent import app as agent_app
from tests import agentbuilders
from tests.builders import make_job

REPO = Path(__file__).resolve().parents[2]
TEAM_A = {"Authorization": "Bearer dev-team-a"}
TEAM_B = {"Authorization": "Bearer dev-team-b"}
ADMIN = {"Authorization": "Bearer dev-admin"}
H100 = agentbuilders.H100
TEMPLATE = 'http://grafana:3000/explore?traceId={trace_id}&x="<b>"'
Client = TestClient[Any, Any]


async def start(tmp_path: Path, **settings: Any) -> Client:
    config = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}",
        tokens_file=settings.pop("tokens_file", REPO / "config" / "tokens.yaml"),
        **settings,
    )
    client = TestClient(TestServer(broker_app.create_app(config)))
    await client.start_server()
    return client


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Client]:
    client = await start(tmp_path, trace_url_template=TEMPLATE)
    try:
        yield client
    finally:
        await client.close()


class Stream:
    """An open `GET /v1/events`, read event by event."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self, *, timeout: float = 5.0) -> tuple[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                block = (await self.response.content.readuntil(b"\n\n")).decode()
                lines = [line for line in block.strip().split("\n") if not line.startswith(":")]
                if not lines:
                    continue  # a keepalive
                fields = dict(line.split(": ", 1) for line in lines)
                return fields["event"], json.loads(fields["data"])

    async def until(
        self, wanted: Callable[[str, Any], bool], *, timeout: float = 5.0
    ) -> list[tuple[str, Any]]:
        """Every event up to and with the first `wanted` one."""
        seen = []
        async with asyncio.timeout(timeout):
            while True:
                seen.append(await self.next(timeout=timeout))
                if wanted(*seen[-1]):
                    return seen


async def open_stream(api: Client, headers: dict[str, str]) -> Stream:
    response = await api.get("/v1/events", headers=headers)
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"] == "text/event-stream"
    stream = Stream(response)
    name, _ = await stream.next()
    assert name == "hello"
    return stream


async def submit(api: Client, name: str, headers: dict[str, str] = TEAM_A) -> str:
    job = make_job(name, gpus=1).document()
    response = await api.post("/v1/jobs", json=job, headers=headers)
    assert response.status == 202, await response.text()
    return str((await response.json())["id"])


# ---- the files -------------------------------------------------------------------------------


async def test_the_console_is_served_without_a_token_and_names_the_trace_template(
    api: Client,
) -> None:
    moved = await api.get("/ui", allow_redirects=False)
    assert (moved.status, moved.headers["Location"]) == (308, "/ui/")
    page = await api.get("/ui/")
    assert page.status == 200 and page.content_type == "text/html"
    text = await page.text()
    assert 'src="js/main.js"' in text and "https://" not in text.replace(TEMPLATE, "")
    # the template is in the page, escaped: it cannot end the attribute
    assert (
        'content="http://grafana:3000/explore?traceId={trace_id}&amp;x=&quot;&lt;b&gt;&quot;"'
        in (text)
    )
    policy = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "frame-ancestors 'none'" in policy  # added by http.headers for every HTML answer
    script = await api.get("/ui/js/main.js")
    assert script.status == 200 and script.content_type == "text/javascript"
    assert "sessionStorage" in await (await api.get("/ui/js/api.js")).text()
    assert (await api.get("/ui/console.css")).content_type == "text/css"


@pytest.mark.parametrize(
    "path", ["/ui/nothing.js", "/ui/../broker.db", "/ui/js/../../app.py", "/ui/%2e%2e/app.py"]
)
async def test_a_path_that_is_not_a_console_file_is_404(api: Client, path: str) -> None:
    response = await api.get(path)
    assert response.status == 404


def test_a_trace_template_must_be_an_http_url_with_the_trace_id() -> None:
    for bad in ["http://grafana/explore", "javascript:alert({trace_id})"]:
        with pytest.raises(ValueError, match="--trace-url-template"):
            broker_app.BrokerSettings(trace_url_template=bad)


async def test_whoami_names_the_role_and_tenant(api: Client) -> None:
    answer = await (await api.get("/v1/whoami", headers=TEAM_A)).json()
    assert (answer["role"], answer["tenant"]) == ("submitter", "team-a")
    answer = await (await api.get("/v1/whoami", headers=ADMIN)).json()
    assert (answer["role"], answer["tenant"]) == ("admin", None)
    assert (await api.get("/v1/whoami")).status == 401


# ---- the stream ------------------------------------------------------------------------------


async def test_the_stream_sends_each_callers_own_jobs_as_they_change(api: Client) -> None:
    assert (await api.get("/v1/events")).status == 401
    mine = await open_stream(api, TEAM_A)
    fleet = await open_stream(api, ADMIN)
    theirs = await submit(api, "theirs", TEAM_B)
    job_id = await submit(api, "mine")
    seen = await mine.until(lambda name, data: name == "job" and data["id"] == job_id)
    assert [d["id"] for n, d in seen if n == "job"] == [job_id]  # never team-b's
    (_, record) = seen[-1]
    assert (record["tenant"], record["status"]["state"]) == ("team-a", "Queued")
    assert record["job"]["metadata"]["name"] == "mine"
    assert "traceparent" in record and "traceParent" not in record  # as the API shows a job
    admin_seen: set[str] = set()
    await fleet.until(
        lambda name, data: (
            name == "job" and admin_seen.add(data["id"]) is None and {job_id, theirs} <= admin_seen
        )
    )
    assert (await api.delete(f"/v1/jobs/{job_id}", headers=TEAM_A)).status == 202
    (_, cancelled) = (
        await mine.until(lambda n, d: n == "job" and d["status"]["state"] == "Cancelled")
    )[-1]
    assert cancelled["id"] == job_id


async def test_a_burst_becomes_one_event_per_job_and_too_many_a_resync(
    api: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = await open_stream(api, TEAM_A)
    ids = await asyncio.gather(*(submit(api, f"b{i}") for i in range(3)))
    seen = [await stream.next() for _ in range(3)]
    assert sorted(d["id"] for _, d in seen) == sorted(ids)
    monkeypatch.setattr(events, "MAX_BATCH", 2)
    await asyncio.gather(*(submit(api, f"c{i}") for i in range(3)))
    assert await stream.next() == ("resync", {"changed": 3})


async def test_the_stream_ends_when_its_token_is_revoked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "KEEPALIVE_SECONDS", 0.1)
    tokens = tmp_path / "tokens.yaml"
    entries = yaml.safe_load((REPO / "config" / "tokens.yaml").read_text())["tokens"]
    tokens.write_text(yaml.safe_dump({"tokens": entries}))
    api = await start(tmp_path, tokens_file=tokens, tokens_poll_seconds=0.05)
    try:
        stream = await open_stream(api, TEAM_A)
        kept = [e for e in entries if e.get("token") != "dev-team-a"]
        tokens.write_text(yaml.safe_dump({"tokens": kept}))
        name, data = await stream.next(timeout=10)
        assert name == "bye" and "no longer valid" in data["reason"]
    finally:
        await api.close()


async def test_an_open_stream_does_not_hold_the_broker_up(tmp_path: Path) -> None:
    api = await start(tmp_path)
    stream = await open_stream(api, TEAM_A)
    started = time.monotonic()
    closing = asyncio.create_task(api.server.close())  # the server first, the client reading
    try:
        name, data = await stream.next()
        await closing
        assert name == "bye" and "shutting down" in data["reason"]
        assert time.monotonic() - started < 5
    finally:
        await api.close()


# ---- the GPU map -----------------------------------------------------------------------------


async def wait_for(api: Client, job_id: str, state: str, *, timeout: float = 15.0) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            got = await (await api.get(f"/v1/jobs/{job_id}", headers=ADMIN)).json()
            if got["status"]["state"] == state and got["status"]["pods"]:
                return got
            await asyncio.sleep(0.05)


async def test_the_gpu_map_shows_the_pods_the_agent_placed_and_every_other_node(
    api: Client, tmp_path: Path
) -> None:
    token = tmp_path / "a100.token"
    token.write_text("dev-agent-a100\n")
    stop = asyncio.Event()
    settings = agent_app.AgentSettings(
        broker_url=str(api.make_url("/")),
        cluster="a100",
        token_file=token,
        nodes_file=agentbuilders.write_cluster(tmp_path),  # 2 x 8 H100, 1 x 4 L4
        summary_interval_seconds=0.02,
    )
    agent = asyncio.create_task(agent_app.run_agent(settings, stop=stop))
    try:
        whole = make_job("whole", gpus=4).model(H100).duration(60).document()
        shared = make_job("shared", gpus=1).model(H100).shared(500).duration(60).document()
        ids = []
        for job, headers in ((whole, TEAM_A), (shared, TEAM_B)):
            answer = await api.post("/v1/jobs", json=job, headers=headers)
            assert answer.status == 202, await answer.text()
            ids.append((await answer.json())["id"])
        placed = [await wait_for(api, job_id, "Running") for job_id in ids]
        await asyncio.sleep(0.2)  # the summary after the placements
        got = await api.get("/v1/clusters/a100/gpus", headers=TEAM_A)
        assert got.status == 200, await got.text()
        answer = await got.json()
        assert answer["health"] == "Ready"
        assert sorted((m["model"], m["gpusPerNode"], m["nodes"]) for m in answer["models"]) == [
            (H100, 8, 2),
            (agentbuilders.L4, 4, 1),
        ]
        assert len(answer["nodes"]) + sum(g["count"] for g in answer["others"]) == 3
        by_node = {n["name"]: n for n in answer["nodes"]}
        for record, kind in zip(placed, "WS", strict=True):
            for pod in record["status"]["pods"]:
                cells = by_node[pod["node"]]["cells"]
                assert {cells[slot["index"]] for slot in pod["gpus"]} == {kind}
        (whole_node,) = {p["node"] for p in placed[0]["status"]["pods"]}
        assert by_node[whole_node]["cells"].count("W") == 4
        assert ids[0] in by_node[whole_node]["jobs"]
        shown = {job for node in answer["nodes"] for job in node["jobs"]}
        assert ids[1] not in shown  # team-b's job colours its cell, its id is not team-a's
        free_h100 = [{"model": H100, "cells": "F" * 8, "count": 1}] if len(by_node) == 1 else []
        l4 = [{"model": agentbuilders.L4, "cells": "FFFF", "count": 1}]
        assert answer["others"] == free_h100 + l4  # from the summary: names not reported
        assert (await api.get("/v1/clusters/nowhere/gpus", headers=TEAM_A)).status == 404
        assert (await api.get("/v1/clusters/a100/gpus")).status == 401
    finally:
        stop.set()
        async with asyncio.timeout(5):
            await agent
