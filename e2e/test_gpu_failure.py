"""A GPU failing under a running gang, with real broker and agent processes on the simulated
backend: the gang fails `GPUFailed` as a unit, the broker retries it (GPUFailed is one of the
default `retryOn` reasons) and the retry runs on other nodes, the failed GPU's node having been
cordoned (`--auto-cordon --cordon-after 1`); the agent's /metrics count the unhealthy GPU, the
failure and the cordon; `gpufed clusters` (and `GET /v1/clusters`) shows the GPUs out of
service as unavailable, how many are unhealthy and which nodes were cordoned.

The failure is injected by the job itself (`gpufed.io/sim-gpu-failure: 0.3@1`: 0.3 s into
attempt 1, the first GPU of each pod still running fails).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import parser

from e2e.helpers import FINAL, run_cli, wait_for
from gpufed.local import processes
from member_agent.cluster.simulated import faults
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
NODES = """
cluster: gpus
pools:
  - name: h100
    count: 3
    gpu_product: NVIDIA-H100-80GB-HBM3
    gpus_per_node: 8
    gpu_memory_mib: 81559
    cpu: 200
    memory: 2Ti
    nvlink_island: 8
"""


async def agent_metrics(port: int) -> dict[str, float]:
    """The agent's /metrics: sample name (with its labels) -> value."""
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        text = await response.text()
    out: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "cluster"
            )
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def nodes_of(job: dict[str, Any], attempt: int) -> set[str]:
    return {p["node"] for p in job["status"]["pods"] if p["name"].endswith(f"-a{attempt}")}


async def test_a_gang_on_a_failing_gpu_fails_gpufailed_and_is_retried_elsewhere(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    nodes = tmp_path / "gpus.yaml"
    nodes.write_text(NODES)
    port = processes.free_port()
    fleet.write_tokens(tenants=["team-a"], clusters=["gpus"])
    await fleet.start_broker()
    await fleet.start_agent(
        "gpus", nodes, "--metrics-port", str(port), "--auto-cordon", "--cordon-after", "1"
    )
    await fleet.wait_clusters_ready(["gpus"])
    job = make_job("fragile", gpus=4).model(H100).gang(2).duration(1.5)
    job.annotate(faults.SIM_GPU_FAILURE_ANNOTATION, "0.3@1")
    async with fleet.client("team-a") as api:
        job_id = (await api.submit(json.dumps(job.document())))["id"]
        first = await wait_for(api, job_id, {"Running"})
        first_nodes = {p["node"] for p in first["status"]["pods"]}
        done = await wait_for(api, job_id, FINAL, timeout=30)

    events = [(e["state"], e["reason"]) for e in done["status"]["events"]]
    assert done["status"]["state"] == "Succeeded", events
    assert ("Queued", "GPUFailed") in events  # requeued by the failure policy, not Failed
    assert done["status"]["attempts"] == 2 and done["status"]["infraRetries"] == 1
    assert nodes_of(done, 2) and not nodes_of(done, 2) & first_nodes  # elsewhere
    assert {p["phase"] for p in done["status"]["pods"]} == {"Succeeded"}

    metrics = await agent_metrics(port)
    failures = metrics["gpufed_agent_gpu_failures_total{}"]
    assert 1 <= failures <= 2  # the first GPU of each pod of attempt 1 still running then
    assert metrics["gpufed_agent_node_cordons_total{}"] == len(first_nodes)
    assert metrics["gpufed_agent_gpu_failed_pods_total{}"] >= 1
    unhealthy = {k: v for k, v in metrics.items() if k.startswith("gpufed_agent_gpus_unhealthy")}
    assert sum(unhealthy.values()) == failures
    assert {key.split("node=")[1].rstrip("}") for key in unhealthy} <= first_nodes

    # the broker's view: the cordoned nodes' GPUs are unavailable
    expected = str(8 * len(first_nodes))
    for _ in range(50):
        code, out, _ = await run_cli(fleet, "clusters")
        row = next(line.split() for line in out.splitlines() if line.startswith("gpus "))
        if row[6] == expected:
            break
        await asyncio.sleep(0.1)
    assert code == 0 and row[:3] == ["gpus", "Ready", H100] and row[6] == expected, out
    # and says why: the unhealthy GPUs and the nodes the agent cordoned (protocol 6)
    cordoned = ", ".join(sorted(first_nodes))
    line = f"gpus: {failures:.0f} unhealthy GPUs; cordoned for GPU failures: {cordoned}"
    assert line in out.splitlines(), out
    async with fleet.client("team-a") as api:
        [view] = await api.clusters()
    assert view["cordoned_nodes"] == sorted(first_nodes)
    assert view["unhealthy_gpus"] == failures
