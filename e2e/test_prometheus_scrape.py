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
import yaml

from gpufed.local import processes

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"


def scrape_config(broker: str, work: Path) -> Path:
    """prometheus.yaml with its broker job aimed at `broker`, scraping every second, and a copy
    of that job without its authorization."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yaml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "gpufed-broker"]
    job["static_configs"] = [{"targets": [broker]}]
    unauthorized = {k: v for k, v in job.items() if k != "authorization"}
    unauthorized["job_name"] = "gpufed-broker-no-token"
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"] = [job, unauthorized]
    shutil.copy(PROMETHEUS_DIR / "alerts.yaml", work / "alerts.yaml")
    path = work / "prometheus.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def targets(http: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with http.get(f"{url}/api/v1/targets") as answer:
        body = await answer.json()
    return {t["labels"]["job"]: t for t in body["data"]["activeTargets"]}


async def test_prometheus_scrapes_the_broker_with_the_shipped_config_and_only_with_a_token(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    shutil.copy(REPO / "config" / "tokens.yaml", tmp_path / "tokens.yaml")  # dev-metrics
    await fleet.start_broker()
    port = processes.free_port()
    config = scrape_config(f"127.0.0.1:{fleet.port}", tmp_path)
    process = await asyncio.create_subprocess_exec(
        prometheus,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
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
                    found = await targets(http, url)
                    query = f"{url}/api/v1/query?query=gpufed_broker_leader"
                    async with http.get(query) as answer:
                        series = (await answer.json())["data"]["result"]
    finally:
        process.terminate()
        await process.wait()
    assert found["gpufed-broker"]["health"] == "up", found["gpufed-broker"]["lastError"]
    assert found["gpufed-broker-no-token"]["health"] == "down"
    assert "401" in found["gpufed-broker-no-token"]["lastError"]
    assert [(s["metric"]["job"], s["value"][1]) for s in series] == [("gpufed-broker", "1")]
