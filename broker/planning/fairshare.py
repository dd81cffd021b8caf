"""Fair share between queues: dominant-resource shares with GPU models weighted. Pure.

Called by `planning.plan_cycle` to order the queues' head jobs, and by the scheduling shell
for the per-queue metrics (`gpufed_queue_dominant_share`, fair share in GPUs).

A queue's dominant share is `max over models m of (w_m × used_m) / W / weight`, where `w_m` is
the model's weight (`policy.modelWeights`: an H100 counts more than a T4), `W` the cohort's
weighted capacity `Σ_m w_m × capacity_m` (one denominator for every model, so the model
weights matter: a queue holding 8 H100 of weight 4 has a larger share than one holding 8 T4
of weight 0.5) and `weight` the queue's fair-share weight. The queue with the smallest share
goes next, so in steady state (every queue asking for more than it gets) the shares even out
and each queue holds GPUs in proportion to its weight.

Order of the heads of the queues: (tier, dominant share, -priority, submission time, id):
tier 0 are jobs that fit their queue's guarantee (they come first, whatever the shares), tier
1 the jobs that borrow. Within a queue: priority, then submission time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime

from broker.planning import quotas, snapshot


def weighted_capacity(ledger: quotas.Ledger, cohort: str) -> float:
    tenancy = ledger.tenancy
    return sum(
        tenancy.model_weight(model) * count
        for model, count in ledger.cohort_capacity(cohort).items()
    )


def dominant_share(ledger: quotas.Ledger, queue: str) -> float:
    """The queue's weighted dominant share of its cohort, divided by its weight (kept in
    the ledger until `Ledger.charge` changes the queue's usage)."""
    share = ledger.shares.get(queue)
    if share is None:
        share = ledger.shares[queue] = _dominant_share(ledger, queue)
    return share


def _dominant_share(ledger: quotas.Ledger, queue: str) -> float:
    total = weighted_capacity(ledger, ledger.cohort_of(queue))
    if total <= 0:
        return 0.0
    tenancy = ledger.tenancy
    held = ledger.usage.get(queue, {})
    top = max((tenancy.model_weight(m) * n for m, n in held.items() if n > 0), default=0.0)
    return top / total / tenancy.weight(queue)


def fair_shares(ledger: quotas.Ledger, active: Iterable[str]) -> dict[str, dict[str, float]]:
    """GPUs per model each active queue would hold if all asked for more than they get.

    The cohort's capacity split by the weights of its active queues (those with jobs pending
    or running); an idle queue's fair share is zero.
    """
    by_cohort: dict[str, list[str]] = {}
    for queue in sorted(set(active)):
        by_cohort.setdefault(ledger.cohort_of(queue), []).append(queue)
    out: dict[str, dict[str, float]] = {}
    for cohort, members in by_cohort.items():
        weights = {q: ledger.tenancy.weight(q) for q in members}
        total = sum(weights.values())
        capacity = ledger.cohort_capacity(cohort)
        for queue in members:
            out[queue] = {m: c * weights[queue] / total for m, c in capacity.items()}
    return out


def order_in_queue(job: snapshot.PendingJob, priority: int) -> tuple[int, datetime, str]:
    return (-priority, job.created, job.job_id)


class QueueOrder:
    """Yields pending jobs head by head: the queue with the lowest key next.

    After a job is handled call `advance(queue)`: its queue's next head is keyed again with
    the queue's usage at that time (a placement raised its share).
    """

    def __init__(
        self,
        by_queue: Mapping[str, Sequence[snapshot.PendingJob]],
        *,
        key: Callable[[snapshot.PendingJob], tuple[int, float]],
        priority: Callable[[snapshot.PendingJob], int],
    ) -> None:
        self._key = key
        self._priority = priority
        self._queues = {
            name: sorted(jobs, key=lambda j: order_in_queue(j, priority(j)), reverse=True)
            for name, jobs in by_queue.items()
        }
        self._heap: list[tuple[tuple[int, float], int, datetime, str, str]] = []
        for name in self._queues:
            self._push(name)

    def _push(self, queue: str) -> None:
        stack = self._queues[queue]
        if not stack:
            return
        head = stack[-1]
        entry = (self._key(head), -self._priority(head), head.created, head.job_id, queue)
        heapq.heappush(self._heap, entry)

    def pop(self) -> snapshot.PendingJob | None:
        if not self._heap:
            return None
        queue = heapq.heappop(self._heap)[-1]
        return self._queues[queue].pop()

    def advance(self, queue: str) -> None:
        self._push(queue)
