"""Tokens with a life and roles per route, through a real broker app on loopback: expiry, the
tokens file followed without a restart (a change, a rename, a Secret's symlink swap, SIGHUP),
a broken file that changes nothing, what each role may call, tenants reading their own queues,
`gpufed token create` pasted into the file, and /metrics behind a token."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app
from broker.api import messages
from broker.http import tokens
from gpufed import cli
from tests.builders import make_job

BASE: list[dict[str, Any]] = [
    {"token": "team-a", "tenant": "team-a"},  # no role: submitter, as before roles
    {"token": "team-b", "tenant": "team-b"},
    {"token": "a-admin", "tenant": "team-a", "role": "tenant-admin"},
    {"token": "a-viewer", "tenant": "team-a", "role": "viewer"},
    {"token": "fleet-viewer", "role": "viewer"},
    {"token": "admin", "admin": True},
    {"token": "scraper", "role": "metrics"},
    {"token": "agent-c1", "agent": "c1"},
]
QUEUES = {
    "queues": [
        {"name": "a-q", "tenant": "team-a", "quotas": {"*": {"guaranteed": 0, "limit": 8}}},
        {"name": "b-q", "tenant": "team-b", "quotas": {"*": {"guaranteed": 0, "limit": 8}}},
    ],
}
SECRET = "s3cret-in-a-broken-file"
REPO = Path(__file__).resolve().parents[2]


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass
class Broker:
    client: TestClient[Any, Any]
    tokens_file: Path

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    def write(self, entries: list[dict[str, Any]]) -> None:
        self.tokens_file.write_text(yaml.safe_dump({"tokens": entries}))

    async def call(
        self, token: str | None, method: str, path: str, body: Any = None
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body)
        async with self.client.request(method, path, data=data, headers=bearer(token)) as answer:
            text = await answer.text()
            try:
                return answer.status, json.loads(text)
            except ValueError:
                return answer.status, text

    async def status(self, token: str | None, path: str = "/v1/jobs") -> int:
        return (await self.call(token, "GET", path))[0]

    async def submit(self, token: str, queue: str = "a-q") -> str:
        status, body = await self.call(token, "POST", "/v1/jobs", make_job(queue=queue).document())
        assert status == 202, body
        return str(body["id"])


Start = Callable[..., Awaitable[Broker]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    clients: list[TestClient[Any, Any]] = []

    async def _start(
        entries: list[dict[str, Any]] = BASE, *, tokens_file: Path | None = None, **settings: Any
    ) -> Broker:
        path = tokens_file or tmp_path / "tokens.yaml"
        if tokens_file is None:
            path.write_text(yaml.safe_dump({"tokens": entries}))
        (tmp_path / "queues.yaml").write_text(yaml.safe_dump(QUEUES))
        defaults: dict[str, Any] = {"tokens_poll_seconds": 0.1, "queue_mode": "open"}
        app = broker_app.create_app(
            broker_app.BrokerSettings(
                store=f"sqlite:///{tmp_path / 'broker.db'}",
                tokens_file=path,
                queues_file=tmp_path / "queues.yaml",
                **{**defaults, **settings},
            )
        )
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return Broker(client, path)

    yield _start
    for client in clients:
        await client.close()


async def within(seconds: float, check: Callable[[], Awaitable[bool]]) -> float:
    """How long until `check()` holds; fails past `seconds`."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


# ---- roles per route -----------------------------------------------------------------------


async def test_each_route_lets_in_only_the_roles_it_states(start: Start) -> None:
    broker = await start()
    a_job = await broker.submit("team-a")
    b_job = await broker.submit("team-b", "b-q")
    new_queue = {"tenant": "team-a", "quotas": {"*": {"guaranteed": 0, "limit": 4}}}
    b_queue = {"tenant": "team-b", "quotas": {"*": {"guaranteed": 0, "limit": 4}}}
    job = make_job(queue="a-q").document()
    cases: list[tuple[str | None, str, str, Any, int]] = [
        # a viewer reads and does nothing else
        ("a-viewer", "GET", f"/v1/jobs/{a_job}", None, 200),
        ("a-viewer", "GET", f"/v1/jobs/{b_job}", None, 404),
        ("a-viewer", "POST", "/v1/jobs", job, 403),
        ("a-viewer", "DELETE", f"/v1/jobs/{a_job}", None, 403),
        ("a-viewer", "PUT", "/v1/queues/a-new", new_queue, 403),
        ("fleet-viewer", "GET", f"/v1/jobs/{b_job}", None, 200),
        ("fleet-viewer", "POST", "/v1/jobs", job, 403),
        ("fleet-viewer", "DELETE", f"/v1/jobs/{b_job}", None, 403),
        # a submitter submits and cancels its tenant's jobs; no queue changes
        ("team-a", "PUT", "/v1/queues/a-new", new_queue, 403),
        ("team-a", "DELETE", "/v1/queues/a-q", None, 403),
        ("team-b", "DELETE", f"/v1/jobs/{a_job}", None, 404),
        # a tenant-admin changes its own tenant's queues only
        ("a-admin", "PUT", "/v1/queues/a-new", new_queue, 201),
        ("a-admin", "PUT", "/v1/queues/b-q", b_queue, 403),
        ("a-admin", "PUT", "/v1/queues/a-new", {**new_queue, "tenant": "team-b"}, 403),
        ("a-admin", "DELETE", "/v1/queues/b-q", None, 403),
        ("a-admin", "DELETE", "/v1/queues/a-new", None, 204),
        ("a-admin", "POST", "/v1/jobs", job, 202),
        ("admin", "PUT", "/v1/queues/b-q", b_queue, 200),
        ("admin", "POST", "/v1/jobs", job, 403),
        # an agent token opens its session and calls nothing else
        ("agent-c1", "GET", "/v1/jobs", None, 403),
        ("agent-c1", "GET", "/v1/queues", None, 403),
        ("agent-c1", "GET", "/v1/clusters", None, 403),
        ("agent-c1", "POST", "/v1/jobs", job, 403),
        ("agent-c1", "GET", "/metrics", None, 403),
        ("team-a", "GET", "/v1/agents/connect", None, 403),
        ("admin", "GET", "/v1/agents/connect", None, 403),
        # a scraper reads /metrics, nothing else
        ("scraper", "GET", "/v1/jobs", None, 403),
        ("scraper", "GET", "/v1/clusters", None, 403),
        # /metrics shows every tenant's queues: no token of one tenant reads it
        (None, "GET", "/metrics", None, 401),
        ("team-a", "GET", "/metrics", None, 403),
        ("a-viewer", "GET", "/metrics", None, 403),
        ("scraper", "GET", "/metrics", None, 200),
        ("fleet-viewer", "GET", "/metrics", None, 200),
        ("admin", "GET", "/metrics", None, 200),
        ("team-a", "DELETE", f"/v1/jobs/{a_job}", None, 202),
    ]
    seen = []
    for token, method, path, body, _ in cases:
        seen.append((await broker.call(token, method, path, body))[0])
    wrong = [
        f"{token} {method} {path}: {got}, not {want}"
        for (token, method, path, _, want), got in zip(cases, seen, strict=True)
        if got != want
    ]
    assert not wrong, "\n".join(wrong)


async def test_a_refusal_names_the_role_needed_and_who_asked(start: Start) -> None:
    broker = await start()
    status, problem = await broker.call("a-viewer", "POST", "/v1/jobs", make_job().document())
    assert status == 403
    assert problem["detail"] == (
        "POST /v1/jobs needs the role tenant-admin or submitter; "
        "this token is viewer of tenant team-a"
    )
    status, problem = await broker.call("agent-c1", "GET", "/v1/queues")
    assert status == 403 and "this token is agent:c1" in problem["detail"]
    assert "admin, tenant-admin, submitter or viewer" in problem["detail"]
    status, problem = await broker.call("a-admin", "DELETE", "/v1/queues/b-q")
    assert status == 403 and problem["detail"].startswith("queue 'b-q' belongs to tenant team-b")


async def test_the_openapi_document_states_each_routes_roles(start: Start) -> None:
    broker = await start()
    paths = (await broker.call(None, "GET", "/openapi.json"))[1]["paths"]
    assert paths["/v1/queues/{name}"]["put"]["x-gpufed-roles"] == ["admin", "tenant-admin"]
    assert paths["/v1/agents/connect"]["get"]["x-gpufed-roles"] == ["agent:<cluster>"]
    assert paths["/metrics"]["get"]["x-gpufed-roles"] == ["admin", "viewer", "metrics"]
    assert "security" not in paths["/metrics"]["get"]
    assert paths["/v1/status"]["get"]["security"] == []


# ---- tenants read their own queues -------------------------------------------------------------


async def test_a_tenant_lists_its_own_queues_and_gpufed_queues_works_with_its_token(
    start: Start, capsys: pytest.CaptureFixture[str]
) -> None:
    broker = await start()
    await broker.submit("team-a", "scratch")  # an open queue: shared, shown to who uses it

    async def names(token: str) -> list[str]:
        status, body = await broker.call(token, "GET", "/v1/queues")
        assert status == 200, body
        return sorted(q["name"] for q in body["items"])

    assert await names("team-a") == ["a-q", "scratch"]
    assert await names("a-viewer") == ["a-q", "scratch"]
    assert await names("team-b") == ["b-q"]
    assert await names("admin") == ["a-q", "b-q", "scratch"]
    assert await names("fleet-viewer") == ["a-q", "b-q", "scratch"]
    assert await broker.status("team-a", "/v1/queues/a-q") == 200
    assert await broker.status("team-b", "/v1/queues/a-q") == 404
    assert await broker.status("team-b", "/v1/queues/scratch") == 404

    argv = ["queues", "--broker", broker.url, "--token", "team-a"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    table = capsys.readouterr().out
    assert "a-q" in table and "b-q" not in table


# ---- tokens with a life ----------------------------------------------------------------------


async def test_an_expired_token_gets_401_naming_it_expired_never_echoing_it(start: Start) -> None:
    now = datetime.now(UTC)
    soon = now + timedelta(seconds=0.8)
    broker = await start(
        [
            *BASE,
            {"token": "old-token", "tenant": "team-a", "expires": "2020-01-01T00:00:00Z"},
            {"token": "soon-token", "tenant": "team-a", "expires": soon.isoformat()},
            {"token": "kept-token", "tenant": "team-a", "expires": "2999-01-01T00:00:00+01:00"},
        ]
    )
    async with broker.client.get("/v1/jobs", headers=bearer("old-token")) as answer:
        assert answer.status == 401
        assert 'error="invalid_token"' in answer.headers["WWW-Authenticate"]
        problem = await answer.json()
    assert problem["type"] == "urn:gpufed:problem:token-expired"
    assert "expired at 2020-01-01T00:00:00Z" in problem["detail"]
    assert "old-token" not in json.dumps(problem)
    assert await broker.status("kept-token") == 200
    assert await broker.status("soon-token") == 200
    await asyncio.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.05)
    assert await broker.status("soon-token") == 401, "expired while the broker runs"


def _swap_symlink(directory: Path, entries: list[dict[str, Any]], version: int) -> None:
    """What the kubelet does to a Secret's volume: a new directory, `..data` swapped to it."""
    data = directory / f"..v{version}"
    data.mkdir()
    (data / "tokens.yaml").write_text(yaml.safe_dump({"tokens": entries}))
    (directory / "..data_tmp").symlink_to(data.name)
    os.replace(directory / "..data_tmp", directory / "..data")


def _rename_over(path: Path, entries: list[dict[str, Any]]) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(yaml.safe_dump({"tokens": entries}))
    os.replace(staged, path)


@pytest.mark.parametrize(
    ("how", "poll"),
    [
        pytest.param("in place", 1.0, id="rewritten in place, the default 1 s poll"),
        pytest.param("rename", 0.1, id="replaced by a rename"),
        pytest.param("symlink", 0.1, id="a Kubernetes Secret's symlink swapped"),
    ],
)
async def test_a_changed_tokens_file_applies_within_5_s_without_a_restart(
    start: Start, tmp_path: Path, how: str, poll: float
) -> None:
    changed = [e for e in BASE if e["token"] != "team-b"] + [{"token": "new", "tenant": "team-c"}]
    mounted = tmp_path / "secret"
    if how == "symlink":
        mounted.mkdir()
        _swap_symlink(mounted, BASE, 1)
        (mounted / "tokens.yaml").symlink_to("..data/tokens.yaml")
        broker = await start(tokens_file=mounted / "tokens.yaml", tokens_poll_seconds=poll)
    else:
        broker = await start(tokens_poll_seconds=poll)
    assert await broker.status("team-b") == 200 and await broker.status("new") == 401
    if how == "symlink":
        _swap_symlink(mounted, changed, 2)
    elif how == "rename":
        _rename_over(broker.tokens_file, changed)
    else:
        broker.write(changed)

    async def applied() -> bool:
        assert await broker.status("team-a") == 200, "a token kept stays valid throughout"
        return await broker.status("team-b") == 401 and await broker.status("new") == 200

    took = await within(5.0, applied)
    assert took < 2 * poll + 1.0


async def test_a_tokens_file_that_does_not_read_keeps_the_tokens_and_logs_one_error(
    start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    broker = await start()
    caplog.set_level(logging.INFO, logger=tokens.__name__)
    broken = [
        f"tokens:\n  - token: {SECRET}\n    tenant: [team-c\n",  # not YAML
        yaml.safe_dump({"tokens": [{"token": SECRET, "role": "submitter"}]}),  # no tenant
        yaml.safe_dump({"tokens": [*BASE[1:], {"token": SECRET, "tenant": "x", "role": "x"}]}),
    ]
    for index, text in enumerate(broken):
        caplog.clear()
        broker.tokens_file.write_text(text)
        await within(3.0, lambda: _logged(caplog, logging.ERROR))
        await asyncio.sleep(0.5)  # five more polls: nothing more is logged, nothing applied
        [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        message = error.getMessage()
        assert message.startswith(f"tokens file {broker.tokens_file}: "), message
        assert "the broker keeps the tokens it had" in message
        assert SECRET not in message, "a token is never logged"
        assert await broker.status("team-a") == 200, f"broken file {index}: half applied?"
        assert await broker.status(SECRET) == 401
    broker.tokens_file.unlink()
    await within(3.0, lambda: _logged(caplog, logging.ERROR, "cannot read it"))
    assert await broker.status("team-a") == 200
    broker.write([*BASE, {"token": "fixed", "tenant": "team-c"}])

    async def fixed() -> bool:
        return await broker.status("fixed") == 200

    await within(3.0, fixed)


async def _logged(caplog: pytest.LogCaptureFixture, level: int, text: str = "") -> bool:
    return any(r.levelno >= level and text in r.getMessage() for r in caplog.records)


async def test_sighup_reloads_the_tokens_file_at_once(start: Start) -> None:
    broker = await start(tokens_poll_seconds=2.0, reload_tokens_on_sighup=True)
    broker.write([e for e in BASE if e["token"] != "team-b"])
    os.kill(os.getpid(), signal.SIGHUP)

    async def revoked() -> bool:
        return await broker.status("team-b") == 401

    assert await within(1.0, revoked) < 1.0, "sooner than a poll (2 s) could apply it"


@pytest.mark.parametrize("how", ["revoked", "expired"])
async def test_an_agent_session_ends_when_its_token_is_revoked_or_expires(
    start: Start, how: str
) -> None:
    expires = (datetime.now(UTC) + timedelta(seconds=1.5)).isoformat()
    agent = {
        "token": "agent-c2",
        "agent": "c2",
        **({"expires": expires} if how == "expired" else {}),
    }
    broker = await start([*BASE, agent])
    ws = await broker.client.ws_connect("/v1/agents/connect", headers=bearer("agent-c2"))
    await ws.send_str(messages.encode(messages.Hello(cluster="c2")))
    assert isinstance(messages.decode(await ws.receive_str()), messages.Welcome)
    other = await broker.client.ws_connect("/v1/agents/connect", headers=bearer("agent-c1"))
    await other.send_str(messages.encode(messages.Hello(cluster="c1")))
    started = time.monotonic()
    if how == "revoked":
        broker.write(BASE)
    while (message := await ws.receive(timeout=5.0)).type == aiohttp.WSMsgType.TEXT:
        pass  # heartbeats, until the broker closes the session
    assert message.type == aiohttp.WSMsgType.CLOSE
    assert message.extra == "the agent's token was revoked or has expired"
    assert time.monotonic() - started < 5.0
    assert not other.closed, "another cluster's session goes on"
    refused = await broker.call("agent-c2", "GET", "/v1/agents/connect")
    assert refused[0] == 401
    await other.close()


# ---- gpufed token create, pasted into the file --------------------------------------------------


@pytest.mark.parametrize(
    ("args", "call"),
    [
        pytest.param(["--tenant", "team-a"], ("POST", "/v1/jobs", 202), id="a submitter submits"),
        pytest.param(
            ["--tenant", "team-a", "--role", "tenant-admin", "--name", "a-ops"],
            ("PUT", "/v1/queues/a-ops", 201),
            id="a tenant-admin puts its queue",
        ),
        pytest.param(["--role", "metrics"], ("GET", "/metrics", 200), id="a scraper scrapes"),
    ],
)
async def test_a_created_token_pasted_into_the_file_is_accepted(
    start: Start,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    call: tuple[str, str, int],
) -> None:
    method, path, want = call
    example = tmp_path / "example-tokens.yaml"  # the shipped example, as a person starts
    example.write_text((REPO / "config" / "tokens.yaml").read_text())
    broker = await start(tokens_file=example)
    assert cli.main(["token", "create", *args, "--expires", "1h"]) == 0
    token, *entry = capsys.readouterr().out.splitlines()
    assert await broker.status(token, path) == 401
    with broker.tokens_file.open("a") as pasted:  # as a person pastes it under `tokens:`
        pasted.write("\n".join(entry) + "\n")
    assert token not in broker.tokens_file.read_text()

    async def accepted() -> bool:  # known: 200, or 403 for a role without /metrics
        return await broker.status(token, "/metrics") != 401

    await within(3.0, accepted)
    body = {
        "POST": make_job(queue="a-q").document(),
        "PUT": {"tenant": "team-a", "quotas": {"*": {"guaranteed": 0, "limit": 2}}},
    }.get(method)
    status, answer = await broker.call(token, method, path, body)
    assert status == want, answer


# ---- /metrics ----------------------------------------------------------------------------------


async def test_metrics_public_serves_metrics_without_a_token(start: Start) -> None:
    broker = await start(metrics_public=True)
    status, text = await broker.call(None, "GET", "/metrics")
    assert status == 200 and "gpufed_broker_leader 1.0" in text
    paths = (await broker.call(None, "GET", "/openapi.json"))[1]["paths"]
    assert paths["/metrics"]["get"]["security"] == []
    assert await broker.status("agent-c1") == 403, "the rest still needs its roles"


def test_the_prometheus_configs_send_a_token_the_example_tokens_file_holds() -> None:
    entries = tokens.read_file(REPO / "config" / "tokens.yaml")
    metrics_tokens = {e.token for e in entries if e.role == "metrics"}
    for name in ("prometheus.yaml", "prometheus.compose.yaml"):
        config = yaml.safe_load((REPO / "deploy" / "prometheus" / name).read_text())
        [job] = [j for j in config["scrape_configs"] if j["job_name"] == "gpufed-broker"]
        assert job["authorization"]["type"] == "Bearer", name
        assert job["authorization"]["credentials"] in metrics_tokens, name
