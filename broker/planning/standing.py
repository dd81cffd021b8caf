"""Is a cluster scored down for failing to start what it accepted? Pure.

A cluster answers for the offers it accepts: an accept that does not name the gang's pods
(`api.messages.accept_problem`), or a job accepted and not Running within the broker's start
timeout (`jobs.starting`), is a strike against it. `limit` strikes within `window` seconds
score the cluster down for `cooldown` seconds: the planner then ranks it after every cluster
that is not (`planning.plan_cycle`'s rank, after the job's own `spec.clusters` order), so it
gets work only where nothing else fits. Its strikes are spent by scoring it down: once the
cooldown ends it needs `limit` new ones to be scored down again.

Called by `jobs.fleet` (the leader's view of each cluster) with monotonic seconds; no clock,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STRIKES = 3  # failures to start within the window that score a cluster down
WINDOW_SECONDS = 1800.0
COOLDOWN_SECONDS = 600.0


@dataclass(frozen=True)
class StrikePolicy:
    limit: int = STRIKES
    window: float = WINDOW_SECONDS
    cooldown: float = COOLDOWN_SECONDS


@dataclass(frozen=True)
class Standing:
    """A cluster's strikes still counted (their times) and until when it is scored down."""

    strikes: tuple[float, ...] = ()
    scored_down_until: float | None = None

    def scored_down(self, *, now: float) -> bool:
        return self.scored_down_until is not None and now < self.scored_down_until


def strike(standing: Standing, *, now: float, policy: StrikePolicy) -> Standing:
    """One more strike at `now`: the strikes older than the window are dropped; `limit` of
    them score the cluster down until `now + cooldown` and are spent. A strike while it is
    scored down counts towards the next time."""
    kept = (*kept_strikes(standing.strikes, now=now, window=policy.window), now)
    until = standing.scored_down_until
    if until is not None and until <= now:
        until = None
    if len(kept) >= policy.limit and until is None:
        return Standing(strikes=(), scored_down_until=now + policy.cooldown)
    return Standing(strikes=kept, scored_down_until=until)


def kept_strikes(strikes: Sequence[float], *, now: float, window: float) -> tuple[float, ...]:
    """The strikes of the last `window` seconds."""
    return tuple(at for at in strikes if now - at < window)
