"""Store micro-benchmark: latency of puts and compare-and-swap commits, SQLite and real etcd.

    .venv/bin/python -m e2e.bench_store [--ops 2000] [--stores sqlite,etcd]

Each store is measured sequentially (one writer) and with 32 writers in flight. A CAS commit
compares the key's revision from the writer's previous commit, as the scheduler does. Prints
p50/p99 per operation, throughput and the client's CPU time per operation; asserts nothing.
SQLite runs on a file in the system's temporary directory; etcd is a real server from
tests/etcdserver.py (its data on tmpfs when the machine has one, so etcd's fsync is cheap
here: production disks are slower).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from broker.state import opening, store
from tests import etcdserver

IN_FLIGHT = 32
VALUE = b"x" * 512  # about the size of a job record


def summarise_latencies(label: str, latencies: list[float], elapsed: float, cpu: float) -> str:
    ordered = sorted(latencies)
    p50 = statistics.median(ordered) * 1e3
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3
    rate = len(ordered) / elapsed
    per_op = cpu / len(ordered) * 1e6
    return (
        f"{label:<34} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   {rate:9,.0f} ops/s"
        f"   client CPU {per_op:5.0f} us/op"
    )


async def measure_writers(
    kv: store.Store,
    *,
    writers: int,
    ops: int,
    write: Callable[[store.Store, str, int], Awaitable[int]],
) -> tuple[list[float], float, float]:
    """Run `ops` writes split among `writers` coroutines; per-op latencies, elapsed time and
    this process's CPU time (the client's side of a write)."""
    latencies: list[float] = []

    async def run_writer(index: int) -> None:
        key = f"/bench/{time.monotonic_ns()}/{index}"
        revision = 0
        for _ in range(ops // writers):
            began = time.perf_counter()
            revision = await write(kv, key, revision)
            latencies.append(time.perf_counter() - began)

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(run_writer(i) for i in range(writers)))
    return latencies, time.perf_counter() - began, time.process_time() - cpu


async def write_put(kv: store.Store, key: str, _revision: int) -> int:
    return await kv.put(key, VALUE)


async def write_cas(kv: store.Store, key: str, revision: int) -> int:
    return await kv.commit(store.Txn(compares=[store.Compare(key, revision)], puts=[(key, VALUE)]))


async def bench_store(name: str, url: str, *, ops: int) -> None:
    kv = await opening.open_store(url)
    try:
        await measure_writers(kv, writers=IN_FLIGHT, ops=min(ops, 320), write=write_put)  # warm
        for writers in (1, IN_FLIGHT):
            for op_name, write in (("put", write_put), ("CAS commit", write_cas)):
                latencies, elapsed, cpu = await measure_writers(
                    kv, writers=writers, ops=ops, write=write
                )
                label = f"{name} {op_name}, {writers} in flight"
                print(summarise_latencies(label, latencies, elapsed, cpu), flush=True)
    finally:
        await kv.close()


async def run_benchmarks(stores: list[str], *, ops: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpufed-bench-") as scratch:
        if "sqlite" in stores:
            await bench_store("sqlite", f"sqlite:///{Path(scratch) / 'bench.db'}", ops=ops)
        if "etcd" in stores:
            server = await asyncio.to_thread(etcdserver.EtcdServer.start)
            try:
                await bench_store("etcd", server.url, ops=ops)
            finally:
                await asyncio.to_thread(server.cleanup)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Store latency benchmark (prints, asserts nothing)."
    )
    parser.add_argument("--ops", type=int, default=2000, help="writes per measurement")
    parser.add_argument("--stores", default="sqlite,etcd", help="comma-separated: sqlite,etcd")
    args = parser.parse_args()
    asyncio.run(run_benchmarks(args.stores.split(","), ops=args.ops))


if __name__ == "__main__":
    main()
