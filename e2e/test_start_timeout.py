"""A cluster answers for what it accepts (real broker and agent processes): an accept that
names no pods does not keep a job, a job whose pods stay Pending is withdrawn after the start
timeout (`StartTimeout`) and runs elsewhere, and a cluster that keeps failing to start jobs is
scored down for a while."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from broker.api import messages
from e2e.helpers import run_cli, wait_for
from gpufed.local import processes
from tests.builders import make_job, make_model_summary, make_summary

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


def rogue_summary(seq: int) -> str:
    """Four nodes with one free H100 each: the tightest fit there is for a 1-GPU job."""
    model = make_model_summary(H100, nodes_by_free=[0, 4])
    return messages.encode(
        messages.Summary(full=True, summary=make_summary("rogue", model, seq=seq))
    )


async def accept_everything_naming_nothing(ws: aiohttp.ClientWebSocketResponse) -> int:
    """The rogue agent: every offer `accepted` with no pods, a fresh summary every 0.2 s (so
    it is never passed over for want of one); the offers it got, once cancelled."""
    offers = 0
    seq = 1
    await ws.send_str(rogue_summary(seq))
    try:
        while True:
            try:
                frame = await ws.receive(timeout=0.2)
            except TimeoutError:
                seq += 1
                await ws.send_str(rogue_summary(seq))
                continue
            if frame.type != aiohttp.WSMsgType.TEXT:
                return offers
            offer = messages.decode(frame.data)
            if isinstance(offer, messages.Offer):
                offers += 1
                accepted = messages.Accepted(
                    job_id=offer.job_id, epoch=offer.epoch, pods=[], attempt=offer.attempt
                )
                await ws.send_str(messages.encode(accepted))
    except asyncio.CancelledError:
        return offers


async def submit(
    fleet: processes.LocalFleet, tenant: str, name: str, *, seconds: float = 0.5
) -> str:
    async with fleet.client(tenant) as api:
        job = await api.submit(json.dumps(make_job(name, gpus=1).duration(seconds).document()))
    return str(job["id"])


async def clusters(fleet: processes.LocalFleet) -> dict[str, dict[str, Any]]:
    async with fleet.client("admin") as api:
        return {c["name"]: c for c in await api.clusters()}


async def test_an_accept_naming_no_pods_does_not_keep_the_job(
    fleet: processes.LocalFleet,
) -> None:
    fleet.write_tokens(tenants=["team-a", "team-b"], clusters=["h100", "rogue"])
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])
    headers = {"Authorization": f"Bearer {fleet.tokens['agent:rogue']}"}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{fleet.url}/v1/agents/connect", headers=headers) as ws,
    ):
        await ws.send_str(messages.encode(messages.Hello(cluster="rogue")))
        assert isinstance(messages.decode((await ws.receive(timeout=5)).data), messages.Welcome)
        rogue = asyncio.create_task(accept_everything_naming_nothing(ws))
        try:
            await fleet.wait_clusters_ready(["h100", "rogue"])
            firsts = [await submit(fleet, "team-a", f"first-{i}") for i in range(3)]
            async with fleet.client("team-a") as api:
                for first in firsts:
                    job = await wait_for(api, first, {"Running", "Succeeded"}, timeout=20)
                    assert job["status"]["cluster"] == "h100"
                    events = job["status"]["events"]
                    refused = [e for e in events if e["reason"] == "Rejected"]
                    assert refused, events
                    assert all(
                        "rogue: accepted without naming every pod" in e["message"] for e in refused
                    )
            # three bogus accepts: scored down now, and another tenant's job goes to the
            # healthy cluster at once, though the rogue still claims the tighter fit
            down = (await clusters(fleet))["rogue"]
            assert down["scored_down_until"], down
            assert "did not start" in down["scored_down_reason"], down
            second = await submit(fleet, "team-b", "second")
            async with fleet.client("team-b") as api:
                job = await wait_for(api, second, {"Running", "Succeeded"}, timeout=10)
            assert job["status"]["cluster"] == "h100"
            assert not [e for e in job["status"]["events"] if e["reason"] == "Rejected"]
        finally:
            rogue.cancel()
            offers = await rogue
    assert offers >= 3  # the strikes that scored it down


def stuck_cluster(workdir: Path) -> Path:
    """A simulated cluster of four 1-GPU H100 nodes (the tightest fit for 1-GPU jobs) whose
    pods stay Pending for good."""
    path = workdir / "stuck.yaml"
    pool = {
        "name": "stuck",
        "count": 4,
        "gpu_product": H100,
        "gpus_per_node": 1,
        "gpu_memory_mib": 81559,
        "cpu": 32,
        "memory": "256Gi",
        "stay_pending": True,
    }
    path.write_text(yaml.safe_dump({"cluster": "stuck", "pools": [pool]}))
    return path


async def test_a_job_not_running_within_the_start_timeout_runs_elsewhere(
    fleet: processes.LocalFleet,
) -> None:
    fleet.broker_args = ["--start-timeout", "2"]
    fleet.write_tokens(tenants=["team-a"], clusters=["h100", "stuck"])
    await fleet.start_broker()
    await fleet.start_agent("stuck", stuck_cluster(fleet.workdir))
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["stuck", "h100"])
    ids = [await submit(fleet, "team-a", f"job-{i}", seconds=60) for i in range(3)]
    async with fleet.client("team-a") as api:
        for job_id in ids:
            job = await wait_for(api, job_id, "Running", timeout=30)
            assert job["status"]["cluster"] == "h100"
            timeouts = [e for e in job["status"]["events"] if e["reason"] == "StartTimeout"]
            assert timeouts, job["status"]["events"]
            assert all(e["message"].startswith("stuck: not Running within 2 s") for e in timeouts)
            # why the pods did not start, as the agent reported it
            assert all("ImagePullBackOff" in e["message"] for e in timeouts), timeouts
            assert timeouts[0]["state"] == "Queued"
            why = await api.why(job_id)
            assert "StartTimeout: stuck: not Running within 2 s" in why["message"], why
    stuck = (await clusters(fleet))["stuck"]
    assert stuck["health"] == "Ready" and stuck["scored_down_until"], stuck
    assert "did not start within" in stuck["scored_down_reason"], stuck
    code, out, _ = await run_cli(fleet, "clusters", tenant="admin")
    assert code == 0 and "stuck: scored down until" in out, out
