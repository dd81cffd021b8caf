"""Fixtures for a real PostgreSQL server (registered by tests/conftest.py as a plugin).

`postgres_server` is one server for the whole session, started on first use
(tests/postgresserver.py says from where); `postgres_url` gives a test a schema of its own in
it. Tests using them are marked `postgres`. When no server can be had they skip, with one
line saying what to install, except where `GPUFED_REQUIRE_POSTGRES=1` (CI: .ci/run sets it),
where they fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from tests import postgresserver

SKIPPED: list[str] = []  # why the server could not be had, said once at the end of the run


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgresserver.PostgresServer]:
    try:
        server = postgresserver.start()
    except (postgresserver.PostgresNotFoundError, postgresserver.PostgresStartError) as exc:
        if postgresserver.required():
            pytest.fail(f"cannot start PostgreSQL: {exc}", pytrace=False)
        SKIPPED.append(str(exc))
        pytest.skip(postgresserver.HOW_TO_GET_ONE)
    yield server
    server.stop()


@pytest.fixture
async def postgres_url(postgres_server: postgresserver.PostgresServer) -> AsyncIterator[str]:
    """The URL of a schema of this test's own (dropped afterwards)."""
    import asyncpg

    schema = postgres_server.new_schema_name()
    conn = await asyncpg.connect(postgres_server.url)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
    finally:
        await conn.close()
    yield postgres_server.dsn(schema)
    conn = await asyncio.wait_for(asyncpg.connect(postgres_server.url), 10)
    try:
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await conn.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SKIPPED:
        terminalreporter.write_line(f"PostgreSQL tests SKIPPED: {SKIPPED[0]}", yellow=True)
