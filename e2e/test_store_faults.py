"""SQLite faults with real `gpufed broker` processes (issue 10, measured case 9).

A damaged file stops the broker with one line; a record that does not parse is set aside and
listed by `gpufed broker quarantine`; `gpufed broker backup` copies the store while the broker
takes jobs, and a broker started on the copy has every job acknowledged before the copy; a
file copied without its `-wal` after kill -9 is said so in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from broker.state import sqlite
from e2e.helpers import run_cli
from gpufed.local import processes
from tests.builders import make_job

pytestmark = pytest.mark.e2e

WAL_WARNING = "-wal file is missing"
GARBAGE = b"\x00garbage\xff"  # not a job record: not even JSON


async def submit_jobs(fleet: processes.LocalFleet, count: int, *, name: str) -> list[str]:
    async with fleet.client("team-a") as api:
        return [
            (await api.submit(json.dumps(make_job(f"{name}-{i}", gpus=1).document())))["id"]
            for i in range(count)
        ]


async def job_ids(fleet: processes.LocalFleet) -> set[str]:
    async with fleet.client("admin") as api:
        return {job["id"] for job in await api.jobs()}


async def test_a_damaged_store_stops_the_broker_with_one_line(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=[])
    await fleet.start_broker()
    await submit_jobs(fleet, 60, name="filler")  # jobs in kv, their history in changes
    await fleet.stop()
    path = tmp_path / "broker.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        [(root,)] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'changes'")
        [(size,)] = conn.execute("PRAGMA page_size")
    with path.open("r+b") as file:  # garbage over a page of the change log, not of kv
        file.seek((root - 1) * size)
        file.write(b"\xde\xad\xbe\xef" * (size // 4))

    broker = await processes.spawn(
        "damaged",
        ["broker", "--store", f"sqlite:///{path}", "--tokens", str(tmp_path / "tokens.yaml"),
         "--port", str(processes.free_port())],
        workdir=tmp_path,
    )  # fmt: skip
    code = await asyncio.wait_for(broker.process.wait(), 30)

    assert code != 0
    lines = [line for line in broker.log.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpufed broker: sqlite store ")
    assert str(path) in lines[0] and "is damaged" in lines[0]


async def test_an_unparsable_record_is_set_aside_and_listed(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=[])
    await fleet.start_broker()
    [good] = await submit_jobs(fleet, 1, name="good")
    await fleet.stop()
    kv = await sqlite.SqliteStore.open(tmp_path / "broker.db")
    await kv.put("/gpufed/jobs/x", GARBAGE)
    await kv.close()

    await fleet.start_broker()  # it starts: the record is set aside, not a crash
    assert await job_ids(fleet) == {good}
    store_url = f"sqlite:///{tmp_path / 'broker.db'}"
    # the admin command reads the store beside the running broker
    code, out, err = await run_cli(fleet, "broker", "quarantine", "--store", store_url)
    assert code == 0, err
    assert "/gpufed/jobs/x" in out and "Invalid JSON" in out and f" {len(GARBAGE)} " in out
    code, out, err = await run_cli(
        fleet, "broker", "quarantine", "--store", store_url, "-o", "json"
    )
    [item] = json.loads(out)
    assert item["key"] == "/gpufed/jobs/x" and item["size"] == len(GARBAGE)
    assert item["storedUnder"] == "/gpufed/quarantine/jobs/x"
    assert "Invalid JSON" in item["error"]
    assert fleet.broker is not None and "set aside as /gpufed/quarantine/jobs/x" in (
        fleet.broker.tail(50)
    )


async def test_a_backup_taken_while_the_broker_takes_jobs_has_every_acknowledged_job(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=[])
    await fleet.start_broker()
    acknowledged: list[str] = []
    stop = asyncio.Event()

    async def keep_submitting() -> None:
        async with fleet.client("team-a") as api:
            while not stop.is_set():
                document = json.dumps(make_job(f"j{len(acknowledged)}", gpus=1).document())
                acknowledged.append((await api.submit(document))["id"])

    submitter = asyncio.create_task(keep_submitting())
    try:
        while len(acknowledged) < 200:
            await asyncio.sleep(0.02)
        before = set(acknowledged)
        copy = tmp_path / "backups" / "broker.db"
        copy.parent.mkdir()
        code, out, err = await run_cli(
            fleet, "broker", "backup", "--store", f"sqlite:///{tmp_path / 'broker.db'}",
            str(copy),
        )  # fmt: skip
        after_backup = len(acknowledged)
        while len(acknowledged) < after_backup + 50:  # and the broker goes on taking jobs
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await submitter
    assert code == 0, err
    assert out.startswith(f"backed up {tmp_path / 'broker.db'} to {copy}")
    assert sorted(p.name for p in copy.parent.iterdir()) == ["broker.db"]

    restored = processes.LocalFleet(workdir=copy.parent, store=f"sqlite:///{copy}")
    restored.write_tokens(tenants=["team-a"], clusters=[])
    try:
        await restored.start_broker()
        ids = await job_ids(restored)
        assert restored.broker is not None
        assert WAL_WARNING not in restored.broker.tail(50)
    finally:
        await restored.stop()
    assert before <= ids <= set(acknowledged)


async def test_a_store_copied_without_its_wal_after_kill_9_is_said_so(
    fleet: processes.LocalFleet, tmp_path: Path
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=[])
    await fleet.start_broker()
    acknowledged = set(await submit_jobs(fleet, 100, name="acked"))
    assert fleet.broker is not None
    await fleet.broker.stop(sig=signal.SIGKILL)
    assert (tmp_path / "broker.db-wal").exists()
    alone = tmp_path / "copied" / "broker.db"
    alone.parent.mkdir()
    shutil.copy(tmp_path / "broker.db", alone)  # the mistake the README warns of

    copied = processes.LocalFleet(workdir=alone.parent, store=f"sqlite:///{alone}")
    copied.write_tokens(tenants=["team-a"], clusters=[])
    try:
        await copied.start_broker()
        assert copied.broker is not None
        assert await job_ids(copied) < acknowledged
        assert WAL_WARNING in copied.broker.tail(50)
    finally:
        await copied.stop()

    await fleet.start_broker()  # the file with its -wal: every job, no warning
    assert await job_ids(fleet) == acknowledged
    assert fleet.broker is not None and WAL_WARNING not in fleet.broker.tail(50)
