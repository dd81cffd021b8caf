"""The API fuzzed from its own `/openapi.json` (schemathesis) with a tenant's token, against
a real broker with a real agent: no answer is a 5xx, every status is one the OpenAPI
declares, and another tenant's canary job is dispatched right after."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from e2e.helpers import wait_for
from gpufed.local import processes
from tests.builders import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
MAX_SECONDS = 90  # the fuzzing's own time budget (the bound: two minutes)


async def test_fuzzing_the_api_finds_no_server_error_and_the_canary_still_runs(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    if not SCHEMATHESIS.exists() and shutil.which("schemathesis") is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[test]'", pytrace=False)
    await fleet.start_simulated(["h100"], tenants=["team-a", "team-b"])
    report = tmp_path / "fuzz.json"
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        str(SCHEMATHESIS), "run", f"{fleet.url}/openapi.json",
        "--header", f"Authorization: Bearer {fleet.tokens['team-b']}",
        "--checks", "not_a_server_error,status_code_conformance",
        "--max-time", str(MAX_SECONDS), "--max-examples", "150", "--seed", "7",
        # one worker: hypothesis parses lambdas' source with `ast`, and CPython 3.11 before
        # 3.11.8 can raise "AST constructor recursion depth mismatch" when two threads do
        # that at once (python/cpython#106905); CI's 3.11.7 did, once
        "--phases", "examples,coverage,fuzzing", "--workers", "1",
        "--report", "ndjson", "--report-ndjson-path", str(report),
        "--suppress-health-check", "all", "--no-color",
        # the job change stream never ends by itself (tests/integration/test_console_api.py)
        "--exclude-path", "/v1/events",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,  # its cache (.schemathesis/) stays out of the checkout
    )  # fmt: skip
    out, _ = await process.communicate()
    took = time.monotonic() - started
    text = out.decode(errors="replace")
    summary = text[-3000:]
    print(f"\nschemathesis: exit {process.returncode} in {took:.0f}s\n{summary}")
    assert process.returncode == 0, summary
    async with fleet.client("team-a") as api:
        canary = await api.submit(json.dumps(make_job("canary", gpus=1).duration(0.2).document()))
        await wait_for(api, canary["id"], {"Dispatched", "Running", "Succeeded"}, timeout=10)
