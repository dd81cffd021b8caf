"""The broker's live view of member clusters: sessions, summaries, health, in-flight offers.

Held by the job collaborators (the cycle reads summaries less in-flight offers; reports and
cancels send through `send`) and kept current by `broker.dispatch.connecting`, which owns the
agent sessions behind each `AgentLink`. An offer in flight keeps the time it went out: one
neither accepted nor rejected within `offer_timeout` is withdrawn (`reports.withdraw_unanswered`,
from the sessions' watchdog). At most `max_offers_in_flight` offers are out unanswered to one
agent (`snapshot`: the cluster's `offer_slots`): a burst of thousands of jobs that all fit on
one cluster is not sent at once to an agent that answers a few hundred a second (Kubernetes
pod creation, tens): the rest go to other clusters, or wait there as ClusterBusy, instead of
timing out by the thousand and going round again.

That limit adapts to each agent (additive increase, multiplicative decrease, as TCP's
congestion window): a watchdog pass that withdraws offers of a cluster halves its window
(`offers_timed_out`, not below `WINDOW_FLOOR`), and each offer answered grows it back by
`WINDOW_GROWTH`, up to `max_offers_in_flight`. An agent that answers more slowly than the
flag assumed (a Kubernetes agent creates tens of pods a second; a simulated one starved of
CPU, a few hundred) then has as many offers out as it answers within the timeout, and the
rest wait as ClusterBusy or go elsewhere instead of timing out and going round again.

A cluster answers for what it accepts (`planning.standing`): an accept that does not name the
gang's pods, or a job accepted and not Running within `start_timeout` (`jobs.starting`), is a
strike (`Fleet.strike`); enough of them score the cluster down for a while (`snapshot`:
`ClusterCapacity.scored_down`), which `GET /v1/clusters` shows with the reason. Strikes are
the leader's memory of this term: a new leader starts with none.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from broker.api import inventory, messages, status
from broker.planning import fitting, snapshot, standing

logger = logging.getLogger(__name__)

MAX_OFFERS_IN_FLIGHT = 1000  # per agent: seconds of a simulated agent's answers; two cycles' budget
WINDOW_FLOOR = 16  # an agent's offer window is never halved below this
WINDOW_GROWTH = 0.1  # offers the window grows by per offer answered (halved: back in 5 x)


class AgentLink(Protocol):
    """How the broker talks to one connected agent (a WebSocket in production)."""

    async def send(self, message: messages._Msg) -> None: ...

    async def close(self, *, reason: str) -> None: ...


@dataclass
class InFlight:
    fit: fitting.Fit
    sent_at: float = 0.0  # monotonic: when the offer went out
    accepted: bool = False
    attempt: int = 1  # the job's attempt the offer is of (an answer names it)
    heard: bool = False  # its answer was read, not applied yet (`Offers.hear`)

    @property
    def answered(self) -> bool:
        return self.accepted or self.heard


class Offers(dict[str, InFlight]):
    """A cluster's offers in flight, by job id, in the order sent: a dict that counts what
    leaves it (`removals`: an offer popped, deleted, replaced or cleared), so that a kept
    capacity knows in O(1) whether it still holds only offers deducted once; and how many
    of them the agent answered (`answered`: accepted, or an answer read and not applied
    yet), so the unanswered ones are counted in O(1)."""

    def __init__(self) -> None:
        super().__init__()
        self.removals = 0
        self.answered = 0

    @property
    def unanswered(self) -> int:
        """Offers the agent has not answered, as far as the broker has read: what its offer
        window bounds. An answer waiting in the broker's inbox is the broker's lag, not the
        agent's (the inbox and TCP hold a broker that falls behind)."""
        return len(self) - self.answered

    def hear(self, job_id: str, attempt: int) -> bool:
        """The agent's answer to the job's offer (of `attempt`) was read: no longer
        unanswered. False if no such offer waits for one."""
        flight = self.get(job_id)
        if flight is None or flight.answered or flight.attempt != attempt:
            return False
        flight.heard = True
        self.answered += 1
        return True

    def accept(self, job_id: str) -> bool:
        """Mark the job's offer accepted; False if it is not here or was already."""
        flight = self.get(job_id)
        if flight is None or flight.accepted:
            return False
        self.answered += not flight.heard
        flight.accepted = True
        return True

    def _left(self, flight: InFlight) -> None:
        self.removals += 1
        self.answered -= flight.answered

    def __setitem__(self, job_id: str, flight: InFlight) -> None:
        old = self.get(job_id)
        if old is not None:  # replaced: it keeps its old place, so it counts as gone
            self._left(old)
        super().__setitem__(job_id, flight)
        self.answered += flight.answered

    def __delitem__(self, job_id: str) -> None:
        self._left(self[job_id])
        super().__delitem__(job_id)

    def pop(self, job_id: str, default: Any = None) -> Any:
        flight = super().pop(job_id, None)
        if flight is None:
            return default
        self._left(flight)
        return flight

    def clear(self) -> None:
        if self:
            self.removals += 1
        super().clear()
        self.answered = 0

    def popitem(self) -> tuple[str, InFlight]:
        job_id, flight = super().popitem()
        self._left(flight)
        return job_id, flight

    def update(self, *args: Any, **kwargs: Any) -> None:
        for job_id, flight in dict(*args, **kwargs).items():
            self[job_id] = flight

    def setdefault(self, job_id: str, default: InFlight) -> InFlight:
        if job_id not in self:
            self[job_id] = default
        return self[job_id]


@dataclass
class Cluster:
    name: str
    link: AgentLink | None = None
    epoch: int = 0
    summary: inventory.ClusterSummary | None = None
    last_seen: float = 0.0
    disconnected_at: float | None = None
    lost: bool = False
    inflight: Offers = field(default_factory=Offers)
    # how many offers may be out unanswered (None: the fleet's `max_offers_in_flight`)
    offer_window: float | None = None
    window_cut_at: float = 0.0  # monotonic: when the window was last halved
    # job id -> summary seq at its rejection: excluded for that job until a newer summary
    rejected: dict[str, int] = field(default_factory=dict)
    # why the broker refused what the agent sent (no new work until a good full summary)
    degraded: str | None = None
    # why the latest cycle set the cluster aside (planning it raised); tried again each cycle
    planning_error: str | None = None
    # the session whose messages the broker is behind on (applying its hello, its inbox
    # full): what it sent waits unread, so its silence is the broker's, not the agent's
    behind: AgentLink | None = None
    behind_since: float = 0.0  # monotonic: since when (`behind`)
    unapplied: int = 0  # the current session's messages read, not yet applied
    applied_read_at: float = 0.0  # monotonic: when the last one applied was read
    # the capacity of `summary` with the first `_assumed` offers of `inflight` deducted
    # (`capacity`), as of `_removals_seen` of its removals: a cycle deducts only the offers
    # sent since; a new summary, or an offer gone, starts it again
    _view: snapshot.ClusterCapacity | None = field(default=None, repr=False)
    _view_of: inventory.ClusterSummary | None = field(default=None, repr=False)
    _assumed: int = field(default=0, repr=False)
    _removals_seen: int = field(default=-1, repr=False)
    _accepted: list[str] = field(default_factory=list, repr=False)  # since the last summary
    # its strikes for failing to start what it accepted, and whether it is scored down for
    # them (monotonic times; kept across its sessions: a reconnect does not clear them)
    starts: standing.Standing = field(default_factory=standing.Standing)
    scored_down_reason: str | None = None  # the strike that scored it down, in words

    def forget_offers(self) -> None:
        """The session ended: no offer is in flight any more."""
        self.inflight.clear()
        self._accepted.clear()

    def accept(self, job_id: str) -> bool:
        """The agent accepted the job's offer: it stays deducted until the next summary (which
        shows the placement). False if no such offer waited for an answer."""
        if not self.inflight.accept(job_id):
            return False
        self._accepted.append(job_id)
        return True

    def capacity(
        self, *, offer_slots: int | None = None, scored_down: bool = False
    ) -> snapshot.ClusterCapacity:
        """The summary's capacity, every offer in flight deducted in the order they were sent,
        with the offer slots and standing given.

        Copy on write: what it returns is never changed afterwards (a planning cycle, which
        changes its snapshot, replaces a cluster with a changed copy), so while a cluster's
        summary, offers, slots and standing stay as they were, it is the same object, shared
        by the snapshots that hold it; offers sent since are deducted on a copy."""
        assert self.summary is not None
        inflight = self.inflight
        view = self._view
        self._view = None  # kept only whole: after a deduction that raises, built again
        if (
            view is None
            or self._view_of is not self.summary
            or self._removals_seen != inflight.removals
        ):
            view = snapshot.ClusterCapacity.from_summary(self.summary, healthy=True)
            for flight in inflight.values():
                fitting.assume(view, flight.fit)
        elif self._assumed < len(inflight):
            # none gone since: the offers sent since are the last ones (dicts keep order)
            view = view.copy()
            for flight in itertools.islice(inflight.values(), self._assumed, None):
                fitting.assume(view, flight.fit)
        if view.offer_slots != offer_slots or view.scored_down != scored_down:
            view = view.reshaped(offer_slots=offer_slots, scored_down=scored_down)
        self._view, self._view_of = view, self.summary
        self._assumed, self._removals_seen = len(inflight), inflight.removals
        return view

    def silent_for(self, now: float) -> float:
        """Seconds since the agent was last heard (0 while the broker is behind on it)."""
        if self.behind is not None and self.behind is self.link:
            return 0.0
        return now - self.last_seen

    def heard_until(self, now: float) -> float:
        """How far the broker has applied what the agent sent: `now` once caught up; else
        the time it read the last message it applied (or fell behind): an answer sent since
        may be waiting unread or unapplied, and an offer is not overdue for it."""
        until = now
        if self.behind is not None and self.behind is self.link:
            until = min(until, self.behind_since)
        if self.unapplied > 0:
            until = min(until, self.applied_read_at)
        return until

    @property
    def connected(self) -> bool:
        return self.link is not None

    def health(self, *, now: float, stale_after: float) -> str:
        if self.lost:
            return "Lost"
        if self.degraded is not None:
            return "Degraded"
        if self.link is None or self.silent_for(now) > stale_after:
            return "Unreachable"
        if self.summary is None:
            return "Connecting"
        return "Degraded" if self.planning_error is not None else "Ready"

    @property
    def reason(self) -> str | None:
        """Why the cluster is Degraded, if it is."""
        return self.degraded or self.planning_error

    def plannable(self, *, now: float, stale_after: float) -> bool:
        """May the next cycle plan on it? (A planning error is tried again each cycle.)"""
        return (
            self.link is not None
            and not self.lost
            and self.degraded is None
            and self.summary is not None
            and self.silent_for(now) <= stale_after
        )

    def unanswered(self, *, now: float, timeout: float) -> list[str]:
        """The jobs whose offers are neither accepted nor rejected `timeout` seconds on."""
        return [
            job_id
            for job_id, flight in self.inflight.items()
            if not flight.accepted and now - flight.sent_at > timeout
        ]

    def scored_down(self, *, now: float) -> bool:
        """Is it ranked after the others for failing to start jobs (`planning.standing`)?"""
        return self.starts.scored_down(now=now)

    def degrade(self, reason: str) -> None:
        """The agent sent something the broker refused: no new work until it sends a good
        full summary (at the start of its next session)."""
        self.degraded = reason

    def apply_summary(self, message: messages.Summary) -> None:
        incoming = message.summary
        if message.full:
            self.degraded = None
        if message.full or self.summary is None:
            self.summary = incoming
        else:
            models = {m.model: m for m in self.summary.models}
            models.update({m.model: m for m in incoming.models})
            self.summary = self.summary.model_copy(
                update={
                    "models": sorted(models.values(), key=lambda m: m.model),
                    "seq": incoming.seq,
                    "fragmentation_milli": incoming.fragmentation_milli,
                    "labels": incoming.labels,
                    "gpu_health": incoming.gpu_health,
                }
            )
        # the agent sends a summary after each accepted offer: accepted placements are in it
        for job_id in self._accepted:
            flight = self.inflight.get(job_id)
            if flight is not None and flight.accepted:
                del self.inflight[job_id]
        self._accepted.clear()
        seq = self.summary.seq
        self.rejected = {job: at for job, at in self.rejected.items() if at >= seq}


class Fleet:
    """Every cluster the broker has heard of, connected or not."""

    def __init__(
        self,
        *,
        stale_after: float = 15.0,
        cancel_grace_seconds: float = 30.0,
        offer_timeout_seconds: float = 30.0,
        max_offers_in_flight: int | None = MAX_OFFERS_IN_FLIGHT,
        start_timeout_seconds: float = 600.0,
        strikes: standing.StrikePolicy | None = None,
    ) -> None:
        self.clusters: dict[str, Cluster] = {}
        self.stale_after = stale_after
        self.cancel_grace = cancel_grace_seconds
        self.offer_timeout = offer_timeout_seconds  # an offer unanswered this long is withdrawn
        self.max_offers_in_flight = max_offers_in_flight  # per agent, unanswered (None: any)
        # a job dispatched and not Running this long is withdrawn (`jobs.starting`)
        self.start_timeout = start_timeout_seconds
        self.strikes = strikes or standing.StrikePolicy()
        self.changed = asyncio.Event()

    async def send(self, cluster_name: str | None, message: messages._Msg) -> bool:
        """Send to the cluster's agent if it is connected; False if it is not (or went)."""
        cluster = self.clusters.get(cluster_name) if cluster_name else None
        if cluster is None or cluster.link is None:
            return False
        try:
            await cluster.link.send(message)
        except ConnectionError:
            logger.warning("%s not sent: %s disconnected", type(message).__name__, cluster_name)
            return False
        return True

    async def send_cancel(
        self,
        cluster_name: str | None,
        job_id: str,
        *,
        epoch: int,
        reason: str,
        attempt: int,
        grace_seconds: float | None = None,
    ) -> bool:
        """Ask the cluster's agent to delete one attempt's pods (grace: `cancel_grace`, or
        `grace_seconds`: a preemption's, the job's `spec.preemption.gracePeriodSeconds`)."""
        cancel = messages.Cancel(
            job_id=job_id,
            epoch=epoch,
            reason=reason,
            grace_seconds=self.cancel_grace if grace_seconds is None else grace_seconds,
            attempt=attempt,
        )
        return await self.send(cluster_name, cancel)

    def get(self, name: str) -> Cluster:
        if name not in self.clusters:
            self.clusters[name] = Cluster(name=name)
        return self.clusters[name]

    async def attach(self, name: str, link: AgentLink, *, epoch: int) -> Cluster:
        cluster = self.get(name)
        old = cluster.link
        cluster.link = link
        cluster.epoch = epoch
        cluster.last_seen = time.monotonic()
        cluster.disconnected_at = None
        cluster.lost = False
        cluster.summary = None
        cluster.forget_offers()
        cluster.rejected.clear()
        if old is not None:
            await old.close(reason="replaced by a newer session")
        return cluster

    def detach(self, name: str, link: AgentLink) -> None:
        cluster = self.clusters.get(name)
        if cluster is None or cluster.link is not link:
            return
        cluster.link = None
        cluster.disconnected_at = time.monotonic()
        cluster.forget_offers()
        self.changed.set()

    def start_term(self, names: Iterable[str], *, now: float) -> None:
        """A new leader's term begins (or a restart): every cluster known, and each one the
        book places jobs on (`names`), counts as away since `now` until its agent connects:
        the lost-cluster grace runs for it from here, never from an earlier term."""
        for name in names:
            self.get(name)
        for cluster in self.clusters.values():
            if cluster.link is None:
                cluster.disconnected_at = now
                cluster.lost = False
                cluster.forget_offers()
                cluster.rejected.clear()
        self.changed.set()

    def views(self, *, now: float, running: Mapping[str, int]) -> list[inventory.ClusterView]:
        """What `GET /v1/clusters` shows of each cluster, by name (`now`: monotonic)."""
        out = []
        for name in sorted(self.clusters):
            cluster = self.clusters[name]
            models = []
            if cluster.summary is not None:
                for m in cluster.summary.models:
                    models.append(
                        inventory.ModelTotals(
                            model=m.model,
                            total=m.total_gpus,
                            free=m.free_gpus,
                            allocated=m.total_gpus - m.free_gpus - m.unavailable_gpus,
                            unavailable=m.unavailable_gpus,
                            mig=_mig_view(m),
                        )
                    )
            seen = round(now - cluster.last_seen, 3) if cluster.last_seen else None
            out.append(
                inventory.ClusterView(
                    name=name,
                    health=cluster.health(now=now, stale_after=self.stale_after),
                    connected=cluster.connected,
                    epoch=cluster.epoch,
                    last_seen_seconds=seen,
                    models=models,
                    running_jobs=running.get(name, 0),
                    reason=cluster.reason,
                    labels=dict(cluster.summary.labels) if cluster.summary is not None else {},
                    **_health_view(cluster.summary),
                    **_standing_view(cluster, now=now),
                )
            )
        return out

    def strike(self, cluster: Cluster, reason: str, *, now: float) -> bool:
        """The cluster failed to start what it accepted (`reason`, in words): a strike
        (`planning.standing`). True if that scored it down (now)."""
        was = cluster.scored_down(now=now)
        cluster.starts = standing.strike(cluster.starts, now=now, policy=self.strikes)
        if was or not cluster.scored_down(now=now):
            return False
        policy = self.strikes
        cluster.scored_down_reason = (
            f"{policy.limit} jobs it accepted did not start within {policy.window:g} s "
            f"(the last: {reason}); other clusters are preferred for {policy.cooldown:g} s"
        )
        logger.warning("cluster %s scored down: %s", cluster.name, cluster.scored_down_reason)
        self.changed.set()
        return True

    def offer_window(self, cluster: Cluster) -> int | None:
        """How many offers may be out unanswered to the cluster's agent now (None: any)."""
        if self.max_offers_in_flight is None:
            return None
        if cluster.offer_window is None:
            return self.max_offers_in_flight
        return int(cluster.offer_window)

    def offer_slots(self, cluster: Cluster) -> int | None:
        """How many more offers the cluster's agent may be sent now (None: any number)."""
        window = self.offer_window(cluster)
        return None if window is None else max(0, window - cluster.inflight.unanswered)

    def free_offer_slots(self, *, now: float) -> int | None:
        """`offer_slots` of every plannable cluster together (None: no window). O(clusters):
        each cluster counts its unanswered offers."""
        if self.max_offers_in_flight is None:
            return None
        free = 0
        for cluster in self.clusters.values():
            if cluster.summary is None or not cluster.plannable(
                now=now, stale_after=self.stale_after
            ):
                continue
            slots = self.offer_slots(cluster)
            if slots is None:
                return None
            free += slots
        return free

    def offers_answered(self, cluster: Cluster, count: int = 1) -> None:
        """`count` offers were answered (accepted or rejected): the window grows back."""
        if self.max_offers_in_flight is None or cluster.offer_window is None:
            return
        grown = cluster.offer_window + WINDOW_GROWTH * count
        cluster.offer_window = None if grown >= self.max_offers_in_flight else grown

    def offers_timed_out(self, cluster: Cluster, *, sent_at: float, now: float) -> None:
        """Offers to the cluster went unanswered past the timeout, the latest of them sent at
        `sent_at`: its window is halved, once for the offers sent before a cut (TCP's rule:
        one loss window, one decrease)."""
        limit = self.offer_window(cluster)
        if limit is None or sent_at <= cluster.window_cut_at:
            return
        cluster.window_cut_at = now
        floor = min(WINDOW_FLOOR, self.max_offers_in_flight or WINDOW_FLOOR)
        cluster.offer_window = float(max(floor, limit // 2))
        logger.warning(
            "cluster %s answers its offers more slowly than they time out (%g s): at most "
            "%d offers in flight to it now (growing back as it answers)",
            cluster.name,
            self.offer_timeout,
            int(cluster.offer_window),
        )

    def healthy(self, cluster: Cluster, *, now: float) -> bool:
        return cluster.health(now=now, stale_after=self.stale_after) == "Ready"

    def total_gpus(self, *, now: float) -> dict[str, int]:
        """GPUs per model of the plannable clusters, free or not: `snapshot(now=now)
        .total_gpus()` read off the summaries, without building their capacity."""
        out: dict[str, int] = {}
        for cluster in self.clusters.values():
            if cluster.summary is None or not cluster.plannable(
                now=now, stale_after=self.stale_after
            ):
                continue
            for model in cluster.summary.models:
                out[model.model] = out.get(model.model, 0) + snapshot.total_gpus_of(model)
        return out

    def snapshot(self, *, now: float) -> snapshot.FleetSnapshot:
        """Capacity of every plannable cluster, in-flight offers deducted. A cluster whose
        capacity cannot be built is left out, with the reason kept (`planning_error`)."""
        capacities = []
        for cluster in self.clusters.values():
            if cluster.summary is None or not cluster.plannable(
                now=now, stale_after=self.stale_after
            ):
                continue
            try:
                capacity = cluster.capacity(
                    offer_slots=self.offer_slots(cluster), scored_down=cluster.scored_down(now=now)
                )
            except Exception as exc:
                cluster.planning_error = f"its capacity cannot be computed: {exc!r}"[:300]
                logger.exception("cluster %s left out of planning", cluster.name)
                continue
            capacities.append(capacity)
        return snapshot.FleetSnapshot.build(capacities)


def _mig_view(summary: inventory.ModelSummary) -> list[inventory.MIGTotals]:
    """A model's MIG devices per profile, by name (none from an agent before protocol 7)."""
    return [
        inventory.MIGTotals(profile=profile, total=slices.total, free=slices.free)
        for profile, slices in sorted((summary.mig or {}).items())
    ]


def _health_view(summary: inventory.ClusterSummary | None) -> dict[str, Any]:
    """What `GET /v1/clusters` shows of the agent's GPU health (nothing from an older agent)."""
    health = summary.gpu_health if summary is not None else None
    if health is None:
        return {}
    return {"unhealthy_gpus": health.unhealthy_gpus, "cordoned_nodes": list(health.cordoned_nodes)}


def _standing_view(cluster: Cluster, *, now: float) -> dict[str, Any]:
    """What `GET /v1/clusters` shows of a cluster scored down (nothing for the others): until
    when, as a wall-clock time to the second (it stays the same from view to view), and why."""
    until = cluster.starts.scored_down_until
    if until is None or until <= now:
        return {}
    at = status.utcnow() + timedelta(seconds=until - now)
    return {
        "scored_down_until": at.replace(microsecond=0),
        "scored_down_reason": cluster.scored_down_reason,
    }
