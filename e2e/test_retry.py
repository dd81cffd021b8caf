"""A job retried after an infrastructure failure runs again on the same cluster.

One simulated cluster, real broker and agent processes. The job's pods fail with NodeLost on
its first attempt only (`gpufed.io/sim-outcome: Failed:NodeLost@1`): the broker requeues it
(NodeLost is not the workload's fault) and offers it again to the only cluster there is,
whose agent still holds the failed first attempt. The second attempt must run, under pod
names of its own, and succeed, instead of being taken for a re-sent offer of the first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.helpers import FINAL, wait_for
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"


def transitions(job: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(state, reason, cluster) of each change of state, in order."""
    out: list[tuple[str, str, str | None]] = []
    for event in job["status"]["events"]:
        if not out or out[-1][0] != event["state"]:
            out.append((event["state"], event["reason"], event.get("cluster")))
    return out


async def test_a_job_whose_first_attempt_loses_its_node_runs_again_on_the_same_cluster(
    fleet: processes.LocalFleet,
) -> None:
    await fleet.start_simulated(["h100"])
    # both pods fail with NodeLost half a second into attempt 1; attempt 2 succeeds
    flaky = make_job("flaky", gpus=8).model(H100).gang(2).duration(0.5)
    flaky.outcome("Failed:NodeLost@1")
    async with fleet.client("team-a") as api:
        job_id = (await api.submit(json.dumps(flaky.document())))["id"]
        done = await wait_for(api, job_id, FINAL)

    assert done["status"]["state"] == "Succeeded", transitions(done)
    steps = transitions(done)
    assert [state for state, _, _ in steps] == [
        "Queued",
        "Dispatched",
        "Running",
        "Queued",
        "Dispatched",
        "Running",
        "Succeeded",
    ]
    assert steps[3][1] == "NodeLost"
    assert {cluster for state, _, cluster in steps if state == "Dispatched"} == {"h100"}
    assert done["status"]["cluster"] == "h100"
    assert done["status"]["attempts"] == 2
    assert done["status"]["infraRetries"] == 1
    pods = done["status"]["pods"]
    assert sorted(p["name"] for p in pods) == [
        f"{job_id}-worker-0-a2",
        f"{job_id}-worker-1-a2",
    ]
    assert {p["phase"] for p in pods} == {"Succeeded"}
