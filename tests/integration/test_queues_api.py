"""Queues through the broker's HTTP API and its real scheduler, with a scripted agent on the
real WebSocket session: PUT/GET queues (admin only, validation, warnings), the queue checks at
submit, `why` with reason codes, and a reclaim preemption from Cancel to requeue."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import gangs, messages, status
from broker.http import keys
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
ADMIN = {"Authorization": "Bearer admin-token"}


def tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-token"}


QUEUES = {
    "policy": {"maxPreemptionsPerCycle": 4, "modelWeights": {H100: 4}},
    "priorityClasses": [{"name": "normal", "value": 0}, {"name": "high", "value": 100}],
    "queues": [
        {"name": "a-q", "tenant": "team-a", "quotas": {H100: {"guaranteed": 8, "limit": 8}}},
        {"name": "b-q", "tenant": "team-b", "quotas": {H100: {"guaranteed": 0, "limit": 16}}},
    ],
}


class FakeAgent:
    """The agent of cluster c1: 2 nodes of 8 H100; runs what it accepts until told."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client
        self.free = {"c1-n0": 8, "c1-n1": 8}
        self.pods: dict[str, list[tuple[str, int]]] = {}
        self.seq = 0
        self.epoch = 0
        self.cancels: list[messages.Cancel] = []
        self.hold_cancels = asyncio.Event()
        self.hold_cancels.set()
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.ws = await self.client.ws_connect(
            "/v1/agents/connect", headers={"Authorization": "Bearer agent-token"}
        )
        await self.send(messages.Hello(cluster="c1"))
        welcome = messages.decode(await self.ws.receive_str())
        assert isinstance(welcome, messages.Welcome)
        self.epoch = welcome.epoch
        await self.send_summary()
        self.task = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.ws is not None:
            await self.ws.close()

    async def send(self, message: messages._Msg) -> None:
        assert self.ws is not None
        await self.ws.send_str(messages.encode(message))

    async def send_summary(self) -> None:
        self.seq += 1
        hist = [0] * 9
        for free in self.free.values():
            hist[free] += 1
        summary = make_summary("c1", make_model_summary(H100, nodes_by_free=hist), seq=self.seq)
        await self.send(messages.Summary(summary=summary))

    async def _serve(self) -> None:
        assert self.ws is not None
        async for frame in self.ws:
            message = messages.decode(frame.data)
            if isinstance(message, messages.Offer):
                await self._offer(message)
            elif isinstance(message, messages.Cancel):
                self.cancels.append(message)
                asyncio.create_task(self._cancel(message))  # noqa: RUF006

    async def _offer(self, offer: messages.Offer) -> None:
        request = gangs.gang_request(offer.job_id, offer.job)
        placed: list[tuple[str, int]] = []
        for _, _, shape in request.pod_names():
            fits = sorted((f, n) for n, f in self.free.items() if f >= shape.gpus)
            if not fits:
                for node, gpus in placed:
                    self.free[node] += gpus
                await self.send(
                    messages.Rejected(job_id=offer.job_id, epoch=offer.epoch, reasons=["full"])
                )
                return
            node = fits[0][1]
            self.free[node] -= shape.gpus
            placed.append((node, shape.gpus))
        self.pods[offer.job_id] = placed
        pods = [
            status.PodPlacement(
                name=f"{offer.job_id}-{i}",
                task="worker",
                node=node,
                gpus=[status.GPUSlot(index=k) for k in range(gpus)],
            )
            for i, (node, gpus) in enumerate(placed)
        ]
        await self.send(messages.Accepted(job_id=offer.job_id, epoch=offer.epoch, pods=pods))
        running = [status.PodStatus(**p.model_dump(), phase=status.PodPhase.RUNNING) for p in pods]
        await self.send(
            messages.JobUpdate(
                job_id=offer.job_id, epoch=offer.epoch, state=status.JobState.RUNNING, pods=running
            )
        )
        await self.send_summary()

    async def _cancel(self, cancel: messages.Cancel) -> None:
        await self.hold_cancels.wait()
        for node, gpus in self.pods.pop(cancel.job_id, []):
            self.free[node] += gpus
        await self.send(
            messages.JobUpdate(
                job_id=cancel.job_id,
                epoch=cancel.epoch,
                state=status.JobState.CANCELLED,
                reason=cancel.reason,
            )
        )
        await self.send_summary()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    tokens = [{"token": f"{t}-token", "tenant": t} for t in ("team-a", "team-b")]
    tokens += [{"token": "admin-token", "admin": True}, {"token": "agent-token", "agent": "c1"}]
    (tmp_path / "tokens.yaml").write_text(yaml.safe_dump({"tokens": tokens}))
    (tmp_path / "queues.yaml").write_text(yaml.safe_dump(QUEUES))
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{tmp_path / 'broker.db'}",
        tokens_file=tmp_path / "tokens.yaml",
        queues_file=tmp_path / "queues.yaml",
        cancel_grace_seconds=5.0,
    )
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def agent(api: TestClient[Any, Any]) -> AsyncIterator[FakeAgent]:
    fake = FakeAgent(api)
    await fake.start()
    await eventually(api, lambda: clusters_ready(api))
    try:
        yield fake
    finally:
        await fake.stop()


async def clusters_ready(api: TestClient[Any, Any]) -> bool:
    items = (await (await api.get("/v1/clusters", headers=ADMIN)).json())["items"]
    return any(c["name"] == "c1" and c["health"] == "Ready" for c in items)


async def eventually(
    api: TestClient[Any, Any], check: Callable[[], Any], timeout: float = 5
) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            result = await check()
            if result:
                return result
            await asyncio.sleep(0.02)


async def submit(api: TestClient[Any, Any], team: str, builder: Any) -> Any:
    body = io.BytesIO(json.dumps(builder.document()).encode())
    return await api.post("/v1/jobs", data=body, headers=tenant(team))


async def submitted(api: TestClient[Any, Any], team: str, builder: Any) -> str:
    response = await submit(api, team, builder)
    assert response.status == 202, await response.text()
    return str((await response.json())["id"])


async def job(api: TestClient[Any, Any], job_id: str) -> dict[str, Any]:
    return dict(await (await api.get(f"/v1/jobs/{job_id}", headers=ADMIN)).json())


async def why(api: TestClient[Any, Any], job_id: str) -> dict[str, Any]:
    return dict(await (await api.get(f"/v1/jobs/{job_id}/why", headers=ADMIN)).json())


def in_state(api: TestClient[Any, Any], job_id: str, state: str) -> Callable[[], Any]:
    async def check() -> bool:
        return (await job(api, job_id))["status"]["state"] == state

    return check


# ---- the queues API -------------------------------------------------------------------------


async def test_queues_are_put_by_the_admin_read_by_their_tenant_and_put_creates_then_updates(
    api: TestClient[Any, Any],
) -> None:
    spec = {"tenant": "team-a", "weight": 2, "quotas": {H100: {"guaranteed": 4, "limit": 8}}}
    denied = await api.put("/v1/queues/a-2", data=json.dumps(spec), headers=tenant("team-a"))
    assert denied.status == 403
    own = await (await api.get("/v1/queues", headers=tenant("team-a"))).json()
    assert [q["name"] for q in own["items"]] == ["a-q"], "a tenant reads its own queues only"
    created = await api.put("/v1/queues/a-2", data=json.dumps(spec), headers=ADMIN)
    assert created.status == 201
    body = await created.json()
    assert body["spec"]["weight"] == 2 and body["declared"] is True
    assert body["status"]["gpus"] == [
        {"model": H100, "inUse": 0, "guaranteed": 4, "limit": 8, "fairShare": 0.0}
    ]
    spec["weight"] = 3
    updated = await api.put("/v1/queues/a-2", data=yaml.safe_dump(spec), headers=ADMIN)
    assert updated.status == 200 and (await updated.json())["spec"]["weight"] == 3
    listed = await (await api.get("/v1/queues", headers=ADMIN)).json()
    assert [q["name"] for q in listed["items"]] == ["a-2", "a-q", "b-q"]
    assert (await api.get("/v1/queues/nope", headers=ADMIN)).status == 404


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param(
            {"tenant": "t", "quotas": {H100: {"guaranteed": 24, "limit": 16}}},
            f"quotas.{H100}.guaranteed",
            id="guaranteed above limit",
        ),
        pytest.param(
            {"tenant": "t", "priorityClass": "urgent"}, "priorityClass", id="unknown class"
        ),
        pytest.param({"tenant": "t", "weight": 0}, "weight", id="weight zero"),
        pytest.param({"tenant": "t", "colour": "blue"}, "colour", id="unknown field"),
        pytest.param({"name": "other", "tenant": "t"}, "name", id="name differs from path"),
        pytest.param({"quotas": {}}, "tenant", id="no tenant"),
    ],
)
async def test_put_refuses_a_queue_that_cannot_work(
    api: TestClient[Any, Any], spec: dict[str, Any], field: str
) -> None:
    response = await api.put("/v1/queues/q1", data=json.dumps(spec), headers=ADMIN)
    assert response.status == 422
    problem = await response.json()
    assert problem["field"] == field, problem
    listed = await (await api.get("/v1/queues", headers=ADMIN)).json()
    assert "q1" not in [q["name"] for q in listed["items"]]


async def test_cohort_guaranteeing_more_than_the_fleet_is_a_warning(
    api: TestClient[Any, Any], agent: FakeAgent
) -> None:
    spec = {"tenant": "team-b", "quotas": {H100: {"guaranteed": 12, "limit": 16}}}
    response = await api.put("/v1/queues/b-q", data=json.dumps(spec), headers=ADMIN)
    assert response.status == 200
    [warning] = (await response.json())["warnings"]
    assert "guaranteed 20" in warning and "fleet's 16" in warning
    assert "299 gpufed" in response.headers["Warning"]
    listed = await (await api.get("/v1/queues", headers=ADMIN)).json()
    assert listed["warnings"] == [warning]


@pytest.mark.parametrize(
    ("team", "edit", "status_", "field"),
    [
        pytest.param("team-a", {"queue": "nope"}, 422, "spec.queue", id="undeclared queue"),
        pytest.param("team-b", {"queue": "a-q"}, 403, "spec.queue", id="another tenant's queue"),
        pytest.param(
            "team-a",
            {"queue": "a-q", "priorityClass": "urgent"},
            422,
            "spec.priorityClass",
            id="unknown priority class",
        ),
    ],
)
async def test_submit_checks_the_queue(
    api: TestClient[Any, Any], team: str, edit: dict[str, str], status_: int, field: str
) -> None:
    builder = make_job(gpus=1)
    builder.doc["spec"].update(edit)
    response = await submit(api, team, builder)
    assert response.status == status_
    assert (await response.json())["field"] == field


# ---- why, and a reclaim through the whole broker ----------------------------------------------


async def test_borrowing_limit_is_what_why_says(
    api: TestClient[Any, Any], agent: FakeAgent
) -> None:
    first = await submitted(api, "team-a", make_job("a", gpus=8, queue="a-q"))
    await eventually(api, in_state(api, first, "Running"))
    second = await submitted(api, "team-a", make_job("a", gpus=4, queue="a-q"))

    async def explained() -> dict[str, Any] | None:
        answer = await why(api, second)
        return answer if answer["reasons"] else None

    answer = await eventually(api, explained)
    assert answer["state"] == "Queued" and answer["queue"] == "a-q"
    assert [(r["cluster"], r["code"]) for r in answer["reasons"]] == [("fleet", "BorrowingLimit")]
    assert "may hold at most 8" in answer["reasons"][0]["message"]
    assert answer["clusters"] == [
        {
            "cluster": "fleet",
            "codes": ["BorrowingLimit"],
            "reasons": [answer["reasons"][0]["message"]],
        }
    ]


async def test_reclaim_preempts_a_borrower_which_goes_back_to_the_queue(
    api: TestClient[Any, Any], agent: FakeAgent
) -> None:
    borrowers = []
    for i in range(2):
        borrowers.append(await submitted(api, "team-b", make_job(f"b{i}", gpus=8, queue="b-q")))
        await eventually(api, in_state(api, borrowers[-1], "Running"))
        await asyncio.sleep(0.05)  # b1 starts later: it lost least work
    agent.hold_cancels.clear()
    reclaimer = await submitted(api, "team-a", make_job("a", gpus=8, queue="a-q"))

    async def preempting() -> dict[str, Any] | None:
        answer = await why(api, reclaimer)
        codes = {r["code"] for r in answer["reasons"]}
        return answer if "WaitingForPreemption" in codes else None

    answer = await eventually(api, preempting)
    assert [c.reason for c in agent.cancels] == ["Preempted"]
    assert agent.cancels[0].job_id == borrowers[1]
    assert agent.cancels[0].grace_seconds == 5.0
    assert any(
        r["cluster"] == "c1" and "to reclaim the guaranteed quota of queue a-q" in r["message"]
        for r in answer["reasons"]
    ), answer
    victim_why = await why(api, borrowers[1])
    assert "being preempted for job" in victim_why["message"]

    agent.hold_cancels.set()
    await eventually(api, in_state(api, reclaimer, "Running"))
    victim = await job(api, borrowers[1])
    assert victim["status"]["state"] == "Queued"
    reasons = [(e["state"], e["reason"]) for e in victim["status"]["events"]]
    assert ("Running", "Preempting") in reasons and reasons[-1] == ("Queued", "Preempted")
    assert "reclaim the guaranteed quota of queue a-q" in victim["status"]["events"][-1]["message"]
    assert len(agent.cancels) == 1, "one preemption made room; no second one"

    async def victim_explained() -> dict[str, Any] | None:
        answer = await why(api, borrowers[1])
        codes = {r["code"] for r in answer["reasons"]}
        return answer if codes >= {"Capacity", "FairShare"} else None

    await eventually(api, victim_explained)

    queues = {
        q["name"]: q for q in (await (await api.get("/v1/queues", headers=ADMIN)).json())["items"]
    }
    assert queues["a-q"]["status"]["gpus"][0]["inUse"] == 8
    assert queues["b-q"]["status"]["gpus"][0]["inUse"] == 8
    assert queues["b-q"]["status"]["preemptions"] == 1
    metrics = await (await api.get("/metrics", headers=ADMIN)).text()
    assert 'gpufed_preemptions_total{queue="b-q",reason="Reclaim"} 1.0' in metrics

    async def gauges() -> str | None:
        text = await (await api.get("/metrics", headers=ADMIN)).text()
        return (
            text if f'gpufed_queue_gpus_in_use{{model="{H100}",queue="a-q"}} 8.0' in text else None
        )

    text = await eventually(api, gauges)
    assert f'gpufed_queue_gpus_guaranteed{{model="{H100}",queue="a-q"}} 8.0' in text
    assert f'gpufed_queue_gpus_fair_share{{model="{H100}",queue="b-q"}} 8.0' in text
    book = api.app[keys.JOBS]
    kept = book.usage()  # kept on transitions: the same as a recount from the jobs
    assert {q: dict(g) for q, g in kept.gpus.items() if any(g.values())} == {
        "a-q": {H100: 8},
        "b-q": {H100: 8},
    }


async def test_running_job_of_a_queue_within_its_guarantee_is_never_reclaimed(
    api: TestClient[Any, Any], agent: FakeAgent
) -> None:
    held = await submitted(api, "team-a", make_job("a", gpus=8, queue="a-q"))
    await eventually(api, in_state(api, held, "Running"))
    big = await submitted(api, "team-b", make_job("b", gpus=8, queue="b-q").gang(2))

    async def explained() -> dict[str, Any] | None:
        answer = await why(api, big)
        return answer if answer["reasons"] else None

    answer = await eventually(api, explained)
    codes = {(r["cluster"], r["code"]) for r in answer["reasons"]}
    assert ("c1", "Capacity") in codes and ("fleet", "FairShare") in codes
    assert agent.cancels == []
