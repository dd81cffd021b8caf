"""Keeping the leader's lease alive: a task of its own, over an etcd connection of its own.

`state.electing` holds its term on an etcd lease of `ttl` seconds, renewed every ttl/3, and
steps down when no renewal got through for ttl less a safety margin. A busy leader can lose
its own lease two ways: a renewal over the same gRPC connection as transactions of hundreds
of jobs waits behind them (a keep-alive times out with the loop not stalled), and a held
loop (a long pass of the garbage collector, stalls one after another) renews nothing.

`Keeper` renews from a task of its own on the main loop, over a store connection of its own
(the election's `connect`: for etcd a client on the same members, credentials and TLS,
opened on this loop; the election opens it once and hands it to each term's keeper, so a
campaign does not pay for it), so a renewal never queues behind the book's transactions.
Each renewal may take two of the renewals' measured round trips when the lease leaves room
(`Renewal.round_trip`). It cannot renew while the loop is held; `kits.garbage` times its
full pass to fit in the lease's slack (`Election.pause_budget`), and the planner's budget
keeps a cycle short.

Not a thread: a keeper on a thread and event loop of its own would renew through a held
loop, but gRPC's asyncio stack shares one completion queue and one wake-up socket among
every loop of the process (grpc/grpc#25364), and with such a keeper running the leader's own
job watch can stop delivering (its cache never syncs again). A thread would need the
synchronous gRPC API, with etcd's auth done by hand.

The keeper never steps down itself: it records the latest renewal that got an answer
(`Renewal.renewed_at`, the monotonic time it was sent) and whether the store said the
lease is gone (`expired`), and wakes the election (`notify`); the election decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from broker.state import errors, store
from kits import tasks

logger = logging.getLogger(__name__)

RETRY_SECONDS = 0.1  # after a failed renewal, the next try this soon
STOP_SECONDS = 2.0  # the keeper, cancelled, is waited for this long (twice at most)


@dataclass
class Renewal:
    """What the keeper knows of one lease; written by the keeper, read by the election (a
    float and a bool)."""

    lease: int
    renewed_at: float  # monotonic: when the latest renewal that got an answer was sent
    expired: bool = False  # the store said the lease is gone
    renewals: int = 0
    round_trip: float = 0.0  # the renewals' round trip lately (moving average)

    def note_round_trip(self, seconds: float) -> None:
        before = self.round_trip
        self.round_trip = seconds if before == 0.0 else 0.7 * before + 0.3 * seconds


async def answered(renewal: asyncio.Future[int], *, by: float) -> bool:
    """Whether the renewal `renewal` got through (waited for until the monotonic `by`, then
    cancelled); its errors are its answer."""
    try:
        await asyncio.wait_for(renewal, max(0.0, by - time.monotonic()))
    except (errors.StoreError, TimeoutError):
        return False
    return True


async def keep_renewing(
    backing: store.DurableStore,
    renewal: Renewal,
    *,
    ttl: float,
    safety: float,
    notify: Callable[[], None],
    on_error: Callable[[], None] | None = None,
) -> None:
    """Renew `renewal.lease` every ttl/3 (sooner again after a failure) until cancelled or
    the store says the lease is gone; never raises a store error."""
    while True:
        tasks.check_cancelled()  # a cancel a `wait_for` below swallowed: stop renewing
        deadline = renewal.renewed_at + ttl - safety
        left = deadline - time.monotonic()
        if left <= 0:
            notify()  # the election steps down; it stops this keeper
            await asyncio.sleep(RETRY_SECONDS)
            continue
        sent = time.monotonic()
        # half the time left, at least a third of the TTL and two round trips: a slow
        # answer (a busy or distant store) still renews in time, and a lost one leaves room
        # for another try
        timeout = max(0.05, min(left, max(ttl / 3, left / 2, 2 * renewal.round_trip)))
        try:
            await asyncio.wait_for(backing.keep_alive(renewal.lease), timeout)
            tasks.check_cancelled()
        except errors.LeaseExpiredError:
            renewal.expired = True
            notify()
            return
        except (errors.StoreError, TimeoutError) as exc:
            if on_error is not None:
                on_error()
            logger.warning("keeping the leader lease alive failed: %s", str(exc) or "timed out")
            await asyncio.sleep(RETRY_SECONDS)
            continue
        renewal.renewed_at = sent
        renewal.renewals += 1
        renewal.note_round_trip(time.monotonic() - sent)
        await asyncio.sleep(max(0.0, sent + ttl / 3 - time.monotonic()))


@dataclass(frozen=True)
class Keeping:
    """One lease to keep alive, and whom to tell: what either keeper renews by."""

    renewal: Renewal
    ttl: float
    safety: float
    notify: Callable[[], None]  # wake the election
    on_error: Callable[[], None] | None = None

    def renewing(self, backing: store.DurableStore) -> Coroutine[Any, Any, None]:
        return keep_renewing(
            backing,
            self.renewal,
            ttl=self.ttl,
            safety=self.safety,
            notify=self.notify,
            on_error=self.on_error,
        )


class Keeper:
    """`keep_renewing` as a task of the running event loop, over `backing`: the lease
    keeper's own connection, which the election opens once and keeps across terms
    (`Election._keeper_store`), or the election's store."""

    def __init__(self, backing: store.DurableStore, keeping: Keeping) -> None:
        self.backing = backing
        self.keeping = keeping
        self.renewal = keeping.renewal
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.keeping.renewing(self.backing), name="lease-keeper")

    async def stop(self) -> None:
        """Stop renewing; the lease itself is left to the caller (revoked, or let expire),
        the connection to the election."""
        task, self._task = self._task, None
        if task is not None:  # its keep-alive may swallow the cancellation: bounded
            await tasks.stop_task(task, timeout=STOP_SECONDS, expected=(Exception,))
