"""Knocks: agents the followers hear from, so a leader cut off from its agents steps aside.

A leader that reaches etcd but not its agents (a partition between them, a broken route or
load balancer in front of one replica) keeps its lease: nothing in the election sees the
agents. They notice the silence, try the other replicas, and are refused there (409, not the
leader) while their jobs wait and their fences come closer. A follower that refuses an agent
records a *knock* (`note`): the key `/gpufed/knocks/<cluster>` written (at most once a
second per cluster) on a lease of its own that expires by itself. The leader watches those
keys from its term's start (`watch_term`) and notes, on its own clock, when each cluster last
knocked. `decide` (pure) then says whether to step aside: a majority of the clusters it
counts (those with a live session on it, and those knocking) have none (no session, or one
silent for two heartbeats) and knocked at a follower within `window`, continuously for
`hold`, and not within `settle` of the term's start (agents that are finding a new leader
knock first). The leader then resigns and does
not campaign for a hold-off (`electing.Election.step_aside`), so a replica the agents reach
takes over. `docs/design/failover.md` argues the rule and why it does not flap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from broker.jobs import fleet
from broker.state import electing, errors, store
from kits import tasks

logger = logging.getLogger(__name__)

PREFIX = "/gpufed/knocks/"
KNOCK_EVERY = 1.0  # a follower writes one cluster's knock at most this often
LEASE_TTL = 60  # the knocks' lease: they vanish this long after the last one at most
LEASE_RENEW_AFTER = 30.0  # a follower takes a new lease for its knocks this often
ASSESS_MAX_SECONDS = 0.5  # the leader looks at least this often
SILENT_BEATS = 2.0  # a session silent this many heartbeats does not count as one
BACKOFF_SECONDS = 1.0
STOP_SECONDS = 2.0  # the knocks' watch, cancelled, is waited for this long (twice at most)


@dataclass(frozen=True)
class Rule:
    """When a leader cut off from its agents steps aside, in seconds (`for_heartbeat`)."""

    window: float  # a knock counts this long after it was heard
    hold: float  # the cut must last this long ...
    settle: float  # ... and may not begin sooner than this after the term's start
    hold_off: float  # a replica that stepped aside does not campaign for this long

    @classmethod
    def for_heartbeat(cls, heartbeat: float) -> Rule:
        """An agent that lost its session knocks again every connect wait (at most two
        heartbeats) and a Retry-After: a window of four heartbeats and 2 s holds two knocks.
        The cut must outlast a heartbeat (at least a second), and agents find a new leader
        within about the window, so a term's first window is not judged. A replica that
        stepped aside waits until its successor has been judged by the same rule."""
        window = 4 * heartbeat + 2.0
        hold = max(1.0, heartbeat)
        return cls(window=window, hold=hold, settle=window, hold_off=window + hold + window)


@dataclass(frozen=True)
class Verdict:
    cut_since: float | None  # since when the leader has been cut off (None: it is not)
    step_aside: bool
    reason: str = ""


def decide(
    sessions: Set[str],
    knocks: Mapping[str, float],
    *,
    now: float,
    term_began: float,
    cut_since: float | None,
    rule: Rule,
) -> Verdict:
    """Whether the leader steps aside: `sessions` the clusters with a session on it, `knocks`
    when each cluster last knocked at a follower (this term), `cut_since` what the previous
    verdict said. Pure: no clock, no I/O."""
    knocking = {name for name, at in knocks.items() if now - at <= rule.window}
    away = knocking - sessions
    counted = len(sessions | knocking)
    if not away or 2 * len(away) <= counted:
        return Verdict(None, False)
    since = cut_since if cut_since is not None else now
    if now - since < rule.hold or now - term_began < rule.settle + rule.hold:
        return Verdict(since, False)
    reason = (
        f"{len(away)} of {counted} clusters reach followers and not this leader "
        f"for {now - since:.1f} s ({', '.join(sorted(away)[:5])})"
    )
    return Verdict(since, True, reason)


def encode_knock(replica: str, cluster: str) -> bytes:
    return json.dumps({"replica": replica, "cluster": cluster}, sort_keys=True).encode()


class Knocks:
    """A follower's knocks (`note`) and the leader's watch over them (`watch_term`)."""

    def __init__(
        self,
        backing: store.DurableStore,
        leadership: electing.Election,
        *,
        heartbeat: float,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.backing = backing
        self.leadership = leadership
        self.rule = Rule.for_heartbeat(heartbeat)
        self.heartbeat = heartbeat
        self.every = min(ASSESS_MAX_SECONDS, heartbeat / 2)
        self.on_error = on_error
        self._written: dict[str, float] = {}  # cluster -> when this follower last wrote
        self._writing: set[asyncio.Task[None]] = set()
        self._lease: tuple[int, float] | None = None  # (id, granted at)
        self.heard: dict[str, float] = {}  # on the leader: cluster -> when it last knocked

    # ---- a follower ------------------------------------------------------------------------

    def note(self, cluster: str) -> None:
        """An agent of `cluster` knocked (this replica refused it: not the leader)."""
        if self.leadership.is_leader:
            return  # the leader's own refusal (its work is starting): not a follower's knock
        now = time.monotonic()
        if now - self._written.get(cluster, -KNOCK_EVERY) < KNOCK_EVERY:
            return
        self._written[cluster] = now
        task = asyncio.create_task(self._write(cluster), name="knock")
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def _write(self, cluster: str) -> None:
        key = PREFIX + cluster
        try:
            lease = await self._current_lease()
            value = encode_knock(self.leadership.replica, cluster)
            await self.backing.commit(
                store.Txn(puts=[(key, value)], lease=lease, lease_keys=frozenset({key}))
            )
        except errors.StoreError as exc:
            self._lease = None  # expired, perhaps: a new one next time
            if self.on_error is not None:
                self.on_error()
            logger.info("recording a knock of %s failed: %s", cluster, exc)

    async def _current_lease(self) -> int:
        now = time.monotonic()
        if self._lease is None or now - self._lease[1] > LEASE_RENEW_AFTER:
            self._lease = (await self.backing.grant_lease(LEASE_TTL), now)
        return self._lease[0]

    # ---- the leader ------------------------------------------------------------------------

    async def watch_term(self, clusters: fleet.Fleet) -> None:
        """The leader's task: hear knocks committed after this term began, and step aside
        when `decide` says so. Runs until cancelled (the term's end)."""
        leader = self.leadership.leader
        if leader is None:
            return
        self.heard = {}
        began = time.monotonic()
        listening = asyncio.create_task(self._listen(leader.revision + 1), name="knocks-watch")
        cut_since: float | None = None
        try:
            while self.leadership.is_leader:
                await asyncio.sleep(self.every)
                now = time.monotonic()
                quiet = SILENT_BEATS * self.heartbeat  # past it, the watchdog closes it soon
                sessions = {
                    name
                    for name, c in clusters.clusters.items()
                    if c.link is not None and c.silent_for(now) <= quiet
                }
                verdict = decide(
                    sessions,
                    self.heard,
                    now=now,
                    term_began=began,
                    cut_since=cut_since,
                    rule=self.rule,
                )
                if verdict.cut_since is not None and cut_since is None:
                    logger.warning("agents knock at followers and not at this leader")
                cut_since = verdict.cut_since
                if verdict.step_aside:
                    self.leadership.step_aside(verdict.reason, hold_off=self.rule.hold_off)
                    return
        finally:  # its watch may swallow the cancellation: not waited for unbounded
            await tasks.stop_task(listening, timeout=STOP_SECONDS)

    async def _listen(self, revision: int) -> None:
        """Note when each cluster knocks (this replica's clock), from `revision` on; a store
        error is retried (the rule only ever waits for lack of knocks)."""
        while True:
            try:
                async for event in self.backing.watch(PREFIX, start_revision=revision):
                    revision = event.revision + 1
                    if event.type == store.EventType.PUT:
                        self.heard[event.key[len(PREFIX) :]] = time.monotonic()
            except errors.CompactedError:  # older than a knock that counts: from now on
                with contextlib.suppress(errors.StoreError):
                    revision = (await self.backing.list(PREFIX))[1] + 1
            except errors.StoreError as exc:
                if self.on_error is not None:
                    self.on_error()
                logger.warning("watching the agents' knocks failed: %s", exc)
            await asyncio.sleep(BACKOFF_SECONDS)
