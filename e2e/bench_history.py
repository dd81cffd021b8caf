"""History benchmark: pages of 100 over 1,000,000 finished jobs, SQLite and a real PostgreSQL.

    .venv/bin/python -m e2e.bench_history [--rows 1000000] [--samples 200]
        [--stores sqlite,postgres] [--dir DIR] [--cases all|text] [--keep] [--reuse DIR]

Fills each store with `--rows` finished jobs spread over 7 days (the default history TTL):
10 tenants, 50 queues, 20 clusters, Succeeded 80% / Failed 15% / Cancelled 5%, two labels;
each row a real `JobRecord`'s JSON (one pod, four events, about 1.7 KB), varied per job, bulk
inserted 10,000 rows a call through `put_rows`. Then times `--samples` pages of 100 for each
case (the first page; a deep page via a continue token at a random point of the week; a queue;
a state; a one-hour window; a label; a tenant with a state; the text search `q` with a word
of 1 name in 8, one name, a text matching nothing; the oldest-first order) and `get` by id,
and prints p50/p99 per case (target: p99 <= 50 ms a page), the insert rate and the size on disk, and
for reference what parsing a page's 100 records costs alone (pydantic: most of a page's time;
the queries themselves take 0.5-2 ms here). The data lives in `--dir` (default: the system's
temporary folder, on disk, not tmpfs); PostgreSQL is pgserver's (as configured by it) or
Debian's (fsync off), started there by tests/postgresserver.py. Figures only; asserts nothing.
These machines are shared: compare medians, and read a p99 with the load beside it.
`--cases text` times the text searches only (a common word, one name, two letters, nothing).
`--keep` keeps the data folder (its path printed) and `--reuse DIR` opens the SQLite history
kept there instead of filling one: a history written by an older broker, opened by this one
(the time it takes to open is printed), so two versions can be timed over the same rows.
`--gc-freeze` moves what the process holds out of the cyclic collector's reach before the
figures (`gc.freeze()`, as a broker would after loading its book): most of a page's p99
beyond its median is otherwise a full collection scanning the heap.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from broker.api import selectors, status
from broker.state import opening
from broker.state.history import protocol
from broker.state.history import query as queries
from tests import postgresserver
from tests.builders import make_job

PAGE = 100
CHUNK = 10_000
WEEK_US = 7 * 24 * 3600 * 1_000_000
START = datetime(2026, 11, 24, tzinfo=UTC)
TENANTS = [f"team-{i}" for i in range(10)]
QUEUES = {tenant: [f"{tenant}-q{j}" for j in range(5)] for tenant in TENANTS}
CLUSTERS = [f"cluster-{i:02d}" for i in range(20)]
STATES = ["Succeeded"] * 16 + ["Failed"] * 3 + ["Cancelled"]
WORDS = ["train-llm", "sweep-lr", "eval", "notebook", "finetune", "render", "serve", "pretrain"]
NAMES = 10_000  # numbers per word: a name (`eval-1234`) is about 1 job in 80,000


def template() -> dict[str, Any]:
    """A realistic finished record (one pod, four events) as a dict to vary."""
    builder = make_job("train", queue="q").duration(600)
    record = status.JobRecord(id="train-00000000", tenant="t", job=builder.build(), created=START)
    record.status.cluster = "c"
    record.status.attempts = 1
    record.status.epoch = 3
    record.status.pods = [
        status.PodStatus(
            name="train-00000000-worker-0-a1",
            task="worker",
            node="gpu-node-0123",
            gpus=[status.GPUSlot(index=3)],
            phase=status.PodPhase.SUCCEEDED,
        )
    ]
    for state, reason in [
        (status.JobState.QUEUED, "Submitted"),
        (status.JobState.DISPATCHED, "Planned"),
        (status.JobState.RUNNING, "PodsRunning"),
        (status.JobState.SUCCEEDED, "Completed"),
    ]:
        record.record(state, reason, f"{reason.lower()} on c", now=START)
    record.traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    record.trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    doc: dict[str, Any] = json.loads(record.model_dump_json(by_alias=True))
    return doc


def make_rows(count: int, *, seed: int = 7) -> Iterator[list[protocol.HistoryRow]]:
    """`count` rows in chunks of CHUNK, finished times spread over the week in order."""
    pick = random.Random(seed)
    base = template()
    start_us = queries.to_us(START)
    chunk: list[protocol.HistoryRow] = []
    for index in range(count):
        tenant = pick.choice(TENANTS)
        queue = pick.choice(QUEUES[tenant])
        state = pick.choice(STATES)
        cluster = None if pick.random() < 0.03 else pick.choice(CLUSTERS)
        name = f"{pick.choice(WORDS)}-{pick.randrange(NAMES)}"
        job_id = f"{name}-{pick.getrandbits(48):012x}"
        finished_us = start_us + index * WEEK_US // count + pick.randrange(1_000_000)
        created_us = finished_us - pick.randrange(60_000_000, 7_200_000_000)
        labels = {"team": f"t{pick.randrange(10)}", "tier": pick.choice(["gold", "silver"])}
        base["id"], base["tenant"], base["status"]["state"] = job_id, tenant, state
        base["status"]["cluster"] = cluster
        base["job"]["spec"]["queue"] = queue
        base["job"]["metadata"]["name"] = name
        base["job"]["metadata"]["labels"] = labels
        created, ended = queries.from_us(created_us), queries.from_us(finished_us)
        base["created"] = created.isoformat()
        for event_index, event in enumerate(base["status"]["events"]):
            event["time"] = (ended if event_index == 3 else created).isoformat()
            event["cluster"] = cluster
        base["status"]["events"][3]["state"] = state
        chunk.append(
            protocol.HistoryRow(
                id=job_id,
                name=name,
                tenant=tenant,
                queue=queue,
                state=state,
                cluster=cluster,
                created_us=created_us,
                finished_us=finished_us,
                labels=tuple(sorted(labels.items())),
                record=json.dumps(base, separators=(",", ":")),
            )
        )
        if len(chunk) == CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


async def fill(history: protocol.HistoryStore, rows: int) -> tuple[float, list[str]]:
    """Insert `rows`; the insert rate (rows/s, inserting only) and some ids to `get`."""
    spent, ids = 0.0, []
    for chunk in make_rows(rows):
        began = time.perf_counter()
        await history.put_rows(chunk)
        spent += time.perf_counter() - began
        ids.append(chunk[len(chunk) // 2].id)
    return rows / spent, ids


def describe(label: str, latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered) * 1e3
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3
    return f"  {label:<44} p50 {p50:7.2f} ms   p99 {p99:7.2f} ms"


async def timed(samples: int, call: Callable[[int], Awaitable[object]]) -> list[float]:
    latencies = []
    for sample in range(samples):
        began = time.perf_counter()
        await call(sample)
        latencies.append(time.perf_counter() - began)
    return latencies


async def measure(
    history: protocol.HistoryStore, samples: int, ids: list[str], *, which: str = "all"
) -> None:
    pick = random.Random(3)
    start_us = queries.to_us(START)

    def deep(query: queries.JobQuery) -> str:
        """A token at a random point of the week, as a reader paging down would hold."""
        at = start_us + pick.randrange(WEEK_US)
        return queries.encode(queries.Cursor(False, at, "train-~"), query)

    async def page(query: queries.JobQuery, cont: str | None = None) -> None:
        found = await history.page(query, limit=PAGE, cont=cont)
        short[0] += len(found.items) < PAGE  # the tail of a deep page: fewer rows left

    short = [0]

    everything = queries.JobQuery()
    token: list[str | None] = [None]

    async def walk(_: int) -> None:
        found = await history.page(everything, limit=PAGE, cont=token[0])
        token[0] = found.next

    cases: list[tuple[str, Callable[[int], Awaitable[object]]]] = [
        ("first page", lambda _: page(everything)),
        ("deep page (continue)", lambda _: page(everything, deep(everything))),
        ("next page, walking from the top", walk),
    ]

    def a_queue() -> queries.JobQuery:
        tenant = pick.choice(TENANTS)
        return queries.JobQuery(queue=pick.choice(QUEUES[tenant]))

    def a_window() -> queries.JobQuery:
        begin = START + timedelta(microseconds=pick.randrange(WEEK_US - 3_600_000_000))
        return queries.JobQuery(finished_after=begin, finished_before=begin + timedelta(hours=1))

    cases += [
        ("queue (1 of 50)", lambda _: page(a_queue())),
        ("queue, deep page", lambda _: page(q := a_queue(), deep(q))),
        ("state Failed (15%)", lambda _: page(queries.JobQuery(state=status.JobState.FAILED))),
        (
            "state Cancelled (5%), deep page",
            lambda _: page(q := queries.JobQuery(state=status.JobState.CANCELLED), deep(q)),
        ),
        ("one-hour window", lambda _: page(a_window())),
        ("label team=tN (10%)", lambda _: page(label_query(pick))),
        (
            "tenant + state Failed",
            lambda _: page(
                queries.JobQuery(tenant=pick.choice(TENANTS), state=status.JobState.FAILED)
            ),
        ),
        ("get by id", lambda n: history.get(ids[n % len(ids)])),
    ]
    if which == "text":
        cases = [case for case in text_cases(pick, page, deep) if case[0].startswith("q ")]
    else:
        cases += text_cases(pick, page, deep)
        texts = [row.record for row in next(make_rows(PAGE, seed=11))]

        async def parse(_: int) -> None:  # what a page costs beyond the store: its records read
            for text in texts:
                status.JobRecord.model_validate_json(text)

        cases.append(("(reference: parsing 100 records, no store)", parse))
    for label, call in cases:
        await timed(min(20, samples), call)  # warm
        short[0] = 0
        latencies = await timed(samples, call)
        tail = f"   ({short[0]} pages short: the end)" if short[0] else ""
        print(describe(label, latencies) + tail, flush=True)


def text_cases(
    pick: random.Random,
    page: Callable[[queries.JobQuery, str | None], Awaitable[None]],
    deep: Callable[[queries.JobQuery], str],
) -> list[tuple[str, Callable[[int], Awaitable[object]]]]:
    """The text search (`q`) and the oldest-first order: common, rare and absent texts."""
    oldest = queries.Order.OLDEST

    def word() -> queries.JobQuery:
        return queries.JobQuery(text=pick.choice(WORDS).upper())  # the case ignored

    def one_name() -> queries.JobQuery:
        return queries.JobQuery(text=f"{pick.choice(WORDS)}-{pick.randrange(NAMES)}")

    def two_letters() -> queries.JobQuery:
        return queries.JobQuery(text=pick.choice(WORDS)[:2])

    return [
        ("q a word (1 of 8 names)", lambda _: page(word(), None)),
        ("q a word, deep page", lambda _: page(q := word(), deep(q))),
        (
            "q a word + tenant",
            lambda _: page(
                queries.JobQuery(text=pick.choice(WORDS), tenant=pick.choice(TENANTS)), None
            ),
        ),
        ("q one name (1 job in 80,000)", lambda _: page(one_name(), None)),
        ("q one name, deep page", lambda _: page(q := one_name(), deep(q))),
        ("q two letters (too short to index)", lambda _: page(two_letters(), None)),
        ("q matching nothing", lambda n: page(queries.JobQuery(text=f"zz{n}"), None)),
        (
            "q matching nothing + queue (1 of 50)",
            lambda n: page(
                queries.JobQuery(text=f"zz{n}", queue=pick.choice(QUEUES[pick.choice(TENANTS)])),
                None,
            ),
        ),
        ("sort oldest, first page", lambda _: page(queries.JobQuery(order=oldest), None)),
        (
            "sort oldest, deep page",
            lambda _: page(q := queries.JobQuery(order=oldest), deep(q)),
        ),
    ]


def label_query(pick: random.Random) -> queries.JobQuery:
    return queries.JobQuery(labels=selectors.parse(f"team=t{pick.randrange(10)}"))


Sizer = Callable[[protocol.HistoryStore], Awaitable[int]]


async def bench(name: str, url: str, args: argparse.Namespace, size: Sizer) -> None:
    if args.reuse is None:
        history = await opening.open_history(url)
        try:
            began = time.perf_counter()
            rate, ids = await fill(history, args.rows)
            taken = time.perf_counter() - began
            count, used = await history.count(), await size(history)
            print(
                f"{name}: {count:,} rows in {taken:.0f} s (generating them included);"
                f" insert {rate:,.0f} rows/s; size {used / 2**20:,.0f} MiB"
                f" ({used / count:,.0f} B a job)",
                flush=True,
            )
        finally:
            await history.close()
    else:
        ids = [chunk[len(chunk) // 2].id for chunk in make_rows(args.rows)]
    if url.startswith("postgresql://"):
        began = time.perf_counter()
        await settle(url)
        print(f"  vacuumed and analyzed in {time.perf_counter() - began:.0f} s", flush=True)
    began = time.perf_counter()
    history = await opening.open_history(url)  # the figures of a broker that restarted
    print(f"  opened again in {(time.perf_counter() - began) * 1e3:.0f} ms", flush=True)
    if args.reuse is not None:
        count, used = await history.count(), await size(history)
        print(f"{name}: {count:,} rows kept; size {used / 2**20:,.0f} MiB", flush=True)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    try:
        await measure(history, args.samples, ids, which=args.cases)
    finally:
        await history.close()


async def settle(url: str) -> None:
    """What autovacuum would do after a bulk load, done now rather than during the figures."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for table in ("job_history", "job_history_labels"):
            await conn.execute(f"VACUUM (ANALYZE) {table}")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def main(args: argparse.Namespace) -> None:
    if args.reuse is not None:
        root = Path(args.reuse)
    else:
        root = Path(tempfile.mkdtemp(prefix="gpufed-bench-history-", dir=args.dir))
        root.chmod(0o711)  # PostgreSQL's binaries run as nobody when this runs as root
    stores = args.stores.split(",")
    try:
        if "sqlite" in stores:
            path = root / "history.db"

            async def file_size(_: protocol.HistoryStore) -> int:
                files = (path, Path(f"{path}-wal"))
                return sum(os.path.getsize(p) for p in files if os.path.exists(p))

            await bench("sqlite", f"sqlite:///{path}", args, file_size)
        if "postgres" in stores and args.reuse is None:
            try:
                server = postgresserver.start(root / "pg")
            except (postgresserver.PostgresNotFoundError, postgresserver.PostgresStartError) as exc:
                print(f"postgres: skipped ({exc})")
                return
            try:
                print(f"postgres ({server.source}):", flush=True)
                await bench("postgres", server.url, args, lambda store: store.size_bytes())
            finally:
                server.stop()
    finally:
        if args.keep or args.reuse is not None:
            print(f"data kept in {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--stores", default="sqlite,postgres")
    parser.add_argument("--dir", default=None, help="where the data goes (default: /tmp)")
    parser.add_argument("--cases", choices=["all", "text"], default="all")
    parser.add_argument("--keep", action="store_true", help="keep the data folder")
    parser.add_argument("--reuse", default=None, help="a kept folder's SQLite history, not filled")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before measuring")
    asyncio.run(main(parser.parse_args()))
