"""The `gpufed` CLI as people expect it, against a real broker and agent: errors in one line
(or a problem document with `-o json`), never a traceback, not even for `| head`; `--state` in
any case; one trace context in job JSON; `get -w` until the job ends; `list -o wide`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from e2e.helpers import run_cli, wait_for
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e


async def submit(fleet: processes.LocalFleet, tmp_path: Path, name: str, **annotations: str) -> str:
    builder = make_job(name, gpus=1)
    for key, value in annotations.items():
        builder = builder.annotate(key, value)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(builder.document()))
    code, out, err = await run_cli(fleet, "submit", str(path), "-o", "json")
    assert code == 0, err
    job_id: str = json.loads(out)["id"]
    return job_id


async def test_errors_are_one_line_or_a_problem_document_never_a_traceback(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    await fleet.start_simulated(["h100"])
    missing = str(tmp_path / "missing.yaml")

    code, out, err = await run_cli(fleet, "submit", missing)
    assert (code, out) == (1, "")
    assert err == f"gpufed submit: cannot read the file {missing}: No such file or directory\n"

    code, out, err = await run_cli(fleet, "submit", missing, "-o", "json")
    assert (code, out) == (1, "")  # stdout holds answers only
    assert json.loads(err) == {
        "type": "urn:gpufed:problem:cli-file",
        "title": "Cannot read",
        "detail": f"cannot read the file {missing}: No such file or directory",
    }

    code, out, err = await run_cli(fleet, "queues", "training", "--apply", missing)
    assert code == 1 and "Traceback" not in err
    assert (
        err == f"gpufed queues: cannot read the queues file {missing}: No such file or directory\n"
    )

    code, out, err = await run_cli(fleet, "list", "--token-file", missing, "-o", "json")
    assert code == 1 and json.loads(err)["detail"].startswith("cannot read the token file")

    # the broker's own problem, as it wrote it
    code, out, err = await run_cli(fleet, "get", "no-such-job", "-o", "json")
    assert (code, out) == (1, "")
    problem = json.loads(err)
    assert (problem["status"], problem["detail"]) == (404, "no job 'no-such-job'")
    code, out, err = await run_cli(fleet, "get", "no-such-job")
    assert (code, err) == (1, "gpufed get: no job 'no-such-job'\n")

    bad = make_job("bad", gpus=1).document()
    bad["spec"]["colour"] = "blue"
    code, out, err = await run_cli(fleet, "submit", "-", "-o", "json", stdin=json.dumps(bad))
    assert code == 1 and json.loads(err)["field"] == "spec.colour"


async def test_a_reader_that_goes_away_stops_the_cli_quietly(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    """`gpufed list -o json | head`: stdout's reader is gone before the CLI writes."""
    await fleet.start_simulated(["h100"])
    await submit(fleet, tmp_path, "piped")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write to the pipe is EPIPE
    env = {**os.environ, "GPUFED_BROKER": fleet.url, "GPUFED_TOKEN": fleet.tokens["team-a"]}
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpufed.cli", "list", "-o", "json", env=env,
            stdout=write_end, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    finally:
        os.close(write_end)
    _, err = await process.communicate()
    assert process.returncode == 141  # as `yes | head`
    assert err.decode() == ""  # no traceback, no "Exception ignored"


async def test_state_in_any_case_and_one_trace_context_in_job_json(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    await fleet.start_simulated(["h100"])
    job_id = await submit(fleet, tmp_path, "long", **{"gpufed.io/sim-duration": "600"})
    async with fleet.client("team-a") as api:
        await wait_for(api, job_id, "Running")

    for spelled in ("running", "RUNNING", "Running"):
        code, out, err = await run_cli(fleet, "list", "--state", spelled, "-o", "json")
        assert code == 0, err
        assert [j["id"] for j in json.loads(out)] == [job_id]
    code, out, _ = await run_cli(fleet, "list", "--state", "queued", "-o", "json")
    assert json.loads(out) == []
    for search in (["-q", "LONG"], ["--search", "ong", "--sort", "oldest"]):
        code, out, err = await run_cli(fleet, "list", *search, "-o", "json")
        assert code == 0, err
        assert [j["id"] for j in json.loads(out)] == [job_id]
    code, out, _ = await run_cli(fleet, "list", "-q", "short", "-o", "json")
    assert json.loads(out) == []

    code, out, _ = await run_cli(fleet, "get", job_id, "-o", "json")
    job = json.loads(out)
    assert "traceParent" not in job  # one trace context: the W3C `traceparent`
    version, trace_id, span_id, flags = job["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", job["traceId"], "01") and len(span_id) == 16
    code, out, _ = await run_cli(fleet, "list", "-o", "json")
    assert all("traceParent" not in j and j["traceparent"] for j in json.loads(out))
    code, out, _ = await run_cli(fleet, "cancel", job_id, "-o", "json")
    assert "traceParent" not in json.loads(out)


async def test_get_watch_prints_each_state_until_the_job_ends(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    await fleet.start_simulated(["h100"])
    ok = await submit(fleet, tmp_path, "watched", **{"gpufed.io/sim-duration": "1"})
    code, out, err = await run_cli(fleet, "get", "-w", ok)
    assert code == 0, err
    header, *events = out.splitlines()
    assert header == f"{ok}  (watched, queue default)"
    assert [line.split()[1] for line in events] == ["Queued", "Dispatched", "Running", "Succeeded"]
    assert "Running on h100" in events[2]

    failing = await submit(
        fleet,
        tmp_path,
        "oom",
        **{"gpufed.io/sim-duration": "3", "gpufed.io/sim-outcome": "Failed:OOMKilled"},
    )
    code, out, err = await run_cli(fleet, "get", "--watch", failing, "-o", "json")
    assert code == 1, err  # it Failed
    seen = [json.loads(line) for line in out.splitlines()]
    assert seen[-1]["status"]["state"] == "Failed"
    assert len(seen) >= 2  # a line per change: not only the end


async def test_list_wide_adds_who_where_and_how_long(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    await fleet.start_simulated(["h100"])
    job_id = await submit(fleet, tmp_path, "wide", **{"gpufed.io/sim-duration": "0.5"})
    async with fleet.client("team-a") as api:
        await wait_for(api, job_id, "Succeeded")
    code, out, err = await run_cli(fleet, "list", "-o", "wide")
    assert code == 0, err
    header, _, row = out.splitlines()
    assert header.split() == [
        "ID", "NAME", "TENANT", "QUEUE", "PRIORITY", "STATE", "CLUSTER", "GPUS", "PODS",
        "NODES", "CREATED", "WAITED", "RAN",
    ]  # fmt: skip
    cells = row.split()
    assert cells[:9] == [job_id, "wide", "team-a", "default", "0", "Succeeded", "h100", "1", "1"]
    assert cells[9].startswith("hgx-h100-")
    assert cells[-1].endswith("s")  # RAN: it ran for about 0.5 s
