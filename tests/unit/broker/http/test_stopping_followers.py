"""Background tasks that end with the process (the token, OIDC and TLS followers, the event
streams' sweeper, the acknowledgements' sender; the agent's watchers) are stopped with
`kits.tasks.stop_task`: one that swallows its cancellation is left behind after a bound and
never holds up a shutdown. Shown on the event streams' sweeper: awaited after its cancel, as
before, the stop waited for ever."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from broker.http import events
from kits import tasks


async def stubborn(release: asyncio.Event) -> None:
    while not release.is_set():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)


@pytest.mark.looptime  # the bound passes at once
async def test_a_sweeper_that_swallows_its_cancel_does_not_hold_up_the_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    hub = events.Hub()
    hub._sweeper = asyncio.create_task(stubborn(release), name="events-sweep")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with caplog.at_level(logging.WARNING, logger="kits.tasks"):
        await hub.stop()
    assert loop.time() - began == pytest.approx(2 * tasks.STOP_SECONDS)
    assert "task events-sweep still runs after it was cancelled twice; left behind" in (caplog.text)
    release.set()
    hub._sweeper.cancel()
    await asyncio.wait({hub._sweeper}, timeout=1.0)
