"""Is the store answering? A small read every second, for `/readyz` and a gauge.

Run by `broker.app` as a background task; it reports each change through `on_change`, so a
broker whose store went away answers 503 on `/readyz` (and its load balancer stops sending
it traffic) until the store is back. It never dies of an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from broker.state import store

logger = logging.getLogger(__name__)

PROBE_KEY = "/gpufed/probe"


async def probe_store(
    backing: store.Store,
    on_change: Callable[[bool], None],
    *,
    every: float = 1.0,
    timeout: float = 3.0,
) -> None:
    """Read one key every `every` seconds; call `on_change(up)` when the answer changes."""
    up = True
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
