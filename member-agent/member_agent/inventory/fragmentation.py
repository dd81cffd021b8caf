"""FGD's fragmentation measure: how much idle GPU a node holds that typical pods cannot use.

A measure of the inventory; decides nothing by itself. `placement.scoring` (the `fgd`
policies), `summary` (the cluster's fragmentation figure) and `gpufed simulate` (the reported
measure) call it. Pure: no I/O, no clock.

Definition (Weng et al., "Beware of Fragmentation", USENIX ATC '23; the authors' simulator,
`pkg/utils/frag.go`). The expected workload M is a set of typical pod shapes m with
probabilities p_m. For each m a node is classified:

* m is CPU-only, or m's GPU models exclude the node, or the node lacks CPU or GPU for m:
  **all** of the node's idle GPU milli is fragment for m;
* otherwise (m fits): only the GPUs whose free milli is below m's per-GPU milli are fragment.

F_node(M) = Σ_m p_m × fragment_m. Only CPU (not memory) enters the classification, as in the
paper. F depends on the node's CPU only through which typical CPU requests it can still meet,
so states are cached under a canonical key (model, free milli sorted, CPU threshold index).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kits import tables

GPU_MILLI = 1000
MEMO_LIMIT = 500_000  # canonical states remembered before the memo starts afresh


@dataclass(frozen=True)
class TypicalShape:
    """One pod shape of the expected workload and its probability."""

    cpu_milli: int
    gpu_milli: int  # per GPU; 0 for CPU-only shapes
    gpus: int
    models: tuple[str, ...] = ()  # allowed GPU models; empty = any
    weight: float = 1.0
    memory_mib: int = 0  # 0: memory does not enter the classification (the paper's measure)


StateKey = tuple[str, tuple[int, ...], int, int]
RequestKey = tuple[int, int, int, tuple[str, ...], int]


@dataclass
class Workload:
    """The expected workload M, with the memo of F per canonical node state."""

    shapes: tuple[TypicalShape, ...]
    _thresholds: list[int] = field(init=False, repr=False)
    _levels: tuple[int, ...] = field(init=False, repr=False)
    _mem_thresholds: list[int] = field(init=False, repr=False)
    _mem_levels: tuple[int, ...] = field(init=False, repr=False)
    _memo: dict[StateKey, float] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._thresholds = sorted({s.cpu_milli for s in self.shapes if s.gpu_milli > 0})
        # a shape's CPU is met when the node's CPU class is above the shape's level
        self._levels = tuple(bisect.bisect_left(self._thresholds, s.cpu_milli) for s in self.shapes)
        self._mem_thresholds = sorted({s.memory_mib for s in self.shapes if s.gpu_milli > 0})
        if not any(self._mem_thresholds):
            self._mem_thresholds = []
        self._mem_levels = tuple(
            bisect.bisect_left(self._mem_thresholds, s.memory_mib) if self._mem_thresholds else -1
            for s in self.shapes
        )

    def cpu_class(self, cpu_free: int) -> int:
        """How many of the typical shapes' distinct CPU requests `cpu_free` meets."""
        return bisect.bisect_right(self._thresholds, cpu_free)

    def memory_class(self, memory_free: int) -> int:
        """Like `cpu_class` for memory; always 0 when the shapes carry no memory."""
        if not self._mem_thresholds:
            return 0
        return bisect.bisect_right(self._mem_thresholds, memory_free)

    def fragmentation(
        self, model: str, free: tuple[int, ...], cpu_class: int, memory_class: int = 0
    ) -> float:
        """F of a node of `model` whose GPUs have `free` milli (sorted, largest first)."""
        key = (model, free, cpu_class, memory_class)
        cached = self._memo.get(key)
        if cached is None:
            cached = compute_fragmentation(
                self.shapes,
                (self._levels, self._mem_levels),
                model=model,
                free=free,
                classes=(cpu_class, memory_class),
            )
            tables.remember(self._memo, key, cached, limit=MEMO_LIMIT)
        return cached

    def node_fragmentation(
        self, model: str, gpu_free: Sequence[int], cpu_free: int, memory_free: int = 0
    ) -> float:
        """F of one node from its raw free vectors."""
        free = tuple(sorted(gpu_free, reverse=True))
        return self.fragmentation(
            model, free, self.cpu_class(cpu_free), self.memory_class(memory_free)
        )


def compute_fragmentation(
    shapes: Sequence[TypicalShape],
    levels: tuple[Sequence[int], Sequence[int]],
    *,
    model: str,
    free: Sequence[int],
    classes: tuple[int, int],
) -> float:
    """F_node(M), uncached; shape i's CPU is met when `levels[0][i] < classes[0]`, its
    memory when `levels[1][i] < classes[1]` (a level of -1 is always met)."""
    cpu_levels, mem_levels = levels
    cpu_class, memory_class = classes
    total = sum(free)
    if total <= 0:
        return 0.0
    value = 0.0
    for shape, level, mem_level in zip(shapes, cpu_levels, mem_levels, strict=True):
        if shape.gpu_milli <= 0 or (shape.models and model not in shape.models):
            value += shape.weight * total
            continue
        able = sum(1 for milli in free if milli >= shape.gpu_milli)
        if able >= shape.gpus and level < cpu_class and mem_level < memory_class:
            value += shape.weight * sum(milli for milli in free if milli < shape.gpu_milli)
        else:
            value += shape.weight * total
    return value


def derive_workload(
    requests: Iterable[tuple[int, int, int, tuple[str, ...]] | RequestKey],
    *,
    coverage: float = 0.95,
) -> Workload:
    """Typical shapes from observed requests (cpu_milli, gpu_milli, gpus, models[, memory]).

    The most frequent shapes that together cover `coverage` of the requests, probabilities
    renormalised over the kept shapes (FGD's `--pod-popularity-threshold 95`). Equal counts
    are ordered by the shape itself so the result does not depend on input order.
    """
    counts: Counter[RequestKey] = Counter(
        request if len(request) == 5 else (*request, 0) for request in requests
    )
    total = sum(counts.values())
    if total == 0:
        return Workload(shapes=())
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept: list[tuple[RequestKey, int]] = []
    covered = 0
    for shape, count in ordered:
        if covered >= coverage * total:
            break
        kept.append((shape, count))
        covered += count
    return Workload(
        shapes=tuple(
            TypicalShape(
                cpu_milli=cpu,
                gpu_milli=milli,
                gpus=gpus,
                models=models,
                weight=count / covered,
                memory_mib=memory,
            )
            for (cpu, milli, gpus, models, memory), count in kept
        )
    )


# A fixed table for agents with no history: whole-GPU training shapes and common
# inference slices, roughly the mix of the Alibaba 2023 trace (single-GPU dominant).
DEFAULT_WORKLOAD_TABLE: tuple[tuple[int, int, int, float], ...] = (
    # cpu_milli, gpu_milli, gpus, weight
    (0, 0, 0, 0.13),
    (8000, 1000, 1, 0.40),
    (8000, 500, 1, 0.15),
    (4000, 250, 1, 0.10),
    (16000, 1000, 2, 0.08),
    (32000, 1000, 4, 0.07),
    (64000, 1000, 8, 0.07),
)


def default_workload() -> Workload:
    """The fixed expected workload used when nothing better is known."""
    return Workload(
        shapes=tuple(
            TypicalShape(cpu_milli=cpu, gpu_milli=milli, gpus=gpus, weight=weight)
            for cpu, milli, gpus, weight in DEFAULT_WORKLOAD_TABLE
        )
    )
