"""A real broker on loopback served the way `gpufed broker` serves it (`broker.http.listening`:
connections capped per address, the header timeout), for the OIDC, audit and limits tests."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from broker import app as broker_app
from broker.http import listening
from tests.builders import make_job

TOKENS: list[dict[str, Any]] = [
    {"token": "team-a", "tenant": "team-a", "name": "ci-a"},
    {"token": "team-b", "tenant": "team-b"},
    {"token": "a-admin", "tenant": "team-a", "role": "tenant-admin", "name": "lead-a"},
    {"token": "a-viewer", "tenant": "team-a", "role": "viewer"},
    {"token": "admin", "admin": True, "name": "ops"},
    {"token": "agent-c1", "agent": "c1"},
    {"token": "old-a", "tenant": "team-a", "expires": "2020-01-01T00:00:00Z", "name": "old"},
]
QUEUES = {
    "queues": [
        {"name": "a-q", "tenant": "team-a", "quotas": {"*": {"guaranteed": 0, "limit": 8}}},
        {"name": "b-q", "tenant": "team-b", "quotas": {"*": {"guaranteed": 0, "limit": 8}}},
    ],
}


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@dataclass
class Broker:
    url: str
    port: int
    app: web.Application
    session: aiohttp.ClientSession
    tmp: Path
    runner: web.AppRunner = field(repr=False)

    async def call(
        self,
        token: str | None,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        data = None if body is None else json.dumps(body)
        sent = {**bearer(token), **(headers or {})}
        async with self.session.request(method, self.url + path, data=data, headers=sent) as got:
            text = await got.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return got.status, parsed, dict(got.headers)

    async def submit(self, token: str, queue: str = "a-q") -> str:
        status, body, _ = await self.call(
            token, "POST", "/v1/jobs", make_job(queue=queue).document()
        )
        assert status == 202, body
        return str(body["id"])


Start = Callable[..., Awaitable[Broker]]


@contextlib.asynccontextmanager
async def brokers(tmp_path: Path) -> AsyncIterator[Start]:
    """`await start(**settings)` inside: a broker with TOKENS and QUEUES, the settings given
    (`listen=ListenSettings(...)` for the listener; `prepare(app)` before it starts), all
    stopped at the end. A test module's `start` fixture yields it."""
    started: list[Broker] = []

    async def _start(
        *,
        listen: listening.ListenSettings | None = None,
        prepare: Callable[[web.Application], None] | None = None,
        **settings: Any,
    ) -> Broker:
        (tmp_path / "tokens.yaml").write_text(yaml.safe_dump({"tokens": TOKENS}))
        (tmp_path / "queues.yaml").write_text(yaml.safe_dump(QUEUES))
        defaults: dict[str, Any] = {"queue_mode": "open", "tokens_poll_seconds": 0.2}
        app = broker_app.create_app(
            broker_app.BrokerSettings(
                store=f"sqlite:///{tmp_path / f'broker{len(started)}.db'}",
                tokens_file=tmp_path / "tokens.yaml",
                queues_file=tmp_path / "queues.yaml",
                **{**defaults, **settings},
            )
        )
        if prepare is not None:  # routes of the test's own, before the app starts
            prepare(app)
        runner, site = await listening.start(
            app, host="127.0.0.1", port=0, settings=listen or listening.ListenSettings()
        )
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        broker = Broker(f"http://127.0.0.1:{site.port}", site.port, app, session, tmp_path, runner)
        started.append(broker)
        return broker

    yield _start
    for broker in started:
        await broker.session.close()
        await broker.runner.cleanup()
