"""Failures kept local inside a planning cycle: a job or a cluster whose planning raises is
set aside with a reason, and the cycle goes on for everyone else. Pure.

Called by `planning.plan_cycle`. Before the cycle, `check_cluster` looks for what the fit
and the deduction rely on (histograms of one length, no negative counts) and sets aside a
cluster whose capacity breaks it; during the cycle, an exception while planning one job sets
that job aside (`why` shows the reason), and a cluster that raises for two different jobs is
set aside for the rest of the cycle. Exceptions here mean a bug or input that validation
missed: the shell counts them (`gpufed_planning_set_aside_total`) and logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.planning import snapshot

JOB = "job"
CLUSTER = "cluster"
CLUSTER_STRIKES = 2  # different jobs a cluster may raise for before it is set aside


@dataclass(frozen=True)
class SetAside:
    kind: str  # JOB | CLUSTER
    name: str
    reason: str


def describe(exc: BaseException) -> str:
    """One line for a `why` answer and a log: the error's type and message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def check_cluster(cluster: snapshot.ClusterCapacity) -> str | None:
    """What in `cluster`'s capacity planning cannot work with, or None. Runs for every
    cluster every cycle, so it looks only at what makes the fit or the deduction raise
    (histogram lengths) and at negative node counts, with C-speed builtins, and the answer
    is kept with the capacity until its histograms change (`ClusterCapacity.checked`)."""
    if cluster.checked is None:
        cluster.checked = (_problem(cluster),)
    return cluster.checked[0]


def _problem(cluster: snapshot.ClusterCapacity) -> str | None:
    for name, model in cluster.models.items():
        width = len(model.nodes_by_free)
        if width and min(model.nodes_by_free) < 0:
            return f"model {name}: a negative node count"
        for rack, histogram in model.racks.items():
            if len(histogram) != width:
                return f"model {name}: rack {rack} has {len(histogram)} entries, not {width}"
    return None


class Strikes:
    """Which clusters raised while planning which jobs, this cycle."""

    def __init__(self) -> None:
        self._jobs: dict[str, set[str]] = {}

    def add(self, cluster: str, job_id: str) -> bool:
        """Note a failure; True once the cluster should be set aside."""
        jobs = self._jobs.setdefault(cluster, set())
        jobs.add(job_id)
        return len(jobs) >= CLUSTER_STRIKES
