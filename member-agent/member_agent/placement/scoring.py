"""Score plug-ins: how good is this node for this pod, and which of its GPUs to take. Pure.

`gang.place_gang` calls `score` for every feasible node and keeps the highest; equal scores go
to the node of lowest rank (`indexing.Entry.rank`). `slots` then picks the GPUs on the winner.
`policies` names them. Every plug-in here is deterministic: the same inventory and request
give the same answer (`Random` draws from a generator seeded by the policy seed and the job).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kits import tables
from member_agent.inventory import fragmentation
from member_agent.placement import filtering, indexing

GPU_MILLI = indexing.GPU_MILLI
MAX_SPEC_CPU = 128_000  # BestFit's normalisation (FGD artefact: largest node, milli-CPU)
MAX_SPEC_GPU = 8_000  # BestFit's normalisation (8 GPUs, milli)
MEMO_LIMIT = 500_000


class Scorer:
    """Base plug-in: first fit (every node scores 0, so the lowest rank wins)."""

    name = "firstfit"
    randomised = False

    def score(self, entry: indexing.Entry, demand: filtering.Demand) -> float:
        return 0.0

    def share_gpu(self, entry: indexing.Entry, demand: filtering.Demand) -> int:
        """GPU index for a sharing pod: here the lowest index that fits."""
        for index, milli in enumerate(entry.gpu_free):
            if milli >= demand.gpu_milli:
                return index
        raise ValueError(f"{entry.name}: no GPU with {demand.gpu_milli} milli free")

    def slots(self, entry: indexing.Entry, demand: filtering.Demand) -> list[tuple[int, int]]:
        """(GPU index, milli) pairs the pod takes on `entry`."""
        if demand.gpus == 0:
            return []
        if demand.gpu_milli < GPU_MILLI:
            return [(self.share_gpu(entry, demand), demand.gpu_milli)]
        return [(index, GPU_MILLI) for index in filtering.whole_slots(entry, demand)]

    def pick(
        self, feasible: Sequence[indexing.Entry], *, job_id: str
    ) -> indexing.Entry:  # pragma: no cover - only randomised scorers use it
        raise NotImplementedError


def best_fit_gpu(entry: indexing.Entry, milli: int) -> int:
    """The GPU with the least free milli that still fits (lowest index among equals)."""
    best, best_free = -1, GPU_MILLI + 1
    for index, free in enumerate(entry.gpu_free):
        if milli <= free < best_free:
            best, best_free = index, free
    return best


class BestFit(Scorer):
    """FGD paper's BestFit: least weighted leftover of CPU and GPU, integer score 0-100."""

    name = "bestfit"

    def score(self, entry: indexing.Entry, demand: filtering.Demand) -> float:
        left = (
            0.5 * (entry.cpu_free - demand.cpu_milli) / MAX_SPEC_CPU
            + 0.5 * (sum(entry.gpu_free) - demand.gpu_total) / MAX_SPEC_GPU
        )
        return float(int((1.0 - left) * 100))

    def share_gpu(self, entry: indexing.Entry, demand: filtering.Demand) -> int:
        return best_fit_gpu(entry, demand.gpu_milli)


class Binpack(Scorer):
    """Pack: the node with the least GPU (then CPU) left after the pod; best-fit GPU."""

    name = "binpack"

    def score(self, entry: indexing.Entry, demand: filtering.Demand) -> float:
        gpu_left = sum(entry.gpu_free) - demand.gpu_total
        cpu_left = entry.cpu_free - demand.cpu_milli
        return -(gpu_left * MAX_SPEC_CPU + cpu_left) / MAX_SPEC_CPU

    def share_gpu(self, entry: indexing.Entry, demand: filtering.Demand) -> int:
        return best_fit_gpu(entry, demand.gpu_milli)


class Spread(Scorer):
    """Spread: the node with the most GPU (then CPU) left; the emptiest GPU for sharing."""

    name = "spread"

    def score(self, entry: indexing.Entry, demand: filtering.Demand) -> float:
        return -Binpack.score(self, entry, demand)  # type: ignore[arg-type]

    def share_gpu(self, entry: indexing.Entry, demand: filtering.Demand) -> int:
        best, best_free = -1, -1
        for index, free in enumerate(entry.gpu_free):
            if free >= demand.gpu_milli and free > best_free:
                best, best_free = index, free
        return best


class Random(Scorer):
    """A uniformly random feasible node and GPU, seeded by (policy seed, job id)."""

    name = "random"
    randomised = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def pick(self, feasible: Sequence[indexing.Entry], *, job_id: str) -> indexing.Entry:
        self._rng = random.Random(f"{self.seed}/{job_id}")
        return feasible[self._rng.randrange(len(feasible))]

    def share_gpu(self, entry: indexing.Entry, demand: filtering.Demand) -> int:
        fitting = [i for i, free in enumerate(entry.gpu_free) if free >= demand.gpu_milli]
        return fitting[self._rng.randrange(len(fitting))]


class FGD(Scorer):
    """Fragmentation Gradient Descent: the node (and GPU) whose fragmentation grows least.

    `truncate=True` is the paper's score, int(100 × sigmoid(ΔF / 1000)): many nodes tie and
    the rank decides, which acts as a first fit in rank order among them. `truncate=False`
    compares ΔF itself. With `prefer_used`, nodes that tie on the score prefer one that
    already runs GPU work over an untouched one (then the rank), keeping whole nodes whole.
    """

    def __init__(
        self,
        workload: fragmentation.Workload,
        *,
        name: str = "fgd",
        truncate: bool = True,
        prefer_used: bool = False,
    ) -> None:
        self.name = name
        self.workload = workload
        self.truncate = truncate
        self.prefer_used = prefer_used
        self._memo: dict[tuple[object, ...], tuple[float, tuple[int, ...]]] = {}

    def _value(self, delta: float) -> float:
        if self.truncate:
            return float(int(100.0 / (1.0 + math.exp(-delta / 1000.0))))
        return delta

    def _evaluate(
        self, entry: indexing.Entry, demand: filtering.Demand
    ) -> tuple[float, tuple[int, ...]]:
        workload = self.workload
        before_class = workload.cpu_class(entry.cpu_free)
        after_class = workload.cpu_class(entry.cpu_free - demand.cpu_milli)
        mem_before = workload.memory_class(entry.mem_free)
        mem_after = workload.memory_class(entry.mem_free - demand.memory_mib)
        key = (entry.model, entry.free_sorted, before_class, after_class, mem_before, mem_after,
               demand.gpus, demand.gpu_milli)  # fmt: skip
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        free = entry.free_sorted
        before = workload.fragmentation(entry.model, free, before_class, mem_before)
        if demand.gpus and demand.gpu_milli < GPU_MILLI:
            best = -math.inf
            values: tuple[int, ...] = ()
            for position, milli in enumerate(free):
                if milli < demand.gpu_milli:
                    break
                if position and free[position - 1] == milli:
                    continue
                after = list(free)
                after[position] = milli - demand.gpu_milli
                after.sort(reverse=True)
                value = self._value(
                    before
                    - workload.fragmentation(entry.model, tuple(after), after_class, mem_after)
                )
                if value > best:
                    best, values = value, (milli,)
                elif value == best:
                    values += (milli,)
            result = (best, values)
        else:
            taken = demand.gpus
            after_free = free[taken:] + (0,) * taken if taken else free
            after_value = workload.fragmentation(entry.model, after_free, after_class, mem_after)
            result = (self._value(before - after_value), ())
        # a long-lived agent: forgotten wholesale when full, never grown forever
        return tables.remember(self._memo, key, result, limit=MEMO_LIMIT)

    def score(self, entry: indexing.Entry, demand: filtering.Demand) -> float:
        value = self._evaluate(entry, demand)[0]
        if self.prefer_used:
            # scores are whole numbers: doubling keeps their order, +1 breaks their ties
            untouched = entry.whole == entry.gpu_count
            return 2.0 * value + (0.0 if untouched else 1.0)
        return value

    def share_gpu(self, entry: indexing.Entry, demand: filtering.Demand) -> int:
        values = self._evaluate(entry, demand)[1]
        for index, milli in enumerate(entry.gpu_free):
            if milli in values:
                return index
        return super().share_gpu(entry, demand)
