"""Knocks through a real etcd (`dispatch.knocking`): a follower that refuses an agent records
its knock; the leader hears it on its own clock and, with no session of that cluster, steps
aside once the rule says so, and another replica leads; the leader's own refusals (its work
still starting) are no knocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from broker.dispatch import knocking
from broker.jobs import fleet
from tests.elections import replica, stop

pytestmark = pytest.mark.etcd

HEARTBEAT = 0.25  # the rule: window 3 s, hold 1 s, settle 3 s


async def test_agents_knocking_at_a_follower_make_the_leader_step_aside(etcd_url: str) -> None:
    a, a_task = await replica(etcd_url, "a", ttl=2)
    await asyncio.wait_for(a.leading.wait(), 5)
    b, b_task = await replica(etcd_url, "b", ttl=2)
    leader_knocks = knocking.Knocks(a.backing, a, heartbeat=HEARTBEAT)
    follower_knocks = knocking.Knocks(b.backing, b, heartbeat=HEARTBEAT)
    rule = leader_knocks.rule
    watching = asyncio.create_task(leader_knocks.watch_term(fleet.Fleet()))
    began = time.monotonic()
    try:
        leader_knocks.note("h100")  # the leader's own refusal: not written
        await asyncio.sleep(0.5)
        assert leader_knocks.heard == {}

        async def knock() -> None:  # an agent cut off from the leader, refused by b
            while True:
                follower_knocks.note("h100")
                await asyncio.sleep(0.5)

        knocking_task = asyncio.create_task(knock())
        try:
            await asyncio.wait_for(b.leading.wait(), rule.settle + rule.hold + 3)
        finally:
            knocking_task.cancel()
        assert time.monotonic() - began >= rule.settle + rule.hold
        assert "h100" in leader_knocks.heard
        assert not a.is_leader and "stepping aside" in a.reason
        assert a.holding_off > rule.hold_off - 2
        await asyncio.wait_for(watching, 1)  # the leader's watch ends with its term
    finally:
        watching.cancel()
        await stop(a, a_task)
        await stop(b, b_task)
