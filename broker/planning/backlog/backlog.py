"""The queued jobs as one scheduler keeps them between cycles: live (planned every cycle) or
parked (left out of the plan until something that could admit them changes). Pure data.

Owned by `jobs.scheduling.Scheduler`: it `put`s a queued job (as the planner sees it) when
its record changes and `drop`s one that left the queue; `parking.plan_backlog` reads it,
plans the live jobs and the parked ones a change woke, and says which planned jobs park;
the scheduler applies that with `settle`. The rules (when a job parks, what wakes it, why no
decision changes) are `parking`'s; here are the indices that make a wake cost O(what
changed): parked jobs with the same `Wake` form one class, and each class is filed under
every bound, usage threshold and priority that wakes it.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TypeVar

from broker.planning import reservation, snapshot
from broker.planning.backlog import bounds
from kits import tables

Order = tuple[int, datetime, str]  # (-priority, created, id): the place in its queue
Band = tuple[int, str | None]  # (priority, class) of a job's spec: its queue's jobs alike in order
Entry = tuple[datetime, str]  # (created, id) of a live job, in its band's heap
UsageKey = tuple[str, str, str]  # (QUEUE | COHORT, name, model)
QUEUE = "queue"
COHORT = "cohort"
K = TypeVar("K")


@dataclass(frozen=True, order=True)
class Threshold:
    """Wakes once the GPUs of `model` held by the queue (or cohort) `name` are at most
    `at_most` (its quota verdict for the model could be better from there) or, `rising`,
    above it (worse: what `why` says of it changes)."""

    scope: str  # QUEUE | COHORT
    name: str
    model: str
    at_most: int
    rising: bool = False


@dataclass(frozen=True)
class Reservable:
    """Where a parked job could be reserved once due: the models it may use, and the
    clusters it could fit with every GPU free on them."""

    models: frozenset[str]
    clusters: frozenset[str]


@dataclass(frozen=True)
class Wake:
    """What wakes a parked job; jobs with the same wake form a class and wake together."""

    shape: Hashable  # the request's pods and topology: jobs alike share a class
    witnesses: tuple[bounds.Witness, ...]  # a cluster shows room past one of them
    thresholds: tuple[Threshold, ...]  # usage falls to one of them
    priority: int | None = None  # a job of a lower priority holds GPUs: it could preempt
    reserve: Reservable | None = None  # where it could be reserved, once due
    timed: bool = False  # reservations on, a model admitted: once due, its reasons change
    admitted: frozenset[str] = frozenset()  # its models its queue admits (reservations block)
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:  # the key of every index: hashed once, not per lookup
        fields = (
            self.shape,
            self.witnesses,
            self.thresholds,
            self.priority,
            self.reserve,
            self.timed,
            self.admitted,
        )
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash


@dataclass(frozen=True, slots=True)  # one for every parked job
class Park:
    job: snapshot.PendingJob
    wake: Wake
    order: Order
    due: bool = True  # due for a reservation already (or never to be: not `wake.timed`)


class _Line:
    """One queue's parked jobs of one shape, in queue order: what `stand_ins` searches."""

    def __init__(self) -> None:
        self.orders: list[Order] = []  # sorted; entries of jobs gone are skipped, then dropped
        self.added: list[Order] = []  # not sorted in yet (`settle`)
        self.members: dict[str, Order] = {}

    def add(self, order: Order) -> None:
        self.members[order[-1]] = order
        self.added.append(order)

    def remove(self, job_id: str) -> None:
        del self.members[job_id]
        if len(self.orders) > 2 * len(self.members) + 64:  # gone, or parked again: once
            self.orders = sorted({o for o in self.orders if self.members.get(o[-1]) == o})

    def settle(self) -> None:
        if len(self.added) > 64:
            self.orders.extend(self.added)
            self.orders.sort()
        else:
            for order in self.added:
                bisect.insort(self.orders, order)
        self.added = []

    def last_before(self, order: Order, skip: Collection[str]) -> str | None:
        at = bisect.bisect_left(self.orders, order)
        while at > 0:
            at -= 1
            found = self.orders[at]
            if self.members.get(found[-1]) == found and found[-1] not in skip:
                return found[-1]
        return None


class Backlog:
    def __init__(self) -> None:
        self._live: dict[str, snapshot.PendingJob] = {}
        # queue -> band -> heap of the live jobs' entries (stale ones skipped, then dropped):
        # a queue's live jobs in its order, whatever the configuration (`heads`)
        self._bands: dict[str, dict[Band, list[Entry]]] = {}
        self._banded: Counter[tuple[str, Band]] = Counter()  # live jobs per band
        self._parked: dict[str, Park] = {}
        self._counts: Counter[str] = Counter()  # queue -> pending jobs, live and parked
        self._classes: dict[Wake, set[str]] = {}
        # each class's one Wake: the jobs of a class, parked cycle after cycle, hold it, not
        # an equal copy of their own
        self._wakes: dict[Wake, Wake] = {}
        self._bounds: dict[bounds.Bound, dict[int, set[Wake]]] = {}  # bound -> need -> classes
        self._on_cluster: dict[str, set[bounds.Bound]] = {}
        self._thresholds: dict[UsageKey, dict[int, set[Wake]]] = {}
        self._rising: dict[UsageKey, dict[int, set[Wake]]] = {}
        self._priorities: dict[int, set[Wake]] = {}
        self._lines: dict[str, dict[Hashable, _Line]] = {}  # queue -> shape -> parked jobs
        self._timed: dict[Wake, list[tuple[datetime, str]]] = {}  # -> (since, job) heap
        self._not_due: list[tuple[datetime, str]] = []  # heap of jobs parked before due

    # ---- the queued jobs ------------------------------------------------------------------

    def put(self, job: snapshot.PendingJob) -> None:
        """A queued job as the planner sees it now; a parked job that changed is live again."""
        live = old = self._live.get(job.job_id)
        parked = self._parked.get(job.job_id)
        if parked is not None:
            if parked.job == job:
                return
            self._unpark(job.job_id)
            old = parked.job
        if old is not None:
            self._counts[old.queue] -= 1
        self._counts[job.queue] += 1
        self._enter(job, live)

    def drop(self, job_id: str) -> None:
        """The job is no longer pending (dispatched, cancelled, gone)."""
        job = self._leave(job_id)
        if job is None and job_id in self._parked:
            job = self._unpark(job_id).job
        if job is not None:
            self._counts[job.queue] -= 1
            if self._counts[job.queue] <= 0:
                del self._counts[job.queue]

    def settle(self, woken: Iterable[str], parks: Iterable[Park]) -> None:
        """Apply a cycle's outcome: woken jobs are live again, the parks are parked."""
        for job_id in woken:
            if job_id in self._parked:
                self._enter(self._unpark(job_id).job, None)
        for park in parks:  # the job as it was planned (a newer version stays live)
            live = self._live.get(park.job.job_id)
            if live is not None and (live is park.job or live == park.job):
                self._leave(park.job.job_id)
                self._park(park)
        for lines in self._lines.values():
            for line in lines.values():
                if line.added:
                    line.settle()

    def __len__(self) -> int:
        return len(self._live) + len(self._parked)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._live or job_id in self._parked

    def ids(self) -> Iterator[str]:
        yield from self._live
        yield from self._parked

    def get(self, job_id: str) -> snapshot.PendingJob | None:
        """The pending job as the planner sees it, live or parked."""
        found = self._live.get(job_id)
        if found is not None:
            return found
        parked = self._parked.get(job_id)
        return parked.job if parked is not None else None

    def live(self) -> list[snapshot.PendingJob]:
        return list(self._live.values())

    def live_count(self) -> int:
        return len(self._live)

    def get_live(self, job_id: str) -> snapshot.PendingJob | None:
        return self._live.get(job_id)

    def heads(
        self, order_of: Callable[[snapshot.PendingJob], Order]
    ) -> Mapping[str, Iterator[tuple[Order, snapshot.PendingJob]]]:
        """Per queue, its live jobs in its order (`order_of`: (-priority, created, id)),
        lazily: taking the first k of a queue costs O(k log k), whatever the backlog's size
        (each band's heap is walked from its root, not popped). A job whose priority cannot
        be read (`order_of` raises) goes by its own field, as `budget.select` orders it."""
        out: dict[str, Iterator[tuple[Order, snapshot.PendingJob]]] = {}
        for queue, bands in self._bands.items():
            walks = []
            for band, heap in bands.items():
                self._trim(queue, band, heap)
                if heap:
                    walks.append(self._walk(queue, band, heap, order_of))
            if walks:
                out[queue] = heapq.merge(*walks, key=_first)
        return out

    def parked(self) -> Collection[str]:
        return self._parked.keys()

    def park_of(self, job_id: str) -> Park | None:
        return self._parked.get(job_id)

    def is_parked(self, job_id: str) -> bool:
        return job_id in self._parked

    def pending_per_queue(self) -> Mapping[str, int]:
        """Pending jobs per queue, parked ones included (what `GET /v1/queues` counts)."""
        return self._counts

    # ---- what wakes whom ------------------------------------------------------------------

    def members(self, classes: Iterable[Wake]) -> set[str]:
        out: set[str] = set()
        for wake in classes:
            out |= self._classes.get(wake, set())
        return out

    def sample(self, wake: Wake) -> snapshot.PendingJob:
        """One job of the class (they share the request's shape)."""
        return self._parked[next(iter(self._classes[wake]))].job

    def by_bounds(
        self, fleet: snapshot.FleetSnapshot, changed: Mapping[str, Collection[str]]
    ) -> set[Wake]:
        """Classes a bound of which the clusters' changed models (cluster -> models) now meet."""
        out: set[Wake] = set()
        for name, models in changed.items():
            cluster = fleet.clusters.get(name)
            for bound in self._on_cluster.get(name, ()):
                if not any(m in models for m in bound.models):
                    continue
                if cluster is None:  # a cluster gone: its shape changed, all wake anyway
                    out |= {w for classes in self._bounds[bound].values() for w in classes}
                    continue
                offered = bounds.value(cluster, bound)
                for need, classes in self._bounds[bound].items():
                    if need <= offered:
                        out |= classes
        return out

    def by_thresholds(self, usage: Mapping[UsageKey, int], keys: Iterable[UsageKey]) -> set[Wake]:
        """Classes a threshold of which the usage of `keys` has fallen to (or risen past)."""
        out: set[Wake] = set()
        for key in keys:
            held = usage.get(key, 0)
            for at_most, classes in self._thresholds.get(key, {}).items():
                if held <= at_most:
                    out |= classes
            for at_most, classes in self._rising.get(key, {}).items():
                if held > at_most:
                    out |= classes
        return out

    def by_priority(self, lowest: int) -> set[Wake]:
        """Classes of a priority above `lowest` (the lowest of the jobs holding GPUs)."""
        out: set[Wake] = set()
        for priority, classes in self._priorities.items():
            if priority > lowest:
                out |= classes
        return out

    def stand_ins(self, queue: str, order: Order, *, skip: Collection[str] = ()) -> list[str]:
        """For each shape of `queue`'s parked jobs, the last of them ahead of `order`."""
        out = []
        for line in self._lines.get(queue, {}).values():
            found = line.last_before(order, skip)
            if found is not None:
                out.append(found)
        return out

    def has_queue(self, queue: str) -> bool:
        return queue in self._lines

    def reservable(self) -> list[Wake]:
        """Classes that could be reserved somewhere once due."""
        return [wake for wake in self._timed if wake.reserve is not None]

    def classes(self) -> list[Wake]:
        """Every class of parked jobs (a reservation's change is rare: read them all)."""
        return list(self._classes)

    def timed(self) -> list[Wake]:
        """Classes whose reasons depend on being due for a reservation."""
        return list(self._timed)

    def becoming_due(self, *, now: datetime, after: float) -> set[str]:
        """Jobs parked before they were due for a reservation that are due now (the heap
        walked from its root, subtrees not yet due left out: O(what it finds))."""
        heap = self._not_due
        out: set[str] = set()
        stack = [0] if heap else []
        while stack:
            at = stack.pop()
            since, job_id = heap[at]
            if (now - since).total_seconds() < after:  # as `reservation.is_due` says
                continue  # neither is anything below it, which waits since later
            if self._waits(heap[at]):
                out.add(job_id)
            stack.extend(c for c in (2 * at + 1, 2 * at + 2) if c < len(heap))
        return out

    def due(self, wake: Wake, *, now: datetime, after: float) -> set[str]:
        """The jobs of a timed class due for a reservation at `now` (waiting `after`
        seconds); the oldest first, so a class none of which is due costs O(1)."""
        heap = self._timed.get(wake)
        if not heap or not reservation.is_due(self._parked[heap[0][1]].job, now=now, after=after):
            return set()
        return {
            job_id
            for job_id in self._classes[wake]
            if reservation.is_due(self._parked[job_id].job, now=now, after=after)
        }

    # ---- the live jobs in their queues' order ---------------------------------------------

    def _enter(self, job: snapshot.PendingJob, old: snapshot.PendingJob | None) -> None:
        """`job` is live (`old`: its live version before, if it was live)."""
        self._live[job.job_id] = job
        band = (job.priority, job.priority_class)
        if old is not None:
            if (old.queue, old.priority, old.priority_class, old.created) == (
                job.queue,
                *band,
                job.created,
            ):
                return  # its entry stands
            self._unband(old)
        self._banded[(job.queue, band)] += 1
        heap = self._bands.setdefault(job.queue, {}).setdefault(band, [])
        heapq.heappush(heap, (job.created, job.job_id))
        if len(heap) > 2 * self._banded[(job.queue, band)] + 64:  # mostly stale: once
            current = {entry for entry in heap if self._stands(job.queue, band, entry)}
            heap[:] = list(current)
            heapq.heapify(heap)

    def _leave(self, job_id: str) -> snapshot.PendingJob | None:
        job = self._live.pop(job_id, None)
        if job is not None:
            self._unband(job)
            tables.shrink(self._live)
        return job

    def _unband(self, job: snapshot.PendingJob) -> None:
        key = (job.queue, (job.priority, job.priority_class))
        self._banded[key] -= 1
        if self._banded[key] <= 0:  # the band's heap holds stale entries only
            del self._banded[key]
            bands = self._bands[job.queue]
            del bands[key[1]]
            if not bands:
                del self._bands[job.queue]

    def _stands(self, queue: str, band: Band, entry: Entry) -> bool:
        """Is the entry a live job, as it is?"""
        job = self._live.get(entry[1])
        return (
            job is not None
            and job.created == entry[0]
            and job.queue == queue
            and (job.priority, job.priority_class) == band
        )

    def _trim(self, queue: str, band: Band, heap: list[Entry]) -> None:
        """Drop the stale entries at the root (the jobs dispatched first were its heads)."""
        while heap and not self._stands(queue, band, heap[0]):
            heapq.heappop(heap)

    def _walk(
        self,
        queue: str,
        band: Band,
        heap: list[Entry],
        order_of: Callable[[snapshot.PendingJob], Order],
    ) -> Iterator[tuple[Order, snapshot.PendingJob]]:
        """The band's live jobs in (created, id) order, the heap left as it is."""
        rank: int | None = None
        seen: set[str] = set()  # a job put again after it left has two entries
        frontier = [(heap[0], 0)]
        while frontier:
            entry, at = heapq.heappop(frontier)
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if entry[1] in seen or not self._stands(queue, band, entry):
                continue
            seen.add(entry[1])
            job = self._live[entry[1]]
            if rank is None:  # every job of the band has the same priority
                try:
                    rank = order_of(job)[0]
                except Exception:  # the planner sets it aside: its own field orders it
                    rank = -job.priority
            yield (rank, job.created, job.job_id), job

    # ---- the indices ----------------------------------------------------------------------

    def _park(self, park: Park) -> None:
        job_id = park.job.job_id
        wake = self._wakes.setdefault(park.wake, park.wake)
        if wake is not park.wake:
            park = replace(park, wake=wake)
        self._parked[job_id] = park
        lines = self._lines.setdefault(park.job.queue, {})
        lines.setdefault(wake.shape, _Line()).add(park.order)
        if wake.timed:  # by waiting time, stale entries dropped at the top
            heap = self._timed.setdefault(wake, [])
            heapq.heappush(heap, (park.job.waiting_since, job_id))
            if not park.due:
                heapq.heappush(self._not_due, (park.job.waiting_since, job_id))
        members = self._classes.get(wake)
        if members is not None:
            members.add(job_id)
            return
        self._classes[wake] = {job_id}
        for witness in wake.witnesses:
            self._bounds.setdefault(witness.bound, {}).setdefault(witness.need, set()).add(wake)
            self._on_cluster.setdefault(witness.bound.cluster, set()).add(witness.bound)
        for threshold in wake.thresholds:
            key = (threshold.scope, threshold.name, threshold.model)
            index = self._rising if threshold.rising else self._thresholds
            index.setdefault(key, {}).setdefault(threshold.at_most, set()).add(wake)
        if wake.priority is not None:
            self._priorities.setdefault(wake.priority, set()).add(wake)

    def _unpark(self, job_id: str) -> Park:
        park = self._parked.pop(job_id)
        wake = park.wake
        lines = self._lines[park.job.queue]
        line = lines[wake.shape]
        line.remove(job_id)
        if not line.members:
            del lines[wake.shape]
            if not lines:
                del self._lines[park.job.queue]
        if not self._parked:
            self._not_due = []
        elif len(self._not_due) > 2 * len(self._parked) + 64:  # mostly stale: keep the rest
            self._not_due = [entry for entry in self._not_due if self._waits(entry)]
            heapq.heapify(self._not_due)
        members = self._classes[wake]
        members.discard(job_id)
        if members:
            if wake.timed:
                self._tidy(wake, members)
            return park
        del self._classes[wake]
        del self._wakes[wake]
        self._timed.pop(wake, None)
        for witness in wake.witnesses:
            _unfile(self._bounds, witness.bound, witness.need, wake)
            if witness.bound not in self._bounds:
                on = self._on_cluster[witness.bound.cluster]
                on.discard(witness.bound)
                if not on:
                    del self._on_cluster[witness.bound.cluster]
        for threshold in wake.thresholds:
            key = (threshold.scope, threshold.name, threshold.model)
            index = self._rising if threshold.rising else self._thresholds
            _unfile(index, key, threshold.at_most, wake)
        if wake.priority is not None:
            classes = self._priorities[wake.priority]
            classes.discard(wake)
            if not classes:
                del self._priorities[wake.priority]
        return park

    def _tidy(self, wake: Wake, members: set[str]) -> None:
        """Keep the top of a class's waiting-time heap a job of the class, as it is."""
        heap = self._timed[wake]
        if len(heap) > 2 * len(members) + 64:
            heap[:] = [(self._parked[j].job.waiting_since, j) for j in members]
            heapq.heapify(heap)
        while heap and not self._current(heap[0], members):
            heapq.heappop(heap)

    def _waits(self, entry: tuple[datetime, str]) -> bool:
        """Is the entry a job parked before it was due, as it is?"""
        park = self._parked.get(entry[1])
        return park is not None and not park.due and park.job.waiting_since == entry[0]

    def _current(self, entry: tuple[datetime, str], members: set[str]) -> bool:
        since, job_id = entry
        return job_id in members and self._parked[job_id].job.waiting_since == since


def _first(item: tuple[Order, snapshot.PendingJob]) -> Order:
    return item[0]


def _unfile(index: dict[K, dict[int, set[Wake]]], key: K, at: int, wake: Wake) -> None:
    by_value = index[key]
    classes = by_value[at]
    classes.discard(wake)
    if not classes:
        del by_value[at]
        if not by_value:
            del index[key]
