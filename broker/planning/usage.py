"""Per-queue usage: GPUs in use against guarantee, limit and fair share. Pure.

Called by the scheduling shell after every cycle (the `gpufed_queue_*` metrics) and by
`GET /v1/queues` (the queues with their status and the configuration's warnings). Reads the
same ledger the planner admits jobs with, so the numbers a user sees are the planner's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from broker.api import queues
from broker.planning import fairshare, quotas, snapshot


def build_views(
    config: queues.QueuesConfig,
    *,
    running: Sequence[snapshot.RunningJob],
    pending: Sequence[snapshot.PendingJob],
    fleet_gpus: Mapping[str, int],
    preemptions: Mapping[str, int] | None = None,
    waiting: Mapping[str, int] | None = None,
    usage: quotas.Usage | None = None,
) -> list[queues.QueueView]:
    """Every declared queue, and every other queue with jobs, with its status. `waiting`:
    pending jobs per queue, and `usage`, what queues hold, when the caller keeps them (then
    `pending`, and `running`, are not read)."""
    tenancy = quotas.Tenancy(config)
    ledger = quotas.Ledger.build(tenancy, running, fleet_gpus, usage=usage)
    if waiting is None:
        waiting = Counter(job.queue for job in pending)
    waiting = {queue: count for queue, count in waiting.items() if count > 0}
    holding = {q for q, n in usage.jobs.items() if n > 0} if usage else {j.queue for j in running}
    active = set(waiting) | holding
    shares = fairshare.fair_shares(ledger, active)
    names = sorted({q.name for q in config.queues} | active)
    warnings = config.warnings(fleet_gpus)
    views = []
    for name in names:
        queue = tenancy.queue(name)
        models = sorted(
            {m for m in queue.quotas if m != queues.ANY_MODEL} | set(ledger.usage.get(name, {}))
        )
        gpus = []
        for model in models:
            quota = queue.quota(model) or queues.ModelQuota(limit=0)
            gpus.append(
                queues.ModelUsage(
                    model=model,
                    in_use=ledger.used(name, model),
                    guaranteed=quota.guaranteed,
                    limit=quota.limit,
                    fair_share=round(shares.get(name, {}).get(model, 0.0), 3),
                )
            )
        views.append(
            queues.QueueView(
                name=name,
                spec=queues.QueueSpec.model_validate(queue.model_dump(exclude={"name"})),
                declared=tenancy.declared(name),
                status=queues.QueueStatus(
                    pending_jobs=waiting.get(name, 0),
                    running_jobs=ledger.job_counts.get(name, 0),
                    dominant_share=round(fairshare.dominant_share(ledger, name), 4),
                    gpus=gpus,
                    preemptions=(preemptions or {}).get(name, 0),
                ),
                warnings=[w for w in warnings if f"cohort {queue.cohort}:" in w],
            )
        )
    return views
