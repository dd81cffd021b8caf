"""Leader election on a store lease: one broker replica leads, the others follow.

Run by `broker.app` as a background task (`Election.run`); `broker.dispatch.leading` starts
the leader's work when `leading` is set and stops it when `following` is. SQLite is the
one-replica mode: `Sole` always leads.

The leader holds one key, `/gpufed/leader` (JSON: replica id, advertise URL, term), attached
to a lease of `ttl` seconds that it keeps alive every ttl/3 (Kubernetes' Lease object with
etcd's lease for the expiry), from a task and store connection of its own (`state.renewing`)
so that a renewal does not queue behind the book's transactions. A candidate takes it
in one transaction that compares the key absent and the term counter `/gpufed/term`
unchanged since read, and puts both: the counter +1 (not leased: it outlives every leader)
and the leader key (leased). Exactly one candidate wins each vacancy, and the term grows by
one with each new leader (Kubernetes' `leaseTransitions`). Followers watch the key and
campaign the moment it is deleted: a leader that resigns (SIGTERM: the lease revoked) is
replaced within a round trip, one killed with -9 within its lease's TTL.

A campaign spends as little of its lease as it can, so that a slow store slows the leader down
rather than electing a new one every few seconds: the keeper's connection (opened once, kept
across terms) and the term counter come before the grant, the lease's local deadline counts
from when the grant was sent, and the first renewal is sent with the campaign's transaction:
two round trips of the lease's budget before the first renewal is answered. Renewals wait for
two of their measured round trips when the lease leaves room (`renewing`). A replica that
loses its lease within two TTLs of winning holds off campaigning for a TTL, doubled for each
such term in a row (`_back_off`); one that steps aside because its agents reach only followers
(`step_aside`, `dispatch.knocking`) holds off too. `docs/design/failover.md` argues both.

Fencing (etcd's `Mutex.IsOwner`): the leader key is written once per term, so its mod
revision names the term. Every leader write carries `fence()` — a compare on that revision —
so a deposed leader's in-flight transaction fails instead of landing, whatever its process
believes. `fence()` on a replica that does not lead raises NotLeaderError without writing.

A replica id is unique among the live replicas (`<hostname>:<port>` by default): a replica
restarted within its lease finds the key naming itself and takes it over at once (the
earlier process is gone, or its writes fail on the new fence).

A leader steps down (stops its work at once) when its lease is gone, when a fenced write
finds the key changed (`lost_fence`), when the key is deleted or taken, or when it could not
renew the lease for `ttl` less a safety margin: before the store can expire the lease and
let another replica lead. It never dies of a store error: errors are logged, counted
(`on_error`) and retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from broker.state import errors, renewing, store
from kits import tasks

logger = logging.getLogger(__name__)

LEADER_KEY = "/gpufed/leader"
TERM_KEY = "/gpufed/term"
DEFAULT_TTL = 5
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 2.0
REVOKE_TIMEOUT = 1.0
ASIDE_MEMORY = 600.0  # a step aside doubles the hold-off of those this recent ...
MAX_HOLD_OFF_FACTOR = 8  # ... up to this many times
HOLD_OFF_LOOK_SECONDS = 0.5  # holding off, the leader key is read again this often
SHORT_TERM_TTLS = 2.0  # a term that lost its lease sooner than this many TTLs backs off


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` for `event`; True if it is set. Unlike `asyncio.wait_for` on
    Python 3.11, a cancellation arriving as the event is set is never swallowed."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


@dataclass(frozen=True)
class Leader:
    """Who leads, as the leader key says."""

    replica: str
    url: str | None
    term: int
    revision: int  # the leader key's mod revision: what fenced writes compare


def encode_leader(replica: str, url: str | None, term: int) -> bytes:
    return json.dumps({"replica": replica, "url": url, "term": term}, sort_keys=True).encode()


def decode_leader(entry: store.Entry | store.WatchEvent) -> Leader:
    """The leader a key names; a value that does not decode names an unknown leader."""
    revision = entry.mod_revision if isinstance(entry, store.Entry) else entry.revision
    try:
        data = json.loads(entry.value)
        url = data.get("url")
        return Leader(str(data["replica"]), str(url) if url else None, int(data["term"]), revision)
    except (ValueError, TypeError, KeyError, AttributeError):
        logger.warning("the leader key does not decode: %r", entry.value[:200])
        return Leader("?", None, 0, revision)


class Leadership(Protocol):
    """Who leads, for the rest of the broker: `Election` (etcd) or `Sole` (SQLite)."""

    replica: str
    url: str | None  # this replica's advertise URL
    replicated: bool  # several replicas share the store: the book must follow it
    leading: asyncio.Event  # set while this replica leads
    following: asyncio.Event  # set while it does not

    @property
    def is_leader(self) -> bool: ...

    @property
    def term(self) -> int: ...

    @property
    def leader_url(self) -> str | None: ...

    def fence(self) -> store.Compare | None:
        """The compare every leader write carries (None: no fence needed); NotLeaderError
        on a replica that does not lead."""
        ...

    def lost_fence(self, exc: errors.ConflictError) -> bool:
        """True if `exc` is a fenced write refused because another term began (the replica
        steps down)."""
        ...

    def on_change(self, callback: Callable[[], None]) -> None: ...

    async def run(self) -> None: ...

    async def resign(self) -> None: ...


class Sole:
    """The one replica of an SQLite store: always the leader, of term 1, with no fence."""

    replicated = False

    def __init__(self, replica: str, url: str | None) -> None:
        self.replica = replica
        self.url = url
        self.leader = Leader(replica, url, 1, 0)
        self.leading = asyncio.Event()
        self.leading.set()
        self.following = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def term(self) -> int:
        return 1

    @property
    def leader_url(self) -> str | None:
        return self.leader.url

    def fence(self) -> store.Compare | None:
        return None

    def lost_fence(self, exc: errors.ConflictError) -> bool:
        return False

    def on_change(self, callback: Callable[[], None]) -> None:
        pass  # it never changes

    async def run(self) -> None:
        return None

    async def resign(self) -> None:
        return None


class Election:
    """Campaigns for the leader key, keeps the lease alive while leading, follows otherwise."""

    replicated = True

    def __init__(
        self,
        backing: store.DurableStore,
        *,
        replica: str,
        url: str | None,
        ttl: int = DEFAULT_TTL,
        on_error: Callable[[], None] | None = None,
        connect: Callable[[], Awaitable[store.DurableStore]] | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"the leader lease needs at least 1 s, not {ttl}")
        self.backing = backing
        self.replica = replica
        self.url = url
        self.ttl = ttl
        self.safety = min(1.0, ttl * 0.2)  # stop leading this long before the lease may end
        self.leading = asyncio.Event()
        self.following = asyncio.Event()
        self.following.set()
        self.leader: Leader | None = None  # as last seen (this replica while it leads)
        self.reason = ""  # why the latest term of this replica ended
        self._on_error = on_error
        self._callbacks: list[Callable[[], None]] = []
        self.connect = connect  # opens a store connection of the lease keeper's own
        self._lease: int | None = None
        self._renewal: renewing.Renewal | None = None  # the current term's lease, renewed
        self._stop = asyncio.Event()  # ends the current term
        self._resigned = False
        self._hold_until = 0.0  # monotonic: no campaign before (`step_aside`, `_back_off`)
        self._asides: list[float] = []  # when this replica stepped aside, lately
        self._own: store.DurableStore | None = None  # the lease keeper's connection (`connect`)
        self._term_began = 0.0  # monotonic: when the current (or last) term began
        self._short_terms = 0  # terms in a row that lost their lease soon after they began

    # ---- what the broker reads ------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()

    @property
    def term(self) -> int:
        return self.leader.term if self.leader is not None else 0

    @property
    def leader_url(self) -> str | None:
        return self.leader.url if self.leader is not None else None

    @property
    def _renewed_at(self) -> float:
        """When the latest renewal of this term's lease that got an answer was sent."""
        return self._renewal.renewed_at if self._renewal is not None else 0.0

    def renewed_within(self, seconds: float) -> bool:
        """True unless this replica leads on a lease last renewed more than `seconds` ago
        (when a pause of the whole process costs it the least: `telemetry.garbage`)."""
        return not self.is_leader or time.monotonic() - self._renewed_at <= seconds

    def pause_budget(self) -> float:
        """How long the whole process may stop now (a pause that holds the interpreter
        lock: nothing renews) and the leader still keep its term: until it would step
        down for a lease not renewed. Infinite while it does not lead."""
        if not self.is_leader:
            return float("inf")
        return self._renewed_at + self.ttl - self.safety - time.monotonic()

    def fence(self) -> store.Compare | None:
        leader = self.leader
        if not self.is_leader or leader is None:
            raise errors.NotLeaderError(
                f"replica {self.replica} is not the leader", revisions={LEADER_KEY: 0}
            )
        return store.Compare(LEADER_KEY, leader.revision)

    def lost_fence(self, exc: errors.ConflictError) -> bool:
        if LEADER_KEY not in exc.revisions:
            return False
        self.step_down("a fenced write found another term's leader key")
        return True

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def step_down(self, reason: str) -> None:
        """Stop leading now (the leader work stops when `following` is set)."""
        if not self.is_leader:
            return
        self.reason = reason
        logger.warning("replica %s stops leading (term %d): %s", self.replica, self.term, reason)
        self.leader = None
        self.leading.clear()
        self.following.set()
        self._stop.set()
        self._changed()

    def step_aside(self, reason: str, *, hold_off: float) -> None:
        """Stop leading and let another replica lead (the lease is revoked as the term
        ends): no campaign for `hold_off` seconds, doubled for each step aside within
        `ASIDE_MEMORY` (at most `MAX_HOLD_OFF_FACTOR` times), so replicas that cannot keep the
        lead for this reason do not pass it back and forth."""
        if not self.is_leader:
            return
        now = time.monotonic()
        self._asides = [at for at in self._asides if now - at < ASIDE_MEMORY] + [now]
        factor = min(MAX_HOLD_OFF_FACTOR, 2 ** (len(self._asides) - 1))
        self._hold(hold_off * factor)
        self.step_down(f"{reason}; stepping aside, no campaign for {hold_off * factor:g} s")

    def _hold(self, seconds: float) -> None:
        self._hold_until = max(self._hold_until, time.monotonic() + seconds)

    @property
    def holding_off(self) -> float:
        """Seconds until this replica campaigns again (0: it may now)."""
        return max(0.0, self._hold_until - time.monotonic())

    async def resign(self) -> None:
        """Give the leadership up and campaign no more (SIGTERM): the lease is revoked, its
        key deleted, and a follower takes over within a round trip."""
        self._resigned = True
        lease, self._lease = self._lease, None
        self.step_down("resigned")
        if lease is not None:
            await self._revoke(lease)

    # ---- the election ---------------------------------------------------------------------

    async def run(self) -> None:
        """Campaign, lead, follow, until cancelled or resigned; never dies of an error."""
        delay = BACKOFF_INITIAL
        try:
            while not self._resigned:
                tasks.check_cancelled()
                try:
                    await self._round()
                    delay = BACKOFF_INITIAL
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.step_down(f"the election failed: {exc}")
                    if self._on_error is not None:
                        self._on_error()
                    logger.warning("leader election: %s; again in %.2f s", exc, delay)
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(delay * 2, BACKOFF_MAX)
        finally:
            own, self._own = self._own, None
            if own is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(own.close(), REVOKE_TIMEOUT)

    async def _round(self) -> None:
        current = await self.backing.get(LEADER_KEY)
        if self.holding_off and (current is None or decode_leader(current).replica == self.replica):
            self._note(None)  # vacant, and this replica holds off: others campaign
            await asyncio.sleep(min(self.holding_off, HOLD_OFF_LOOK_SECONDS))
            return
        if current is None or decode_leader(current).replica == self.replica:
            # vacant, or held by this replica before (restarted within its lease: a replica
            # id is unique among live replicas): take it
            self._note(None)
            if await self._campaign(current):
                await self._lead()
            return
        self._note(decode_leader(current))
        await self._wait_change(current.mod_revision)

    def _note(self, leader: Leader | None) -> None:
        """Who leads, as a follower sees it."""
        if self.is_leader or leader == self.leader:
            return
        self.leader = leader
        if leader is not None:
            logger.info("replica %s follows %s (term %d)", self.replica, leader.url, leader.term)
        self._changed()

    async def _wait_change(self, revision: int) -> None:
        """Return once the leader key is deleted (campaign), or after `ttl` (look again)."""
        gone = asyncio.Event()

        async def follow() -> None:
            async for event in self.backing.watch(LEADER_KEY, start_revision=revision + 1):
                if event.key != LEADER_KEY:
                    continue
                if event.type == store.EventType.DELETE:
                    self._note(None)
                    gone.set()
                    return
                self._note(decode_leader(event))

        following = asyncio.create_task(follow(), name="leader-watch")
        try:
            await wait_event(gone, self.ttl)
        finally:
            following.cancel()
            with contextlib.suppress(BaseException):  # its stream ends on its own time
                await asyncio.wait({following}, timeout=REVOKE_TIMEOUT)
        if following.done() and not following.cancelled() and following.exception():
            raise following.exception()  # type: ignore[misc]

    async def _campaign(self, current: store.Entry | None) -> bool:
        """Take the leader key (vacant, or `current`: this replica's own) for the next term;
        True if this replica won."""
        if self._resigned:
            return False
        # what costs no lease time comes first: the keeper's connection, the term counter
        keeper = await self._keeper_store()
        counter = await self.backing.get(TERM_KEY)
        term = int(counter.value) + 1 if counter is not None else 1
        started = time.monotonic()  # the lease runs from no earlier than this
        lease = await self.backing.grant_lease(self.ttl)
        renewed = time.monotonic()  # the first renewal goes with the campaign's transaction
        first = asyncio.ensure_future(keeper.keep_alive(lease))
        first.add_done_callback(tasks.retrieve)
        try:
            revision = await self.backing.commit(
                store.Txn(
                    compares=[
                        store.Compare(LEADER_KEY, current.mod_revision if current else 0),
                        store.Compare(TERM_KEY, counter.mod_revision if counter else 0),
                    ],
                    puts=[
                        (TERM_KEY, str(term).encode()),
                        (LEADER_KEY, encode_leader(self.replica, self.url, term)),
                    ],
                    lease=lease,
                    lease_keys=frozenset({LEADER_KEY}),
                )
            )
        except BaseException as exc:
            first.cancel()
            await self._revoke(lease)
            if isinstance(exc, errors.ConflictError):
                return False  # another replica won this vacancy: follow it
            raise
        if self._resigned_meanwhile():  # SIGTERM while campaigning: give it back at once
            first.cancel()
            await self._revoke(lease)
            return False
        renewal = renewing.Renewal(lease, renewed_at=started)
        if await renewing.answered(first, by=started + self.ttl - self.safety):
            renewal.renewed_at = renewed
            renewal.note_round_trip(time.monotonic() - renewed)
        self._lease = lease
        self._renewal = renewal
        self._term_began = time.monotonic()
        self.leader = Leader(self.replica, self.url, term, revision)
        self.reason = ""
        self._stop.clear()
        self.following.clear()
        self.leading.set()
        logger.warning("replica %s leads, term %d (fence at %d)", self.replica, term, revision)
        self._changed()
        return True

    def _resigned_meanwhile(self) -> bool:
        return self._resigned

    async def _lead(self) -> None:
        """Keep the lease alive (`renewing`: every ttl/3, over a connection of its own when
        the store can open one) and look at the leader key, until the term ends."""
        renewal = self._renewal
        if renewal is None:
            return
        keeper = self._keeper(renewal)
        keeper.start()
        try:
            while self.is_leader:
                tasks.check_cancelled()
                deadline = renewal.renewed_at + self.ttl - self.safety
                pause = min(self.ttl / 3, max(0.0, deadline - time.monotonic()))
                await wait_event(self._stop, pause)
                if not self.leading.is_set():  # stepped down while waiting
                    break
                if renewal.expired:
                    self.step_down("its lease expired")
                    break
                if renewal.renewed_at + self.ttl - self.safety <= time.monotonic():
                    self.step_down(f"its lease was not renewed for {self.ttl - self.safety:g} s")
                    break
                self._stop.clear()  # still leading: the keeper's wake-up, not a step-down
                await self._check_key()
        finally:
            self._back_off()  # before any wait: the term's end is known to all
            await keeper.stop()
            lease, self._lease = self._lease, None
            self.step_down(self.reason or "the term ended")
            if lease is not None:
                await self._revoke(lease)

    def _back_off(self) -> None:
        """After a term that lost its lease within `SHORT_TERM_TTLS` lease times of its
        start: no campaign for a lease time, doubled for each such term in a row (at most
        `MAX_HOLD_OFF_FACTOR` times), so a replica that cannot keep the lead leaves it to
        the others rather than winning it back and losing it again."""
        lasted = time.monotonic() - self._term_began
        if "lease" not in self.reason or lasted >= SHORT_TERM_TTLS * self.ttl:
            self._short_terms = 0
            return
        self._short_terms += 1
        seconds = self.ttl * min(MAX_HOLD_OFF_FACTOR, 2 ** (self._short_terms - 1))
        logger.warning(
            "replica %s lost its lease %.1f s into its term: no campaign for %g s",
            self.replica,
            lasted,
            seconds,
        )
        self._hold(seconds)

    def _keeper(self, renewal: renewing.Renewal) -> renewing.Keeper:
        keeping = renewing.Keeping(
            renewal, self.ttl, self.safety, notify=self._stop.set, on_error=self._on_error
        )
        return renewing.Keeper(self._own or self.backing, keeping)

    async def _keeper_store(self) -> store.DurableStore:
        """The lease keeper's connection, opened once and kept across terms (opening it
        costs round trips a campaign must not spend of its lease); the election's store
        when it cannot be opened, or none is to be (`connect` None)."""
        if self._own is None and self.connect is not None:
            try:
                self._own = await self.connect()
            except errors.StoreError as exc:
                if self._on_error is not None:
                    self._on_error()
                logger.warning("the lease keeper's connection: %s; using the election's", exc)
        return self._own or self.backing

    async def _check_key(self) -> None:
        """Step down if the leader key is gone or another term's (a store error: looked at
        again next time; the lease's deadline is what bounds a term without answers)."""
        leader = self.leader
        if leader is None:
            return
        try:
            entry = await asyncio.wait_for(self.backing.get(LEADER_KEY), self.ttl / 3)
        except (errors.StoreError, TimeoutError) as exc:
            if self._on_error is not None:
                self._on_error()
            logger.warning("reading the leader key failed: %s", str(exc) or "timed out")
            return
        if self.is_leader and (entry is None or entry.mod_revision != leader.revision):
            self.step_down("the leader key was deleted or taken")

    async def _revoke(self, lease: int) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.backing.revoke_lease(lease), REVOKE_TIMEOUT)

    def _changed(self) -> None:
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                logger.exception("leadership change callback failed")
