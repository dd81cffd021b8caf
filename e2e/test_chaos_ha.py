"""The HA chaos suite: a three-member etcd cluster, three brokers and three simulated agents,
all real processes on loopback, through a flood of 10,000 jobs (1-pod jobs and gangs) from
clients that pick a random replica for every request and retry with the same
`Idempotency-Key`. On the way: kill -9 of the leader at 30% and again at 70% of the flood,
kill -9 of one etcd member, one agent cut off from every broker (an HTTP proxy the test
controls: `gpufed agent --proxy`) for twice the lost-cluster grace, and a rolling restart of
all three brokers.

What must hold: every key answered 202 has exactly one job; every job ends Succeeded; no
attempt's pod is started twice; no two copies of one job run at the same moment (the agents'
journals: `gpufed agent --sim-journal`); no 5xx other than 503. Failover times are printed
(`-s` shows them). `make chaos` runs it (CI too); GPUFED_CHAOS_JOBS sets a smaller flood for a
quick look.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gpufed.local import processes
from tests import etcdcluster, etcdserver, journals, tcpproxy
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(600)]

JOBS = int(os.environ.get("GPUFED_CHAOS_JOBS", "10000"))
CLUSTERS = ["c0", "c1", "c2"]
CUT = "c2"  # the agent partitioned from every broker
WORKERS = 12
# the budget: the whole run under five minutes on two cores; jobs may finish until
# this long after the flood began (and at least a minute after the faults end)
FINISH_WITHIN = 280.0
GRACE = 9.0  # the brokers' --lost-after: a failover (lease 5 s) reaches agents before they fence
H100 = "NVIDIA-H100-80GB-HBM3"
FINAL = {"Succeeded", "Failed", "Cancelled"}


def write_nodes(path: Path, cluster: str, nodes: int = 40) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": cluster,
                "pools": [
                    {
                        "name": "hgx",
                        "count": nodes,
                        "gpu_product": H100,
                        "gpus_per_node": 8,
                        "gpu_memory_mib": 81559,
                        "cpu": 220,
                        "memory": "2000Gi",
                        "nvlink_island": 8,
                        "racks": 4,
                    }
                ],
            }
        )
    )
    return path


def workload(count: int, rand: random.Random) -> list[tuple[str, str]]:
    """(idempotency key, job document): nine in ten 1-pod jobs, one in ten 2-pod gangs."""
    out = []
    for i in range(count):
        if i % 10 == 9:
            job = make_job(f"gang-{i}", gpus=4).gang(2).duration(rand.uniform(0.5, 1.5))
        else:
            job = make_job(f"one-{i}", gpus=rand.choice([1, 1, 2])).duration(rand.uniform(0.3, 1.2))
        out.append((f"chaos-{i}-{uuid.uuid4().hex[:8]}", json.dumps(job.document())))
    return out


@dataclass
class Flood:
    """The clients: each request to a random live replica, retried with the same key."""

    urls: list[str]
    token: str
    accepted: dict[str, str] = field(default_factory=dict)  # key -> job id
    answers: collections.Counter[int] = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)  # 5xx other than 503, 4xx
    mismatched: list[str] = field(default_factory=list)  # a key answered with two ids
    retries: int = 0

    async def submit(self, session: aiohttp.ClientSession, key: str, doc: str) -> str:
        headers = {
            "Authorization": f"Bearer {self.token}",
            "Content-Type": "application/json",
            "Idempotency-Key": key,
        }
        while True:
            url = random.choice(self.urls)
            try:
                async with session.post(f"{url}/v1/jobs", data=doc, headers=headers) as response:
                    self.answers[response.status] += 1
                    body = await response.text()
                    if response.status in (200, 201, 202):
                        job_id = str(json.loads(body)["id"])
                        if self.accepted.setdefault(key, job_id) != job_id:
                            self.mismatched.append(f"{key}: {self.accepted[key]} and {job_id}")
                        return job_id
                    if response.status != 503:
                        self.bad.append(f"POST {url}: {response.status} {body[:300]}")
                        if response.status < 500:
                            raise AssertionError(self.bad[-1])
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            self.retries += 1
            await asyncio.sleep(0.05 + random.random() * 0.2)

    async def run(self, items: list[tuple[str, str]]) -> None:
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def worker() -> None:
                while not queue.empty():
                    key, doc = queue.get_nowait()
                    await self.submit(session, key, doc)
                    if random.random() < 0.02:  # a client that retries after its answer
                        await self.submit(session, key, doc)

            await asyncio.gather(*(worker() for _ in range(WORKERS)))

    async def get(self, session: aiohttp.ClientSession, path: str) -> dict[str, Any]:
        """A GET answered by any live replica (retried; 5xx other than 503 recorded)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        for _ in range(200):
            url = random.choice(self.urls)
            try:
                async with session.get(f"{url}{path}", headers=headers) as response:
                    self.answers[response.status] += 1
                    if response.status == 200:
                        answer: dict[str, Any] = await response.json()
                        return answer
                    if response.status != 503:
                        self.bad.append(f"GET {url}{path}: {response.status}")
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"no replica answered GET {path}")


@dataclass
class Timeline:
    failovers: list[float] = field(default_factory=list)  # leader kill -> a new leader
    handovers: list[float] = field(default_factory=list)  # SIGTERM -> a new leader
    events: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:6.1f} s  {text}")


async def kill_leader(fleet: processes.LocalFleet, timeline: Timeline) -> None:
    leader = await fleet.leader(timeout=60)
    timeline.note(f"kill -9 of the leader {leader.name}")
    started = time.monotonic()
    leader.process.send_signal(signal.SIGKILL)
    await leader.process.wait()
    successor = await fleet.leader(not_=leader.url, timeout=60)
    timeline.failovers.append(time.monotonic() - started)
    timeline.note(f"{successor.name} leads after {timeline.failovers[-1]:.2f} s")
    await fleet.restart_broker(fleet.brokers.index(leader))
    timeline.note(f"{leader.name} back")


async def kill_etcd_member(etcd: etcdcluster.EtcdCluster, timeline: Timeline) -> None:
    timeline.note("kill -9 of etcd member m1")
    etcd.kill(1)
    await asyncio.sleep(8)
    etcd.launch(1)
    await asyncio.to_thread(etcd.wait_healthy, [1])
    timeline.note("etcd member m1 back")


async def partition(proxy: tcpproxy.TcpProxy, timeline: Timeline) -> None:
    timeline.note(f"agent {CUT} cut off for {2 * GRACE:g} s")
    proxy.cut(mode="blackhole")
    await asyncio.sleep(2 * GRACE)
    proxy.heal()
    timeline.note(f"agent {CUT} healed")


async def rolling_restart(fleet: processes.LocalFleet, timeline: Timeline) -> None:
    """Each broker in turn, the leader last, as an upgrade goes: SIGTERM, then again on its
    port; the leader's successor timed from the signal."""
    leader = await fleet.leader(timeout=60)
    order = [i for i, b in enumerate(fleet.brokers) if b is not leader]
    order.append(fleet.brokers.index(leader))
    for index in order:
        broker = fleet.brokers[index]
        leading = await fleet.leader(timeout=60)
        if broker is leading:
            started = time.monotonic()
            stopping = asyncio.create_task(broker.stop())
            successor = await fleet.leader(not_=broker.url, timeout=60)
            timeline.handovers.append(time.monotonic() - started)
            await stopping
            timeline.note(f"rolling: {broker.name} handed over to {successor.name}")
        await fleet.restart_broker(index)
        timeline.note(f"rolling: {broker.name} restarted")


async def at(flood: Flood, share: float) -> None:
    while len(flood.accepted) < share * JOBS:
        await asyncio.sleep(0.05)


async def faults(
    fleet: processes.LocalFleet,
    etcd: etcdcluster.EtcdCluster,
    proxy: tcpproxy.TcpProxy,
    flood: Flood,
    timeline: Timeline,
) -> None:
    await at(flood, 0.30)
    await kill_leader(fleet, timeline)
    await at(flood, 0.45)
    await asyncio.gather(kill_etcd_member(etcd, timeline), partition(proxy, timeline))
    await at(flood, 0.70)
    await kill_leader(fleet, timeline)
    await at(flood, 0.85)
    await rolling_restart(fleet, timeline)


async def wait_all_final(flood: Flood, timeout: float) -> dict[str, str]:
    """Every job's state, once all are final (or the timeout passed).

    While jobs run it asks only whether any job is still live (one item of each live state),
    as a waiting client would: listing all 10,000 jobs every second would cost the brokers
    more than the jobs do on two cores. Then it lists every job, a page at a time."""
    deadline = time.monotonic() + timeout
    live = ("Queued", "Dispatched", "Running")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while True:
            while time.monotonic() < deadline:
                pages = [await flood.get(session, f"/v1/jobs?state={s}&limit=1") for s in live]
                if not any(page["items"] for page in pages):
                    break
                await asyncio.sleep(1.0)
            states: dict[str, str] = {}
            cont = ""
            while True:  # a page at a time, as any client lists
                page = await flood.get(
                    session, "/v1/jobs?limit=1000" + (f"&continue={cont}" if cont else "")
                )
                states.update({item["id"]: item["status"]["state"] for item in page["items"]})
                cont = page["metadata"].get("continue") or ""
                if not cont:
                    break
            if all(s in FINAL for s in states.values()) or time.monotonic() > deadline:
                return states
            await asyncio.sleep(1.0)


def starts_per_pod(paths: list[Path]) -> collections.Counter[tuple[str, int, str]]:
    """How many times each (job, attempt, pod) started, over every cluster's journal."""
    counts: collections.Counter[tuple[str, int, str]] = collections.Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["event"] == "start":
                counts[(entry["job"], int(entry["attempt"]), entry["pod"])] += 1
    return counts


def summary(values: list[float]) -> str:
    if not values:
        return "none"
    return f"p50 {statistics.median(values):.2f} s, max {max(values):.2f} s ({len(values)})"


async def test_ten_thousand_jobs_through_kills_partitions_and_a_rolling_restart(
    tmp_path: Path,
) -> None:
    try:
        etcd = await asyncio.to_thread(etcdcluster.EtcdCluster.start, 3)
    except (etcdserver.EtcdNotFoundError, etcdserver.EtcdStartError) as exc:
        pytest.fail(f"cannot start etcd: {exc}", pytrace=False)
    fleet = processes.LocalFleet(workdir=tmp_path, heartbeat=0.5, lost_after=GRACE)
    fleet.store = etcd.url
    proxy = await tcpproxy.TcpProxy(http_proxy=True).start()
    paths = [tmp_path / f"{c}.journal" for c in CLUSTERS]
    timeline = Timeline()
    try:
        fleet.write_tokens(tenants=["team-a"], clusters=CLUSTERS)
        await fleet.start_brokers(3)
        for cluster, path in zip(CLUSTERS, paths, strict=True):
            extra = ["--sim-journal", str(path)]
            if cluster == CUT:
                extra += ["--proxy", proxy.url]
            nodes = write_nodes(tmp_path / f"{cluster}.yaml", cluster)
            await fleet.start_agent(cluster, nodes, *extra)
        await fleet.wait_clusters_ready(CLUSTERS)
        assert proxy.accepted > 0, f"agent {CUT} did not connect through its proxy"

        flood = Flood(fleet.urls, fleet.tokens["team-a"])
        items = workload(JOBS, random.Random(7))
        timeline.note(f"flood of {JOBS} jobs from {WORKERS} clients")
        flooding = time.monotonic()
        chaos = asyncio.create_task(faults(fleet, etcd, proxy, flood, timeline))
        await flood.run(items)
        timeline.note(f"flood done: {len(flood.accepted)} accepted, {flood.retries} retries")
        await chaos
        left = FINISH_WITHIN - (time.monotonic() - flooding)
        states = await wait_all_final(flood, timeout=max(60.0, left))
        timeline.note("every job final" if all(s in FINAL for s in states.values()) else "")
        until = time.time()

        copies = journals.read(paths, until=until)
        overlaps = {j: s for j, s in journals.overlap_seconds(copies).items() if s > 0}
        doubled = {pod: n for pod, n in starts_per_pod(paths).items() if n > 1}
        by_state = collections.Counter(states.values())
        print("\n" + "\n".join(timeline.events))
        print(
            f"{JOBS} jobs: {dict(by_state)}; answers {dict(sorted(flood.answers.items()))}; "
            f"kill -9 failover {summary(timeline.failovers)}; "
            f"SIGTERM handover {summary(timeline.handovers)}; "
            f"overlap {sum(overlaps.values()):.3f} s; pods started twice {len(doubled)}"
        )

        ids = set(flood.accepted.values())
        assert len(flood.accepted) == JOBS
        assert not flood.mismatched, flood.mismatched[:5]
        assert len(ids) == JOBS, "two keys answered with one job"
        assert set(states) == ids, (
            f"lost {len(ids - set(states))}, unknown {len(set(states) - ids)}"
        )
        stuck = {j: s for j, s in states.items() if s not in FINAL}
        assert not stuck, f"{len(stuck)} not final: {list(stuck.items())[:5]}"
        assert by_state == {"Succeeded": JOBS}, by_state
        assert not doubled, list(doubled.items())[:5]
        assert not overlaps, list(overlaps.items())[:5]
        assert not flood.bad, flood.bad[:5]
        assert len(timeline.failovers) == 2 and len(timeline.handovers) == 1, timeline.events
    finally:
        await proxy.close()
        await fleet.stop()
        for service in [*fleet.brokers, *fleet.agents.values()]:
            if service.process.returncode not in (0, -15, -9, None):
                print(f"--- {service.name} exited {service.process.returncode}:\n{service.tail()}")
        with contextlib.suppress(Exception):
            etcd.cleanup()
