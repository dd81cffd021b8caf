"""A real Prometheus for e2e tests: Debian's `prometheus` on loopback, with a configuration
written by the test, queried over its HTTP API.

Where no `prometheus` is installed the tests skip with one line saying what to install,
except where `GPUFED_REQUIRE_PROMETHEUS=1` (CI): there it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gpufed.local import processes

REQUIRE_VARIABLE = "GPUFED_REQUIRE_PROMETHEUS"
HOW_TO_GET_ONE = "prometheus is not installed (Debian: apt-get install prometheus)"
REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"


def find_prometheus() -> str:
    """The `prometheus` binary; skips the test (fails it where required) without one."""
    found = shutil.which("prometheus")
    if found is not None:
        return found
    if os.environ.get(REQUIRE_VARIABLE, "") not in ("", "0"):
        pytest.fail(f"{HOW_TO_GET_ONE}, and {REQUIRE_VARIABLE} is set")
    pytest.skip(HOW_TO_GET_ONE)


def shipped_config() -> dict[str, Any]:
    """deploy/prometheus/prometheus.yaml, as a dict to adapt."""
    config: dict[str, Any] = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yaml").read_text())
    return config


def write_rules(work: Path, *, interval: str | None = None) -> Path:
    """A copy of alerts.yaml in `work`, every group evaluated each `interval` if given."""
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yaml").read_text())
    if interval is not None:
        for group in rules["groups"]:
            group["interval"] = interval
    path = work / "alerts.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


@dataclass
class Prometheus:
    url: str
    http: aiohttp.ClientSession

    async def api(self, path: str, **params: str) -> Any:
        """`/api/v1/<path>`'s data; a query Prometheus refuses raises with its error."""
        async with self.http.get(f"{self.url}/api/v1/{path}", params=params) as answer:
            body = await answer.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('error')}")
        return body["data"]

    async def query(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query's result: each series' labels (sorted pairs) -> value."""
        data = await self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return {(): float(data["result"][1])}
        return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in data["result"]}

    async def value(self, expr: str, **labels: str) -> float | None:
        """The value of the one series of `expr` whose labels include `labels` (None: none)."""
        found = [
            v for k, v in (await self.query(expr)).items() if labels.items() <= dict(k).items()
        ]
        assert len(found) <= 1, f"{expr} {labels}: {found}"
        return found[0] if found else None

    async def wait(self, expr: str, *, timeout: float = 30.0, **labels: str) -> float:
        """Poll until `expr` has its series with `labels` (what a scrape brought in)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                value = await self.value(expr, **labels)
                if value is not None:
                    return value
            assert time.monotonic() < deadline, f"no {expr} {labels} after {timeout} s"
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def run_prometheus(config: dict[str, Any], work: Path) -> AsyncIterator[Prometheus]:
    """Prometheus on `config` (written to `work`, beside the rules it names), until the
    context ends; yields once its API answers."""
    binary = find_prometheus()
    path = work / "prometheus.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = processes.free_port()
    log = (work / "prometheus.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        binary,
        f"--config.file={path}",
        f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 30
            while True:
                assert process.returncode is None, (work / "prometheus.log").read_text()[-2000:]
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/-/ready") as answer:
                        if answer.status == 200:
                            break
                assert time.monotonic() < deadline, "Prometheus not ready in 30 s"
                await asyncio.sleep(0.1)
            yield Prometheus(url, http)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()
        log.close()
