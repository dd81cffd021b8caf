"""Dependencies and arrays with real broker and agent processes on a simulated cluster.

- `spec.dependsOn`: a job waits (`Waiting`) until the job it names succeeded, and its pods
  start only after that job's pods stopped (the agent's pod journal says when each ran); a
  job whose dependency failed fails `DependencyFailed` and no pod of it ever runs.
- `spec.array: {count: 10, parallelism: 3}`: ten indexed jobs all succeed, and the journal
  shows at most three of them running at any moment (and three at some moment: the bound is
  reached, not just respected by accident); every pod got `GPUFED_ARRAY_INDEX` with its index.
- The CLI on them: `gpufed why` of a waiting job names its dependency, `gpufed list --array
  NAME --index I` lists one index, `gpufed cancel --array NAME` cancels a whole array.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from e2e.helpers import FINAL, run_cli, wait_for
from gpufed.local import processes
from tests import journals
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
NODES = processes.config_dir() / "clusters" / "h100.yaml"


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def start(fleet: processes.LocalFleet, journal: Path) -> None:
    fleet.cycle_interval = 0.1
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    await fleet.start_agent("h100", NODES, "--sim-journal", str(journal))
    await fleet.wait_clusters_ready(["h100"])


def most_at_once(copies: dict[journals.Copy, list[journals.Interval]]) -> int:
    """The most copies running at one moment (a stop before a start at the same time)."""
    edges = sorted(
        (t, step)
        for intervals in copies.values()
        for a, b in intervals
        for t, step in ((a, 1), (b, -1))
    )
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


async def test_a_dependent_job_starts_after_its_dependency_succeeded_and_fails_with_it(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    path = tmp_path / "h100.journal"
    await start(fleet, path)
    # long enough that the CLI (a process of its own) still finds train Waiting on a loaded CI
    prep = make_job("prep", gpus=8).model(H100).duration(8.0)
    train = make_job("train", gpus=8).model(H100).duration(0.2).document()
    train["spec"]["dependsOn"] = [{"job": "prep"}]
    broken = make_job("broken", gpus=8).model(H100).duration(0.2).outcome("Failed:Error")
    after = make_job("after-broken", gpus=8).model(H100).duration(0.2).document()
    after["spec"]["dependsOn"] = [{"job": "broken", "condition": "Succeeded"}]
    async with fleet.client("team-a") as api:
        prep_id = (await api.submit(json.dumps(prep.document())))["id"]
        waiting = await api.submit(json.dumps(train))
        assert waiting["state"] == "Waiting"
        why = await api.why(waiting["id"])
        assert [r["code"] for r in why["reasons"]] == ["Dependency"]
        assert prep_id in why["message"]
        code, out, _ = await run_cli(fleet, "why", waiting["id"])
        assert code == 0 and "Waiting" in out and f"waits for job {prep_id}" in out, out
        broken_id = (await api.submit(json.dumps(broken.document())))["id"]
        after_id = (await api.submit(json.dumps(after)))["id"]
        done_prep = await wait_for(api, prep_id, FINAL)
        done_train = await wait_for(api, waiting["id"], FINAL)
        done_broken = await wait_for(api, broken_id, FINAL)
        done_after = await wait_for(api, after_id, FINAL)

    assert done_prep["status"]["state"] == "Succeeded"
    assert done_train["status"]["state"] == "Succeeded", done_train["status"]["events"]
    reasons = [(e["state"], e["reason"]) for e in done_train["status"]["events"]]
    assert reasons[:2] == [("Waiting", "Submitted"), ("Queued", "DependenciesMet")]
    copies = journals.read([path])
    runs = {copy.job: intervals for copy, intervals in copies.items()}
    assert runs[waiting["id"]][0][0] >= runs[prep_id][-1][1]  # started after prep stopped

    assert done_broken["status"]["state"] == "Failed"
    assert done_after["status"]["state"] == "Failed", done_after["status"]["events"]
    last = done_after["status"]["events"][-1]
    assert last["reason"] == "DependencyFailed" and broken_id in last["message"]
    assert after_id not in runs  # not one of its pods ever ran
    assert done_after["status"]["attempts"] == 0


async def test_an_array_of_ten_never_runs_more_than_its_parallelism(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    path = tmp_path / "h100.journal"
    await start(fleet, path)
    sweep = make_job("sweep", gpus=1).model(H100).duration(0.6).document()
    sweep["spec"]["array"] = {"count": 10, "parallelism": 3}
    async with fleet.client("team-a") as api:
        answer = await api.submit(json.dumps(sweep))
        array_id = answer["array"]["id"]
        ids = [f"{array_id}-{i}" for i in range(10)]
        done = [await wait_for(api, job_id, FINAL, timeout=60) for job_id in ids]
        code, out, _ = await run_cli(
            fleet, "list", "--array", "sweep", "--index", "3", "-o", "json"
        )
        assert code == 0 and [j["id"] for j in json.loads(out)] == [ids[3]], out
        # a second array, cancelled whole from the CLI while its jobs wait or run
        sweep["spec"]["tasks"][0]["template"]["metadata"]["annotations"][
            "gpufed.io/sim-duration"
        ] = "300"
        second = (await api.submit(json.dumps(sweep)))["array"]["id"]
        await wait_for(api, f"{second}-0", "Running")
        code, out, _ = await run_cli(fleet, "cancel", "--array", "sweep")
        assert code == 0 and out.count("cancelling") == 10, out
        cancelled = [await wait_for(api, f"{second}-{i}", FINAL) for i in range(10)]
        assert {job["status"]["state"] for job in cancelled} == {"Cancelled"}

    assert [job["status"]["state"] for job in done] == ["Succeeded"] * 10
    copies = {c: i for c, i in journals.read([path]).items() if c.job in ids}
    assert sorted(copy.job for copy in copies) == sorted(ids)
    assert most_at_once(copies) == 3  # never more, and the bound was reached
    starts = [line for line in lines_of(path) if line["event"] == "start" and line["job"] in ids]
    for line in starts:
        index = line["job"].rsplit("-", 1)[1]
        assert line["env"] == {"GPUFED_ARRAY_INDEX": index}, line
