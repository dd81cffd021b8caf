"""What each queue holds, kept as jobs move rather than counted every cycle. Pure data.

Owned by `jobs.accounting.Accounting`, which calls `hold` when a job starts holding GPUs
(Dispatched) and `release` when it stops (requeued, finished), and `reset` every few seconds
from the jobs themselves (GPU models inferred from fresh summaries, records put back after a
store conflict). The scheduling shell hands `usage()` to `planning.plan_cycle`, so a cycle
costs O(queues), not O(running jobs), until a preemption has to look at the jobs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from broker.planning import quotas, snapshot


class Holdings:
    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._jobs: dict[str, tuple[str, dict[str, int], quotas.PriorityKey]] = {}
        self._gpus: dict[str, dict[str, int]] = {}
        self._holders: Counter[str] = Counter()
        self._priorities: Counter[quotas.PriorityKey] = Counter()

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def hold(
        self, job_id: str, queue: str, gpus: Mapping[str, int], key: quotas.PriorityKey
    ) -> None:
        if job_id in self._jobs:
            return
        self._jobs[job_id] = (queue, dict(gpus), key)
        self._holders[queue] += 1
        self._priorities[key] += 1
        held = self._gpus.setdefault(queue, {})
        for model, count in gpus.items():
            held[model] = held.get(model, 0) + count

    def release(self, job_id: str) -> None:
        found = self._jobs.pop(job_id, None)
        if found is None:
            return
        queue, gpus, key = found
        self._holders[queue] -= 1
        self._priorities[key] -= 1
        held = self._gpus.get(queue, {})
        for model, count in gpus.items():
            held[model] = held.get(model, 0) - count

    def of(self, job_id: str) -> tuple[str, dict[str, int]] | None:
        """The queue and GPUs a job holds."""
        found = self._jobs.get(job_id)
        return (found[0], dict(found[1])) if found else None

    def usage(self) -> quotas.Usage:
        return quotas.Usage(self._gpus, self._holders, self._priorities)

    def reset(self, views: Iterable[snapshot.RunningJob]) -> None:
        """Count again from the jobs holding GPUs."""
        self._clear()
        for view in views:
            key = (view.queue, view.priority, view.priority_class)
            self.hold(view.job_id, view.queue, view.gpus, key)
