"""The web console in a real browser: a broker and two simulated agents as processes, Chromium
driven by Playwright (`tests/browser.py`: skips with one line where there is none, fails
where GPUFED_REQUIRE_BROWSER=1, as in CI).

Cluster h100 is config/clusters/h100.yaml (16 x 8 H100); cluster big has 1,000 nodes of 8
A100, for the GPU map. team-a signs in with its token (typed, Enter: the keyboard), sees its
jobs, sees one submitted meanwhile appear and start running without a reload, filters, opens
a job (timeline, pods with node and GPU indices, spec, trace link), sees why a job too large
waits, cancels one and sees it Cancelled, and looks at its queue's bars and the GPU maps
(1,000 rows drawn in well under a frame budget). Screenshots of every page go to the test's
folder (GPUFED_SCREENSHOTS=DIR to keep them elsewhere); the run prints where.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufed.client import BrokerClient
from gpufed.local import processes
from tests import browser
from tests.builders import make_job

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
BIG_NODES = 1000
TRACES = "http://grafana.example:3000/explore?traceId={trace_id}"
WAIT_MS = 15_000


def write_big_cluster(path: Path) -> Path:
    pool = {
        "name": "a100",
        "count": BIG_NODES,
        "gpu_product": A100,
        "gpus_per_node": 8,
        "gpu_memory_mib": 81920,
        "cpu": 240,
        "memory": "1900Gi",
        "nvlink_island": 8,
        "racks": 25,
    }
    path.write_text(yaml.safe_dump({"cluster": "big", "pools": [pool]}))
    return path


def write_queues(path: Path) -> Path:
    queues = [
        {
            "name": "research",
            "tenant": "team-a",
            "weight": 2,
            "quotas": {H100: {"guaranteed": 8, "limit": 64}, A100: {"guaranteed": 16}},
        },
        {"name": "prod", "tenant": "team-b", "quotas": {H100: {"guaranteed": 16}}},
    ]
    path.write_text(yaml.safe_dump({"queues": queues}))
    return path


async def until(page: Any, expression: str, *, timeout: float = WAIT_MS / 1000) -> None:
    """Until `expression` is true in the page (Playwright's wait_for_function evaluates a
    string with eval, which the console's Content-Security-Policy refuses, rightly)."""
    async with asyncio.timeout(timeout):
        while not await page.evaluate(expression):
            await asyncio.sleep(0.05)


async def submit(api: BrokerClient, name: str, *, gpus: int, model: str, **shape: Any) -> str:
    queue = shape.pop("queue", "research")
    builder = make_job(name, gpus=gpus, queue=queue).model(model).duration(shape.pop("s", 600))
    if "gang" in shape:
        builder = builder.gang(shape.pop("gang"))
    if "shared" in shape:
        builder = builder.shared(shape.pop("shared"))
    answer = await api.submit(json.dumps(builder.document()))
    return str(answer["id"])


async def test_the_console_shows_the_fleet_live(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    chromium = browser.skip_or_fail_without_browser()
    shots = browser.screenshots_dir(tmp_path, "test_console")
    fleet.queues = write_queues(tmp_path / "queues.yaml")
    fleet.broker_args = ["--trace-url-template", TRACES]
    fleet.write_tokens(tenants=["team-a", "team-b"], clusters=["h100", "big"])
    await fleet.start_broker()
    await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.start_agent("big", write_big_cluster(tmp_path / "big.yaml"))
    await fleet.wait_clusters_ready(["h100", "big"])

    async with fleet.client("team-a") as team_a, fleet.client("team-b") as team_b:
        train = await submit(team_a, "train-llm", gpus=8, model=H100, gang=2)
        await submit(team_a, "sweep-lr", gpus=2, model=A100)
        await submit(team_a, "notebook", gpus=1, model=H100, shared=500)
        await submit(team_b, "serve", gpus=4, model=H100, queue="prod")

        async with browser.chromium(chromium) as chrome:
            page = await chrome.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(WAIT_MS)
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))

            def console_message(message: Any) -> None:
                # Chromium logs every refused request; the wrong token's 401 is expected
                if message.type == "error" and "status of 401" not in message.text:
                    problems.append(f"console: {message.text} ({message.location.get('url')})")

            page.on("console", console_message)
            try:
                # ---- sign in, by keyboard: the token field has the focus and a label ----------
                await page.goto(f"{fleet.url}/ui/")
                token_field = page.get_by_label("Access token")
                await token_field.wait_for()
                assert await page.evaluate("document.activeElement.id") == "token"
                await page.keyboard.press("Shift+Tab")  # the skip link comes first
                assert await page.evaluate("document.activeElement.id") == "skip"
                await page.keyboard.press("Tab")
                assert await page.evaluate("document.activeElement.id") == "token"
                await page.keyboard.type("not-a-token")
                await page.keyboard.press("Enter")
                await page.get_by_role("alert").filter(has_text="not known").wait_for()
                await token_field.fill(fleet.tokens["team-a"])
                await page.keyboard.press("Enter")
                await page.get_by_role("heading", name="Jobs").wait_for()
                assert await page.evaluate("document.activeElement.tagName") == "H1"
                assert (
                    await page.evaluate("sessionStorage.getItem('gpufed.token')")
                    == (fleet.tokens["team-a"])
                )
                assert fleet.tokens["team-a"] not in page.url
                await page.locator("#live.on").wait_for()
                rows = page.locator("#jobs-body tr")
                await page.locator("#jobs-body tr", has_text="notebook").wait_for()
                assert await rows.count() == 3  # team-a's own; team-b's serve is not shown

                # ---- a job submitted now appears, then runs, without a reload -----------------
                await page.evaluate("window.__stayed = true")
                fresh = await submit(team_a, "live-demo", gpus=2, model=H100, s=600)
                await page.locator(f'#jobs-body tr[data-job-id="{fresh}"]').wait_for()
                await page.locator(
                    f'#jobs-body tr[data-job-id="{fresh}"][data-state="Running"]'
                ).wait_for()
                first = page.locator("#jobs-body tr").first
                assert await first.get_attribute("data-job-id") == fresh  # newest first
                assert await page.evaluate("window.__stayed === true")  # the same page, no reload
                await page.locator(
                    f'#jobs-body tr[data-job-id="{train}"][data-state="Running"]'
                ).wait_for()
                await page.screenshot(path=shots / "1-jobs.png", full_page=True)

                # ---- filters and sorting -----------------------------------------------------
                await page.get_by_label("Search name or id").fill("SWEEP")  # on the broker
                await until(page, "document.querySelectorAll('#jobs-body tr').length === 1")
                await page.get_by_label("Search name or id").fill("")
                await page.get_by_label("Order").select_option("oldest")
                await until(
                    page,
                    "document.querySelector('#jobs-body tr:last-child')?.dataset.jobId"
                    f" === {fresh!r} && document.querySelectorAll('#jobs-body tr').length === 4",
                )
                await page.get_by_label("Order").select_option("newest")
                await until(
                    page,
                    f"document.querySelector('#jobs-body tr').dataset.jobId === {fresh!r}",
                )
                await page.get_by_label("State").select_option("Running")
                await until(
                    page,
                    "[...document.querySelectorAll('#jobs-body tr')]"
                    ".filter(r => r.dataset.state === 'Running').length === 4",
                )
                await page.get_by_label("State").select_option("")
                await page.get_by_label("Cluster").select_option("big")
                await until(
                    page,
                    "[...document.querySelectorAll('#jobs-body tr')].length === 1 && "
                    "document.querySelector('#jobs-body tr').textContent.includes('sweep-lr')",
                )
                await page.screenshot(path=shots / "2-jobs-filtered.png", full_page=True)
                await page.get_by_label("Cluster").select_option("")
                await page.locator("#jobs-body tr", has_text="train-llm").wait_for()
                await page.get_by_role("button", name="GPUs").click()
                await page.get_by_role("button", name="GPUs").click()  # descending
                assert await page.locator("th[aria-sort=descending]").text_content() == "GPUs"
                assert "train-llm" in (
                    await page.locator("#jobs-body tr").first.text_content() or ""
                )

                # ---- a job: timeline, pods, spec, trace link --------------------------------
                await page.get_by_role("link", name="train-llm").click()
                await page.get_by_role("heading", name="Job train-llm").wait_for()
                timeline = page.locator("#timeline li")
                await page.locator('#timeline li[data-state="Running"]').wait_for()
                states = [await item.get_attribute("data-state") for item in await timeline.all()]
                assert states[:3] == ["Queued", "Dispatched", "Running"]
                pods = page.locator("#pods tbody tr")
                assert await pods.count() == 2
                pod_text = await pods.first.text_content() or ""
                assert (
                    re.search(r"hgx-h100-\d{3}", pod_text) and "0, 1, 2, 3, 4, 5, 6, 7" in pod_text
                )
                spec = await page.locator("#spec").text_content() or ""
                assert "kind: GPUJob" in spec and "queue: research" in spec
                record = await team_a.get(train)
                link = page.locator("#trace-link")
                assert await link.get_attribute("href") == TRACES.replace(
                    "{trace_id}", record["traceId"]
                )
                await page.screenshot(path=shots / "3-job.png", full_page=True)

                # ---- a job that cannot fit: why, per cluster --------------------------------
                huge = await submit(team_a, "too-big", gpus=8, model=A100, gang=1001)
                await page.goto(f"{fleet.url}/ui/#/jobs/{huge}")
                await page.locator("#why").wait_for()
                await page.locator("#why tbody tr", has_text="Capacity").wait_for()
                why_rows = await page.locator("#why tbody tr").all_text_contents()
                assert any(r.startswith("big") and "Capacity" in r for r in why_rows), why_rows
                assert any(r.startswith("h100") and "GPUModel" in r for r in why_rows), why_rows
                place = page.locator("#why #position", has_text="Position in its queue")
                await place.wait_for()  # its place in line, and why it has no ETA
                assert "Estimated start" in (await place.text_content() or "")
                await page.screenshot(path=shots / "4-job-why.png", full_page=True)

                # ---- cancel one's own job, by keyboard, and see it Cancelled live -----------
                await page.goto(f"{fleet.url}/ui/#/jobs/{fresh}")
                await page.get_by_role("heading", name="Job live-demo").wait_for()
                await page.get_by_role("button", name="Cancel job…").focus()
                await page.keyboard.press("Enter")
                assert await page.evaluate("document.activeElement.id") == "cancel-yes"
                await page.keyboard.press("Enter")
                await page.locator("#job .state-Cancelled").first.wait_for()
                await page.locator('#timeline li[data-state="Cancelled"]').wait_for()
                assert await page.get_by_role("button", name="Cancel job…").count() == 0
                assert (await team_a.get(fresh))["status"]["state"] == "Cancelled"
                await page.screenshot(path=shots / "5-job-cancelled.png", full_page=True)

                # ---- queues: bars per model ------------------------------------------------
                await page.get_by_role("link", name="Queues").click()
                card = page.locator('section[data-queue="research"]')
                await card.wait_for()
                await card.locator(f'.bar-row[data-model="{H100}"]').wait_for()
                words = await card.locator(
                    f'.bar-row[data-model="{H100}"] .bar-text'
                ).text_content()
                assert words and "within the guarantee of 8" in words and "borrowed" in words
                assert await page.locator('section[data-queue="prod"]').count() == 0  # team-b's
                await page.screenshot(path=shots / "6-queues.png", full_page=True)

                # ---- clusters and the GPU maps ---------------------------------------------
                await page.get_by_role("link", name="Clusters").click()
                await page.locator('#clusters-body tr[data-cluster="big"] .health-Ready').wait_for()
                await page.get_by_label("Cluster").select_option("big")
                await until(
                    page, f"document.querySelector('#gpumap').dataset.rows === '{BIG_NODES}'"
                )
                draw_ms = float(await page.locator("#gpumap").get_attribute("data-draw-ms") or "0")
                print(f"\nthe GPU map of {BIG_NODES} nodes drawn in {draw_ms} ms")
                assert draw_ms < 100, f"drawing {BIG_NODES} nodes took {draw_ms} ms"
                label = await page.locator("#gpumap").get_attribute("aria-label") or ""
                assert f"{BIG_NODES} nodes" in label and "2 whole" in label
                await page.screenshot(path=shots / "7-clusters-big.png", full_page=True)
                await page.get_by_label("Cluster").select_option("h100")
                await until(page, "document.querySelector('#gpumap').dataset.rows === '16'")
                await page.locator("#gpumap").focus()
                await page.keyboard.press("Home")
                info = page.locator("#map-node")
                await info.filter(has_text="hgx-h100-").wait_for()
                assert "whole" in (await info.text_content() or "")
                await page.screenshot(path=shots / "8-clusters-h100.png", full_page=True)
                assert problems == []
            except BaseException:  # what the page showed when it failed
                await page.screenshot(path=shots / "failure.png", full_page=True)
                raise
    print(f"\nscreenshots: {shots}")
