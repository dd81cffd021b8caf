"""Plan one scheduling cycle: which cluster runs each pending job. Pure.

Called by `cycle.Scheduler` once per cycle with a snapshot of the fleet and the queued jobs;
the simulator and the benchmarks call it the same way. No await, no clock, no I/O: same
inputs, same plan.

Phases: (1) order jobs by priority, then submission time; (2) for each job, fit the whole gang
on every eligible cluster from its summary; (3) choose the tightest fit (least whole GPUs left
on the nodes taken, then the cluster name) and *assume* it in the snapshot, so later decisions
in the cycle see it; a job that fits nowhere is a value with the reasons per cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from broker.scheduler import fitting, snapshot


@dataclass(frozen=True)
class Assignment:
    job_id: str
    cluster: str
    takes: tuple[fitting.Take, ...]


@dataclass(frozen=True)
class Unplaceable:
    job_id: str
    reasons: tuple[str, ...]  # "cluster: reason", sorted


@dataclass
class CyclePlan:
    assignments: list[Assignment] = field(default_factory=list)
    unplaceable: list[Unplaceable] = field(default_factory=list)


def order_pending(pending: Sequence[snapshot.PendingJob]) -> list[snapshot.PendingJob]:
    """Higher priority first, then first come first served."""
    return sorted(pending, key=lambda job: (-job.priority, job.created, job.job_id))


def choose_cluster(
    fleet: snapshot.FleetSnapshot, job: snapshot.PendingJob
) -> fitting.Fit | Unplaceable:
    best: fitting.Fit | None = None
    reasons: list[str] = []
    for name in sorted(fleet.clusters):
        cluster = fleet.clusters[name]
        if name in job.excluded:
            reasons.append(f"{name}: rejected the job; waiting for a fresh summary")
            continue
        result = fitting.fit_gang(cluster, job.request)
        if isinstance(result, fitting.NoFit):
            reasons.append(f"{name}: {result.reason}")
        elif best is None or result.leftover < best.leftover:
            best = result
    if best is not None:
        return best
    if not fleet.clusters:
        reasons.append("fleet: no member cluster is connected")
    return Unplaceable(job.job_id, tuple(sorted(reasons)))


def plan_cycle(
    fleet: snapshot.FleetSnapshot,
    pending: Sequence[snapshot.PendingJob],
    *,
    max_assignments: int = 10_000,
) -> CyclePlan:
    """Decide placements for one cycle. The fleet snapshot is changed (assumed placements)."""
    plan = CyclePlan()
    for job in order_pending(pending):
        if len(plan.assignments) >= max_assignments:
            break
        result = choose_cluster(fleet, job)
        if isinstance(result, Unplaceable):
            plan.unplaceable.append(result)
            continue
        fitting.assume(fleet.clusters[result.cluster], result)
        plan.assignments.append(Assignment(job.job_id, result.cluster, result.takes))
    return plan
