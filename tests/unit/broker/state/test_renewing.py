"""The leader lease's keeper stops when cancelled, even when the cancellation arrives as a
renewal is answered: Python 3.11's `asyncio.wait_for` then returns the answer and swallows
the cancellation, and a keeper that carried on would renew a finished term's lease for ever
(and the term's end, which waits for it, would hang)."""

from __future__ import annotations

import asyncio
import time

from broker.state import renewing, sqlite


class CancelledAsAnswered(sqlite.SqliteStore):
    """The real SQLite store; its keeper's task is cancelled at the moment a renewal is
    answered (the race a busy loop meets)."""

    keeper: asyncio.Task[None] | None = None
    renewals = 0

    async def keep_alive(self, lease: int) -> int:
        answer = await super().keep_alive(lease)
        self.renewals += 1
        if self.keeper is not None and self.renewals == 2:
            self.keeper.cancel()
        return answer


async def test_a_keeper_cancelled_as_its_renewal_is_answered_stops() -> None:
    backing = await CancelledAsAnswered.open(":memory:")
    try:
        lease = await backing.grant_lease(3)
        renewal = renewing.Renewal(lease, renewed_at=time.monotonic())
        keeper = asyncio.create_task(
            renewing.keep_renewing(backing, renewal, ttl=0.3, safety=0.05, notify=lambda: None)
        )
        backing.keeper = keeper
        done, _ = await asyncio.wait({keeper}, timeout=2.0)
        assert done == {keeper}, f"still renewing after {backing.renewals} renewals"
        assert keeper.cancelled() and backing.renewals == 2
    finally:
        await backing.close()
