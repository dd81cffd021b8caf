"""What a job's own policies do, with real broker and agent processes on a simulated cluster.

- `failurePolicy.backoffLimit: 1`: a job whose pods always fail with NodeLost (an
  infrastructure reason, retried by default) runs twice and then fails; a failure whose
  reason is not in `retryOn` (Error) fails the first attempt.
- `failurePolicy.activeDeadlineSeconds: 2`: a job that would run for five minutes fails
  `DeadlineExceeded` two seconds after it started, and its pod is deleted (the agent's pod
  journal says when it stopped).
- `spec.preemption.gracePeriodSeconds: 2`: a low-priority job preempted for a high-priority
  one; its pods were annotated with the notice (the deadline, RFC 3339) before the agent
  deleted them, ran on through the grace period (the workload takes longer to exit than the
  grace), and the preemptor's pods started only once the victim's were gone: the broker never
  counted their GPUs free before.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.helpers import FINAL, wait_for
from gpufed.local import processes
from member_agent.cluster.simulated import backend as simulated
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
NODES = processes.config_dir() / "clusters" / "h100.yaml"


def write_small_cluster(path: Path) -> Path:
    """One node of 8 H100: any two 8-GPU jobs compete for it."""
    pool = {
        "name": "one-h100",
        "count": 1,
        "gpu_product": H100,
        "gpus_per_node": 8,
        "gpu_memory_mib": 81920,
        "cpu": 200,
        "memory": "2000Gi",
    }
    path.write_text(yaml.safe_dump({"cluster": "small", "pools": [pool]}))
    return path


def write_queues(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "policy": {"minRunSeconds": 0, "reserveAfterSeconds": None},
                "queues": [
                    {
                        "name": "default",
                        "tenant": "team-a",
                        "quotas": {H100: {"guaranteed": 8, "limit": 16}},
                    }
                ],
                "priorityClasses": [
                    {"name": "low", "value": 0, "preempts": False},
                    {"name": "high", "value": 100, "preempts": True},
                ],
            }
        )
    )
    return path


def journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def of_job(lines: list[dict[str, Any]], job_id: str, event: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["job"] == job_id and line["event"] == event]


async def until(condition: Callable[[], bool], *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.05)


def event_time(job: dict[str, Any], state: str, reason: str | None = None) -> datetime:
    for event in job["status"]["events"]:
        if event["state"] == state and (reason is None or event["reason"] == reason):
            return datetime.fromisoformat(event["time"])
    raise AssertionError(f"no {state} {reason or ''} event: {job['status']['events']}")


async def test_backoff_limit_and_retry_on_decide_how_often_a_failed_job_runs(
    fleet: processes.LocalFleet,
) -> None:
    await fleet.start_simulated(["h100"])
    flaky = make_job("node-lost", gpus=8).model(H100).duration(0.2).outcome("Failed:NodeLost")
    flaky.failure_policy(backoffLimit=1)
    broken = make_job("bug", gpus=8).model(H100).duration(0.2).outcome("Failed:Error")
    async with fleet.client("team-a") as api:
        flaky_id = (await api.submit(json.dumps(flaky.document())))["id"]
        broken_id = (await api.submit(json.dumps(broken.document())))["id"]
        lost = await wait_for(api, flaky_id, FINAL)
        failed = await wait_for(api, broken_id, FINAL)

    assert lost["status"]["state"] == "Failed", lost["status"]["events"]
    assert lost["status"]["attempts"] == 2  # the first attempt and its one retry
    assert lost["status"]["infraRetries"] == 1
    last = lost["status"]["events"][-1]
    assert last["reason"] == "NodeLost"
    assert "backoffLimit 1 reached" in last["message"]
    requeued = [e for e in lost["status"]["events"] if e["state"] == "Queued"]
    assert [e["reason"] for e in requeued[1:]] == ["NodeLost"]

    assert failed["status"]["state"] == "Failed"
    assert failed["status"]["attempts"] == 1  # Error is not in retryOn: never retried
    assert failed["status"]["events"][-1]["reason"] == "Error"


async def test_an_active_deadline_ends_a_long_job_and_deletes_its_pods(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    path = tmp_path / "h100.journal"
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    await fleet.start_agent("h100", NODES, "--sim-journal", str(path))
    await fleet.wait_clusters_ready(["h100"])
    long = (
        make_job("long", gpus=8).model(H100).duration(300).failure_policy(activeDeadlineSeconds=2)
    )
    async with fleet.client("team-a") as api:
        job_id = (await api.submit(json.dumps(long.document())))["id"]
        done = await wait_for(api, job_id, FINAL, timeout=30)
        # the agent deletes the pod once told: its journal says it stopped
        await until(lambda: bool(of_job(journal(path), job_id, "stop")), timeout=10)

    assert done["status"]["state"] == "Failed", done["status"]["events"]
    assert done["status"]["events"][-1]["reason"] == "DeadlineExceeded"
    ran = event_time(done, "Failed") - event_time(done, "Running")
    assert 2.0 <= ran.total_seconds() < 4.0, ran
    lines = journal(path)
    (start,) = of_job(lines, job_id, "start")
    (stop,) = of_job(lines, job_id, "stop")
    assert stop["phase"] == "Deleted"
    assert 2.0 <= stop["t"] - start["t"] < 6.0


async def test_a_preempted_job_gets_its_notice_and_its_grace_period(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    path = tmp_path / "small.journal"
    fleet.queues = write_queues(tmp_path / "queues.yaml")
    fleet.cycle_interval = 0.2
    fleet.write_tokens(tenants=["team-a"], clusters=["small"])
    await fleet.start_broker()
    nodes = write_small_cluster(tmp_path / "small.yaml")
    await fleet.start_agent("small", nodes, "--sim-journal", str(path))
    await fleet.wait_clusters_ready(["small"])
    # the victim's workload takes a minute to exit on SIGTERM: only the grace ends it
    victim = make_job("victim", gpus=8).model(H100).duration(300).priority_class("low")
    victim.preemption(2).annotate(simulated.SIM_EXIT_AFTER_ANNOTATION, "60")
    urgent = make_job("urgent", gpus=8).model(H100).duration(0.5).priority_class("high")
    async with fleet.client("team-a") as api:
        victim_id = (await api.submit(json.dumps(victim.document())))["id"]
        await wait_for(api, victim_id, "Running")
        urgent_id = (await api.submit(json.dumps(urgent.document())))["id"]
        done = await wait_for(api, urgent_id, FINAL, timeout=30)
        preempted = await api.get(victim_id)

    assert done["status"]["state"] == "Succeeded", done["status"]["events"]
    reasons = [e["reason"] for e in preempted["status"]["events"]]
    assert "Preempting" in reasons and "Preempted" in reasons, reasons
    lines = journal(path)
    (terminate,) = of_job(lines, victim_id, "terminate")
    assert terminate["grace"] == 2
    notice = datetime.fromisoformat(terminate["notice"]).timestamp()
    assert abs(notice - (terminate["t"] + 2)) < 1.0  # the deadline the workload was told
    stop = of_job(lines, victim_id, "stop")[0]
    assert stop["phase"] == "Deleted"
    assert 1.8 <= stop["t"] - terminate["t"] < 4.0  # it ran through its grace period
    (started,) = of_job(lines, urgent_id, "start")
    assert started["t"] >= stop["t"]  # the GPUs were not counted free before
    requeued = event_time(preempted, "Queued", "Preempted").timestamp()
    assert requeued >= stop["t"] - 0.5  # reported Cancelled once its pods were gone
