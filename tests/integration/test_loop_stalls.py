"""The event-loop monitor on a real loop: a callback that holds the loop for longer than the
stall threshold is reported once, with the stack that held it, and the lag is observed."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from broker.telemetry import stalls


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a long pure computation does to every other task


async def test_a_blocked_loop_is_reported_with_the_stack_that_holds_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lag = Histogram("lag_seconds", "lag", registry=CollectorRegistry(), buckets=(0.1, 1.0, 5.0))
    monitor = stalls.LoopMonitor(lag, tick=0.05, stall=0.3)
    caplog.set_level(logging.WARNING, logger=stalls.__name__)
    running = asyncio.create_task(monitor.run())
    try:
        await asyncio.sleep(0.2)  # ticking, nothing to report
        assert monitor.stalls == 0
        hold_the_loop(0.8)
        await asyncio.sleep(0.3)  # the loop is back: the end of the stall is logged
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert monitor.stalls == 1
    messages = [r.getMessage() for r in caplog.records]
    blocked = [m for m in messages if "has been blocked" in m]
    assert len(blocked) == 1 and "hold_the_loop" in blocked[0], messages
    assert any("was blocked for" in m for m in messages), messages
    late = lag.collect()[0].samples
    slow = next(s.value for s in late if s.name == "lag_seconds_bucket" and s.labels["le"] == "0.1")
    total = next(s.value for s in late if s.name == "lag_seconds_count")
    assert total > slow  # the stalled tick was observed late
