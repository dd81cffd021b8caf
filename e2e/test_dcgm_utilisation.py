"""GPU utilisation from dcgm-exporter on a real agent's /metrics: a broker and an agent process
(`gpufed agent --dcgm-url`), the exporter an HTTP server of the test serving dcgm-exporter's
page for the node the job's pod landed on. Allocated versus utilised per queue appear on the
agent's `/metrics`; an exporter that is down or serves garbage changes nothing else."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from e2e.helpers import wait_for
from e2e.test_metrics import Scrape, scrape
from gpufed.local import processes
from tests import dcgmpages
from tests.builders import make_job

pytestmark = pytest.mark.e2e

CLUSTER = "inference"
L4 = "NVIDIA-L4"
L4_MIB = 23034


class Exporter:
    """Serves the page of `gpus` at /metrics; `garbage` makes it serve an HTML error page."""

    def __init__(self) -> None:
        self.gpus: list[dcgmpages.GPU] = []
        self.garbage = False

    async def metrics(self, request: web.Request) -> web.Response:
        del request
        if self.garbage:
            return web.Response(
                text="<html><h1>upstream gone</h1></html>", content_type="text/html"
            )
        return web.Response(text=dcgmpages.render(self.gpus), content_type="text/plain")


@pytest.fixture
async def exporter() -> AsyncIterator[tuple[Exporter, str]]:
    fake = Exporter()
    app = web.Application()
    app.router.add_get("/metrics", fake.metrics)
    server = TestServer(app)
    await server.start_server()
    try:
        yield fake, str(server.make_url("/metrics"))
    finally:
        await server.close()


async def start(fleet: processes.LocalFleet, *dcgm_urls: str) -> str:
    """A broker and the inference cluster's agent reading `dcgm_urls`; the agent's /metrics."""
    port = processes.free_port()
    fleet.write_tokens(tenants=["team-a"], clusters=[CLUSTER])
    await fleet.start_broker()
    flags = [f"--dcgm-url={url}" for url in dcgm_urls]
    await fleet.start_agent(
        CLUSTER,
        processes.config_dir() / "clusters" / f"{CLUSTER}.yaml",
        "--metrics-port",
        str(port),
        "--dcgm-interval",
        "0.1",
        *flags,
    )
    await fleet.wait_clusters_ready([CLUSTER])
    return f"http://127.0.0.1:{port}/metrics"


async def scrape_until(
    url: str, check: Callable[[Scrape], bool], *, timeout: float = 10.0
) -> Scrape:
    deadline = time.monotonic() + timeout
    page = await scrape(url)
    while not check(page) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        page = await scrape(url)
    return page


async def run_job(api: Any, gpus: int) -> dict[str, Any]:
    job = make_job("busy", gpus=gpus).model(L4).duration(60)
    job_id = (await api.submit(json.dumps(job.document())))["id"]
    return await wait_for(api, job_id, "Running")


async def test_the_agent_exports_allocated_and_utilised_gpus_per_queue(
    fleet: processes.LocalFleet, exporter: tuple[Exporter, str]
) -> None:
    fake, url = exporter
    metrics = await start(fleet, url)
    async with fleet.client("team-a") as api:
        job = await run_job(api, gpus=2)
        (pod,) = job["status"]["pods"]
        node, held = pod["node"], sorted(slot["index"] for slot in pod["gpus"])
        # the node's eight GPUs as its exporter prints them: the pod's two at 87% and 3%
        # (with its pod mapped to them, as dcgm-exporter's --kubernetes does), the rest idle
        # and no one's
        busy = {held[0]: 87.0, held[1]: 3.0}
        fake.gpus = [
            dcgmpages.GPU(
                node,
                index,
                util=busy.get(index, 0.0),
                fb_used=12000 if index in busy else 0,
                fb_total=L4_MIB,
                model=dcgmpages.L4,
                namespace="default" if index in busy else "",
                pod=pod["name"] if index in busy else "",
                container="main" if index in busy else "",
            )
            for index in range(8)
        ]

        page = await scrape_until(
            metrics, lambda p: p.value("gpufed_agent_queue_gpus_measured", queue="default") == 2
        )
        await api.cancel(job["id"])

    def value(name: str) -> float:
        return page.value(name, cluster=CLUSTER, queue="default")

    assert page.value("gpufed_agent_dcgm_up", cluster=CLUSTER) == 1
    assert page.value("gpufed_agent_dcgm_gpus", cluster=CLUSTER) == 8
    assert value("gpufed_agent_queue_gpus_allocated") == 2
    assert value("gpufed_agent_queue_gpus_measured") == 2
    assert value("gpufed_agent_queue_gpus_utilised") == pytest.approx(0.90)
    assert value("gpufed_agent_queue_gpus_idle") == 1  # the one at 3%
    assert value("gpufed_agent_queue_gpu_memory_used_bytes") == 2 * 12000 * (1 << 20)
    assert value("gpufed_agent_queue_gpu_memory_bytes") == 2 * L4_MIB * (1 << 20)
    assert page.types["gpufed_agent_queue_gpus_utilised"] == "gauge"


async def test_an_exporter_down_or_serving_garbage_never_stops_the_agent(
    fleet: processes.LocalFleet, exporter: tuple[Exporter, str]
) -> None:
    fake, url = exporter
    fake.garbage = True
    closed = f"http://127.0.0.1:{processes.free_port()}/metrics"  # nothing listens there
    metrics = await start(fleet, url, closed)
    async with fleet.client("team-a") as api:
        job = await run_job(api, gpus=1)  # offers, placement and binding go on

        page = await scrape_until(
            metrics, lambda p: p.value("gpufed_agent_dcgm_scrape_failures_total") >= 10
        )
        assert page.value("gpufed_agent_dcgm_up", cluster=CLUSTER) == 0
        assert page.value("gpufed_agent_dcgm_scrape_failures_total", cluster=CLUSTER) >= 10
        assert page.value("gpufed_agent_queue_gpus_allocated", queue="default") == 1
        assert page.value("gpufed_agent_queue_gpus_measured", queue="default") == 0
        async with aiohttp.ClientSession() as session:
            health_url = metrics.replace("/metrics", "/healthz")
            async with session.get(health_url) as response:
                assert (await response.json())["status"] == "ok"

        fake.garbage, fake.gpus = False, [dcgmpages.GPU(job["status"]["pods"][0]["node"], 0)]
        page = await scrape_until(
            metrics,
            lambda p: p.value("gpufed_agent_dcgm_gpus", cluster=CLUSTER) == 1,
        )
        assert page.value("gpufed_agent_dcgm_gpus", cluster=CLUSTER) == 1  # the other still down
        await api.cancel(job["id"])
        await wait_for(api, job["id"], "Cancelled")

    log = fleet.agents[CLUSTER].log.read_text()
    down = [line for line in log.splitlines() if "is down" in line]
    assert len(down) == 2, "one warning per endpoint going down, not one per fetch"
    assert any(url in line and "not dcgm-exporter's page" in line for line in down)
    assert any(closed in line for line in down)
    assert sum(f"dcgm-exporter {url} answers" in line for line in log.splitlines()) == 1
    assert fleet.agents[CLUSTER].alive
