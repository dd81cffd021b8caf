"""Which member cluster for a gang, judged from the clusters' summaries only. Pure.

Called by the broker's planner and by `gpufed simulate --clusters K` for every job. A cluster
is feasible when, for one GPU model the job allows, its `nodes_by_free` histogram can hold
every pod (whole-GPU pods: best fit, the fullest node that still has the GPUs; sharing pods:
the free milli on partly used GPUs, else one whole GPU; CPU-only pods: CPU and memory
headroom). Feasible clusters are ranked fragmentation-aware:

1. least *opened* capacity: whole GPUs left idle on the nodes the gang breaks into, plus the
   whole GPUs a sharing pod has to open (exact fits first);
2. then the busiest cluster (highest share of its GPU milli allocated): clusters are packed
   one after another, which keeps the others whole for large gangs;
3. then the name.

Measured with `gpufed simulate --clusters 4` on the Alibaba trace: this ranking leaves as few
GPUs unallocated as one pool of the same nodes, while preferring the least fragmented cluster
(which spreads pods over clusters) left 7.5% unallocated instead of 4.7%.

The answer is a value: the ranked feasible clusters and, per other cluster, why not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.api import inventory as api
from broker.api import jobs

GPU_MILLI = 1000


@dataclass(frozen=True)
class ClusterChoice:
    ranked: tuple[str, ...]  # feasible clusters, best first
    reasons: dict[str, str]  # cluster -> why it cannot take the job

    @property
    def cluster(self) -> str | None:
        return self.ranked[0] if self.ranked else None


def choose_cluster(
    summaries: Sequence[api.ClusterSummary], request: jobs.GangRequest
) -> ClusterChoice:
    """Rank the clusters that can hold all of `request` (by their summaries)."""
    shapes = sorted(
        (shape for _, replicas, shape in request.tasks for _ in range(replicas)),
        key=lambda shape: -shape.gpus * shape.gpu_milli,
    )
    needed = min(request.min_member, len(shapes))
    keyed: list[tuple[tuple[int, float], str]] = []
    reasons: dict[str, str] = {}
    for item in summaries:
        best: tuple[int, int] | None = None
        why = "no GPU model the job allows"
        for summary in item.models:
            outcome = _fit_model(summary, shapes, needed)
            if isinstance(outcome, str):
                why = outcome
                continue
            if best is None or outcome < best:
                best = outcome
        if best is None:
            reasons[item.cluster] = why
            continue
        total = sum(model.total_gpus for model in item.models) * GPU_MILLI
        free = sum(model.free_gpus * GPU_MILLI + model.shared_free_milli for model in item.models)
        busy = (total - free) / total if total else 0.0
        keyed.append(((best[0], -round(busy, 4)), item.cluster))
    keyed.sort()
    return ClusterChoice(ranked=tuple(name for _, name in keyed), reasons=reasons)


def _fit_model(
    summary: api.ModelSummary, shapes: Sequence[jobs.PodShape], needed: int
) -> tuple[int, int] | str:
    """(opened whole GPUs, free milli of the model) if `needed` pods fit, else why not.

    The gang is fitted to one GPU model at a time: all its pods on nodes of that model.
    """
    histogram = list(summary.nodes_by_free)
    shared = summary.shared_free_milli
    opened = 0
    placed = 0
    why = ""
    for shape in shapes:
        if shape.gpus and summary.gpus_per_node == 0:
            why = "no GPU nodes"
            continue
        if shape.models and summary.model not in shape.models:
            why = f"no node of model {'|'.join(shape.models)}"
            continue
        if shape.min_gpu_memory_mib > summary.gpu_memory_mib:
            why = f"GPUs of {summary.model} have less than {shape.min_gpu_memory_mib} MiB"
            continue
        if (
            shape.cpu_milli > summary.max_free_cpu_milli
            or shape.memory_mib > summary.max_free_memory_mib
        ):
            why = "no node with the CPU and memory free"
            continue
        if shape.gpus == 0:
            placed += 1
            continue
        if shape.gpu_milli < GPU_MILLI:
            if shared >= shape.gpu_milli:
                shared -= shape.gpu_milli
                placed += 1
                continue
            source = _take(histogram, 1)
            if source is None:
                why = f"no GPU with {shape.gpu_milli} milli free"
                continue
            shared += GPU_MILLI - shape.gpu_milli
            opened += 1 + (source - 1)
            placed += 1
            continue
        source = _take(histogram, shape.gpus)
        if source is None:
            why = f"no node with {shape.gpus} whole GPUs free"
            continue
        opened += source - shape.gpus
        placed += 1
    if placed < needed:
        return why or "not enough free GPUs"
    free_milli = summary.free_gpus * GPU_MILLI + summary.shared_free_milli
    return (opened, free_milli)


def _take(histogram: list[int], gpus: int) -> int | None:
    """Best fit in the histogram: the fullest node with `gpus` free; returns its free count."""
    for free in range(gpus, len(histogram)):
        if histogram[free] > 0:
            histogram[free] -= 1
            histogram[free - gpus] += 1
            return free
    return None
