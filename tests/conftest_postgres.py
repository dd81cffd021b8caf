"""Fixtures for a real PostgreSQL server (registered by tests/conftest.py as a plugin).

`postgres_server` is one server for the whole session, started on first use
(tests/postgresserver.py says from where); `postgres_url` gives a test a schema of its own in
it. Tests using them are marked `postgres`. When no server can be had they skip, with one
line saying what to install, except where `GPUFED_REQUIRE_POSTGRES=1` (CI: .ci/run sets it),
where they fail.

`postgres_trgm_url` is the same with the `pg_trgm` extension to be had (the history's text
index): the session's server if it has it, else a second one from PostgreSQL's binaries
(pgserver's build leaves the contrib modules out; Debian's `postgresql` has them). The
extension is created in `public`, where a test's schema dropped at its end cannot take it
along.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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


@pytest.fixture(scope="session")
def postgres_trgm_server(
    postgres_server: postgresserver.PostgresServer,
) -> Iterator[postgresserver.PostgresServer]:
    if _has_trgm_apart(postgres_server.url):
        yield postgres_server
        return
    try:
        server = postgresserver.start_binaries(None)
    except (postgresserver.PostgresNotFoundError, postgresserver.PostgresStartError) as exc:
        why = f"no PostgreSQL with pg_trgm ({postgres_server.source} has none; {exc})"
        if postgresserver.required():
            pytest.fail(why, pytrace=False)
        SKIPPED.append(why)
        pytest.skip("no PostgreSQL with pg_trgm: `apt-get install postgresql`")
    try:
        if not _has_trgm_apart(server.url):
            pytest.fail(f"PostgreSQL at {server.source} has no pg_trgm", pytrace=False)
        yield server
    finally:
        server.stop()


def _has_trgm_apart(url: str) -> bool:
    """`_has_trgm` on a thread of its own: a fixture may be set up inside the test's loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, _has_trgm(url)).result()


async def _has_trgm(url: str) -> bool:
    """Whether the server has pg_trgm, which is then created in `public`."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        query = "SELECT count(*) FROM pg_available_extensions WHERE name = 'pg_trgm'"
        if not await conn.fetchval(query):
            return False
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm SCHEMA public")
        return True
    finally:
        await conn.close()


@pytest.fixture
async def postgres_trgm_url(
    postgres_trgm_server: postgresserver.PostgresServer,
) -> AsyncIterator[str]:
    """A schema of this test's own on a server with pg_trgm (dropped afterwards)."""
    async for url in _own_schema(postgres_trgm_server):
        yield url


@pytest.fixture
async def postgres_url(postgres_server: postgresserver.PostgresServer) -> AsyncIterator[str]:
    """The URL of a schema of this test's own (dropped afterwards)."""
    async for url in _own_schema(postgres_server):
        yield url


async def _own_schema(postgres_server: postgresserver.PostgresServer) -> AsyncIterator[str]:
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
