"""The broker and an agent process started with `gpufed agent --devices dra` against an
emulated Kubernetes 1.34 API (kmock over HTTP): the GPUs are the ones the ResourceSlices
publish, and every pod's ResourceClaim is allocated to the GPUs the job's status says it was
placed on."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.helpers import wait_for
from gpufed.local import processes
from tests import kubeemulator
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


async def claims_of(emulator: kubeemulator.Emulator, count: int) -> list[dict[str, Any]]:
    """The reserved claims once there are `count` of them."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [c for c in emulator.claims() if (c.get("status") or {}).get("reservedFor")]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} reserved claims: {emulator.claims()}")


async def test_an_agent_in_dra_mode_allocates_the_gpus_it_chose(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    async with kubeemulator.with_kubeconfig(tmp_path, "train") as (emulator, kubeconfig):
        emulator.declare_dra(("v1",))
        for n in range(2):
            await emulator.add_node(f"train-node-{n}")
            await emulator.add_slice(f"train-node-{n}")
        # someone else's pods were given GPUs 0-3 of node 0 by the kube-scheduler
        devices = [f"gpu-{i}" for i in range(4)]
        await emulator.add_allocated_claim("other-team", "x", "train-node-0", devices)
        try:
            fleet.write_tokens(tenants=["team-a"], clusters=["train"])
            await fleet.start_broker()
            flags = ["--kubeconfig", str(kubeconfig), "--namespace", "default", "--devices", "dra"]
            await fleet.start_agent("train", None, *flags, backend="kubernetes")
            await fleet.wait_clusters_ready(["train"])
            async with fleet.client("team-a") as api:
                gang = make_job("gang", gpus=4).model(H100).gang(3).document()
                gang_id = (await api.submit(json.dumps(gang)))["id"]
                claims = await claims_of(emulator, 3)
                job = await wait_for(api, gang_id, {"Dispatched", "Running"})
                deadline = time.monotonic() + 30
                while len(job["status"]["pods"]) < 3:  # the agent's accept names the pods
                    assert time.monotonic() < deadline, job["status"]
                    await asyncio.sleep(0.05)
                    job = await api.get(gang_id)
                placed = {p["name"]: p for p in job["status"]["pods"]}
                assert len(placed) == 3
                for claim in claims:
                    pod = claim["status"]["reservedFor"][0]["name"]
                    results = claim["status"]["allocation"]["devices"]["results"]
                    where = placed[pod]
                    assert {r["pool"] for r in results} == {where["node"]}
                    assert [r["device"] for r in results] == [
                        f"gpu-{g['index']}" for g in where["gpus"]
                    ]
                taken = {(p["node"], g["index"]) for p in placed.values() for g in p["gpus"]}
                assert not taken & {("train-node-0", i) for i in range(4)}
        finally:
            await fleet.stop()  # the agent holds watches open: stop it before the emulator
