"""The metrics a platform engineer graphs and alerts on move when a job runs: a real broker and
agent, scraped over HTTP before and after a job runs to completion (and while another waits).

Every family the dashboards and alerts rely on is checked: counters increased, histograms'
`_count` increased, gauges carry the label sets the dashboards group by.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client import parser

from broker.telemetry import metrics
from gpufed.local import processes
from member_agent import telemetry
from tests.builders import make_job

pytestmark = pytest.mark.e2e

L4 = "NVIDIA-L4"
CLUSTER = "inference"
QUEUE = "default"


@dataclass
class Scrape:
    """One `/metrics` page: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]]
    types: dict[str, str]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels` (0 if none)."""
        return sum(
            value for have, value in self.samples.get(name, []) if labels.items() <= have.items()
        )

    def label_sets(self, name: str, *keys: str) -> set[tuple[str, ...]]:
        return {tuple(have[k] for k in keys) for have, _ in self.samples.get(name, [])}


async def scrape(url: str, *, token: str | None = None) -> Scrape:
    """`url` scraped as Prometheus does, with the bearer token `token` (the broker's)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as session, session.get(url) as response:
        assert response.status == 200, url
        assert response.content_type == "text/plain"
        text = await response.text()
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    types = {}
    for family in parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), sample.value))
    return Scrape(dict(samples), types)


async def wait_state(api: Any, job_id: str, states: set[str], *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = await api.get(job_id)
        if job["status"]["state"] in states:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id} not in {states} after {timeout}s")


async def wait_for(
    check: Any, url: str, *, token: str | None = None, timeout: float = 10.0
) -> Scrape:
    """Scrape `url` until `check(scrape)` holds (gauges follow the agent's reports)."""
    deadline = time.monotonic() + timeout
    while True:
        page = await scrape(url, token=token)
        if check(page) or time.monotonic() > deadline:
            return page
        await asyncio.sleep(0.1)


def session_ready(page: Scrape) -> bool:
    return page.value("gpufed_agent_session_state", cluster=CLUSTER, state="Ready") == 1


# (side, sample, labels it must carry, at least how much it moves during the test)
COUNTERS: list[tuple[str, str, dict[str, str], int]] = [
    ("broker", "gpufed_jobs_submitted_total", {"queue": QUEUE}, 2),
    ("broker", "gpufed_jobs_finished_total", {"state": "Succeeded"}, 1),
    ("broker", "gpufed_placements_total", {"result": "accepted"}, 1),
    ("broker", "gpufed_scheduling_cycle_duration_seconds_count", {}, 1),
    ("broker", "gpufed_scheduling_decision_duration_seconds_count", {}, 1),
    ("broker", "gpufed_job_submit_to_dispatch_seconds_count", {}, 1),
    ("broker", "gpufed_agent_summary_duration_seconds_count", {}, 1),
    ("broker", "gpufed_job_submit_to_running_seconds_count", {}, 1),
    ("broker", "gpufed_store_operation_duration_seconds_count", {"op": "create"}, 2),
    ("broker", "gpufed_store_operation_duration_seconds_count", {"op": "update"}, 1),
    ("agent", "gpufed_agent_offers_total", {"result": "accepted"}, 1),
    ("agent", "gpufed_agent_placement_duration_seconds_count", {}, 1),
    ("agent", "gpufed_agent_summaries_total", {}, 1),
]


async def run_job_and_scrape(fleet: processes.LocalFleet) -> dict[str, Any]:
    metrics_port = processes.free_port()
    fleet.write_tokens(tenants=["team-a"], clusters=[CLUSTER])
    await fleet.start_broker()
    clusters = processes.config_dir() / "clusters"
    await fleet.start_agent(
        CLUSTER, clusters / f"{CLUSTER}.yaml", "--metrics-port", str(metrics_port)
    )
    await fleet.wait_clusters_ready([CLUSTER])
    broker_url = f"{fleet.url}/metrics"
    scraper = fleet.tokens["metrics"]  # the broker's /metrics needs a token (role metrics)
    agent_url = f"http://127.0.0.1:{metrics_port}"
    before = {
        "broker": await wait_for(session_ready, broker_url, token=scraper),
        "agent": await scrape(f"{agent_url}/metrics"),
    }
    async with fleet.client("team-a") as api:
        waiting = make_job("waits", gpus=1).model("NVIDIA-B200")  # no such GPU in the fleet
        runs = make_job("runs", gpus=1).model(L4).duration(0.3)
        waiting_id = (await api.submit(json.dumps(waiting.document())))["id"]
        runs_id = (await api.submit(json.dumps(runs.document())))["id"]
        await wait_state(api, runs_id, {"Succeeded", "Failed", "Cancelled"})
        job = await api.get(runs_id)
        assert job["status"]["state"] == "Succeeded"
        await asyncio.sleep(0.2)  # the waiting job ages; a cycle exports it
        after = {
            "broker": await wait_for(
                lambda p: p.value("gpufed_placements_total", result="accepted") >= 1,
                broker_url,
                token=scraper,
            ),
            "agent": await wait_for(
                lambda p: p.value("gpufed_agent_placement_duration_seconds_count") >= 1,
                f"{agent_url}/metrics",
            ),
        }
        async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/healthz") as r:
            health = await r.json()
        await api.cancel(waiting_id)
    async with fleet.client("admin") as admin:
        totals = {
            m["model"]: m["total"]
            for c in await admin.clusters()
            if c["name"] == CLUSTER
            for m in c["models"]
        }
    return {"before": before, "after": after, "health": health, "totals": totals}


async def test_a_job_moves_every_broker_and_agent_metric(fleet: processes.LocalFleet) -> None:
    seen = await run_job_and_scrape(fleet)
    before, after = seen["before"], seen["after"]

    moves = {
        (name, *labels.values()): after[side].value(name, **labels)
        - before[side].value(name, **labels)
        for side, name, labels, _ in COUNTERS
    }
    expected = {(name, *labels.values()): least for _, name, labels, least in COUNTERS}
    assert {k: v for k, v in moves.items() if v < expected[k]} == {}

    broker, agent = after["broker"], after["agent"]
    assert broker.types["gpufed_scheduling_decision_duration_seconds"] == "histogram"
    buckets = broker.label_sets("gpufed_scheduling_decision_duration_seconds_bucket", "le")
    assert ("0.002",) in buckets, "the 2 ms decision target is a bucket boundary"
    # pending jobs by queue, and how long the oldest has waited
    assert broker.value("gpufed_pending_jobs", queue=QUEUE) == 1
    assert broker.value("gpufed_pending_oldest_age_seconds", queue=QUEUE) > 0.1
    # GPUs per cluster and model by state: every model has every state, summing to its total
    states = broker.label_sets("gpufed_cluster_gpus", "cluster", "model", "state")
    assert states == {(CLUSTER, m, s) for m in seen["totals"] for s in metrics.GPU_STATES}
    for model, total in seen["totals"].items():
        assert broker.value("gpufed_cluster_gpus", cluster=CLUSTER, model=model) == total
    assert broker.label_sets("gpufed_cluster_fragmentation_gpus", "cluster") == {(CLUSTER,)}
    # agent session state, from both ends
    assert broker.label_sets("gpufed_agent_session_state", "state") == {
        (s,) for s in metrics.SESSION_STATES
    }
    assert broker.value("gpufed_agent_session_state", cluster=CLUSTER, state="Ready") == 1
    assert broker.value("gpufed_agent_session_state", cluster=CLUSTER) == 1
    assert broker.value("gpufed_agent_session_connected", cluster=CLUSTER) == 1
    assert agent.value("gpufed_agent_session_connected", cluster=CLUSTER) == 1
    assert agent.value("gpufed_agent_sessions_total", cluster=CLUSTER) == 1
    assert broker.value("gpufed_cluster_sessions_total", cluster=CLUSTER) == 1
    # every value a counter can take is there from the start, at 0 until it happens
    assert broker.label_sets("gpufed_placements_total", "cluster", "result") == {
        (CLUSTER, r) for r in metrics.PLACEMENT_RESULTS
    }
    assert broker.label_sets("gpufed_jobs_finished_total", "queue", "state") == {
        (QUEUE, s) for s in metrics.FINISHED_STATES
    }
    assert broker.value("gpufed_jobs_finished_total", state="Failed") == 0
    assert broker.label_sets("gpufed_preemptions_total", "queue", "reason") == {
        (QUEUE, r) for r in metrics.PREEMPTION_REASONS
    }
    assert agent.label_sets("gpufed_agent_offers_total", "result") == {
        (r,) for r in telemetry.OFFER_RESULTS
    }
    assert agent.label_sets("gpufed_agent_pods", "phase") == {(p,) for p in telemetry.POD_PHASES}
    assert agent.label_sets("gpufed_agent_jobs", "state") == {(s,) for s in telemetry.JOB_STATES}
    assert seen["health"] == {"status": "ok", "connected": True}
    # every agent family carries the cluster label
    for name, samples in agent.samples.items():
        assert all(labels.get("cluster") == CLUSTER for labels, _ in samples), name
