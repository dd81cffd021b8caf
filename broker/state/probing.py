"""Is the store answering? A small read every second, for `/readyz` and a gauge; and which
of its alarms are raised (etcd's `NOSPACE`), for a gauge and an alert.

Run by `broker.app` as a background task; it reports each change through `on_change`, so a
broker whose store went away answers 503 on `/readyz` (and its load balancer stops sending
it traffic) until the store is back. A full store is not a store that went away: it still
answers reads, so the replica stays ready and writes get 507 `store-full`; the alarm is
reported through `on_alarms` instead. It never dies of an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from broker.state import store

logger = logging.getLogger(__name__)

PROBE_KEY = "/gpufed/probe"


async def probe_store(
    backing: store.Store,
    on_change: Callable[[bool], None],
    *,
    every: float = 1.0,
    timeout: float = 3.0,
    alarms: Callable[[], Awaitable[set[str]]] | None = None,
    on_alarms: Callable[[set[str]], None] | None = None,
) -> None:
    """Read one key every `every` seconds; call `on_change(up)` when the answer changes.
    With `alarms` (the store's raised alarms), call `on_alarms(raised)` when they change."""
    up = True
    raised: set[str] = set()
    while True:
        await asyncio.sleep(every)
        try:
            await asyncio.wait_for(backing.get(PROBE_KEY), timeout)
            now_up = True
        except Exception as exc:  # any failure to answer means: not ready
            now_up = False
            if up:
                logger.warning("the store does not answer: %s", str(exc) or type(exc).__name__)
        if now_up != up:
            if now_up:
                logger.info("the store answers again")
            up = now_up
            on_change(up)
        if up and alarms is not None and on_alarms is not None:
            try:
                now_raised = await asyncio.wait_for(alarms(), timeout)
            except Exception as exc:  # unknown this time: keep what was last seen
                logger.debug("the store's alarms could not be read: %s", exc)
                continue
            if now_raised != raised:
                for alarm in sorted(now_raised - raised):
                    logger.error("the store raised its %s alarm: it refuses writes", alarm)
                for alarm in sorted(raised - now_raised):
                    logger.info("the store's %s alarm is cleared", alarm)
                raised = now_raised
                on_alarms(raised)
