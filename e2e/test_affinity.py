"""Validation at the edge and node affinity through real processes, on the demo's simulated
clusters: a job that excludes H100 never lands on the H100 cluster (the broker excludes it;
the agent decides labels the broker cannot see), and one tenant's bad queue name is refused
without stopping anyone else."""

from __future__ import annotations

import asyncio
import json

import pytest

from e2e.helpers import wait_for
from gpufed import client
from gpufed.local import processes
from member_agent.cluster.simulated import backend as simulated
from tests.builders import expr, make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
A100_SXM = "NVIDIA-A100-SXM4-80GB"
A100_PCIE = "NVIDIA-A100-PCIE-40GB"
PRODUCT = "nvidia.com/gpu.product"


def pools_of(cluster: str) -> dict[str, str]:
    """node -> pool, as the agent's simulated backend names them (`<pool>-<index>`)."""
    pools = simulated.load_pools(processes.config_dir() / "clusters" / f"{cluster}.yaml")
    return {node.name: node.labels[simulated.POOL_LABEL] for node in simulated.build_nodes(pools)}


async def test_notin_h100_never_runs_on_the_h100_cluster(fleet: processes.LocalFleet) -> None:
    await fleet.start_simulated(["h100", "a100"], tenants=["team-a", "team-b"])
    a100_nodes = pools_of("a100")
    async with fleet.client("team-a") as api, fleet.client("team-b") as other:
        # every A100 GPU taken for a few seconds: the H100 cluster is the only free one
        filler = make_job("filler", gpus=8).model(A100_SXM, A100_PCIE).gang(24).duration(4)
        filler_id = (await api.submit(json.dumps(filler.document())))["id"]
        await wait_for(api, filler_id, "Running")
        avoid = make_job("avoid", gpus=8).gang(2).duration(1)
        avoid = avoid.node_affinity([expr(PRODUCT, "NotIn", H100)])
        avoid_id = (await api.submit(json.dumps(avoid.document())))["id"]
        # another job without affinity gets the idle H100s meanwhile
        plain_id = (await other.submit(json.dumps(make_job("plain", gpus=8).document())))["id"]
        plain = await wait_for(other, plain_id, "Running")
        assert plain["status"]["cluster"] == "h100"
        for _ in range(10):
            waiting = await api.get(avoid_id)
            assert waiting["status"]["state"] == "Queued", waiting["status"]
            await asyncio.sleep(0.1)
        ran = await wait_for(api, avoid_id, {"Running", "Succeeded"}, timeout=30)
    assert ran["status"]["cluster"] == "a100"
    assert all(pod["node"] in a100_nodes for pod in ran["status"]["pods"])
    assert all(event.get("cluster") != "h100" for event in ran["status"]["events"])


async def test_the_agent_decides_labels_the_broker_cannot_see(
    fleet: processes.LocalFleet,
) -> None:
    """`gpufed.io/pool In [a100-pcie]`: the broker sees only GPU models and may offer the job
    to either cluster; only the A100 agent has such nodes, and places it there."""
    await fleet.start_simulated(["h100", "a100"])
    a100_nodes = pools_of("a100")
    async with fleet.client("team-a") as api:
        job = make_job("pcie", gpus=2).gang(3).duration(30)
        job = job.node_affinity([expr(simulated.POOL_LABEL, "In", "a100-pcie")])
        job_id = (await api.submit(json.dumps(job.document())))["id"]
        ran = await wait_for(api, job_id, "Running", timeout=30)
    assert ran["status"]["cluster"] == "a100"
    assert {a100_nodes[pod["node"]] for pod in ran["status"]["pods"]} == {"a100-pcie"}


async def test_a_bad_queue_name_is_refused_and_others_still_run(
    fleet: processes.LocalFleet,
) -> None:
    await fleet.start_simulated(["h100"], tenants=["team-a", "team-b"])
    async with fleet.client("team-a") as api, fleet.client("team-b") as other:
        with pytest.raises(client.BrokerError) as refused:
            await api.submit(json.dumps(make_job("bad", gpus=1, queue="Team_A").document()))
        assert refused.value.status == 422
        assert refused.value.body["field"] == "spec.queue", refused.value.body
        good = make_job("good", gpus=1, queue="team-b").duration(30)
        good_id = (await other.submit(json.dumps(good.document())))["id"]
        await wait_for(other, good_id, "Running")
        assert await api.jobs() == []  # nothing of the refused job was stored
