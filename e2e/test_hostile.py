"""Nothing one tenant or one agent sends stops the fleet (real broker and agent processes):
hostile bodies get a 4xx and store nothing, a malformed agent message degrades that cluster
only, and another tenant's canary job is dispatched right after."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from broker.api import messages
from e2e.helpers import wait_for
from gpufed.local import processes
from tests.builders import make_job, make_model_summary, make_summary

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


def job_text(**spec: Any) -> str:
    document = make_job("hostile", gpus=1).document()
    document["spec"].update(spec)
    return json.dumps(document)


def annotated(value: str) -> str:
    """A job whose annotation is `value` as raw JSON text (escapes kept as sent)."""
    document = make_job("hostile", gpus=1).document()
    text = json.dumps(document)
    return text.replace('"annotations": {}', f'"annotations": {{"note": {value}}}', 1)


HOSTILE = {
    "deeply nested JSON": ("[" * 5000 + "]" * 5000, "application/json"),
    "5000-digit integer": (
        job_text(priority=0).replace('"priority": 0', '"priority": ' + "9" * 5000),
        "application/json",
    ),
    "priority beyond int32": (job_text(priority=10**30), "application/json"),
    "lone surrogate": (annotated('"\\ud800"'), "application/json"),
    "queue not a DNS label": (job_text(queue="Team_A"), "application/json"),
    "deep YAML": ("a:\n  - " + "[" * 3000 + "]" * 3000, "application/yaml"),
    "YAML long int": ("spec: {priority: " + "1" * 5000 + "}", "application/yaml"),
    "infinite number": (
        job_text(priority=0).replace('"priority": 0', '"priority": 1e999'),
        "application/json",
    ),
}


async def post(fleet: processes.LocalFleet, tenant: str, body: str, content_type: str) -> Any:
    headers = {"Authorization": f"Bearer {fleet.tokens[tenant]}", "Content-Type": content_type}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{fleet.url}/v1/jobs", data=body.encode(), headers=headers) as response,
    ):
        return response.status, await response.text()


@pytest.fixture
async def running(fleet: processes.LocalFleet) -> processes.LocalFleet:
    fleet.write_tokens(tenants=["team-a", "team-b"], clusters=["h100", "rogue"])
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])
    return fleet


async def canary_runs(fleet: processes.LocalFleet) -> float:
    """team-a's canary job: seconds from its submit to its dispatch, by the broker's own event
    times (a scheduling cycle takes milliseconds: under half a second is the next cycles)."""
    async with fleet.client("team-a") as api:
        canary = await api.submit(json.dumps(make_job("canary", gpus=1).duration(0.2).document()))
        job = await wait_for(api, canary["id"], {"Dispatched", "Running", "Succeeded"}, timeout=10)
    events = {e["state"]: datetime.fromisoformat(e["time"]) for e in job["status"]["events"]}
    return (events["Dispatched"] - events["Queued"]).total_seconds()


async def test_hostile_bodies_get_a_4xx_and_the_canary_still_runs(
    running: processes.LocalFleet,
) -> None:
    answers = {}
    for name, (body, content_type) in HOSTILE.items():
        status, text = await post(running, "team-b", body, content_type)
        problem = json.loads(text)
        answers[name] = status
        assert problem["status"] == status and problem["detail"], (name, text)
    assert {n: s for n, s in answers.items() if not 400 <= s < 500} == {}
    async with running.client("admin") as api:
        assert [j for j in await api.jobs() if j["tenant"] == "team-b"] == []
    assert await canary_runs(running) < 0.5


async def rogue_session(fleet: processes.LocalFleet, frame: str) -> tuple[int | None, str]:
    """Connect as the agent of `rogue`, say hello, send `frame`; the close code and reason."""
    headers = {"Authorization": f"Bearer {fleet.tokens['agent:rogue']}"}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{fleet.url}/v1/agents/connect", headers=headers) as ws,
    ):
        await ws.send_str(messages.encode(messages.Hello(cluster="rogue")))
        welcome = messages.decode((await ws.receive(timeout=5)).data)
        assert isinstance(welcome, messages.Welcome)
        await ws.send_str(frame)
        while True:
            message = await ws.receive(timeout=5)
            if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                return ws.close_code, str(message.extra or "")


def good_summary(seq: int) -> str:
    model = make_model_summary(H100, nodes_by_free=[0] * 8 + [2])
    return messages.encode(
        messages.Summary(full=True, summary=make_summary("rogue", model, seq=seq))
    )


def bad_summary(field: str, value: Any) -> str:
    frame = json.loads(good_summary(1))
    frame["summary"]["models"][0][field] = value
    return json.dumps(frame)


MALFORMED = {  # what a buggy agent sends, and the field the refusal names
    "negative GPU total": (bad_summary("total_gpus", -16), "total_gpus"),
    "rack beyond the histogram": (bad_summary("racks", {"r1": [0] * 8 + [5]}), "racks"),
    "integer above 10^308": (
        good_summary(1).replace('"free_gpus":16', '"free_gpus":1' + "0" * 400),
        "free_gpus",
    ),
    "malformed job status": ('{"type": "job_status", "job_id": 5}', "job_id"),
    "deeply nested frame": ("[" * 3000 + "]" * 3000, "bad unknown message"),
}


async def test_a_malformed_agent_message_degrades_that_cluster_only(
    running: processes.LocalFleet,
) -> None:
    for name, (frame, field) in MALFORMED.items():
        code, reason = await rogue_session(running, frame)
        assert code == 4400, name
        assert field in reason, (name, reason)
        async with running.client("admin") as api:
            clusters = {c["name"]: c for c in await api.clusters()}
        assert clusters["rogue"]["health"] == "Degraded", name
        assert field in clusters["rogue"]["reason"], name
        assert clusters["rogue"]["models"] == [], name  # the bad summary never got in
        assert clusters["h100"]["health"] == "Ready", name
        assert await canary_runs(running) < 0.5, name


async def test_a_degraded_cluster_is_ready_again_after_a_good_full_summary(
    running: processes.LocalFleet,
) -> None:
    await rogue_session(running, bad_summary("nodes", -1))
    headers = {"Authorization": f"Bearer {running.tokens['agent:rogue']}"}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{running.url}/v1/agents/connect", headers=headers) as ws,
    ):
        await ws.send_str(messages.encode(messages.Hello(cluster="rogue")))
        await ws.receive(timeout=5)
        await ws.send_str(good_summary(2))
        deadline = time.monotonic() + 5
        async with running.client("admin") as api:
            while time.monotonic() < deadline:
                rogue = {c["name"]: c for c in await api.clusters()}["rogue"]
                if rogue["health"] == "Ready":
                    break
        assert rogue["health"] == "Ready" and rogue["reason"] is None
        assert rogue["models"][0]["total"] == 16
