"""The collector housekeeping of `kits.garbage`: passes measured, survivors
frozen out of full passes, a cycle that died frozen reclaimed by the next full pass, and
freed memory given back to the system at a trim."""

from __future__ import annotations

import asyncio
import gc
import logging
import mmap
import os
import subprocess
import sys
import weakref
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram

from kits import garbage

REPO = Path(__file__).resolve().parents[3]


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def collector() -> Iterator[garbage.Collector]:
    registry = CollectorRegistry()
    pauses = Histogram("pauses", "", ["generation"], registry=registry)
    # its loop's due times on the event loop's clock: the looptime tests below wait none of it
    loop_time = lambda: asyncio.get_running_loop().time()  # noqa: E731
    out = garbage.Collector(pauses, freeze_every=0.01, full_every=0.05, clock=loop_time)
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


def test_installed_the_young_generation_is_collected_less_often() -> None:
    before = gc.get_threshold()
    pauses = Histogram("pauses", "", ["generation"], registry=CollectorRegistry())
    out = garbage.Collector(pauses)
    out.install()
    try:
        assert gc.get_threshold() == garbage.THRESHOLDS
        assert garbage.THRESHOLDS[0] > before[0]
    finally:
        out.uninstall()
    assert gc.get_threshold() == before  # what the process had, given back
    kept = garbage.Collector(pauses, thresholds=None)
    kept.install()
    try:
        assert gc.get_threshold() == before
    finally:
        kept.uninstall()


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


def test_a_freeze_runs_no_pass(collector: garbage.Collector) -> None:
    """A young pass walks every object allocated since the last one: a freeze that began
    with one took up to 140 ms a time in the soak. Cycles dead by then wait for the full
    pass, in whichever generation they died."""
    old = Node()
    old.other = old  # a cycle of one object
    gc.collect(0)  # it survives a young pass: in the middle generation now
    dead_old = weakref.ref(old)
    del old
    young = Node()
    young.other = young
    dead_young = weakref.ref(young)
    del young
    passes = observed(collector, "count", "0") + observed(collector, "count", "1")
    collector.freeze()
    assert observed(collector, "count", "0") + observed(collector, "count", "1") == passes
    assert dead_young() is not None and dead_old() is not None  # frozen dead, both
    collector.full_pass()
    assert dead_young() is None and dead_old() is None


async def until_a_full_pass(
    collector: garbage.Collector, running: Coroutine[Any, Any, None]
) -> None:
    """Run the collector's loop until its first full pass (5 s at most), then stop it."""
    task = asyncio.create_task(running)
    try:
        async with asyncio.timeout(5):
            while collector.full_passes == 0:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()


@pytest.mark.looptime
async def test_the_full_pass_waits_for_a_fresh_lease(collector: garbage.Collector) -> None:
    asked: list[float] = []

    def just_renewed(seconds: float) -> bool:
        asked.append(seconds)
        return len(asked) >= 3  # renewed only at the third look

    await until_a_full_pass(collector, collector.run(just_renewed))
    assert len(asked) >= 3
    assert asked[0] == garbage.LATEST_RENEWAL_SECONDS
    assert collector.freezes >= 1


@pytest.mark.looptime
async def test_a_full_pass_that_would_not_fit_the_budget_waits_until_it_does(
    collector: garbage.Collector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=garbage.__name__)
    kept = [Node() for _ in range(50_000)]  # objects the full pass will look at
    collector.freeze()
    budgets = [0.0, 0.0]  # the leader's lease slack, twice too short; then ample

    def budget() -> float:
        return budgets.pop(0) if budgets else 60.0

    await until_a_full_pass(collector, collector.run(None, budget))
    assert budgets == []  # it looked at the budget three times, ran at the third
    told = [r.getMessage() for r in caplog.records if "put off" in r.getMessage()]
    assert len(told) == 2  # told once when put off, once when it ran: "put off 2 times"
    assert "put off 2 times" in told[1]
    assert collector.postponed == 0  # and the count of passes put off starts over
    assert collector.freezes >= 2  # survivors still frozen while it waited
    # the rate it measured (seconds per MiB resident) foresees the next pass
    assert 0 < collector.seconds_per_mib < 0.1
    assert collector.fits(60.0) and not collector.fits(0.4)
    del kept


def test_a_full_pass_is_foreseen_from_the_memory_it_will_look_through(
    collector: garbage.Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    resident = garbage.resident_mib()
    assert 10 < resident < 64 * 1024
    block = mmap.mmap(-1, 100 * 1024 * 1024)  # 100 MiB of fresh pages, not the heap's
    try:
        block[:: mmap.PAGESIZE] = b"x" * len(block[:: mmap.PAGESIZE])  # touched: resident
        assert garbage.resident_mib() >= resident + 90
    finally:
        block.close()
    monkeypatch.setattr(garbage, "resident_mib", lambda: 1000.0)
    collector.seconds_per_mib = 0.001
    assert collector.foreseen() == pytest.approx(1.0)  # 1,000 MiB at 1 ms each
    # a budget fits 1.5 times the foreseen pass and half a second more
    assert collector.fits(1.0 * garbage.PASS_HEADROOM + 0.6)
    assert not collector.fits(1.0 * garbage.PASS_HEADROOM + 0.4)


def test_nothing_counts_the_frozen_objects(
    collector: garbage.Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gc.get_freeze_count()` walks the whole permanent generation: at 4 million objects
    one call held the loop over a second, and a put-off pass called it every 2 s."""

    def walks_them_all() -> int:
        raise AssertionError("gc.get_freeze_count() is O(frozen objects)")

    monkeypatch.setattr(gc, "get_freeze_count", walks_them_all)
    collector.warn_seconds = 0.0  # every pass logged
    collector.freeze()
    assert collector._may_pass(0.0) is False  # put off, and told
    collector.full_pass()
    gc.collect()


TRIMMED = """
import gc, os
from kits import garbage
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


@pytest.mark.looptime
async def test_the_book_shrinking_brings_the_trim_forward(collector: garbage.Collector) -> None:
    """The minute's trim alone could come just before thousands of jobs retire; a book
    holding `trim_after_jobs` fewer jobs than at its highest is trimmed at once."""
    if garbage._malloc_trim is None:
        pytest.skip("no glibc malloc_trim on this system")
    held = [5000]
    task = asyncio.create_task(collector.run(held=lambda: held[0]))
    try:
        for size in (5000, 6000, 5200, 6500):  # growing, and shrinking by less than 1,000
            held[0] = size
            await asyncio.sleep(0.05)
        assert collector.trims == 0  # a minute has not passed
        held[0] = 5400  # 1,100 fewer than at its highest
        async with asyncio.timeout(5):
            while collector.trims == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert collector.trims == 1  # once: the highest is counted from the trim again
        held[0] = 4300
        async with asyncio.timeout(5):
            while collector.trims == 1:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
