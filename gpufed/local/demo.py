"""`gpufed demo`: a broker on SQLite, three simulated member clusters, a mixed workload.

Every service is its own process talking over loopback HTTP. The demo submits the workload,
shows progress while it runs, cancels the jobs meant to be cancelled once they run, and ends
with a summary: jobs by final state against what was expected, GPUs per cluster and model,
and submit→dispatched / submit→running latency. Exit 0 only if every job ended as expected.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from gpufed import tables
from gpufed.local import processes, workloads

CLUSTERS = ["h100", "a100", "inference"]
TENANTS = ["ml-research", "serving"]
DEADLINE_SECONDS = 110.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _seconds_between(job: dict[str, Any], first: str, then: str) -> float | None:
    times: dict[str, datetime] = {}
    for event in job["status"]["events"]:
        times.setdefault(event["state"], datetime.fromisoformat(event["time"]))
    if first in times and then in times:
        return (times[then] - times[first]).total_seconds()
    return None


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.started = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.last_line = ""

    def show(self, counts: Counter[str], peak: dict[str, int]) -> None:
        done = counts["Succeeded"] + counts["Failed"] + counts["Cancelled"]
        width = 30
        filled = int(width * done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        busy = " ".join(f"{c}:{n}" for c, n in sorted(peak.items()))
        line = (
            f"[{bar}] {done}/{self.total} done  t={time.monotonic() - self.started:5.1f}s  "
            f"queued {counts['Queued']:>3}  dispatched {counts['Dispatched']:>3}  "
            f"running {counts['Running']:>3}  ok {counts['Succeeded']:>3}  "
            f"failed {counts['Failed']:>2}  cancelled {counts['Cancelled']:>2}  "
            f"GPUs busy {busy}"
        )
        if self.tty:
            print("\r" + line, end="", flush=True)
        elif line != self.last_line:
            print(line, flush=True)
        self.last_line = line

    def end(self) -> None:
        if self.tty:
            print()


async def _run(fleet: processes.LocalFleet, count: int) -> int:
    print(f"gpufed demo: starting a broker (SQLite) and {len(CLUSTERS)} member agents ...")
    await fleet.start_simulated(CLUSTERS, tenants=TENANTS)
    async with fleet.client("admin") as admin:
        inventory = await admin.clusters()
    print(
        tables.render(
            ["CLUSTER", "MODEL", "GPUS"],
            [[c["name"], m["model"], m["total"]] for c in inventory for m in c["models"]],
        )
    )
    demo_jobs = workloads.build(count)
    clients = {t: fleet.client(t) for t in TENANTS}
    try:
        print(
            f"\nsubmitting {len(demo_jobs)} jobs "
            f"({sum(j.gpus for j in demo_jobs)} GPUs asked in all) ..."
        )
        submitted = await asyncio.gather(
            *[
                clients[j.tenant].submit(json.dumps(j.document), idempotency_key=f"demo-{n}")
                for n, j in enumerate(demo_jobs)
            ]
        )
        ids = [s["id"] for s in submitted]
        expected = dict(zip(ids, demo_jobs, strict=True))
        final = await _watch(fleet, clients, expected)
    finally:
        for api in clients.values():
            await api.close()
    return _report(final, expected, fleet.peak, inventory)


async def _watch(
    fleet: processes.LocalFleet, clients: dict[str, Any], expected: dict[str, workloads.DemoJob]
) -> dict[str, dict[str, Any]]:
    progress = Progress(len(expected))
    cancelled: set[str] = set()
    deadline = time.monotonic() + DEADLINE_SECONDS
    jobs: dict[str, dict[str, Any]] = {}
    async with fleet.client("admin") as admin:
        while True:
            jobs = {j["id"]: j for j in await admin.jobs(limit=100_000) if j["id"] in expected}
            for cluster in await admin.clusters():
                for model in cluster["models"]:
                    key = f"{cluster['name']}/{model['model']}"
                    fleet.peak[key] = max(fleet.peak.get(key, 0), model["allocated"])
            counts = Counter(j["status"]["state"] for j in jobs.values())
            busy = {
                c["name"]: sum(m["allocated"] for m in c["models"]) for c in await admin.clusters()
            }
            progress.show(counts, busy)
            for job_id, job in jobs.items():
                want = expected[job_id]
                if (
                    want.cancel_when_running
                    and job_id not in cancelled
                    and job["status"]["state"] == "Running"
                ):
                    await clients[want.tenant].cancel(job_id)
                    cancelled.add(job_id)
            if all(
                j["status"]["state"] in ("Succeeded", "Failed", "Cancelled") for j in jobs.values()
            ):
                break
            if time.monotonic() > deadline:
                print(f"\ngpufed demo: not finished after {DEADLINE_SECONDS:.0f}s")
                break
            await asyncio.sleep(0.5)
    progress.end()
    return jobs


def _report(
    jobs: dict[str, dict[str, Any]],
    expected: dict[str, workloads.DemoJob],
    peak: dict[str, int],
    inventory: list[dict[str, Any]],
) -> int:
    print("\nJobs by final state")
    got = Counter((expected[i].kind, jobs[i]["status"]["state"]) for i in jobs)
    want = Counter((j.kind, j.expected) for j in expected.values())
    keys = sorted(set(got) | set(want))
    print(
        tables.render(
            ["KIND", "STATE", "EXPECTED", "GOT"],
            [[k, s, want[(k, s)], got[(k, s)]] for k, s in keys],
        )
    )
    print("\nGPUs per cluster and model")
    gpu_seconds: dict[str, float] = defaultdict(float)
    for job in jobs.values():
        ran = _seconds_between(job, "Running", job["status"]["state"])
        if ran is not None and job["status"].get("cluster"):
            gpus = sum(len(p.get("gpus", [])) for p in job["status"]["pods"])
            gpu_seconds[job["status"]["cluster"]] += gpus * ran
    rows = []
    for cluster in inventory:
        for model in cluster["models"]:
            key = f"{cluster['name']}/{model['model']}"
            rows.append([cluster["name"], model["model"], model["total"], peak.get(key, 0)])
    print(tables.render(["CLUSTER", "MODEL", "GPUS", "PEAK ALLOCATED"], rows))
    print(
        tables.render(
            ["CLUSTER", "GPU-SECONDS RUN"],
            [[c, f"{s:.0f}"] for c, s in sorted(gpu_seconds.items())],
        )
    )
    dispatch = [
        s for j in jobs.values() if (s := _seconds_between(j, "Queued", "Dispatched")) is not None
    ]
    running = [
        s for j in jobs.values() if (s := _seconds_between(j, "Queued", "Running")) is not None
    ]
    print("\nLatency (seconds; includes time waiting for free GPUs)")
    print(
        tables.render(
            ["PATH", "JOBS", "P50", "P99", "MAX"],
            [
                [
                    "submit -> dispatched",
                    len(dispatch),
                    f"{percentile(dispatch, 50):.3f}",
                    f"{percentile(dispatch, 99):.3f}",
                    f"{max(dispatch, default=0):.3f}",
                ],
                [
                    "submit -> running",
                    len(running),
                    f"{percentile(running, 50):.3f}",
                    f"{percentile(running, 99):.3f}",
                    f"{max(running, default=0):.3f}",
                ],
            ],
        )
    )
    wrong = [
        i
        for i in expected
        if jobs.get(i, {}).get("status", {}).get("state") != expected[i].expected
    ]
    if wrong:
        print(f"\ngpufed demo: FAILED — {len(wrong)} job(s) did not end as expected:")
        for job_id in wrong[:10]:
            state = jobs.get(job_id, {}).get("status", {}).get("state", "missing")
            print(f"  {job_id}: expected {expected[job_id].expected}, got {state}")
        return 1
    print(f"\ngpufed demo: OK — all {len(expected)} jobs ended as expected.")
    return 0


def main(*, jobs: int = 72, keep: bool = False) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="gpufed-demo-"))
    fleet = processes.LocalFleet(workdir=workdir)

    async def go() -> int:
        try:
            return await _run(fleet, jobs)
        finally:
            await fleet.stop()

    started = time.monotonic()
    try:
        code = asyncio.run(go())
    except (RuntimeError, TimeoutError) as exc:
        print(f"gpufed demo: {exc}", file=sys.stderr)
        code = 2
    print(
        f"(demo took {time.monotonic() - started:.1f}s; logs in {workdir})"
        if keep or code
        else f"(demo took {time.monotonic() - started:.1f}s)"
    )
    if not keep and code == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    return code
