"""What e2e scenarios share: waiting for a job's state, long jobs running, the broker's /metrics,
and running the real `gpufed` CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from gpufed import client
from gpufed.local import processes
from tests.builders import make_job

FINAL = frozenset({"Succeeded", "Failed", "Cancelled"})


@contextlib.contextmanager
def workdir(prefix: str) -> Iterator[Path]:
    """A benchmark's directory (processes' logs, tokens, the history file): removed when the
    run ends well, kept (and named on stderr) when it fails, for its logs. A soak's is about
    50 MB: left behind after every run, they filled the machine's /tmp."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"the run's processes' logs are kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


async def scrape(fleet: processes.LocalFleet) -> str:
    """The broker's /metrics page, as Prometheus reads it (with the metrics token)."""
    scraper = {"Authorization": f"Bearer {fleet.tokens['metrics']}"}
    async with (
        aiohttp.ClientSession(headers=scraper) as session,
        session.get(f"{fleet.url}/metrics") as response,
    ):
        return await response.text()


async def broker_counts(fleet: processes.LocalFleet) -> dict[str, float]:
    """The broker's counters the benchmarks read from its /metrics, so far: seconds its garbage
    collector paused it (`gc`, every generation), scheduling cycles (`cycles`) and the time
    they took (`cycle_seconds`), and store writes by operation (`store:<op>`)."""
    counts: dict[str, float] = {}
    for line in (await scrape(fleet)).splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("gpufed_gc_pause_seconds_sum"):
            key = "gc"
        elif name == "gpufed_scheduling_cycles_total":
            key = "cycles"
        elif name == "gpufed_scheduling_cycle_duration_seconds_sum":
            key = "cycle_seconds"
        elif name.startswith("gpufed_store_operation_duration_seconds_count{"):
            key = "store:" + name.split('op="', 1)[1].split('"', 1)[0]
        else:
            continue
        counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def counts_since(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def writes_per_job(counts: dict[str, float], jobs: int) -> str:
    """`broker_counts`' store writes per job, by operation: "create 0.020, update 0.045"."""
    return ", ".join(
        f"{key.removeprefix('store:')} {value / jobs:.3f}"
        for key, value in sorted(counts.items())
        if key.startswith("store:") and value
    )


async def wait_for(
    api: client.BrokerClient, job_id: str, states: str | set[str] | frozenset[str], *,
    timeout: float = 30.0,
) -> dict[str, Any]:  # fmt: skip
    """The job once it is in one of `states`; fails the test with its status if it never is."""
    wanted = {states} if isinstance(states, str) else set(states)
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = await api.get(job_id)
        if job["status"]["state"] in wanted:
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id} not in {sorted(wanted)} after {timeout}s: {job.get('status')}")


async def eventually(
    check: Callable[[], Awaitable[Any]], *, what: str, timeout: float = 10.0
) -> Any:
    """What `check()` answers once it is true (asked every 0.1 s); fails the test, saying
    `what` was awaited, if it never is within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"not {what} after {timeout}s")


async def long_jobs(api: client.BrokerClient, count: int) -> dict[str, str]:
    """`count` running jobs of one GPU for 600 s (long-0, long-1, ...), each Running before the
    next is submitted, that may be requeued if their cluster is lost: id -> cluster."""
    placed = {}
    for i in range(count):
        job = json.dumps(make_job(f"long-{i}", gpus=1).duration(600).document())
        job_id = (await api.submit(job))["id"]
        placed[job_id] = (await wait_for(api, job_id, {"Running"}))["status"]["cluster"]
    return placed


async def run_cli(
    fleet: processes.LocalFleet, *args: str, tenant: str = "team-a", stdin: str | None = None
) -> tuple[int, str, str]:
    """`gpufed ARGS` as a user runs it, against the fleet's broker: (exit code, out, err)."""
    env = {**os.environ, "GPUFED_BROKER": fleet.url, "GPUFED_TOKEN": fleet.tokens[tenant]}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufed.cli", *args, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate(stdin.encode() if stdin else None)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
