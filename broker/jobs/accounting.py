"""GPUs held per queue and model, and the jobs holding them as the planner sees them.

A `book.JobBook` observer: a job that starts holding GPUs (Dispatched) is counted, one that
stops (requeued, finished) is released; `resync` counts again from the book every few
seconds (GPU models inferred from fresh summaries after a restart). The cycle hands `usage()`
to the planner, so a cycle costs O(queues), not O(running jobs), until a preemption looks at
the jobs (`running_jobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from broker.api import status
from broker.jobs import book, fleet
from broker.planning import holdings, quotas, snapshot


class Accounting:
    def __init__(
        self,
        jobs: book.JobBook,
        clusters: fleet.Fleet,
        *,
        is_preempting: Callable[[str], bool],
    ) -> None:
        self.book = jobs
        self.fleet = clusters
        self._is_preempting = is_preempting
        self.holdings = holdings.Holdings()
        self._models_of: dict[str, dict[str, int]] = {}  # GPUs taken per model at dispatch
        self._views: dict[str, tuple[tuple[object, ...], snapshot.RunningJob]] = {}

    def expect(self, job_id: str, gpus: Mapping[str, int]) -> None:
        """The GPUs per model a dispatch about to be committed takes (else inferred)."""
        self._models_of[job_id] = dict(gpus)

    def forget(self, job_id: str) -> None:
        """A dispatch whose commit failed: it takes nothing."""
        if job_id not in self.holdings:
            self._models_of.pop(job_id, None)

    def __call__(self, change: book.Change) -> None:
        record = change.after
        if record.status.state in book.HOLDING:
            self._hold(record)
        else:
            self.holdings.release(record.id)
            self._models_of.pop(record.id, None)

    def _cluster_models(self, record: status.JobRecord) -> list[str]:
        cluster = self.fleet.clusters.get(record.status.cluster or "")
        summary = cluster.summary if cluster is not None else None
        return [m.model for m in summary.models] if summary else []

    def _hold(self, record: status.JobRecord) -> None:
        if record.id in self.holdings:
            return
        gpus = self._models_of.get(record.id)
        if gpus is None:
            gpus = holdings.infer_models(self.book.gang(record), self._cluster_models(record))
        spec = record.job.spec
        key = (spec.queue, spec.priority, spec.priority_class)
        self.holdings.hold(record.id, spec.queue, gpus, key)

    def usage(self) -> quotas.Usage:
        """GPUs held per queue and model (Dispatched and Running jobs), without a walk."""
        return self.holdings.usage()

    def held_by(self, job_id: str) -> tuple[str, dict[str, int]] | None:
        return self.holdings.of(job_id)

    def running_jobs(self) -> list[snapshot.RunningJob]:
        """The jobs holding GPUs (Dispatched, Running), as the planner sees them."""
        out = []
        holding = self.book.holding()
        for job_id in holding:
            record = self.book.get(job_id)
            if record is None or not record.status.cluster:
                continue
            preempting = self._is_preempting(job_id)
            key = (
                record.status.state,
                record.status.cluster,
                len(record.status.events),
                len(record.status.pods),
                preempting,
            )
            cached = self._views.get(job_id)
            if cached is None or cached[0] != key:
                view = holdings.running_view(
                    record,
                    self.book.gang(record),
                    models=self._models_of.get(job_id),
                    cluster_models=self._cluster_models(record),
                    preempting=preempting,
                )
                cached = (key, view)
                self._views[job_id] = cached
            out.append(cached[1])
        if len(self._views) > 2 * len(holding) + 64:
            self._views = {k: v for k, v in self._views.items() if k in holding}
        return out

    def resync(self) -> None:
        """Count again from the jobs themselves (the scheduler calls it every few seconds)."""
        self.holdings.reset(self.running_jobs())
