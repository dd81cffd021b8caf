"""Retrying one request to the API server within a deadline.

A busy control plane answers some requests 429 (API Priority and Fairness), or 5xx, or not at
all (a timeout, a connection reset behind a load balancer). Giving up a whole gang for one such
answer deletes the pods already made and offers the job again into the same overload, so the
Kubernetes backend sends each write again (`call`) while its failure is an
`errors.TemporaryBackendError`: after the server's `Retry-After` when it gave one, else after an
exponential backoff with jitter, and only while the request's deadline (`RetryPolicy.deadline`)
leaves time for the wait and another try; each try gets what is left of the deadline, at most
the request timeout, so the deadline bounds the whole call. A permanent error ends it at once.

A try whose failure is ambiguous (the server may have applied it and the answer was lost) is
sent again all the same: the caller makes the request idempotent (a create that finds its own
object is a success, a delete that finds nothing is done).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from member_agent.cluster import errors
from member_agent.cluster.kubernetes import watching

logger = logging.getLogger(__name__)

T = TypeVar("T")
Sleep = Callable[[float], Awaitable[None]]
DEFAULT_DEADLINE_SECONDS = 20.0  # within the broker's 30 s for an offer's answer
DEFAULT_BACKOFF = watching.Backoff(initial=0.1, maximum=5.0, factor=2.0, jitter=0.5)


@dataclass(frozen=True)
class RetryPolicy:
    """How long one request is tried (`deadline`, seconds from its first try) and how long
    to wait between tries: the server's Retry-After stretched by up to `backoff.jitter` of it
    (so a throttled gang does not come back in one burst), and never less than the backoff's
    delay for that try. `sleep` and `clock` are the event loop's unless a test passes its own."""

    deadline: float = DEFAULT_DEADLINE_SECONDS
    backoff: watching.Backoff = DEFAULT_BACKOFF
    sleep: Sleep = asyncio.sleep
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, tries: int, retry_after: float | None) -> float:
        """The wait after the `tries`-th failed try."""
        backoff = self.backoff.delay(tries, rng=self.rng)
        if retry_after is None:
            return backoff
        stretched = retry_after * (1.0 + self.backoff.jitter * self.rng.random())
        return max(stretched, backoff)


NO_RETRY = RetryPolicy(deadline=0.0)


async def call(
    policy: RetryPolicy,
    what: str,
    attempt: Callable[[float], Awaitable[T]],
    *,
    timeout: float,
) -> T:
    """`attempt(seconds)` until it returns, raises anything but a TemporaryBackendError, or
    the deadline leaves no room for the wait and another try (then its last error is
    raised). `seconds` is the try's own timeout: what is left of the deadline, at most
    `timeout` (all of `timeout` when the policy has no deadline: one try)."""
    started = policy.clock()
    tries = 0
    while True:
        left = policy.deadline - (policy.clock() - started)
        budget = timeout if policy.deadline <= 0 else max(0.001, min(timeout, left))
        try:
            return await attempt(budget)
        except errors.TemporaryBackendError as exc:
            tries += 1
            wait = policy.delay(tries, exc.retry_after)
            left = policy.deadline - (policy.clock() - started)
            if wait >= left:
                if tries > 1:
                    logger.warning("%s: giving up after %d tries: %s", what, tries, exc)
                raise
            logger.debug("%s: try %d failed (%s), again in %.2f s", what, tries, exc, wait)
        await policy.sleep(wait)
