"""Bounds on the room a gang could find on a cluster: necessary conditions for any fit, which
only fall as GPUs are taken. Pure.

Called by `parking`, which parks a queued job that does not fit only with a *witness* per
cluster: a bound the cluster breaks for that gang. For a threshold `g` (1 … its largest pod),
the whole-GPU pods of at least `g` GPUs need, on the GPU models any of its pods may use there
(the models it is given, its pods' node selection and GPU memory):

- `gpus`: their GPUs ≤ Σ free GPUs of the nodes with at least `g` free;
- `slots`: their number ≤ Σ ⌊free / g⌋ over those nodes;

and with rack topology required (a gang of several pods), the same per rack, the largest over
the racks. Any placement obeys both — a pod of `s ≥ g` GPUs goes on a node that had at least
`s` free, and a node with `f` free takes at most `f` GPUs and ⌊f / g⌋ such pods — so a cluster
that breaks one has no room for the gang, whatever order `fitting.fit_gang` tries the pods
in. Both sides only fall when a node's free GPUs fall (a placement assumed in the cycle, a
summary that shows fewer free), so a witness holds until the cluster shows more free GPUs of
those models, or its shape changes (models, GPU memory, node size, racks: `parking` wakes
every parked job then). Sharing pods (a fraction of a GPU) and CPU-only pods are left out of
the bounds: a bound on fewer pods is still a bound. A pod that may use none of the cluster's
models is a certainty without a bound (nothing to watch but the cluster's shape).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from broker.api import gangs, jobs
from broker.planning import fitting, reservation, snapshot

CLUSTER = "cluster"  # scope: the cluster's nodes
RACKS = "racks"  # scope: the nodes of one rack, the largest over the racks
GPUS = "gpus"  # kind: free GPUs of the nodes with at least `at` free
SLOTS = "slots"  # kind: pods of `at` GPUs those nodes could take


@dataclass(frozen=True, order=True)
class Bound:
    """What a witness reads on a cluster (`value`)."""

    cluster: str
    scope: str  # CLUSTER | RACKS
    kind: str  # GPUS | SLOTS
    models: tuple[str, ...]  # sorted
    at: int  # the threshold g


@dataclass(frozen=True, order=True)
class Witness:
    """The cluster has no room for the gang while `value(cluster, bound) < need`."""

    bound: Bound
    need: int


def demand(request: gangs.GangRequest) -> list[tuple[int, int]]:
    """(GPUs per pod, pods) of the gang's whole-GPU pods, largest first."""
    counts: dict[int, int] = {}
    for _, replicas, shape in request.tasks:
        if shape.gpus >= 1 and shape.gpu_milli >= fitting.GPU_MILLI and replicas > 0:
            counts[shape.gpus] = counts.get(shape.gpus, 0) + replicas
    return sorted(counts.items(), reverse=True)


def need(pods: Iterable[tuple[int, int]], kind: str, at: int) -> int:
    if kind == GPUS:
        return sum(size * count for size, count in pods if size >= at)
    return sum(count for size, count in pods if size >= at)


def _held(hist: list[int], kind: str, at: int) -> int:
    if kind == GPUS:
        return sum(free * hist[free] for free in range(at, len(hist)))
    return sum((free // at) * hist[free] for free in range(at, len(hist)))


def value(cluster: snapshot.ClusterCapacity, bound: Bound) -> int:
    """What the cluster offers the bound now (monotone: never rises as GPUs are taken)."""
    models = [cluster.models[m] for m in bound.models if m in cluster.models]
    if bound.scope == CLUSTER:
        return sum(_held(m.nodes_by_free, bound.kind, bound.at) for m in models)
    racks: dict[str, int] = {}
    for model in models:
        for rack, hist in model.racks.items():
            racks[rack] = racks.get(rack, 0) + _held(hist, bound.kind, bound.at)
    return max(racks.values(), default=0)


def _usable(
    cluster: snapshot.ClusterCapacity, shape: jobs.PodShape, models: frozenset[str]
) -> list[str]:
    """The models of `cluster` a pod may use, as `fitting` judges them (within `models`)."""
    return [
        name
        for name, m in sorted(cluster.models.items())
        if name in models
        and (shape.admits_model(name) if shape.gpus else not shape.models or name in shape.models)
        and m.gpu_memory_mib >= shape.min_gpu_memory_mib
    ]


def witness(
    cluster: snapshot.ClusterCapacity, request: gangs.GangRequest, models: frozenset[str]
) -> tuple[Witness, ...] | None:
    """Proof that the gang fits nowhere on `cluster` on any subset of `models`, while the
    cluster only loses free GPUs: () for a certainty with nothing to watch (an unhealthy
    cluster, a pod that may use none of its models), (witness,) for a bound it breaks, None
    if no bound says so (the gang may fit)."""
    if not cluster.healthy:
        return ()
    eligible: set[str] = set()
    for _, replicas, shape in request.tasks:
        if replicas <= 0:
            continue
        usable = _usable(cluster, shape, models)
        if not usable:
            return ()
        if shape.gpus:
            eligible.update(usable)
    pods = demand(request)
    if not pods:
        return None
    names = tuple(sorted(eligible))
    scopes = [CLUSTER]
    if request.topology.rack == jobs.TopologyMode.REQUIRED and request.pods > 1:
        scopes.append(RACKS)
    for scope in scopes:  # the whole cluster first: it implies every rack
        best: tuple[float, Witness] | None = None
        for at in range(pods[0][0], 0, -1):
            for kind in (SLOTS, GPUS):
                wanted = need(pods, kind, at)
                bound = Bound(cluster.name, scope, kind, names, at)
                short = wanted - value(cluster, bound)
                if short > 0 and (best is None or short / wanted > best[0]):
                    best = (short / wanted, Witness(bound, wanted))
        if best is not None:
            return (best[1],)
    return None


def could_fit_empty(
    cluster: snapshot.ClusterCapacity, request: gangs.GangRequest, models: frozenset[str]
) -> bool:
    """Could the gang fit `cluster` with every GPU free, on `models`? False only when a bound
    says it never could (`reservation.empty_like`: what a reservation there waits for)."""
    return witness(reservation.empty_like(cluster), request, models) is None
