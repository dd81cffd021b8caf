"""The SQLite history gives its page caches back once it has been idle (`PRAGMA
shrink_memory` on the writer's connection and on every reader's, each on its own thread),
and keeps them while it is used. Measured with sqlite's own count of the memory it holds
(`sqlite3_memory_used`, from the library the interpreter's sqlite3 module is linked to)."""

from __future__ import annotations

import asyncio
import ctypes
import sqlite3  # noqa: F401 (loads the library whose memory is read)
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from broker.state.history import query as queries
from broker.state.history import sqlite as sqlite_history
from tests.histories import BASE, finished


def _memory_used() -> Callable[[], int] | None:
    """sqlite3_memory_used of the library this process's sqlite3 module runs on (the one
    mapped in: another copy would count nothing of ours); None if the module has sqlite
    built in."""
    mapped = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libsqlite3" in line.rsplit("/", 1)[-1]
    }
    if len(mapped) != 1:
        return None
    try:
        fn = ctypes.CDLL(mapped.pop()).sqlite3_memory_used
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int64
    return lambda: int(fn())


memory_used = _memory_used()
pytestmark = pytest.mark.skipif(
    memory_used is None,
    reason="the sqlite3 module has sqlite built in: no shared libsqlite3 to read its memory from",
)


@pytest.mark.looptime  # idle and in use on the loop's fake time
async def test_an_idle_history_gives_its_caches_back(tmp_path: Path) -> None:
    assert memory_used is not None
    batches = []
    for batch in range(4):  # some 8 MB of rows: pages the caches keep
        records = [finished(f"job-{batch}-{n}", at=BASE + timedelta(seconds=n)) for n in range(500)]
        for record in records:
            record.job.metadata.annotations["note"] = "x" * 4000
        batches.append(records)
    before = memory_used()  # other connections of this process: not this history's
    history = await sqlite_history.SqliteHistory.open(
        str(tmp_path / "history.db"), idle_seconds=2.0
    )
    try:
        for records in batches:
            await history.put_many(records)
        for _ in range(4):  # both readers read every row
            await asyncio.gather(
                *(history.page(queries.JobQuery(), limit=1000) for _ in range(2)),
                history.count(),
            )
        # on a loaded machine a pause between two reads may pass for idleness: the caches
        # given back then fill again with the next read; what counts is from here on
        busy, given_back = memory_used() - before, history.shrinks
        assert busy > 4 * 2**20, busy  # held while in use
        deadline = time.monotonic() + 10
        while history.shrinks == given_back and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert history.shrinks == given_back + 1
        assert memory_used() - before < busy / 4, (busy, memory_used() - before)
        # used again: the caches fill again, and are given back again once idle
        await history.page(queries.JobQuery(), limit=1000)
        deadline = time.monotonic() + 10
        while history.shrinks == given_back + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert history.shrinks == given_back + 2
    finally:
        await history.close()


@pytest.mark.looptime  # idle and in use on the loop's fake time
async def test_a_history_in_use_keeps_its_caches(tmp_path: Path) -> None:
    history = await sqlite_history.SqliteHistory.open(
        str(tmp_path / "history.db"), idle_seconds=0.3
    )
    try:
        for n in range(15):  # used every 0.1 s, for 1.5 s: never idle for 0.3 s
            await history.put_many([finished(f"job-{n}", at=BASE + timedelta(seconds=n))])
            await asyncio.sleep(0.1)
        assert history.shrinks == 0
    finally:
        await history.close()
