"""A leader whose wall clock runs ahead does not fail jobs early (issue 40 item 6): three
brokers on a real etcd, one of them (broker-1) started under libfaketime with its wall clock
40 s ahead of the others' (its monotonic clock left alone), one simulated agent. A job with
`activeDeadlineSeconds: 30` starts under an unskewed leader; the two others are stopped, so
the skewed replica leads, and the job must still run its 30 s before it fails with
`DeadlineExceeded`. A leader that compared the first start stamped by the old leader with its
own clock would fail it at once (`jobs.deadlines`).

The skew is libfaketime's `FAKETIME=+40s` through `LD_PRELOAD`; where libfaketime is not
installed the test skips with one line, except where `GPUFED_REQUIRE_FAKETIME=1` (CI: .ci/run
installs Debian's `faketime`), where it fails. The skewed broker runs without jemalloc:
preloaded together, the two libraries hang the process on start (jemalloc reads the clock
while libfaketime is setting itself up, and libfaketime cannot recover from that recursion).

Prints when the job failed, by the test's clock and by its events (`-s` shows it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from e2e import helpers
from gpufed.local import processes
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.etcd, pytest.mark.chaos]

REQUIRE_VARIABLE = "GPUFED_REQUIRE_FAKETIME"
HOW_TO_GET_ONE = "libfaketime is not installed (Debian: apt-get install faketime)"
CLUSTERS = ["h100"]
SKEW = 40.0  # seconds broker-1's wall clock runs ahead of the others'
DEADLINE = 30.0  # the job's activeDeadlineSeconds
# how late the job may fail: the watch's lag on the skewed replica, its deadlines pass (at
# most a second apart), the commit, and the test's polling, on a loaded machine
LATE_BY_AT_MOST = 8.0
EARLY_BY_AT_MOST = 1.0  # Running is seen by polling, a little after it was recorded


def find_libfaketime() -> Path:
    """Debian's libfaketime.so.1 (not on the loader's path: under .../faketime/); skips the
    test (fails it where required) without one."""
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1"):
        for found in sorted(Path("/").glob(pattern.lstrip("/"))):
            return found
    if os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0"):
        pytest.fail(f"{HOW_TO_GET_ONE}, and {REQUIRE_VARIABLE} is set")
    pytest.skip(HOW_TO_GET_ONE)


def skewed_env(library: Path) -> dict[str, str]:
    """A broker's environment with its wall clock SKEW seconds ahead, its monotonic clock
    (asyncio's, the leases', the heartbeats') untouched."""
    return {
        "LD_PRELOAD": str(library),  # alone: see the module's docstring on jemalloc
        "FAKETIME": f"+{SKEW:g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


async def start_broker(fleet: processes.LocalFleet, env: dict[str, str]) -> processes.Service:
    """One more broker, with `env` on top of its usual environment (the fleet gives every
    broker it starts its `env`: set for this start only)."""
    fleet.env = env
    try:
        (service,) = await fleet.start_brokers(1)
    finally:
        fleet.env = {}
    return service


async def restart_broker(fleet: processes.LocalFleet, service: processes.Service) -> None:
    fleet.env = {}
    await fleet.restart_broker(fleet.brokers.index(service))


def event_time(job: dict[str, Any], state: str) -> datetime:
    events = job["status"]["events"]
    return next(datetime.fromisoformat(e["time"]) for e in events if e["state"] == state)


async def test_a_leader_with_its_clock_ahead_fails_a_job_at_its_deadline_not_before(
    fleet: processes.LocalFleet, etcd_url: str
) -> None:
    library = find_libfaketime()
    fleet.store = etcd_url
    fleet.lost_after = 9.0  # as test_replicas: a handover reaches the agent before it fences
    fleet.write_tokens(tenants=["team-a"], clusters=CLUSTERS)
    first = await start_broker(fleet, {})
    assert await fleet.leader() is first  # alone: it leads before the others campaign
    skewed = await start_broker(fleet, skewed_env(library))
    third = await start_broker(fleet, {})
    for cluster in CLUSTERS:
        await fleet.start_agent(cluster, processes.config_dir() / "clusters" / f"{cluster}.yaml")
    await fleet.wait_clusters_ready(CLUSTERS)
    leader = await fleet.leader()
    assert leader is not skewed, "the skewed replica leads from the start"

    job = make_job("deadline", gpus=1).duration(600)
    job.failure_policy(activeDeadlineSeconds=int(DEADLINE))
    async with fleet.client("team-a") as api:
        job_id = (await api.submit(json.dumps(job.document())))["id"]
        running = await helpers.wait_for(api, job_id, "Running")
        ran_from = time.monotonic()
        assert running["status"]["cluster"] in CLUSTERS

        # the skewed replica learns of the start by the watch; then it alone is left to lead
        for other in (b for b in (first, third) if b is not leader):
            await other.stop()  # a follower: no handover
        await leader.stop()  # SIGTERM: hands over to the one replica left
        assert await fleet.leader(timeout=15) is skewed
        for other in (first, third):
            await restart_broker(fleet, other)
        assert await fleet.leader(timeout=15) is skewed
        handed_over = time.monotonic() - ran_from

        done = await helpers.wait_for(
            api, job_id, helpers.FINAL, timeout=DEADLINE + LATE_BY_AT_MOST + 5
        )
        failed_after = time.monotonic() - ran_from
    stamped = (event_time(done, "Failed") - event_time(done, "Running")).total_seconds()
    print(
        f"\nthe skewed replica led {handed_over:.1f} s into the job's run; the job failed "
        f"{failed_after:.1f} s into it (by its events: {stamped:.1f} s)"
    )
    assert done["status"]["state"] == "Failed", done["status"]["events"]
    assert done["status"]["events"][-1]["reason"] == "DeadlineExceeded"
    assert failed_after >= DEADLINE - EARLY_BY_AT_MOST, (
        f"failed {failed_after:.1f} s into its run: before its {DEADLINE:g} s deadline"
    )
    assert failed_after <= DEADLINE + LATE_BY_AT_MOST, failed_after
    # the skewed replica failed it: its Failed event is stamped on a clock SKEW s ahead
    assert stamped >= DEADLINE + SKEW - EARLY_BY_AT_MOST, (stamped, "the skew did not apply")
