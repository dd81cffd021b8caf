"""The dashboards and alerts tell what happened: a real Prometheus scrapes a live broker and
three simulated agents every second, evaluating deploy/prometheus/alerts.yaml every second,
while a job fails, a job is preempted, an agent restarts and a cluster is lost. Then every
dashboard query and every rule expression goes through Prometheus's HTTP API, and the ones
that should show those events do:

- the preemption and the failed job show in increase() (their counters were at 0 before);
- the restart shows in the broker's per-cluster session counter (the agent's own starts again);
- the Lost cluster's GPUs count as unavailable, none as free, and strand nothing;
- the queue with nothing pending reads 0, not no series;
- no alert expression holds on this healthy fleet but the Lost cluster's disconnection.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import helpers, scraping
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100, L4, T4 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-L4", "Tesla-T4"
QUEUE = "default"
# train: one 8-GPU node, where a high-priority job preempts a low one; steady: its agent
# restarts; doomed: its agent stops for good and the cluster is Lost
CLUSTERS = {"train": (H100, 1, 8), "steady": (L4, 2, 4), "doomed": (T4, 2, 4)}
DASHBOARDS = scraping.REPO / "deploy" / "grafana" / "dashboards"
WINDOW = "5m"  # the whole test: increase() over it counts every event since Prometheus began


def write_cluster(work: Path, name: str) -> Path:
    model, nodes, gpus = CLUSTERS[name]
    pool = {
        "name": f"{name}-pool",
        "count": nodes,
        "gpu_product": model,
        "gpus_per_node": gpus,
        "gpu_memory_mib": 16384,
        "cpu": 128,
        "memory": "1000Gi",
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"cluster": name, "pools": [pool]}))
    return path


def write_queues(path: Path) -> Path:
    queue = {
        "name": QUEUE,
        "tenant": "team-a",
        "quotas": {H100: {"guaranteed": 8, "limit": 16}, "*": {"guaranteed": 8, "limit": 64}},
    }
    path.write_text(
        yaml.safe_dump(
            {
                "policy": {"minRunSeconds": 0, "reserveAfterSeconds": None},
                "queues": [queue],
                "priorityClasses": [
                    {"name": "low", "value": 0, "preempts": False},
                    {"name": "high", "value": 100, "preempts": True},
                ],
            }
        )
    )
    return path


def prometheus_config(
    fleet: processes.LocalFleet, agent_ports: dict[str, int], work: Path
) -> dict[str, Any]:
    """prometheus.yaml's two jobs aimed at this fleet, scraping and evaluating every second."""
    config = scraping.shipped_config()
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    broker, agent = jobs["gpufed-broker"], jobs["gpufed-agent"]
    broker["static_configs"] = [{"targets": [f"127.0.0.1:{fleet.port}"]}]
    broker["authorization"] = {"type": "Bearer", "credentials": fleet.tokens["metrics"]}
    agent["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in agent_ports.values()]}]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    scraping.write_rules(work, interval="1s")
    return config


async def start_agent(fleet: processes.LocalFleet, name: str, work: Path, port: int) -> None:
    await fleet.start_agent(name, write_cluster(work, name), "--metrics-port", str(port))


async def wait_health(fleet: processes.LocalFleet, cluster: str, health: str) -> None:
    deadline = time.monotonic() + 30
    async with fleet.client("admin") as admin:
        while True:
            items = {c["name"]: c for c in await admin.clusters()}
            if items.get(cluster, {}).get("health") == health:
                return
            assert time.monotonic() < deadline, f"{cluster} not {health}: {items.get(cluster)}"
            await asyncio.sleep(0.1)


async def play_events(
    fleet: processes.LocalFleet, prometheus: scraping.Prometheus, work: Path, ports: dict[str, int]
) -> dict[str, str]:
    """A failed job, a preemption, an agent restart, a lost cluster; the job ids."""
    async with fleet.client("team-a") as api:
        bug = make_job("bug", gpus=1).model(L4).duration(0.2).outcome("Failed:Error")
        bug_id = (await api.submit(json.dumps(bug.document())))["id"]
        await helpers.wait_for(api, bug_id, {"Failed"})

        victim = make_job("victim", gpus=8).model(H100).duration(600).priority_class("low")
        victim_id = (await api.submit(json.dumps(victim.preemption(1).document())))["id"]
        await helpers.wait_for(api, victim_id, {"Running"})
        urgent = make_job("urgent", gpus=8).model(H100).duration(0.5).priority_class("high")
        urgent_id = (await api.submit(json.dumps(urgent.document())))["id"]
        await helpers.wait_for(api, urgent_id, {"Succeeded"}, timeout=60)
        await helpers.wait_for(api, victim_id, {"Running"}, timeout=60)  # it ran again after

    # the broker's session counter of steady was scraped at 1: the restart makes it 2
    await prometheus.wait("gpufed_cluster_sessions_total", cluster="steady")
    await fleet.agents["steady"].stop()
    await start_agent(fleet, "steady", work, ports["steady"])
    await fleet.wait_clusters_ready(["steady"])

    await fleet.agents["doomed"].stop()
    await wait_health(fleet, "doomed", "Lost")
    return {"bug": bug_id, "victim": victim_id, "urgent": urgent_id}


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target, the pickers at All, the rate interval at
    the whole test."""
    found = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        stack = list(board["panels"])
        while stack:
            panel = stack.pop()
            stack.extend(panel.get("panels", []))
            for target in panel.get("targets", []):
                if target["datasource"]["type"] != "prometheus":
                    continue
                expr = target["expr"].replace("$__rate_interval", WINDOW)
                expr = re.sub(r"\$\{?(cluster|model|queue)\}?", ".*", expr)
                where = f"{path.name} panel {panel['id']} {target['refId']} {panel['title']!r}"
                found.append((where, expr))
    return found


def rule_exprs() -> dict[str, str]:
    rules = yaml.safe_load((scraping.PROMETHEUS_DIR / "alerts.yaml").read_text())
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in rules["groups"]
        for rule in group["rules"]
    }


async def test_dashboards_and_alerts_show_what_happened_to_the_fleet(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    scraping.find_prometheus()
    fleet.queues = write_queues(tmp_path / "queues.yaml")
    fleet.cycle_interval = 0.2
    fleet.write_tokens(tenants=["team-a"], clusters=list(CLUSTERS))
    await fleet.start_broker()
    ports = {name: processes.free_port() for name in CLUSTERS}
    config = prometheus_config(fleet, ports, tmp_path)
    async with scraping.run_prometheus(config, tmp_path) as prometheus:
        # scraped before anything happens: the counters of the declared queue, at 0
        await prometheus.wait(
            "gpufed_preemptions_total", queue=QUEUE, reason="Priority", timeout=30
        )
        for name in CLUSTERS:
            await start_agent(fleet, name, tmp_path, ports[name])
        await fleet.wait_clusters_ready(list(CLUSTERS))
        await play_events(fleet, prometheus, tmp_path, ports)
        await asyncio.sleep(3)  # a few scrapes and rule evaluations after the last event

        queries = dashboard_queries()
        results = {where: await prometheus.query(expr) for where, expr in queries}
        rules = {name: await prometheus.query(expr) for name, expr in rule_exprs().items()}
        health = [
            (r["name"], r["health"], r.get("lastError"))
            for g in (await prometheus.api("rules"))["groups"]
            for r in g["rules"]
        ]
        free = await prometheus.query('gpufed_cluster_gpus{state="free"}')
        doomed = await prometheus.query('gpufed_cluster_gpus{cluster="doomed"}')
        broker_sessions = await prometheus.query(
            f"sum by (cluster) (increase(gpufed_cluster_sessions_total[{WINDOW}]))"
        )
        agent_sessions = await prometheus.value(
            f"increase(gpufed_agent_sessions_total[{WINDOW}])", cluster="steady"
        )
        preempted = await prometheus.value(
            f"increase(gpufed_preemptions_total[{WINDOW}])", queue=QUEUE, reason="Priority"
        )
        failed = await prometheus.value(
            f"sum by (state) (increase(gpufed_jobs_finished_total[{WINDOW}]))", state="Failed"
        )
        pending = await prometheus.value("gpufed_pending_jobs", queue=QUEUE)

    # every dashboard query and rule evaluates on a real Prometheus (query() raises if not)
    assert len(results) > 40 and len(rules) > 20
    assert [h for h in health if h[1] != "ok"] == []

    # the preemption and the failed job, each the first of its series
    assert preempted is not None and preempted >= 0.9, preempted
    assert failed is not None and failed >= 0.9, failed
    by_reason = results[next(w for w in results if "Preemptions by queue and reason" in w)]
    assert sum(by_reason.values()) >= 0.9

    # the restart: the broker counts it; the agent's own counter started again at 1
    sessions = {dict(k)["cluster"]: v for k, v in broker_sessions.items()}
    assert sessions.get("steady", 0) >= 0.9, sessions
    assert sessions.get("train", 0) < 0.5, sessions  # one session, never replaced
    assert agent_sessions is not None and agent_sessions < 0.5
    opened = results[next(w for w in results if "Agent sessions opened" in w)]
    assert sum(v for k, v in opened.items() if dict(k)["cluster"] == "steady") >= 0.9

    # the Lost cluster: all its GPUs unavailable, none free, nothing stranded
    states = {dict(k)["state"]: v for k, v in doomed.items()}
    assert states["unavailable"] == 8 and states["free"] == 0, states
    free_panel = results[next(w for w in results if w.endswith("'Free GPUs'"))]
    ready_free = sum(v for k, v in free.items() if dict(k)["cluster"] != "doomed")
    assert list(free_panel.values()) == [ready_free]
    stranded = results[next(w for w in results if "Stranded GPUs by cluster" in w)]
    assert {dict(k)["cluster"]: v for k, v in stranded.items()}["doomed"] == 0

    # nothing pending any more: the queue's line is at 0, not gone
    assert pending == 0

    # alert expressions: only the Lost cluster's disconnection holds (its `for` runs)
    holding = {name for name, found in rules.items() if found and name.startswith("Gpufed")}
    assert holding == {"GpufedAgentDisconnected"}, {n: rules[n] for n in holding}
    [labels] = rules["GpufedAgentDisconnected"]
    assert dict(labels)["cluster"] == "doomed"
