"""What e2e scenarios share: waiting for a job's state, the broker's /metrics, and running the
real `gpufed` CLI."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import aiohttp

from gpufed import client
from gpufed.local import processes

FINAL = frozenset({"Succeeded", "Failed", "Cancelled"})


async def scrape(fleet: processes.LocalFleet) -> str:
    """The broker's /metrics page, as Prometheus reads it (with the metrics token)."""
    scraper = {"Authorization": f"Bearer {fleet.tokens['metrics']}"}
    async with (
        aiohttp.ClientSession(headers=scraper) as session,
        session.get(f"{fleet.url}/metrics") as response,
    ):
        return await response.text()


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
