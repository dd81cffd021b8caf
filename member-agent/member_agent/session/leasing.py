"""The agent's cluster lease: renewed by every message from the broker, a fence when it lapses.

At no moment may two copies of a job run. The broker runs a lost cluster's jobs elsewhere once
the cluster has been away for its grace (`--lost-after`); before then, the agent that cannot
hear the broker (a partition, a broker that stopped answering) stops its own copies. The rule
both ends follow, and why it holds, is `broker.api.leases`.

`ClusterLease` is renewed (`renew`) by every message of the broker on a welcomed session
(`connecting.Connector`: the welcome, heartbeats, offers, cancels, acks). Its terms come from
the welcome (`set_terms`: the broker's heartbeat and grace). `keep` runs as long as the session
loop: when the lease has not been renewed for `fence_after` seconds it calls `on_lapse` once
(`jobs.handling.JobHandler.fence`: no new pods; the pods of jobs whose `clusterLost` policy is
`requeue` deleted, with `grace` seconds to stop), and the next renewal calls `on_renew`
(`JobHandler.unfence`: offers are placed again).

The agent's start counts as a renewal: an agent restarted while its broker is away gets one
lease from its start. An agent that is not running (killed, frozen) cannot fence; its pods are
fenced by the broker when it returns (their attempt was moved past: cancelled as `Stale`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from broker.api import leases

logger = logging.getLogger(__name__)


class OnLapse(Protocol):
    def __call__(self, *, reason: str, grace_seconds: float) -> Awaitable[object]: ...


class ClusterLease:
    def __init__(
        self,
        *,
        requested: float | None,
        heartbeat: float,
        failure_grace: float,
        on_lapse: OnLapse,
        on_renew: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requested = requested  # --fence-after; None: as late as the grace allows
        self.failure_grace = failure_grace
        self.on_lapse = on_lapse
        self.on_renew = on_renew
        self.clock = clock
        self.lost_after: float | None = None  # the broker's grace, once a welcome said it
        self.fence_after = leases.fence_after(requested, heartbeat=heartbeat, lost_after=None)
        self.renewed_at = clock()
        self.lapsed = False
        self.lapses = 0
        self._wake = asyncio.Event()

    def set_terms(self, *, heartbeat: float, lost_after: float | None) -> None:
        """The terms of a welcome: the broker's heartbeat and its grace (None: not said)."""
        self.lost_after = lost_after
        fence_after = leases.fence_after(self.requested, heartbeat=heartbeat, lost_after=lost_after)
        if fence_after != self.fence_after:
            logger.info(
                "fencing after %g s without word from the broker (its grace: %s)",
                fence_after,
                "not said" if lost_after is None else f"{lost_after:g} s",
            )
        self.fence_after = fence_after
        self._wake.set()

    @property
    def grace(self) -> float:
        """Seconds the pods a fence deletes get to stop."""
        return leases.fence_grace(
            self.fence_after, lost_after=self.lost_after, failure_grace=self.failure_grace
        )

    def remaining(self) -> float:
        return self.renewed_at + self.fence_after - self.clock()

    def renew(self) -> None:
        """The broker said something on a live session."""
        self.renewed_at = self.clock()
        if self.lapsed:
            self.lapsed = False
            logger.info("cluster lease renewed: the agent places offers again")
            self.on_renew()
            self._wake.set()

    async def keep(self) -> None:
        """Fence once each time the lease lapses; runs until cancelled."""
        while True:
            remaining = self.remaining()
            if self.lapsed or remaining > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), None if self.lapsed else remaining)
                continue
            self.lapsed = True
            self.lapses += 1
            silent = self.clock() - self.renewed_at
            reason = (
                f"no word from the broker for {silent:.1f} s (the cluster lease is "
                f"{self.fence_after:g} s)"
            )
            logger.warning("cluster lease lapsed: %s; fencing", reason)
            try:
                await self.on_lapse(reason=reason, grace_seconds=self.grace)
            except Exception:  # the lease is kept whatever one fence did
                logger.exception("fencing failed")
