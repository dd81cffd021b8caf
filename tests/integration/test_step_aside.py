"""A leader that steps aside (`Election.step_aside`: its agents reach only followers) on a real
etcd: another replica leads within a round trip, and the one that stepped aside does not
campaign during its hold-off, even with the lead vacant; the hold-off doubles when it steps
aside again soon."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.elections import replica, stop

pytestmark = pytest.mark.etcd

TTL = 2
HOLD_OFF = 3.0


async def test_a_replica_that_stepped_aside_holds_off_and_another_leads(etcd_url: str) -> None:
    a, a_task = await replica(etcd_url, "a", ttl=TTL)
    await asyncio.wait_for(a.leading.wait(), 5)
    b, b_task = await replica(etcd_url, "b", ttl=TTL)
    try:
        await asyncio.sleep(0.3)  # b follows a
        a.step_aside("its agents knock at followers", hold_off=HOLD_OFF)
        stepped = time.monotonic()
        await asyncio.wait_for(b.leading.wait(), 2)
        assert time.monotonic() - stepped < 1.0  # revoked, not left to expire
        assert not a.is_leader and "stepping aside" in a.reason

        # the lead vacant again within a's hold-off: a does not take it ...
        await b.resign()
        await asyncio.sleep(HOLD_OFF - (time.monotonic() - stepped) - 0.5)
        assert not a.is_leader
        # ... until the hold-off is over
        await asyncio.wait_for(a.leading.wait(), 3)
        assert time.monotonic() - stepped >= HOLD_OFF

        # a second step aside within ASIDE_MEMORY: twice the hold-off
        a.step_aside("again", hold_off=HOLD_OFF)
        assert a.holding_off > 1.9 * HOLD_OFF
    finally:
        await stop(a, a_task)
        await stop(b, b_task)
