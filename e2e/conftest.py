"""Fixtures for end-to-end scenarios: real broker and agent processes on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpufed.local import processes
from tests import conftest_etcd


def pytest_configure(config: pytest.Config) -> None:
    """No event loop until a test makes one (as tests/conftest.py says why: looptime's plugin
    would make one nobody closes)."""
    asyncio.set_event_loop(None)


@pytest.fixture
def etcd_url() -> Iterator[str]:
    """A fresh real etcd server of the test's own (no keys shared with other tests)."""
    with conftest_etcd.own_etcd() as url:
        yield url


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[processes.LocalFleet]:
    """A stopped fleet in a work directory; the test starts what it needs."""
    fleet = processes.LocalFleet(workdir=tmp_path, heartbeat=0.5, lost_after=5.0)
    try:
        yield fleet
    finally:
        await fleet.stop()
        for service in [fleet.broker, *fleet.agents.values()]:
            if service is not None and service.process.returncode not in (0, -15, None):
                print(f"--- {service.name} exited {service.process.returncode}:\n{service.tail()}")
