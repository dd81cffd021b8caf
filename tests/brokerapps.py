"""A broker app on loopback for integration tests: its tokens and queues files written into
the test's directory, an SQLite store beside them, an aiohttp TestClient to talk to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from aiohttp.test_utils import TestClient, TestServer

from broker import app as broker_app


@contextlib.asynccontextmanager
async def served(
    directory: Path,
    *,
    tokens: Sequence[Mapping[str, Any]],
    queues: Mapping[str, Any] | None = None,
) -> AsyncIterator[TestClient[Any, Any]]:
    """A broker with these tokens (the tokens file's entries) and queues file, until exit."""
    (directory / "tokens.yaml").write_text(yaml.safe_dump({"tokens": list(tokens)}))
    queues_file = None
    if queues is not None:
        queues_file = directory / "queues.yaml"
        queues_file.write_text(yaml.safe_dump(dict(queues)))
    settings = broker_app.BrokerSettings(
        store=f"sqlite:///{directory / 'broker.db'}",
        tokens_file=directory / "tokens.yaml",
        queues_file=queues_file,
    )
    client = TestClient(TestServer(broker_app.create_app(settings)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
