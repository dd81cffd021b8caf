"""The `gpufed` CLI against a real broker and agent: submit, get, list, why, cancel, clusters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from e2e.helpers import run_cli
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
