"""Trusted images with real broker and agent processes: a job submitted while its image was
allowed, whose tenant's list the fleet admin then narrowed (the queues file edited, the broker
restarted), is refused by the agent when offered, with the image and the list in the job's
`why`, and no pod runs; a new submit of it is 422. And on an emulated Kubernetes cluster, an
admission webhook's denial of the job's pods is the job's `why`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.test_kubernetes_agents import H100, emulated_cluster
from gpufed import client
from gpufed.local import processes
from tests import kubeemulator
from tests.builders import make_job

pytestmark = pytest.mark.e2e

ALLOWED = ["registry.example.com/team-a/", "docker.io/library/"]
NARROWED = ["registry.example.com/team-a/"]


def queues_file(allowed: list[str]) -> dict[str, Any]:
    return {
        "queues": [{"name": "training", "tenant": "team-a", "quotas": {"*": {}}}],
        "allotments": [{"tenant": "team-a", "allowedImages": allowed}],
    }


async def why_until(
    api: client.BrokerClient, job_id: str, holds: Callable[[str], bool], *, timeout: float = 30.0
) -> dict[str, Any]:
    """The job's `why` once the words of its reasons satisfy `holds`."""
    deadline = time.monotonic() + timeout
    answer: dict[str, Any] = {}
    while time.monotonic() < deadline:
        answer = await api.why(job_id)
        if holds(" | ".join(r["message"] for r in answer["reasons"])):
            return answer
        await asyncio.sleep(0.1)
    raise AssertionError(f"{job_id}: why never said it: {answer}")


async def test_a_job_whose_image_was_disallowed_after_submit_is_refused_by_the_agent(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    fleet.queues = tmp_path / "queues.yaml"
    fleet.queues.write_text(yaml.safe_dump(queues_file(ALLOWED)))
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    job = make_job("old-image", gpus=8, queue="training").duration(600).document()  # busybox
    async with fleet.client("team-a") as api:
        job_id = (await api.submit(json.dumps(job)))["id"]  # no cluster yet: it waits

    assert fleet.broker is not None
    await fleet.broker.stop()
    fleet.queues.write_text(yaml.safe_dump(queues_file(NARROWED)))
    await fleet.start_broker()
    agent = await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])

    async with fleet.client("team-a") as api:
        answer = await why_until(api, job_id, lambda said: "not allowed" in said)
        [reason] = [r for r in answer["reasons"] if "not allowed" in r["message"]]
        assert reason["cluster"] == "h100" and reason["code"] == "Rejected"
        assert (
            "spec.tasks[0].template.spec.containers[0].image: image docker.io/library/busybox "
            "is not allowed (allowed: registry.example.com/team-a/)"
        ) in reason["message"]
        assert answer["state"] == "Queued"
        record = await api.get(job_id)
        assert record["status"]["pods"] == []
        assert "Running" not in [e["state"] for e in record["status"]["events"]]
        # the agent said why, creating nothing
        assert "not allowed" in agent.tail(200)

        with pytest.raises(client.BrokerError) as refused:
            await api.submit(json.dumps(job))
        assert refused.value.status == 422
        assert refused.value.body is not None
        assert refused.value.body["field"] == "spec.tasks[0].template.spec.containers[0].image"


async def test_an_admission_webhooks_denial_is_the_jobs_why(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    denial = (
        'admission webhook "policy.sigstore.dev" denied the request: validation failed: '
        "no matching signatures"
    )
    async with emulated_cluster(
        tmp_path, "train", product=H100, nodes=1, gpus=8, memory_mib=81559
    ) as (emulator, kubeconfig):
        try:
            refusal = kubeemulator.Fault("error", 403, "Forbidden", denial)
            emulator.inject("POST", "pods", refusal, times=10_000)  # every pod, every try
            fleet.write_tokens(tenants=["team-a"], clusters=["train"])
            await fleet.start_broker()
            await fleet.start_agent(
                "train",
                None,
                "--kubeconfig",
                str(kubeconfig),
                "--namespace",
                "default",
                backend="kubernetes",
            )
            await fleet.wait_clusters_ready(["train"])
            async with fleet.client("team-a") as api:
                job = make_job("unsigned", gpus=8).model(H100).document()
                job_id = (await api.submit(json.dumps(job)))["id"]
                answer = await why_until(api, job_id, lambda said: denial in said)
                [reason] = [r for r in answer["reasons"] if denial in r["message"]]
                assert reason["cluster"] == "train" and reason["code"] == "Rejected"
                assert "creating pods failed: pod default/" in reason["message"]
                assert answer["state"] == "Queued"
                assert not [
                    p
                    for p in emulator.pods()
                    if p["metadata"].get("labels", {}).get("gpufed.io/job") == job_id
                ]
        finally:
            await fleet.stop()
