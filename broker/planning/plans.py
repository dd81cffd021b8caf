"""What a planning cycle decides, as values: the placements (`Assignment`), the jobs that
wait and why (`Unplaceable`, with a `Reason` per cluster), the victims to preempt
(`Preemption`), the clusters' models held for jobs (`Reservation`) and what was set aside
(`CyclePlan`). Made by
`planning.plan_cycle`; read by the scheduling shell, parking and the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from broker.api.queues import ReasonCode
from broker.planning import containment, fitting, preemption

FLEET = "fleet"  # the "cluster" of a reason that holds on every cluster
ROOM_CODES = frozenset(
    {ReasonCode.CAPACITY, ReasonCode.TOPOLOGY, ReasonCode.FAIR_SHARE, ReasonCode.PRIORITY}
)


@dataclass(frozen=True, order=True)
class Reason:
    cluster: str
    code: ReasonCode
    message: str

    def text(self) -> str:
        return f"{self.cluster}: {self.message}"


@dataclass(frozen=True)
class Assignment:
    job_id: str
    cluster: str
    takes: tuple[fitting.Take, ...]
    borrowing: bool = False  # some of its GPUs are above its queue's guarantee


@dataclass(frozen=True)
class Unplaceable:
    job_id: str
    reasons: tuple[str, ...]  # "cluster: reason", sorted
    details: tuple[Reason, ...] = ()  # the same, with their codes

    @classmethod
    def of(cls, job_id: str, details: Sequence[Reason]) -> Unplaceable:
        ordered = tuple(sorted(set(details)))
        return cls(job_id, tuple(r.text() for r in ordered), ordered)


@dataclass(frozen=True)
class Preemption:
    job_id: str  # the victim
    preemptor: str
    cluster: str
    reason: str  # preemption.RECLAIM | preemption.PRIORITY
    message: str


@dataclass(frozen=True)
class Reservation:
    """A cluster's models held for a job that has waited too long (`reservation`)."""

    job_id: str
    cluster: str
    models: frozenset[str]
    since: datetime


@dataclass
class CyclePlan:
    assignments: list[Assignment] = field(default_factory=list)
    unplaceable: list[Unplaceable] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # jobs and clusters whose planning raised: left out of this cycle, with the reason
    set_aside: list[containment.SetAside] = field(default_factory=list)
    # every cluster's agent was out of offer slots when the cycle ended: nothing more goes
    # before one of them answers (the shell waits for that instead of planning on)
    busy: bool = False


def preemption_of(
    victim: preemption.Victim, *, preemptor: str, cluster: str, why: str
) -> Preemption:
    return Preemption(
        job_id=victim.job.job_id,
        preemptor=preemptor,
        cluster=cluster,
        reason=victim.reason,
        message=f"preempted for job {preemptor} to {why}",
    )
