"""A job as the schedulers see it: its pods, all-or-nothing, and the names its pods take.

`gang_request` turns a validated `GPUJob` into a `GangRequest` (every task's pod shape, the
gang's minimum, topology, priority and attempt); `pod_name` and `attempt_of_pod` name a job's
pods per attempt, so that an earlier attempt's pods never clash with a new one's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from broker.api.jobs import NO_TOPOLOGY, GPUJob, Interning, PodShape, Tasks, Topology, shape_of


@dataclass(frozen=True, slots=True, kw_only=True)
class GangRequest:
    """A whole job as the schedulers see it: every pod, placed all-or-nothing.

    A slotted dataclass, not a model: one is held for every queued job (a fraction of what a
    pydantic model of it would hold), and it is built only from validated jobs, never from
    input."""

    job_id: str
    tasks: Tasks  # (task name, replicas, shape)
    min_member: int
    topology: Topology = field(default_factory=lambda: NO_TOPOLOGY)  # one, shared
    priority: int = 0
    # the broker's dispatch count: pods of a job run again get names of their own
    attempt: int = 1

    @property
    def pods(self) -> int:
        return sum(r for _, r, _ in self.tasks)

    @property
    def gpus(self) -> int:
        return sum(r * s.gpus for _, r, s in self.tasks)

    def pod_names(self) -> list[tuple[str, str, PodShape]]:
        """(pod name, task, shape) for every pod, in a stable order."""
        out = []
        for task, replicas, shape in self.tasks:
            for i in range(replicas):
                out.append((pod_name(self.job_id, task, i, attempt=self.attempt), task, shape))
        return out


def gang_request(
    job_id: str, job: GPUJob, *, attempt: int = 1, interning: Interning | None = None
) -> GangRequest:
    """The gang of `job` (ShapeError if a task's shape is invalid); `interning`: where gangs
    of alike tasks share one tuple of them."""
    tasks: Tasks = tuple((t.name, t.replicas, shape_of(t)) for t in job.spec.tasks)
    if interning is not None:
        tasks = interning.tasks(tasks)
    total = sum(r for _, r, _ in tasks)
    return GangRequest(
        job_id=job_id,
        tasks=tasks,
        min_member=job.spec.gang.min_member or total,
        topology=job.spec.topology,
        priority=job.spec.priority,
        attempt=attempt,
    )


_ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")


def pod_name(job_id: str, task: str, index: int, *, attempt: int = 1) -> str:
    """The name of a job's pod: `{job}-{task}-{index}` on the first attempt, with `-a{attempt}`
    after it from the second on, so that the pods an earlier attempt left behind (a failed pod
    stays for its logs) never clash with the new ones.

    The attempt goes last because a first attempt's name always ends in digits: with it in
    front (`{job}-a2-{task}-{index}`) a task named `a2-x` would take the name of task `x`'s
    pod on attempt 2. Job ids (at most 59 characters) and task names (DNS labels of at most
    63) keep the name a valid DNS subdomain far below 253 characters.
    """
    name = f"{job_id}-{task}-{index}"
    return name if attempt <= 1 else f"{name}-a{attempt}"


def attempt_of_pod(name: str) -> int:
    """The attempt a pod named by `pod_name` belongs to."""
    found = _ATTEMPT_SUFFIX.search(name)
    return int(found.group(1)) if found else 1
