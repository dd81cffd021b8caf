"""Replay a trace through the agent's placement (and the broker's cluster choice).

Called by `gpufed.sim.simulating` once per (policy, seed). Every trace pod becomes a one-pod
GangRequest and goes through the SAME `placement.gang.place_gang` the agent runs; with
several member clusters each pod first goes through the broker's own planner
(`broker.planning.planning.plan_cycle`) over the clusters' `inventory.summary.summarise`
summaries, then to the chosen cluster's place_gang; a cluster that cannot place it is
excluded and the broker decides again, as after an agent's rejection.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from broker.api import gangs, jobs
from broker.api.inventory import ClusterSummary
from broker.planning import planning, snapshot
from gpufed.sim import traces
from member_agent.inventory import fragmentation, model, summary
from member_agent.placement import gang, indexing, ranking, scoring

Progress = Callable[[int, int], None]
_EPOCH = datetime(2023, 1, 1, tzinfo=UTC)


@dataclass
class Member:
    """One member cluster in the replay: its inventory, index and last summary."""

    name: str
    inventory: model.Inventory
    index: indexing.FreeIndex
    scorer: scoring.Scorer
    summary: ClusterSummary | None = None
    rankings: ranking.Rankings | None = None  # the index's orders per pod shape (`ranking`)

    def __post_init__(self) -> None:
        if self.rankings is None:
            self.rankings = ranking.Rankings(self.index, self.scorer)


@dataclass
class Placed:
    order: int
    pod: str
    cluster: str
    node: str
    gpus: tuple[tuple[int, int], ...]


@dataclass
class Replay:
    """Per-pod snapshots of one run (protocol A): what had arrived and what was allocated."""

    capacity_milli: int
    arrived: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    fragmentation: list[float] = field(default_factory=list)
    placements: list[Placed] = field(default_factory=list)
    failed: int = 0


class Federation:
    """The member clusters of one replay and the pod -> cluster -> node decision."""

    def __init__(
        self,
        node_groups: Sequence[Sequence[traces.TraceNode]],
        *,
        ranks: dict[str, int],
        make_scorer: Callable[[], scoring.Scorer],
        workload: fragmentation.Workload,
    ) -> None:
        self.workload = workload
        self.members: list[Member] = []
        self.shapes: dict[tuple[int, int, int, int, tuple[str, ...]], jobs.PodShape] = {}
        for number, group in enumerate(node_groups):
            name = "pool" if len(node_groups) == 1 else f"cluster-{number}"
            inventory = model.Inventory(cluster=name)
            for node in sorted(group, key=lambda node: ranks.get(node.sn, 0)):
                inventory.add(
                    model.Node(
                        name=node.sn,
                        model=node.model,
                        gpu_count=node.gpus,
                        cpu_milli=node.cpu_milli,
                        memory_mib=node.memory_mib,
                    )
                )
            index = indexing.FreeIndex.build(inventory, order=ranks)
            self.members.append(Member(name, inventory, index, make_scorer()))
        self.by_name = {member.name: member for member in self.members}
        self.frag = sum(
            workload.node_fragmentation(node.model, node.gpu_free, node.cpu_free, node.memory_free)
            for member in self.members
            for node in member.inventory
        )
        if len(self.members) > 1:
            for member in self.members:
                member.summary = summary.summarise(member.inventory, workload=workload)

    def request_for(self, pod: traces.TracePod) -> gangs.GangRequest:
        key = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.models)
        shape = self.shapes.get(key)
        if shape is None:
            shape = jobs.PodShape(
                gpus=pod.num_gpu,
                gpu_milli=pod.gpu_milli if pod.num_gpu else 0,
                models=pod.models,
                cpu_milli=pod.cpu_milli,
                memory_mib=pod.memory_mib,
            )
            self.shapes[key] = shape
        return gangs.GangRequest(job_id=pod.name, tasks=(("pod", 1, shape),), min_member=1)

    def place(self, pod: traces.TracePod) -> tuple[Member, gang.PlacedPod] | None:
        """Decide and apply one pod; None when it fits nowhere."""
        request = self.request_for(pod)
        ranked = [self.members[0]] if len(self.members) == 1 else []
        rejected: set[str] = set()
        while True:
            if len(self.members) > 1:
                # the broker's own decision, over the agents' summaries (the service's code);
                # a cluster that cannot place it is excluded, as after a rejection
                ranked = [self.by_name[name] for name in self.choose(request, rejected)]
            if not ranked:
                return None
            member = ranked[0]
            result = gang.place_gang(
                member.inventory,
                request,
                policy=member.scorer,
                index=member.index,
                rankings=member.rankings,
            )
            if isinstance(result, gang.GangPlacement):
                placed = result.pods[0]
                self.apply(member, placed)
                return member, placed
            if len(self.members) == 1:
                return None
            rejected.add(member.name)

    def choose(self, request: gangs.GangRequest, rejected: set[str]) -> list[str]:
        """`planning.plan_cycle` for one job over the members' summaries: [cluster] or []."""
        fleet = snapshot.FleetSnapshot.build(
            [
                snapshot.ClusterCapacity.from_summary(member.summary, healthy=True)
                for member in self.members
                if member.summary is not None
            ]
        )
        job = snapshot.PendingJob(
            job_id=request.job_id,
            queue="trace",
            priority=0,
            created=_EPOCH,
            request=request,
            excluded=frozenset(rejected),
        )
        plan = planning.plan_cycle(fleet, [job])
        return [a.cluster for a in plan.assignments]

    def apply(self, member: Member, placed: gang.PlacedPod) -> None:
        node = member.inventory.nodes[placed.placement.node]
        before = self.workload.node_fragmentation(
            node.model, node.gpu_free, node.cpu_free, node.memory_free
        )
        member.inventory.apply(
            placed.placement,
            cpu_milli=placed.shape.cpu_milli,
            memory_mib=placed.shape.memory_mib,
            mig=placed.mig,
        )
        self._changed(member, node, before)

    def release(self, member: Member, pod_name: str, node_name: str) -> None:
        node = member.inventory.nodes[node_name]
        before = self.workload.node_fragmentation(
            node.model, node.gpu_free, node.cpu_free, node.memory_free
        )
        member.inventory.release(pod_name)
        self._changed(member, node, before)

    def _changed(self, member: Member, node: model.Node, before: float) -> None:
        member.index.refresh(node)
        if member.rankings is not None:
            member.rankings.refresh(member.index.entries[node.name])
        self.frag += (
            self.workload.node_fragmentation(
                node.model, node.gpu_free, node.cpu_free, node.memory_free
            )
            - before
        )
        if member.summary is not None:
            member.summary = summary.summarise(member.inventory, workload=self.workload)

    def allocated_milli(self) -> int:
        return sum(
            node.gpu_count * model.GPU_MILLI - node.free_milli
            for member in self.members
            for node in member.inventory
        )


def replay_protocol_a(
    federation: Federation,
    pods: Sequence[traces.TracePod],
    *,
    progress: Progress | None = None,
) -> Replay:
    """Schedule `pods` one by one, never retried, never leaving; snapshot after each pod."""
    capacity = sum(
        node.gpu_count * model.GPU_MILLI for m in federation.members for node in m.inventory
    )
    replay = Replay(capacity_milli=capacity)
    arrived = 0
    allocated = federation.allocated_milli()
    for order, pod in enumerate(pods):
        arrived += pod.gpu_total
        outcome = federation.place(pod)
        if outcome is None:
            replay.failed += 1
            replay.placements.append(Placed(order, pod.name, "", "", ()))
        else:
            member, placed = outcome
            slots = tuple((slot.index, slot.milli) for slot in placed.placement.gpus)
            allocated += sum(milli for _, milli in slots)
            replay.placements.append(
                Placed(order, pod.name, member.name, placed.placement.node, slots)
            )
        replay.arrived.append(arrived)
        replay.allocated.append(allocated)
        replay.fragmentation.append(federation.frag)
        if progress is not None and (order % 256 == 0 or order == len(pods) - 1):
            progress(order + 1, len(pods))
    return replay


@dataclass
class TimedReplay:
    """Time-driven run: queueing delays of the placed pods and the GPU use over time."""

    delays: list[float] = field(default_factory=list)
    never_placed: int = 0
    peak_allocated_milli: int = 0
    mean_allocated_milli: float = 0.0
    capacity_milli: int = 0


def replay_in_time(
    federation: Federation,
    pods: Sequence[traces.TracePod],
    *,
    compression: float = 1.0,
    progress: Progress | None = None,
) -> TimedReplay:
    """Pods arrive at creation/compression and leave after their own lifetime; FIFO queue.

    A pod that does not fit waits; the queue is served strictly in arrival order (the head
    blocks those behind it) whenever a pod arrives or leaves.
    """
    timed = [pod for pod in pods if pod.creation is not None]
    timed.sort(key=lambda pod: (pod.creation or 0, pod.name))
    capacity = sum(
        node.gpu_count * model.GPU_MILLI for m in federation.members for node in m.inventory
    )
    result = TimedReplay(capacity_milli=capacity)
    departures: list[tuple[float, int, str, str, str]] = []  # (time, seq, member, pod, node)
    queue: deque[tuple[float, traces.TracePod]] = deque()
    allocated = 0
    area = 0.0
    last = 0.0
    seq = 0
    start = (timed[0].creation or 0) / compression if timed else 0.0

    def serve(now: float) -> None:
        nonlocal allocated, seq
        while queue:
            arrived_at, pod = queue[0]
            outcome = federation.place(pod)
            if outcome is None:
                return
            queue.popleft()
            member, placed = outcome
            allocated += sum(slot.milli for slot in placed.placement.gpus)
            result.delays.append(now - arrived_at)
            lifetime = (pod.deletion - (pod.creation or 0)) if pod.deletion is not None else None
            if lifetime is not None:
                seq += 1
                heapq.heappush(
                    departures,
                    (now + lifetime, seq, member.name, placed.placement.name,
                     placed.placement.node),
                )  # fmt: skip

    for number, pod in enumerate(timed):
        now = (pod.creation or 0) / compression
        while departures and departures[0][0] <= now:
            when, _, member_name, pod_name, node_name = heapq.heappop(departures)
            area += allocated * (when - last)
            last = when
            member = federation.by_name[member_name]
            before = sum(member.inventory.nodes[node_name].gpu_free)
            federation.release(member, pod_name, node_name)
            allocated -= sum(member.inventory.nodes[node_name].gpu_free) - before
            serve(when)
        area += allocated * (now - last)
        last = now
        queue.append((now, pod))
        serve(now)
        result.peak_allocated_milli = max(result.peak_allocated_milli, allocated)
        if progress is not None and (number % 256 == 0 or number == len(timed) - 1):
            progress(number + 1, len(timed))
    result.never_placed = len(queue)
    span = last - start
    result.mean_allocated_milli = area / span if span > 0 else float(allocated)
    return result
