"""Cluster choice per job (`spec.clusters`), with a real broker and simulated agents whose
clusters carry labels (`gpufed agent --cluster-label`).

- `selector: {matchLabels: {region: eu}}`: of three clusters of one node of 8 H100 each, two
  labelled `region=eu` and one `region=us`, a backlog of such jobs runs only on the EU two,
  however long the US cluster sits idle; `GET /v1/clusters` shows the labels and `why` says of
  the US cluster that spec.clusters excludes it.
- `order: [c, a, b]`: jobs that each take a whole cluster run on c first, then a once c is
  full, then b — not the planner's own choice (all alike: the first by name).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.helpers import FINAL, wait_for
from gpufed import client
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


def write_cluster(workdir: Path, name: str) -> Path:
    """One node of 8 H100: a job of 8 GPUs fills the cluster."""
    pool = {
        "name": f"{name}-h100",
        "count": 1,
        "gpu_product": H100,
        "gpus_per_node": 8,
        "gpu_memory_mib": 81920,
        "cpu": 200,
        "memory": "2000Gi",
    }
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"cluster": name, "pools": [pool]}))
    return path


async def start(fleet: processes.LocalFleet, tmp_path: Path, labels: dict[str, str]) -> None:
    """A broker and one agent per cluster of `labels` (name -> `--cluster-label` value)."""
    fleet.cycle_interval = 0.2
    fleet.write_tokens(tenants=["team-a"], clusters=list(labels))
    await fleet.start_broker()
    for name, label in labels.items():
        extra = ["--cluster-label", label] if label else []
        await fleet.start_agent(name, write_cluster(tmp_path, name), *extra)
    await fleet.wait_clusters_ready(list(labels))


async def told_of(api: client.BrokerClient, job_id: str, cluster: str) -> dict[str, Any]:
    """The job's `why` once it names `cluster` (the planner has seen the job)."""
    deadline = time.monotonic() + 10
    while True:
        why = await api.why(job_id)
        if any(r["cluster"] == cluster for r in why["reasons"]):
            return why
        assert time.monotonic() < deadline, f"why never names {cluster}: {why}"
        await asyncio.sleep(0.05)


async def test_a_selected_job_runs_only_on_clusters_labelled_so(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    await start(
        fleet, tmp_path, {"eu-1": "region=eu,tier=spot", "eu-2": "region=eu", "us-1": "region=us"}
    )
    async with fleet.client("admin") as admin:
        views = {c["name"]: c["labels"] for c in await admin.clusters()}
    assert views == {
        "eu-1": {"region": "eu", "tier": "spot"},
        "eu-2": {"region": "eu"},
        "us-1": {"region": "us"},
    }
    selected = {"matchLabels": {"region": "eu"}}
    ids = []
    async with fleet.client("team-a") as api:
        for index in range(4):  # two run at once, two wait: us-1 stays idle throughout
            job = make_job(f"eu-{index}", gpus=8).model(H100).duration(1.5)
            document = job.clusters(selector=selected).document()
            ids.append((await api.submit(json.dumps(document)))["id"])
        why = await told_of(api, ids[-1], "us-1")
        done = [await wait_for(api, job_id, FINAL, timeout=60) for job_id in ids]
    assert [job["status"]["state"] for job in done] == ["Succeeded"] * 4
    assert {job["status"]["cluster"] for job in done} == {"eu-1", "eu-2"}
    [excluded] = [r for r in why["reasons"] if r["cluster"] == "us-1"]
    assert excluded["code"] == "ClusterSelector"
    assert "excluded by spec.clusters" in excluded["message"]


async def test_order_spills_over_in_order(fleet: processes.LocalFleet, tmp_path: Path) -> None:
    await start(fleet, tmp_path, {"a": "", "b": "", "c": "tier=spot"})
    placed = []
    async with fleet.client("team-a") as api:
        for index in range(3):  # each fills its cluster and keeps it for a minute
            job = make_job(f"spill-{index}", gpus=8).model(H100).duration(60)
            document = job.clusters(order=["c", "a", "b"]).document()
            job_id = (await api.submit(json.dumps(document)))["id"]
            running = await wait_for(api, job_id, {"Running"}, timeout=30)
            placed.append(running["status"]["cluster"])
    assert placed == ["c", "a", "b"]
