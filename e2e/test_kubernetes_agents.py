"""The broker and two agents, each against its own emulated Kubernetes API (kmock over HTTP)
with GPU nodes of a different model: pods are created in the right cluster on nodes with room,
and pod phases driven in the emulator become job states."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from e2e.helpers import wait_for
from gpufed.local import processes
from tests import kubeemulator
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
L4 = "NVIDIA-L4"


@contextlib.asynccontextmanager
async def emulated_cluster(
    tmp_path: Path, name: str, *, product: str, nodes: int, gpus: int, memory_mib: int
) -> AsyncIterator[tuple[kubeemulator.Emulator, Path]]:
    """An emulated Kubernetes cluster of `nodes` GPU nodes, and a kubeconfig for it."""
    async with kubeemulator.with_kubeconfig(tmp_path, name) as (emulator, kubeconfig):
        for n in range(nodes):
            await emulator.add_node(
                f"{name}-node-{n}", gpus=gpus, product=product, memory_mib=memory_mib
            )
        yield emulator, kubeconfig


async def pods_of(emulator: kubeemulator.Emulator, job_id: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pods = [
            p
            for p in emulator.pods()
            if p["metadata"].get("labels", {}).get("gpufed.io/job") == job_id
        ]
        if len(pods) >= count:
            return pods
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id}: fewer than {count} pods created")


async def test_jobs_run_on_emulated_kubernetes_clusters(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    async with (
        emulated_cluster(tmp_path, "train", product=H100, nodes=3, gpus=8, memory_mib=81559) as (
            train,
            train_config,
        ),
        emulated_cluster(tmp_path, "serve", product=L4, nodes=2, gpus=4, memory_mib=23034) as (
            serve,
            serve_config,
        ),
    ):
        try:
            # a pod of another scheduler already holds 6 GPUs of train-node-0
            await train.add_pod("other-team", "foreign", node="train-node-0", gpus=6)
            fleet.write_tokens(tenants=["team-a"], clusters=["train", "serve"])
            await fleet.start_broker()
            for name, config in (("train", train_config), ("serve", serve_config)):
                await fleet.start_agent(
                    name,
                    None,
                    "--kubeconfig",
                    str(config),
                    "--namespace",
                    "default",
                    backend="kubernetes",
                )
            await fleet.wait_clusters_ready(["train", "serve"])

            async with fleet.client("team-a") as api:
                gang = make_job("gang", gpus=8).model(H100).gang(2).document()
                single = make_job("single", gpus=2).model(L4).document()
                gang_id = (await api.submit(json.dumps(gang)))["id"]
                single_id = (await api.submit(json.dumps(single)))["id"]

                gang_pods = await pods_of(train, gang_id, 2)
                single_pods = await pods_of(serve, single_id, 1)
                assert not [
                    p
                    for p in serve.pods()
                    if p["metadata"].get("labels", {}).get("gpufed.io/job") == gang_id
                ], "gang pods in the wrong cluster"
                nodes = sorted(p["spec"]["nodeName"] for p in gang_pods)
                assert nodes == ["train-node-1", "train-node-2"], "node 0 has only 2 GPUs free"
                assert single_pods[0]["spec"]["nodeName"].startswith("serve-node-")

                submitted = await api.get(gang_id)
                for pod in gang_pods:
                    labels = pod["metadata"]["labels"]
                    assert labels["gpufed.io/queue"] == "default"
                    assert labels["gpufed.io/gang"] == gang_id
                    traceparent = pod["metadata"]["annotations"]["traceparent"]
                    assert traceparent.split("-")[1] == submitted["traceId"], "not the job's trace"

                for pod in gang_pods:
                    await train.set_pod_phase(
                        pod["metadata"]["namespace"], pod["metadata"]["name"], "Running"
                    )
                running = await wait_for(api, gang_id, "Running")
                assert {p["node"] for p in running["status"]["pods"]} == set(nodes)
                for pod in gang_pods:
                    await train.set_pod_phase(
                        pod["metadata"]["namespace"], pod["metadata"]["name"], "Succeeded"
                    )
                done = await wait_for(api, gang_id, "Succeeded")
                states = [e["state"] for e in done["status"]["events"]]
                assert states[0] == "Queued" and states[-1] == "Succeeded" and "Running" in states

                pod = single_pods[0]
                await serve.set_pod_phase(
                    pod["metadata"]["namespace"],
                    pod["metadata"]["name"],
                    "Failed",
                    container_reason="OOMKilled",
                )
                failed = await wait_for(api, single_id, "Failed")
                assert failed["status"]["events"][-1]["reason"] == "OOMKilled"
        finally:
            # agents hold watches open: stop them before the emulators shut down
            await fleet.stop()
