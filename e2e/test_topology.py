"""Topology through real processes: a gang that asks for one rack gets one rack, and pods that
ask for NVLink get GPUs of one NVLink island, on the simulated clusters of the demo."""

from __future__ import annotations

import json

import pytest

from e2e.helpers import wait_for
from gpufed.local import processes
from member_agent.cluster.simulated import backend as simulated
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
A100_SXM = "NVIDIA-A100-SXM4-80GB"
A100_PCIE = "NVIDIA-A100-PCIE-40GB"


async def layout(cluster: str) -> dict[str, tuple[str, str, int]]:
    """node -> (model, rack, GPUs per NVLink island), as the agent's simulated backend has it."""
    backend = simulated.SimulatedBackend(
        cluster, simulated.load_pools(processes.config_dir() / "clusters" / f"{cluster}.yaml")
    )
    await backend.start()
    try:
        return {n.name: (n.model, n.rack, n.nvlink_island) for n in backend.inventory()}
    finally:
        await backend.close()


async def test_rack_and_nvlink_requests_are_honoured(fleet: processes.LocalFleet) -> None:
    await fleet.start_simulated(["h100", "a100"])
    h100, a100 = await layout("h100"), await layout("a100")
    async with fleet.client("team-a") as api:
        # a filler takes four of the 16 nodes first: the rack-bound gang must find a rack
        # that still has three free nodes
        filler = make_job("filler", gpus=8).model(H100).gang(4).duration(30)
        racked = make_job("racked", gpus=8).model(H100).gang(3).topology(rack="required")
        # 4 GPUs over NVLink: only the DGX nodes (one island of 8) can; PCIe nodes pair GPUs
        linked = make_job("linked", gpus=4).model(A100_SXM, A100_PCIE).gang(6)
        linked = linked.topology(nvlink="required").duration(30)
        ids = {}
        for name, builder in [("filler", filler), ("racked", racked), ("linked", linked)]:
            ids[name] = (await api.submit(json.dumps(builder.document())))["id"]
            await wait_for(api, ids[name], "Running")
        jobs = {name: await api.get(job_id) for name, job_id in ids.items()}

    racked_racks = {h100[p["node"]][1] for p in jobs["racked"]["status"]["pods"]}
    assert len(racked_racks) == 1, f"rack required, got {racked_racks}"
    for pod in jobs["linked"]["status"]["pods"]:
        model, _, island = a100[pod["node"]]
        assert model == A100_SXM and island == 8, f"{pod['name']} on {pod['node']} ({model})"
        indices = sorted(g["index"] for g in pod["gpus"])
        assert len({i // island for i in indices}) == 1, f"GPUs {indices} span NVLink islands"
