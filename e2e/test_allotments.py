"""A hostile tenant-admin against its allotment (real broker and agent processes): a queue
guaranteeing the whole fleet, and many small queues adding up past the allotment, are refused
with nothing stored, so the other tenant's running jobs keep running; lowering is allowed, the
admin is not bound, and `gpufed queues --allotments` shows the bound to the tenant."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.helpers import run_cli, wait_for
from gpufed import client
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
QUEUES = {  # no allotment declared: team-a may claim what its queue here claims, 64 H100
    "policy": {"minRunSeconds": 0},
    "queues": [
        {"name": "training", "tenant": "team-a", "quotas": {H100: {"guaranteed": 64}}},
        {"name": "research", "tenant": "team-b", "quotas": {H100: {"guaranteed": 64}}},
    ],
}


def h100(guaranteed: int) -> dict[str, Any]:
    return {"tenant": "team-a", "quotas": {H100: {"guaranteed": guaranteed}}}


async def refused(api: client.BrokerClient, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The problem of a PUT that must be refused (a test failure if it is stored)."""
    try:
        view = await api.put_queue(name, spec)
    except client.BrokerError as exc:
        assert exc.status == 403, exc.body
        return exc.body or {}
    raise AssertionError(f"queue {name} was stored: {view}")


async def guarantees(api: client.BrokerClient) -> dict[str, int]:
    """team-a's queues and their H100 guarantees, as the fleet admin reads them."""
    items = (await api.queues())["items"]
    return {
        q["name"]: q["spec"]["quotas"][H100]["guaranteed"]
        for q in items
        if q["spec"]["tenant"] == "team-a"
    }


HOLD = 5.0


async def settled(api: client.BrokerClient, *, timeout: float = 30.0) -> tuple[int, int]:
    """The tenant's (running, queued) jobs once none is Dispatched and the counts held for
    `HOLD` seconds (a rejected offer waits for the cluster's next summary: on a loaded machine
    one second of no change is not yet the end); the last counts seen after `timeout`."""
    deadline = time.monotonic() + timeout
    last, since = (-1, -1), time.monotonic()
    while time.monotonic() < deadline:
        states = [j["status"]["state"] for j in await api.jobs()]
        counts = (states.count("Running"), states.count("Queued"))
        if counts != last or "Dispatched" in states:
            last, since = counts, time.monotonic()
        elif time.monotonic() - since >= HOLD:
            return counts
        await asyncio.sleep(0.1)
    return last


@pytest.fixture
async def running(fleet: processes.LocalFleet, tmp_path: Path) -> processes.LocalFleet:
    fleet.queues = tmp_path / "queues.yaml"
    fleet.queues.write_text(yaml.safe_dump(QUEUES))
    tokens = fleet.write_tokens(tenants=["team-a", "team-b"], clusters=["h100"])
    entries = yaml.safe_load(tokens.read_text())["tokens"]
    fleet.tokens["a-admin"] = "a-admin-" + fleet.tokens["team-a"]
    entries.append({"token": fleet.tokens["a-admin"], "tenant": "team-a", "role": "tenant-admin"})
    tokens.write_text(yaml.safe_dump({"tokens": entries}))
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])
    return fleet


async def test_a_tenant_admin_cannot_claim_beyond_its_allotment(
    running: processes.LocalFleet,
) -> None:
    async with running.client("team-b") as team_b:  # team-b runs 64 H100 within its guarantee
        b_jobs = []
        for i in range(8):
            job = make_job(f"b{i}", gpus=8, queue="research").duration(600).document()
            b_jobs.append((await team_b.submit(json.dumps(job)))["id"])
        for job_id in b_jobs:
            await wait_for(team_b, job_id, "Running")

    async with running.client("a-admin") as a_admin, running.client("admin") as admin:
        # the measured case: one queue guaranteeing the whole fleet (128 H100)
        problem = await refused(a_admin, "grab", h100(128))
        assert problem["field"] == f"quotas.{H100}.guaranteed"
        assert "guaranteed 192" in problem["detail"] and "allotment of 64" in problem["detail"]
        # raising the file's queue is the same claim
        await refused(a_admin, "training", h100(96))
        # lowering is allowed; then many small queues add up to the allotment and no further
        assert (await a_admin.put_queue("training", h100(32)))["spec"]["quotas"][H100] == {
            "guaranteed": 32,
            "limit": None,
        }
        for name in ("small-1", "small-2"):
            await a_admin.put_queue(name, h100(16))
        problem = await refused(a_admin, "small-3", h100(16))
        assert "guaranteed 80" in problem["detail"]
        assert await guarantees(admin) == {"training": 32, "small-1": 16, "small-2": 16}

        # team-a fills its queues: it holds the 64 H100 it is allotted, team-b keeps its 64
        async with running.client("team-a") as team_a:
            for i, queue in enumerate(["training"] * 6 + ["small-1", "small-2"] * 2):
                job = make_job(f"a{i}", gpus=8, queue=queue).duration(600).document()
                await team_a.submit(json.dumps(job))
            assert await settled(team_a) == (8, 2), "nothing left to take: team-b kept its 64"
        for job_id in b_jobs:
            events = (await admin.get(job_id))["status"]["events"]
            assert events[-1]["state"] == "Running", events
            assert all(e.get("reason") != "Preempted" for e in events)

        # the admin is not bound by allotments
        assert (await admin.put_queue("grab", h100(128)))["spec"]["tenant"] == "team-a"

    code, out, err = await run_cli(running, "queues", "--allotments", tenant="a-admin")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["TENANT", "ALLOTMENT", "MODEL"]
    h100_row = next(r.split() for r in rows if H100 in r)
    assert h100_row[:2] == ["team-a", "from"] and "192/64" in h100_row, out
    assert "may lower them, not raise them" in out, "above it now, by the admin's hand: said"
