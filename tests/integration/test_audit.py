"""The audit trail through a real broker on loopback: every mutating call (submit, batch,
cancel, queue put and delete), whatever its result, and every refused credential (no token,
an unknown or expired one, a role the route does not allow, an agent refused) leaves one
JSON line saying who, for which tenant and role, did what to what, with what result, the
trace and the address it came from; the cancel's event names who cancelled."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from broker.api import messages
from tests import guarded
from tests.builders import make_job
from tests.guarded import Start, bearer

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with guarded.brokers(tmp_path) as starting:
        yield starting


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_every_mutating_call_and_refused_credential_leaves_one_line(
    start: Start, tmp_path: Path
) -> None:
    log = tmp_path / "audit" / "audit.jsonl"
    broker = await start(audit_log=str(log))
    job = make_job(queue="a-q").document()
    queue = {"tenant": "team-a", "quotas": {"*": {"guaranteed": 0, "limit": 4}}}
    trace = {"traceparent": TRACEPARENT}
    calls: list[tuple[str | None, str, str, Any, int]] = [
        ("team-a", "POST", "/v1/jobs", job, 202),
        ("team-a", "POST", "/v1/jobs:batch", {"items": [{"job": job}, {"job": job}]}, 200),
        ("team-a", "POST", "/v1/jobs", {"kind": "nonsense"}, 422),
        ("a-viewer", "POST", "/v1/jobs", job, 403),
        (None, "POST", "/v1/jobs", job, 401),
        ("no-such-token", "GET", "/v1/jobs", None, 401),
        ("old-a", "GET", "/v1/jobs", None, 401),
        ("agent-c1", "GET", "/v1/jobs", None, 403),
        ("a-admin", "PUT", "/v1/queues/a-new", queue, 201),
        ("a-admin", "PUT", "/v1/queues/b-q", {**queue, "tenant": "team-b"}, 403),
        ("a-admin", "DELETE", "/v1/queues/a-new", None, 204),
        ("team-a", "GET", "/v1/agents/connect", None, 403),
    ]
    got: list[int] = []
    for token, method, path, body, expected in calls:
        status, answer, _ = await broker.call(token, method, path, body, headers=trace)
        assert status == expected, (method, path, answer)
        got.append(status)
    job_id = await broker.submit("team-a")
    status, cancelled, _ = await broker.call("admin", "DELETE", f"/v1/jobs/{job_id}")
    assert status == 202
    # reads with a valid token leave nothing
    assert (await broker.call("team-a", "GET", f"/v1/jobs/{job_id}"))[0] == 200
    assert (await broker.call(None, "GET", "/healthz"))[0] == 200
    # an agent saying hello as another cluster
    async with broker.session.ws_connect(
        broker.url + "/v1/agents/connect", headers=bearer("agent-c1")
    ) as ws:
        await ws.send_str(messages.encode(messages.Hello(cluster="c2")))
        closing = await ws.receive(timeout=5.0)
        assert closing.type == aiohttp.WSMsgType.CLOSE and closing.data == 4003

    for _ in range(100):  # the refused session's line comes once its handler returns
        if len(trail := lines(log)) == 15:
            break
        await asyncio.sleep(0.02)
    expected_actions = [
        "job.submit",
        "job.submit_batch",
        "job.submit",
        "job.submit",
        "job.submit",
        "authenticate",
        "authenticate",
        "authorize",
        "queue.put",
        "queue.put",
        "queue.delete",
        "agent.connect",
        "job.submit",
        "job.cancel",
        "agent.connect",
    ]
    assert [line["action"] for line in trail] == expected_actions
    assert [line["result"] for line in trail[: len(got)]] == got
    for line in trail:
        assert {"time", "who", "tenant", "role", "target", "trace_id", "source"} <= set(line)
        assert line["source"] == "127.0.0.1"
        for secret in ("a-admin", "agent-c1", "old-a", "no-such-token"):  # tokens
            assert secret not in json.dumps(line), line
    first, batch = trail[0], trail[1]
    assert first["who"] == "ci-a" and first["tenant"] == "team-a"
    assert first["role"] == "submitter" and first["trace_id"] == TRACE
    assert first["target"].startswith("job-")
    assert isinstance(batch["target"], list) and len(batch["target"]) == 2
    assert trail[2]["reason"].startswith("Invalid")
    assert trail[3]["role"] == "viewer" and trail[3]["result"] == 403
    assert trail[4]["who"] is None and trail[4]["role"] is None
    assert "expired" in trail[6]["reason"]
    assert trail[7]["role"] == "agent:c1"
    assert trail[8]["target"] == "a-new" and trail[8]["who"] == "lead-a"
    cancel = trail[13]
    assert cancel["target"] == job_id and cancel["who"] == "ops" and cancel["role"] == "admin"
    assert trail[14]["result"] == 4003 and trail[14]["role"] == "agent:c1"
    # the job's own history says who cancelled it
    event = cancelled["status"]["events"][-1]
    assert event["state"] == "Cancelled" and event["by"] == "admin (token 'ops')", event


async def test_audit_to_stdout(start: Start, capsys: pytest.CaptureFixture[str]) -> None:
    broker = await start(audit_log="-")
    await broker.submit("team-a")
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["action"], line["result"]) for line in out] == [("job.submit", 202)]


async def test_no_audit_log_no_lines(start: Start, tmp_path: Path) -> None:
    broker = await start()
    await broker.submit("team-a")
    assert not list(tmp_path.glob("**/*.jsonl"))
