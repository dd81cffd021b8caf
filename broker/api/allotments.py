"""What a tenant may claim of the fleet (its allotment), and whether its queues fit it. Pure.

Only the fleet admin decides how much of the fleet a tenant may claim. A tenant-admin manages
its tenant's queues, and each queue claims something: a guarantee (GPUs taken back from
borrowers by preemption), a limit, a weight in fair share, a priority class, a cohort to borrow
from. `check_put` decides whether a tenant-admin's `PUT /v1/queues/{name}` stays within the
tenant's allotment, the guarantees and limits added over **all** the tenant's queues, so that
making many queues claims no more than one. `broker.state.registry` calls it before storing
a tenant-admin's queue; the admin's own PUTs are not bound by it.

Where the queues file declares no allotment for a tenant, its allotment is what the file
already gives it (`derive`): the guarantees of its queues added, their highest weight and
priority class, their cohorts, and no bound on limits; a tenant with no queue in the file gets
what an open queue has (no guarantee, weight 1, cohort `default`). So a configuration written
before allotments is safe as it stands.

A change that claims no more than before always fits, even for a tenant already above its
allotment (the admin lowered it, or PUT more itself): such a tenant may lower and reshuffle,
never raise.

No await, no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.api import queues

ANY = queues.ANY_MODEL
NONE = queues.ModelQuota(guaranteed=0, limit=0)  # what is not allotted at all


@dataclass(frozen=True)
class Excess:
    """One way a queue goes beyond its tenant's allotment: the field of the queue's spec."""

    field: str
    message: str


def derive(tenant: str, config: queues.QueuesConfig) -> queues.Allotment:
    """What `config` (the admin's queues file) already gives `tenant` with its queues."""
    mine = [q for q in config.queues if q.tenant == tenant]
    if not mine:
        return queues.Allotment(tenant=tenant, quotas={ANY: queues.ModelQuota(guaranteed=0)})
    keys = sorted({key for q in mine for key in q.quotas} | {ANY})
    quotas = {key: queues.ModelQuota(guaranteed=_claimed(mine, key)[0]) for key in keys}
    values = {c.name: c.value for c in config.priority_classes}
    named = [
        name
        for q in mine
        if (name := q.priority_class or config.policy.default_priority_class) in values
    ]
    return queues.Allotment(
        tenant=tenant,
        quotas=quotas,
        max_weight=max(q.weight for q in mine),
        max_priority_class=max(named, key=values.__getitem__) if named else None,
        cohorts=sorted({q.cohort for q in mine}),
    )


def allotment_of(tenant: str, config: queues.QueuesConfig) -> tuple[queues.Allotment, bool]:
    """The allotment of `tenant` in the admin's `config`, and whether the admin declared it."""
    declared = config.allotment(tenant)
    if declared is not None:
        return declared, True
    return derive(tenant, config), False


def check_put(
    allotment: queues.Allotment,
    *,
    queue: queues.Queue,
    previous: queues.Queue | None,
    others: Sequence[queues.Queue],
    classes: Mapping[str, int],
    default_class: str | None,
) -> list[Excess]:
    """How putting `queue` (replacing `previous` of the same tenant, if any) beside the
    tenant's `others` queues goes beyond `allotment`; [] when it fits. `classes` are the
    priority classes' values, `default_class` the policy's. Sorted by field."""
    out: list[Excess] = []
    tenant = allotment.tenant
    after = [*others, queue]
    before = [*others, previous] if previous is not None else list(others)
    for key in _keys(allotment, after):
        allotted = allotment.quota(key) or NONE
        field_key = key if key in queue.quotas else ANY
        what = "GPUs of any model not listed" if key == ANY else f"{key} GPUs"
        guaranteed, limit = _claimed(after, key)
        was_guaranteed, was_limit = _claimed(before, key)
        if guaranteed > allotted.guaranteed and guaranteed > was_guaranteed:
            out.append(
                Excess(
                    f"quotas.{field_key}.guaranteed",
                    f"tenant {tenant}'s queues would be guaranteed {guaranteed} {what} "
                    f"together, above its allotment of {allotted.guaranteed}",
                )
            )
        if not _within(limit, allotted.limit) and not _within(limit, was_limit):
            held = "with no limit" if limit is None else f"up to {limit} {what} together"
            out.append(
                Excess(
                    f"quotas.{field_key}.limit",
                    f"tenant {tenant}'s queues would hold {held}, above its allotment's "
                    f"limit of {allotted.limit}",
                )
            )
    same = previous if previous is not None and previous.tenant == queue.tenant else None
    if queue.weight > allotment.max_weight and (same is None or queue.weight > same.weight):
        out.append(
            Excess(
                "weight",
                f"weight {queue.weight:g} is above tenant {tenant}'s allotment "
                f"(maxWeight {allotment.max_weight:g})",
            )
        )
    top = allotment.max_priority_class or default_class
    ceiling = classes.get(top or "", 0)
    value = _class_value(queue, classes)
    if value is not None and value > ceiling:
        was = _class_value(same, classes) if same is not None else None
        if was is None or value > was:
            out.append(
                Excess(
                    "priorityClass",
                    f"priority class {queue.priority_class} ({value}) is above tenant "
                    f"{tenant}'s allotment (maxPriorityClass {top or 'none'}, {ceiling})",
                )
            )
    if queue.cohort not in allotment.cohorts and (same is None or same.cohort != queue.cohort):
        out.append(
            Excess(
                "cohort",
                f"cohort {queue.cohort} is not one tenant {tenant}'s allotment lets its queues "
                f"join ({', '.join(allotment.cohorts) or 'none'})",
            )
        )
    return sorted(out, key=lambda e: e.field)


def uses(allotment: queues.Allotment, mine: Sequence[queues.Queue]) -> list[queues.AllotmentUse]:
    """What the tenant's queues `mine` claim of each model of `allotment` (and theirs)."""
    out = []
    for key in _keys(allotment, mine):
        allotted = allotment.quota(key) or NONE
        guaranteed, limit = _claimed(mine, key)
        out.append(
            queues.AllotmentUse(
                model=key,
                guaranteed=guaranteed,
                allotted_guaranteed=allotted.guaranteed,
                limit=limit,
                allotted_limit=allotted.limit,
            )
        )
    return out


def overdrawn(allotment: queues.Allotment, mine: Sequence[queues.Queue]) -> list[str]:
    """Where the tenant's queues already claim more than its allotment (the admin put them
    there): they may be lowered, not raised."""
    out = []
    for use in uses(allotment, mine):
        what = "GPUs of any model not listed" if use.model == ANY else f"{use.model} GPUs"
        if use.guaranteed > use.allotted_guaranteed:
            out.append(
                f"tenant {allotment.tenant}'s queues are guaranteed {use.guaranteed} {what}, "
                f"above its allotment of {use.allotted_guaranteed}: its tenant-admin may lower "
                "them, not raise them"
            )
        if not _within(use.limit, use.allotted_limit):
            held = "no limit" if use.limit is None else f"limits of {use.limit}"
            out.append(
                f"tenant {allotment.tenant}'s queues have {held} for {what}, above its "
                f"allotment's limit of {use.allotted_limit}: its tenant-admin may lower them, "
                "not raise them"
            )
    return out


def _keys(allotment: queues.Allotment, mine: Sequence[queues.Queue]) -> list[str]:
    """Every model named by the allotment or a queue, and `*`: a model named by none of them
    resolves to `*` everywhere, so the `*` row answers for it."""
    return sorted({*allotment.quotas, *(key for q in mine for key in q.quotas), ANY})


def _claimed(mine: Sequence[queues.Queue], key: str) -> tuple[int, int | None]:
    """The guarantees and the limits (None: one queue has none) of `mine` for `key`, added."""
    guaranteed, limit = 0, 0
    unbounded = False
    for queue in mine:
        quota = queue.quota(key)
        if quota is None:
            continue
        guaranteed += quota.guaranteed
        if quota.limit is None:
            unbounded = True
        else:
            limit += quota.limit
    return guaranteed, None if unbounded else limit


def _within(amount: int | None, bound: int | None) -> bool:
    """`amount` ≤ `bound`, where None is unbounded on both sides."""
    return bound is None or (amount is not None and amount <= bound)


def _class_value(queue: queues.Queue, classes: Mapping[str, int]) -> int | None:
    """The value of the class the queue names; None: it names none (the policy's applies)."""
    if queue.priority_class is None:
        return None
    return classes.get(queue.priority_class, 0)
