"""Keeping the leader's lease alive, off the broker's event loop.

`state.electing` holds its term on an etcd lease of `ttl` seconds, renewed every ttl/3, and
steps down when no renewal got through for ttl less a safety margin. Renewed from the main
event loop, a renewal waits behind whatever the loop does: the single leader of the soak
benchmark lost its own lease 8 times in a 100,000-job run, with the loop busy (stalls of a
second after one another while it served lists and applied reports) and the keep-alive
queued on the same gRPC channel as transactions of hundreds of jobs. Every agent session
went with each loss, and the agents' hellos requeued what they held.

`ThreadKeeper` renews from a thread of its own, on an event loop of its own, over a store
connection of its own (`connect`, called in that thread: for etcd a client on the same
endpoints, credentials and TLS). The main loop busy for seconds no longer costs the lease:
Python switches threads every few milliseconds of bytecode, and the keeper needs a few.
What it cannot get past is a pause that holds the interpreter lock throughout, a full pass
of the garbage collector; `telemetry.garbage` times that pass to fit in the lease's slack
(`Election.pause_budget`).

The keeper never steps down itself: it records the latest renewal that got an answer
(`Renewal.renewed_at`, the monotonic time it was sent) and whether the store said the
lease is gone (`expired`), and wakes the election (`notify`, through the main loop's
`call_soon_threadsafe`); the election, on the main loop, decides (`Election._lead`).

`LoopKeeper` is the same renewal loop as a task of the main loop, for a store that cannot
open a second connection (tests wrap one). Both renew with `keep_renewing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from broker.state import errors, store

logger = logging.getLogger(__name__)

RETRY_SECONDS = 0.1  # after a failed renewal, the next try this soon
CLOSE_TIMEOUT = 1.0
JOIN_TIMEOUT = 3.0


@dataclass
class Renewal:
    """What the keeper knows of one lease; written by the keeper, read by the election (a
    float and a bool: assignments, safe across threads)."""

    lease: int
    renewed_at: float  # monotonic: when the latest renewal that got an answer was sent
    expired: bool = False  # the store said the lease is gone
    renewals: int = 0


class Keeper(Protocol):
    """Keeps one lease alive until stopped (`ThreadKeeper`, `LoopKeeper`)."""

    renewal: Renewal

    def start(self) -> None: ...

    async def stop(self) -> None: ...


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
        deadline = renewal.renewed_at + ttl - safety
        left = deadline - time.monotonic()
        if left <= 0:
            notify()  # the election steps down; it stops this keeper
            await asyncio.sleep(RETRY_SECONDS)
            continue
        sent = time.monotonic()
        # half the time left, at least a third of the TTL: a slow answer (a busy store)
        # still renews in time, and a lost one leaves room for another try
        timeout = max(0.05, min(left, max(ttl / 3, left / 2)))
        try:
            await asyncio.wait_for(backing.keep_alive(renewal.lease), timeout)
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
        await asyncio.sleep(max(0.0, sent + ttl / 3 - time.monotonic()))


class LoopKeeper:
    """`keep_renewing` as a task of the running (main) event loop, on the election's store."""

    def __init__(
        self,
        backing: store.DurableStore,
        renewal: Renewal,
        *,
        ttl: float,
        safety: float,
        notify: Callable[[], None],
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.renewal = renewal
        self.backing = backing
        self.ttl = ttl
        self.safety = safety
        self._notify = notify
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        renewing = keep_renewing(
            self.backing,
            self.renewal,
            ttl=self.ttl,
            safety=self.safety,
            notify=self._notify,
            on_error=self._on_error,
        )
        self._task = asyncio.create_task(renewing, name="lease-keeper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class ThreadKeeper:
    """`keep_renewing` on a thread and event loop of its own, over its own connection."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[store.DurableStore]],
        renewal: Renewal,
        *,
        ttl: float,
        safety: float,
        notify: Callable[[], None],
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.renewal = renewal
        self.connect = connect
        self.ttl = ttl
        self.safety = safety
        self._notify = notify
        self._on_error = on_error
        self._main: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False  # read and written on the keeper's own loop only

    def start(self) -> None:
        """Start the thread (from the main loop: `notify` is called on it)."""
        self._main = asyncio.get_running_loop()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._serve, name=f"lease-keeper-{self.renewal.lease:x}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """Stop renewing, close the connection, and wait (off the main loop) for the thread
        to end; the lease itself is left to the caller (revoked, or let expire)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop already closed: it ended
            loop.call_soon_threadsafe(self._cancel)
        await asyncio.to_thread(thread.join, JOIN_TIMEOUT)
        if thread.is_alive():
            logger.warning("the lease keeper's thread did not end in %g s", JOIN_TIMEOUT)

    # ---- on the keeper's thread ----------------------------------------------------------

    def _serve(self) -> None:
        assert self._loop is not None
        try:
            self._loop.run_until_complete(self._run())
        except Exception:
            logger.exception("the lease keeper failed")
        finally:
            self._loop.close()

    def _cancel(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    def _wake_election(self) -> None:
        main = self._main
        if main is not None:
            with contextlib.suppress(RuntimeError):  # the main loop closed: nothing to wake
                main.call_soon_threadsafe(self._notify)

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        if self._stopped:  # stopped before the thread's loop ran
            return
        backing: store.DurableStore | None = None
        try:
            while backing is None:
                try:
                    backing = await self.connect()
                except errors.StoreError as exc:  # the election steps down at its deadline
                    if self._on_error is not None:
                        self._on_error()
                    logger.warning("the lease keeper cannot reach the store: %s", exc)
                    await asyncio.sleep(RETRY_SECONDS)
            await keep_renewing(
                backing,
                self.renewal,
                ttl=self.ttl,
                safety=self.safety,
                notify=self._wake_election,
                on_error=self._on_error,
            )
        except asyncio.CancelledError:
            pass  # stopped
        finally:
            if backing is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(backing.close(), CLOSE_TIMEOUT)
