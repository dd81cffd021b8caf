"""Trusted images through the broker's HTTP API (a real broker app on loopback, SQLite store)
and at the agent (a job handler on a simulated cluster): a job naming an image its tenant's
allotment or its queue does not allow is 422 naming the image's field, and nothing is stored;
a tenant-admin's queue cannot widen the allotment's list; an offer whose images are not allowed
is rejected with the reason, nothing created; an agent of an older protocol is not sent the
list it would refuse."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from broker.api import jobs, messages
from tests import agentbuilders, brokerapps
from tests.builders import make_job, make_model_summary, make_summary
from tests.unit.member_agent import harnesses

TOKENS: list[dict[str, Any]] = [
    {"token": "admin", "admin": True},
    {"token": "a-admin", "tenant": "team-a", "role": "tenant-admin"},
    {"token": "team-a", "tenant": "team-a"},
    {"token": "team-b", "tenant": "team-b"},
    {"token": "agent", "agent": "c1"},
]
QUEUES = {
    "queues": [
        {"name": "a-q", "tenant": "team-a", "quotas": {"*": {}}},
        {"name": "a-torch", "tenant": "team-a", "allowedImages": ["nvcr.io/nvidia/pytorch"]},
        {"name": "b-q", "tenant": "team-b"},  # team-b has no list: any image, as before
    ],
    "allotments": [
        {"tenant": "team-a", "allowedImages": ["registry.example.com/team-a/", "nvcr.io/nvidia/"]}
    ],
}
MAIN = "spec.tasks[0].template.spec.containers[0].image"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with brokerapps.served(tmp_path, tokens=TOKENS, queues=QUEUES) as client:
        yield client


def job_with(queue: str, image: str, **pod: Any) -> dict[str, Any]:
    doc = make_job("train", gpus=1, queue=queue).document()
    spec = doc["spec"]["tasks"][0]["template"]["spec"]
    spec["containers"][0]["image"] = image
    spec.update(pod)
    return doc


async def submit(api: TestClient[Any, Any], tenant: str, doc: dict[str, Any]) -> tuple[int, Any]:
    async with api.post("/v1/jobs", data=json.dumps(doc), headers=bearer(tenant)) as answer:
        return answer.status, await answer.json()


async def stored(api: TestClient[Any, Any]) -> list[str]:
    async with api.get("/v1/jobs", headers=bearer("admin")) as answer:
        assert answer.status == 200
        return [j["id"] for j in (await answer.json())["items"]]


@pytest.mark.parametrize(
    ("queue", "image", "pod", "field"),
    [
        pytest.param("a-q", "busybox", {}, MAIN, id="Docker Hub, not in the allotment"),
        pytest.param(
            "a-q",
            "registry.example.com.evil.io/team-a/app:1",
            {},
            MAIN,
            id="a host that begins like the allowed one",
        ),
        pytest.param(
            "a-q", "registry.example.com/team-ab/app", {}, MAIN, id="a path that begins alike"
        ),
        pytest.param(
            "a-q",
            "registry.example.com/team-a/app",
            {
                "initContainers": [
                    {"name": "fetch", "image": "registry.example.com/team-a/fetch"},
                    {"name": "setup", "image": "quay.io/evil/setup"},
                ]
            },
            "spec.tasks[0].template.spec.initContainers[1].image",
            id="an init container",
        ),
        pytest.param(
            "a-torch",
            "nvcr.io/nvidia/tensorflow:24.01",
            {},
            MAIN,
            id="in the allotment, not in the queue's narrower list",
        ),
        pytest.param(
            "undeclared",
            "busybox",
            {},
            "spec.queue",
            id="an undeclared queue is refused first (declared mode)",
        ),
    ],
)
async def test_a_job_naming_an_image_not_allowed_is_422_naming_it_and_nothing_is_stored(
    api: TestClient[Any, Any], queue: str, image: str, pod: dict[str, Any], field: str
) -> None:
    status, problem = await submit(api, "team-a", job_with(queue, image, **pod))
    assert status == 422, problem
    assert problem["field"] == field
    if field != "spec.queue":
        assert problem["title"] == "Image not allowed"
        assert problem["errors"][0]["field"] == field
        assert "is not allowed" in problem["detail"]
    assert await stored(api) == []


@pytest.mark.parametrize(
    ("tenant", "queue", "image"),
    [
        pytest.param("team-a", "a-q", "registry.example.com/team-a/train:3", id="the allotment"),
        pytest.param("team-a", "a-q", "Registry.Example.com/team-a/x", id="host in any case"),
        pytest.param("team-a", "a-torch", "nvcr.io/nvidia/pytorch:24.01-py3", id="the queue's"),
        pytest.param("team-b", "b-q", "quay.io/anything/at-all", id="a tenant without a list"),
    ],
)
async def test_an_allowed_image_is_accepted(
    api: TestClient[Any, Any], tenant: str, queue: str, image: str
) -> None:
    status, answer = await submit(api, tenant, job_with(queue, image))
    assert status == 202, answer
    assert await stored(api) == [answer["id"]]


async def put_queue(
    api: TestClient[Any, Any], token: str, name: str, spec: dict[str, Any]
) -> tuple[int, Any]:
    body = json.dumps({"tenant": "team-a", **spec})
    async with api.put(f"/v1/queues/{name}", data=body, headers=bearer(token)) as answer:
        return answer.status, await answer.json()


async def queue_images(api: TestClient[Any, Any], name: str) -> Any:
    async with api.get(f"/v1/queues/{name}", headers=bearer("admin")) as answer:
        return (await answer.json())["spec"].get("allowedImages")


async def test_a_tenant_admin_narrows_the_allotments_list_and_cannot_widen_it(
    api: TestClient[Any, Any],
) -> None:
    status, problem = await put_queue(
        api, "a-admin", "a-wide", {"allowedImages": ["nvcr.io/nvidia/", "docker.io/library/"]}
    )
    assert status == 403, problem
    assert problem["field"] == "allowedImages"
    assert "docker.io/library/" in problem["detail"]
    async with api.get("/v1/queues/a-wide", headers=bearer("admin")) as answer:
        assert answer.status == 404  # nothing stored
    status, problem = await put_queue(api, "a-admin", "a-bad", {"allowedImages": ["team-a/"]})
    assert status == 422, problem
    assert problem["field"] == "allowedImages[0]"

    status, view = await put_queue(
        api, "a-admin", "a-torch", {"allowedImages": ["nvcr.io/nvidia/pytorch:24.01"]}
    )
    assert status == 200, view
    assert await queue_images(api, "a-torch") == ["nvcr.io/nvidia/pytorch:24.01"]
    status, problem = await submit(api, "team-a", job_with("a-torch", "nvcr.io/nvidia/pytorch:25"))
    assert (status, problem["field"]) == (422, MAIN)
    status, answer = await submit(
        api, "team-a", job_with("a-torch", "nvcr.io/nvidia/pytorch:24.01")
    )
    assert status == 202, answer
    # the admin is not bound, but a queue's list still only narrows the allotment's
    status, view = await put_queue(api, "admin", "a-any", {"allowedImages": ["quay.io/"]})
    assert status == 201, view
    status, problem = await submit(api, "team-a", job_with("a-any", "quay.io/x/y"))
    assert (status, problem["field"]) == (422, MAIN)


@pytest.mark.parametrize(
    ("version", "sent"),
    [
        pytest.param(
            messages.IMAGES_SINCE,
            ["nvcr.io/nvidia/", "registry.example.com/team-a/"],
            id="an agent of protocol 8 is sent the tenant's list",
        ),
        pytest.param(
            messages.IMAGES_SINCE - 1, None, id="an older agent, which would refuse it, none"
        ),
    ],
)
async def test_the_offer_carries_the_list_to_an_agent_that_reads_it(
    api: TestClient[Any, Any], version: int, sent: list[str] | None
) -> None:
    ws = await api.ws_connect("/v1/agents/connect", headers=bearer("agent"))
    try:
        await ws.send_str(messages.encode(messages.Hello(cluster="c1", v=version)))
        welcome = messages.decode(await ws.receive_str())
        assert isinstance(welcome, messages.Welcome)
        summary = make_summary("c1", make_model_summary("NVIDIA-L4", nodes_by_free=[0] * 8 + [2]))
        await ws.send_str(messages.encode(messages.Summary(summary=summary)))
        status, answer = await submit(
            api, "team-a", job_with("a-q", "registry.example.com/team-a/app:1")
        )
        assert status == 202, answer
        async with asyncio.timeout(10):
            while True:
                frame = json.loads(await ws.receive_str())
                if frame["type"] == "offer":
                    break
        assert frame["job_id"] == answer["id"]
        assert frame.get("allowed_images") == sent
    finally:
        await ws.close()


# -- at the agent -------------------------------------------------------------------------------


def offer_of(image: str, allowed: list[str] | None, **pod: Any) -> messages.Offer:
    doc = agentbuilders.make_job("train", gpus=1).model_dump(by_alias=True, mode="json")
    spec = doc["spec"]["tasks"][0]["template"]["spec"]
    spec["containers"][0]["image"] = image
    spec.update(pod)
    offer = agentbuilders.make_offer("j1", jobs.GPUJob.model_validate(doc))
    return offer.model_copy(update={"allowed_images": allowed})


@pytest.mark.parametrize(
    ("image", "pod", "allowed", "reason"),
    [
        pytest.param(
            "busybox",
            {},
            ["registry.example.com/team-a/"],
            f"{MAIN}: image docker.io/library/busybox is not allowed "
            "(allowed: registry.example.com/team-a/)",
            id="the main container",
        ),
        pytest.param(
            "registry.example.com/team-a/app",
            {"initContainers": [{"name": "i", "image": "registry.example.com.evil.io/x"}]},
            ["registry.example.com/"],
            "spec.tasks[0].template.spec.initContainers[0].image: image "
            "registry.example.com.evil.io/x is not allowed (allowed: registry.example.com/)",
            id="an init container",
        ),
        pytest.param(
            "registry.example.com/team-a/app",
            {},
            [],
            f"{MAIN}: image registry.example.com/team-a/app is not allowed (allowed: none)",
            id="no image allowed",
        ),
    ],
)
async def test_the_agent_rejects_an_offer_whose_images_are_not_allowed_creating_nothing(
    tmp_path: Path, image: str, pod: dict[str, Any], allowed: list[str], reason: str
) -> None:
    h = harnesses.Harness(tmp_path)
    try:
        await h.handler.handle_offer(
            offer_of(image, allowed, **pod), session_epoch=1, reply=h.replies.append
        )
        [reply] = h.replies
        assert isinstance(reply, messages.Rejected)
        assert reply.reasons == [reason]
        assert h.backend.pods() == []
        assert h.handler.table.get("j1") is None
        assert h.handler.offers == {"image": 1}
    finally:
        await h.close()


@pytest.mark.parametrize(
    "allowed",
    [pytest.param(None, id="no list (an older broker)"), pytest.param(["docker.io/"], id="listed")],
)
async def test_the_agent_runs_an_offer_whose_images_are_allowed(
    tmp_path: Path, allowed: list[str] | None
) -> None:
    h = harnesses.Harness(tmp_path)
    try:
        await h.handler.handle_offer(
            offer_of("busybox", allowed), session_epoch=1, reply=h.replies.append
        )
        assert isinstance(h.replies[-1], messages.Accepted)
        assert len(h.backend.pods_of("j1")) == 1
    finally:
        await h.close()


def test_an_agent_of_an_older_protocol_is_not_sent_the_list() -> None:
    offer = offer_of("busybox", ["docker.io/library/"])
    new = json.loads(messages.encode(offer, peer=messages.IMAGES_SINCE))
    assert new["allowed_images"] == ["docker.io/library/"]
    assert messages.decode(json.dumps(new)) == offer
    old = json.loads(messages.encode(offer, peer=messages.IMAGES_SINCE - 1))
    assert "allowed_images" not in old
    unset = json.loads(messages.encode(offer.model_copy(update={"allowed_images": None})))
    assert "allowed_images" not in unset
