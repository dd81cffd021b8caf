"""A queued job's position and ETA (`why`), with real broker and agent processes.

One simulated node of 8 H100, so every 8-GPU job waits for the one before it. A job that
runs with no declared end holds the node: the last of three queued jobs is third in its
queue and among the jobs wanting H100, with no ETA and the reason. Once the holder is
cancelled, the jobs ahead run one after the other for their `gpufed.io/sim-duration`:
`why` of the last one says a position that shrinks as each starts, and an ETA from the
declared ends of the running job and of the one still ahead of it, close to when it does
start. `gpufed why` prints both.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import helpers
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
RUN_SECONDS = 2.0


def write_one_node(path: Path) -> Path:
    pool = {
        "name": "one-h100",
        "count": 1,
        "gpu_product": H100,
        "gpus_per_node": 8,
        "gpu_memory_mib": 81920,
        "cpu": 200,
        "memory": "2000Gi",
    }
    path.write_text(yaml.safe_dump({"cluster": "line", "pools": [pool]}))
    return path


def document(name: str, seconds: float | None) -> str:
    builder = make_job(name, gpus=8).model(H100)
    if seconds is not None:
        builder = builder.duration(seconds)
    return json.dumps(builder.document())


async def test_why_tells_a_position_that_shrinks_and_an_eta_from_declared_ends(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    fleet.cycle_interval = 0.1
    fleet.write_tokens(tenants=["team-a"], clusters=["line"])
    await fleet.start_broker()
    await fleet.start_agent("line", write_one_node(tmp_path / "line.yaml"))
    await fleet.wait_clusters_ready(["line"])
    async with fleet.client("team-a") as api:
        holder = (await api.submit(document("holder", None)))["id"]
        await helpers.wait_for(api, holder, "Running")
        for name in ("ahead-1", "ahead-2"):
            await api.submit(document(name, RUN_SECONDS))
        last = (await api.submit(document("last", RUN_SECONDS)))["id"]

        # ---- 1. behind a job that declares no end: a position, no ETA -------------------
        answer = await until_positioned(api, last)
        assert answer["position"]["inQueue"] == 3, answer
        assert answer["position"]["competing"] == 3, answer
        assert answer["position"]["models"] == [H100]
        assert answer["position"]["gpusAhead"] == 16
        assert answer["eta"] is None
        assert answer["etaReason"] == (
            "no running job on the GPU models it needs declares when it ends"
        )
        code, out, err = await helpers.run_cli(fleet, "why", last)
        assert code == 0, err
        assert "position: 3 in its queue, 3 among the queued jobs wanting" in out, out
        assert "eta: unknown (no running job" in out, out

        # ---- 2. the holder goes: the jobs ahead start one by one ------------------------
        await api.cancel(holder)
        seen: list[tuple[int, datetime | None]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = await api.why(last)
            if answer["state"] != "Queued":
                break
            if answer["position"] is not None:
                eta = datetime.fromisoformat(answer["eta"]) if answer["eta"] else None
                if not seen or seen[-1] != (answer["position"]["inQueue"], eta):
                    seen.append((answer["position"]["inQueue"], eta))
            await asyncio.sleep(0.05)
        print("\n(position in its queue, eta) as the jobs ahead started:", seen)
        places = [place for place, _ in seen]
        assert places == sorted(places, reverse=True), seen  # it never moves back
        assert places[0] == 3 and 1 in places, seen  # from third to next
        assert 2 in places, seen  # it saw the first of those ahead of it start
        # once the holder is gone, each job ahead runs for its declared duration: the last
        # one has an ETA at every place (the ends of those ahead of it, one after the other)
        timed = [eta for place, eta in seen if place < 3]
        assert timed and None not in timed, seen
        done = await helpers.wait_for(api, last, helpers.FINAL, timeout=30)
        assert done["status"]["state"] == "Succeeded"
        started = event_time(done, "Running")
        # the last ETA given is within a couple of seconds of when it started
        last_eta = timed[-1]
        assert last_eta is not None
        assert abs((last_eta - started).total_seconds()) < RUN_SECONDS, (timed, started)


async def until_positioned(api: Any, job_id: str) -> dict[str, Any]:
    """`why` once the leader's scheduler holds the job (a cycle read it)."""
    for _ in range(100):
        answer: dict[str, Any] = await api.why(job_id)
        if answer["position"] is not None and answer["position"]["inQueue"] == 3:
            return answer
        await asyncio.sleep(0.05)
    raise AssertionError(f"no position: {answer}")


def event_time(job: dict[str, Any], state: str) -> datetime:
    for event in job["status"]["events"]:
        if event["state"] == state:
            return datetime.fromisoformat(event["time"])
    raise AssertionError(f"no {state} event: {job['status']['events']}")
