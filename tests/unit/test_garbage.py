"""The collector housekeeping of `broker.telemetry.garbage`: passes measured, survivors
frozen out of full passes, a cycle that died frozen reclaimed by the next full pass, and
freed memory given back to the system at a trim."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram

from broker.telemetry import garbage

REPO = Path(__file__).resolve().parents[2]


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def collector() -> Iterator[garbage.Collector]:
    registry = CollectorRegistry()
    pauses = Histogram("pauses", "", ["generation"], registry=registry)
    out = garbage.Collector(pauses, freeze_every=0.01, full_every=0.05)
    out.registry = registry  # type: ignore[attr-defined]
    out.install()
    try:
        yield out
    finally:
        out.uninstall()
        gc.unfreeze()


def observed(collector: garbage.Collector, sample: str, generation: str) -> float:
    registry: CollectorRegistry = collector.registry  # type: ignore[attr-defined]
    return registry.get_sample_value(f"pauses_{sample}", {"generation": generation}) or 0.0


def test_every_pass_is_measured_by_generation(collector: garbage.Collector) -> None:
    before = observed(collector, "count", "2")
    gc.collect()
    assert observed(collector, "count", "2") == before + 1
    assert observed(collector, "sum", "2") > 0
    gc.collect(0)
    assert observed(collector, "count", "0") >= 1


def test_a_cycle_that_dies_frozen_waits_for_the_full_pass(collector: garbage.Collector) -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    collector.freeze()
    assert gc.get_freeze_count() > 0
    del a, b
    gc.collect()  # an ordinary full pass does not look at frozen objects
    assert alive() is not None
    collector.full_pass()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # what lives is frozen again


async def test_the_full_pass_waits_for_a_fresh_lease(collector: garbage.Collector) -> None:
    asked: list[float] = []

    def just_renewed(seconds: float) -> bool:
        asked.append(seconds)
        return len(asked) >= 3  # renewed only at the third look

    task = asyncio.create_task(collector.run(just_renewed))
    try:
        async with asyncio.timeout(5):
            while collector.full_passes == 0:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert len(asked) >= 3
    assert asked[0] == garbage.LATEST_RENEWAL_SECONDS
    assert collector.freezes >= 1


TRIMMED = """
import gc, os
from broker.telemetry import garbage
from prometheus_client import CollectorRegistry, Histogram

def rss():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

pauses = Histogram("p", "p", ["generation"], registry=CollectorRegistry())
made = [[str(n) * 8 for n in range(100)] for _ in range(20_000)]  # 100 MB or so
kept = made[::500]  # a few survive among them, as long-lived objects do
del made
gc.collect()
before = rss()
garbage.Collector(pauses).trim()
print(before, rss())
"""


def test_a_trim_gives_freed_memory_back_under_the_c_allocator() -> None:
    """Under PYTHONMALLOC=malloc (how the chart and `gpufed local` run the broker), memory
    freed among objects that live on goes back to the system at a trim."""
    if garbage._malloc_trim is None:
        pytest.skip("no glibc malloc_trim on this system")
    env = {**os.environ, "PYTHONMALLOC": "malloc", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", TRIMMED], env=env, capture_output=True, text=True, check=True
    )
    before, after = (int(x) for x in out.stdout.split())
    assert before - after > 50, (before, after)  # MiB
