"""The `gpufed` CLI against a real broker and agent: submit (one job, or a directory of them in
a batch), get, list, why, cancel, clusters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from e2e.helpers import run_cli, wait_for
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e


async def test_cli_round_trip(fleet: processes.LocalFleet, tmp_path: Path) -> None:
    await fleet.start_simulated(["h100"])

    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(make_job("cli-job", gpus=8).gang(2).document()))
    code, out, _ = await run_cli(fleet, "submit", str(job_file), "-o", "json")
    assert code == 0
    job_id = json.loads(out)["id"]

    code, out, _ = await run_cli(fleet, "get", job_id)
    assert code == 0 and job_id in out and "Queued" in out

    code, out, _ = await run_cli(fleet, "list")
    assert code == 0 and job_id in out and "QUEUE" in out

    code, out, _ = await run_cli(fleet, "clusters")
    assert code == 0 and "NVIDIA-H100-80GB-HBM3" in out and "Ready" in out

    too_big = make_job("too-big", gpus=8).gang(100).document()
    code, out, _ = await run_cli(fleet, "submit", "-", "-o", "json", stdin=json.dumps(too_big))
    big_id = json.loads(out)["id"]
    for _ in range(100):
        code, out, _ = await run_cli(fleet, "why", big_id, "-o", "json")
        if json.loads(out)["clusters"]:
            break
        await asyncio.sleep(0.1)
    answer = json.loads(out)
    assert answer["clusters"][0]["cluster"] == "h100"
    assert "needs 100 node(s) with 8 free GPU(s)" in answer["clusters"][0]["reasons"][0]
    code, out, _ = await run_cli(fleet, "get", big_id)
    assert code == 0 and "Waiting:  h100: needs 100 node(s)" in out

    code, out, _ = await run_cli(fleet, "cancel", job_id)
    assert code == 0

    bad = make_job("bad", gpus=1).document()
    bad["spec"]["colour"] = "blue"
    code, _, err = await run_cli(fleet, "submit", "-", stdin=json.dumps(bad))
    assert code == 1 and "spec.colour: unknown field" in err

    code, _, err = await run_cli(fleet, "get", job_id, tenant="admin")
    assert code == 0


async def test_submit_a_directory_goes_in_one_batch_and_every_job_runs(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    await fleet.start_simulated(["h100"])
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    for n, name in enumerate(["c.yaml", "a.yml", "b.json"]):
        doc = make_job(f"dir-{n}", gpus=1).duration(0.2).document()
        text = json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc)
        (jobs_dir / name).write_text(text)
    (jobs_dir / "notes.txt").write_text("not a job")

    code, out, err = await run_cli(fleet, "submit", "-f", str(jobs_dir), "--idempotency-key", "k")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        str(jobs_dir / name) for name in ("a.yml", "b.json", "c.yaml")
    ], "one line per job, files sorted"
    ids = [line.split()[1] for line in lines]
    assert [i.rsplit("-", 1)[0] for i in ids] == ["dir-1", "dir-2", "dir-0"]
    async with fleet.client("team-a") as api:
        for job_id in ids:
            await wait_for(api, job_id, "Succeeded", timeout=20)

    code, out, _ = await run_cli(fleet, "submit", "-f", str(jobs_dir), "--idempotency-key", "k")
    assert code == 0 and [line.split()[1] for line in out.splitlines()] == ids, "K-<i> replays"
    assert out.count("(replayed") == 3

    several = tmp_path / "several.yaml"
    bad = make_job("bad", gpus=1).document()
    bad["spec"]["colour"] = "blue"
    several.write_text(yaml.safe_dump_all([make_job("fine", gpus=1).document(), bad]))
    code, out, _ = await run_cli(fleet, "submit", "-f", str(several))
    assert code == 1, "an item refused"
    fine, refused = out.splitlines()
    assert fine.startswith(f"{several}#1: fine-") and "Queued" in fine
    assert refused == f"{several}#2: error 422: job.spec.colour: unknown field"
