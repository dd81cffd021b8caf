"""A real Prometheus scrapes a real broker with deploy/prometheus/prometheus.yaml's own broker
job (its bearer token of role metrics from config/tokens.yaml), and the same job without the
token is refused: /metrics needs a token, and the shipped scrape config sends the right one."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e import scraping
from gpufed.local import processes

pytestmark = pytest.mark.e2e


def scrape_config(broker: str, work: Path) -> dict[str, Any]:
    """prometheus.yaml with its broker job aimed at `broker`, scraping every second, and a copy
    of that job without its authorization."""
    config = scraping.shipped_config()
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "gpufed-broker"]
    job["static_configs"] = [{"targets": [broker]}]
    unauthorized = {k: v for k, v in job.items() if k != "authorization"}
    unauthorized["job_name"] = "gpufed-broker-no-token"
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"] = [job, unauthorized]
    scraping.write_rules(work)
    return config


async def targets(prometheus: scraping.Prometheus) -> dict[str, dict[str, Any]]:
    data = await prometheus.api("targets")
    return {t["labels"]["job"]: t for t in data["activeTargets"]}


async def test_prometheus_scrapes_the_broker_with_the_shipped_config_and_only_with_a_token(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    scraping.find_prometheus()
    shutil.copy(scraping.REPO / "config" / "tokens.yaml", tmp_path / "tokens.yaml")  # dev-metrics
    await fleet.start_broker()
    config = scrape_config(f"127.0.0.1:{fleet.port}", tmp_path)
    async with scraping.run_prometheus(config, tmp_path) as prometheus:
        deadline = time.monotonic() + 30
        found: dict[str, dict[str, Any]] = {}
        series: list[dict[str, Any]] = []
        while not (
            series
            and len(found) == 2
            and all(t["lastError"] or t["health"] == "up" for t in found.values())
        ):
            assert time.monotonic() < deadline, f"Prometheus scraped nothing in 30 s: {found}"
            await asyncio.sleep(0.2)
            with contextlib.suppress(aiohttp.ClientError, KeyError, ValueError):
                found = await targets(prometheus)
                series = (await prometheus.api("query", query="gpufed_broker_leader"))["result"]
    assert found["gpufed-broker"]["health"] == "up", found["gpufed-broker"]["lastError"]
    assert found["gpufed-broker-no-token"]["health"] == "down"
    assert "401" in found["gpufed-broker-no-token"]["lastError"]
    assert [(s["metric"]["job"], s["value"][1]) for s in series] == [("gpufed-broker", "1")]
