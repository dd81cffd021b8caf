"""Place a whole gang on an inventory snapshot: every pod or none. Pure: no I/O, no clock.

Called by the agent (`jobs.handling`, placing an offer), by `gpufed simulate` and by the
benchmarks. The result is a value: a GangPlacement, or NoPlacement with sorted reasons; the
inventory is not changed (the caller applies the placement when it commits to it).

The gang is solved as one unit on scratch copies of the nodes: pods are taken largest first,
each goes to the feasible node the policy scores highest (ties: lowest rank), and the scratch
state carries its GPUs, CPU and memory to the next pod. Topology (rack, NVLink domain) narrows
the nodes to one group at a time (`topology.plan_groups`). With `min_member` below the pod
count, pods that do not fit are left out as long as `min_member` are placed; otherwise
nothing is placed and `explaining` says why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from broker.api import gangs, jobs, status
from member_agent.inventory import model
from member_agent.placement import (
    explaining,
    filtering,
    indexing,
    policies,
    ranking,
    scoring,
    topology,
)


@dataclass(frozen=True)
class NoPlacement:
    """The gang does not fit here; `reasons` (sorted, from `explaining`) say why."""

    reasons: tuple[str, ...]


@dataclass(frozen=True)
class PlacedPod:
    placement: status.PodPlacement
    shape: jobs.PodShape
    # a MIG pod's devices: profile -> MIG device indices on the node (`model.Node.mig`)
    mig: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class GangPlacement:
    pods: tuple[PlacedPod, ...]


@dataclass(frozen=True)
class _Pod:
    name: str
    task: str
    shape: jobs.PodShape
    demand: filtering.Demand


def place_gang(
    inventory: model.Inventory,
    request: gangs.GangRequest,
    *,
    policy: str | scoring.Scorer = policies.DEFAULT,
    index: indexing.FreeIndex | None = None,
    rankings: ranking.Rankings | None = None,
) -> GangPlacement | NoPlacement:
    """Choose node and GPUs for every pod of `request`, or say why it cannot be done.

    `policy` is a registry name (`policies.names()`) or a plug-in object. `index` is a
    `FreeIndex` of `inventory` kept current by the caller; without it one is built.
    `rankings`: the orders the caller keeps beside `index` for the same scorer object
    (`ranking`): the same answer, without scoring every node for every pod.
    """
    scorer = policies.resolve(policy)
    free_index = index if index is not None else indexing.FreeIndex.build(inventory)
    if rankings is not None and (rankings.index is not free_index or rankings.scorer is not scorer):
        rankings = None  # kept for another index or scorer: of no use here
    nvlink = request.topology.nvlink == jobs.TopologyMode.REQUIRED
    pods = [
        _Pod(name, task, shape, filtering.demand_of(shape, nvlink=nvlink))
        for name, task, shape in request.pod_names()
    ]
    order = sorted(range(len(pods)), key=lambda i: (-pods[i].demand.gpu_total, i))
    gang_milli = sum(pod.demand.gpu_total for pod in pods)
    groups = topology.plan_groups(free_index.entries.values(), request, gang_milli=gang_milli)
    for group in groups:
        chosen = _place_in_group(
            free_index,
            pods,
            order=order,
            scorer=scorer,
            request=request,
            names=group.names,
            kept=rankings if group.names is None else None,
        )
        if chosen is not None:
            return GangPlacement(pods=tuple(chosen))
    return NoPlacement(
        reasons=explaining.explain(
            free_index,
            [pod.demand for pod in pods],
            min_member=request.min_member,
            groups=[group.label for group in groups if group.label],
        )
    )


def _place_in_group(
    free_index: indexing.FreeIndex,
    pods: Sequence[_Pod],
    *,
    order: Sequence[int],
    scorer: scoring.Scorer,
    request: gangs.GangRequest,
    names: frozenset[str] | None,
    kept: ranking.Rankings | None = None,
) -> list[PlacedPod] | None:
    scratch: dict[str, indexing.Entry] = {}
    placed: dict[int, PlacedPod] = {}
    missing = 0
    allowed_missing = len(pods) - min(request.min_member, len(pods))
    repeated = {d for d, n in Counter(pod.demand for pod in pods).items() if n > 1}
    rankings: dict[filtering.Demand, _Ranking] = {}
    for i in order:
        pod = pods[i]
        if kept is not None and kept.applies(scorer, pod.demand):
            entry = kept.choose(pod.demand, scratch)
        elif pod.demand in repeated and not scorer.randomised and not pod.demand.mig_slices:
            ranking = rankings.get(pod.demand)
            if ranking is None:
                ranking = rankings[pod.demand] = _Ranking(free_index, pod.demand, scorer, names)
            entry = ranking.choose(scratch)
        else:
            entry = choose_node(free_index, pod.demand, scorer, job_id=pod.name,
                                scratch=scratch, names=names)  # fmt: skip
        if entry is None:
            missing += 1
            if missing > allowed_missing:
                return None
            continue
        slots = scorer.slots(entry, pod.demand)
        mig = filtering.mig_slots(entry, pod.demand)
        if entry.name not in scratch:
            entry = entry.copy()
            scratch[entry.name] = entry
        entry.take(slots, cpu_milli=pod.demand.cpu_milli, memory_mib=pod.demand.memory_mib, mig=mig)
        placed[i] = PlacedPod(
            placement=status.PodPlacement(
                name=pod.name,
                task=pod.task,
                node=entry.name,
                gpus=[status.GPUSlot(index=index, milli=milli) for index, milli in slots],
            ),
            shape=pod.shape,
            mig=mig,
        )
    return [placed[i] for i in sorted(placed)]


def choose_node(
    free_index: indexing.FreeIndex,
    demand: filtering.Demand,
    scorer: scoring.Scorer,
    *,
    job_id: str = "",
    scratch: dict[str, indexing.Entry] | None = None,
    names: frozenset[str] | None = None,
) -> indexing.Entry | None:
    """The best feasible node for one pod (scratch copies override indexed entries)."""
    candidates = free_index.candidates(
        models=demand.models,
        gpus=demand.gpus,
        gpu_milli=demand.gpu_milli,
        selector=demand.selector,
    )
    fits = filtering.fits
    if demand.mig_slices:
        return _choose_mig(free_index, demand, scorer, scratch=scratch, names=names)
    if scorer.randomised:
        feasible = []
        for indexed in candidates:
            entry = scratch.get(indexed.name, indexed) if scratch else indexed
            if (names is None or entry.name in names) and fits(entry, demand):
                feasible.append(entry)
        if not feasible:
            return None
        feasible.sort(key=lambda entry: entry.rank)
        return scorer.pick(feasible, job_id=job_id)
    score = scorer.score
    best: indexing.Entry | None = None
    best_score = 0.0
    best_rank = 0
    for indexed in candidates:
        entry = scratch.get(indexed.name, indexed) if scratch else indexed
        if names is not None and entry.name not in names:
            continue
        if not fits(entry, demand):
            continue
        value = score(entry, demand)
        if best is None or value > best_score or (value == best_score and entry.rank < best_rank):
            best, best_score, best_rank = entry, value, entry.rank
    return best


def _choose_mig(
    free_index: indexing.FreeIndex,
    demand: filtering.Demand,
    scorer: scoring.Scorer,
    *,
    scratch: dict[str, indexing.Entry] | None,
    names: frozenset[str] | None,
) -> indexing.Entry | None:
    """A MIG pod's node: the feasible one with the fewest free devices of its profile (best
    fit: nodes with many free keep them for larger asks), then the policy's score, then rank."""
    best: indexing.Entry | None = None
    best_key: tuple[int, float, int] = (0, 0.0, 0)
    for indexed in free_index.candidates(models=demand.models, selector=demand.selector):
        entry = scratch.get(indexed.name, indexed) if scratch else indexed
        if names is not None and entry.name not in names:
            continue
        if not filtering.fits(entry, demand):
            continue
        key = (filtering.mig_free(entry, demand), -scorer.score(entry, demand), entry.rank)
        if best is None or key < best_key:
            best, best_key = entry, key
    return best


class _Ranking:
    """The untouched feasible nodes for one demand of a gang, best first, scored once.

    A node's score depends only on its own state and the demand, so within one gang only the
    nodes already holding a pod of the gang (the scratch copies, a handful) need rescoring;
    the rest keep their order. Same answer as `choose_node`, without rescanning per pod.
    """

    def __init__(
        self,
        free_index: indexing.FreeIndex,
        demand: filtering.Demand,
        scorer: scoring.Scorer,
        names: frozenset[str] | None,
    ) -> None:
        self.demand = demand
        self.scorer = scorer
        self.names = names
        items = []
        for entry in free_index.candidates(
            models=demand.models,
            gpus=demand.gpus,
            gpu_milli=demand.gpu_milli,
            selector=demand.selector,
        ):
            if (names is None or entry.name in names) and filtering.fits(entry, demand):
                items.append((-scorer.score(entry, demand), entry.rank, entry.name, entry))
        items.sort(key=lambda item: item[:3])
        self.items = items
        self.at = 0

    def choose(self, scratch: dict[str, indexing.Entry]) -> indexing.Entry | None:
        items = self.items
        while self.at < len(items) and items[self.at][2] in scratch:
            self.at += 1
        best: indexing.Entry | None = None
        best_key: tuple[float, int] = (0.0, 0)
        if self.at < len(items):
            negative, rank, _, best = items[self.at]
            best_key = (negative, rank)
        for entry in scratch.values():
            if self.names is not None and entry.name not in self.names:
                continue
            if not filtering.fits(entry, self.demand):
                continue
            key = (-self.scorer.score(entry, self.demand), entry.rank)
            if best is None or key < best_key:
                best, best_key = entry, key
        return best
