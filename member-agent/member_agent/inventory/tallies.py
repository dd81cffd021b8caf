"""The agent's summary kept between reports: only the nodes changed since are counted again.

`summary.summarise` counts every node; an agent reports every 50 ms while pods come and go,
and on a large cluster that count is a large share of the agent's CPU. `KeptSummary` keeps
each node's share (`_Share`: what the node adds to its model's counts) and per model the
running tallies (sums, and multisets for the largest values), and after a change counts
again only the nodes the inventory names (`Inventory.take_touched`): a node placed on,
released, made unhealthy, cordoned, added or removed. The first call, a new inventory
object or one `clear`ed is counted whole.

It reads as `summarise` does, field for field; the fragmentation is summed from the same
per-node figures in another order, so `fragmentation_milli` may differ from a fresh
count's by one. Every `check_every` calls it counts the inventory whole as well and takes
that one if they differ (`drifts` counts it: a change made without `Inventory.touch`, which
the reporter logs). Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

from broker.api.inventory import ClusterSummary, MIGSummary, ModelSummary
from member_agent.inventory import fragmentation, model, summary

CHECK_EVERY = 200  # calls between whole counts (10 s of reports every 50 ms)


@dataclass(frozen=True, slots=True)
class _Share:
    """What one node adds to its model's counts."""

    model: str
    gpu_count: int
    gpu_memory_mib: int
    available: bool
    unavailable: int  # its unhealthy GPUs (all of them count when it is unavailable)
    whole: int
    shared: int
    rack: str
    block: int  # most wholly free GPUs in one NVLink island
    domain: str
    cpu_free: int
    memory_free: int
    mig: tuple[tuple[str, int, int], ...]  # profile, devices, free (-1: node unavailable)
    frag: float | None  # None: not counted (unavailable, or no GPUs)


def _share_of(node: model.Node, workload: fragmentation.Workload) -> _Share:
    available = node.ready and node.schedulable
    mig = tuple(
        (profile, count, len(node.mig_free.get(profile, ())) if available else -1)
        for profile, count in node.mig.items()
    )
    whole, shared = summary.whole_and_shared(node.gpu_free) if available else (0, 0)
    counted = available and node.gpu_count > 0
    return _Share(
        model=node.model,
        gpu_count=node.gpu_count,
        gpu_memory_mib=node.gpu_memory_mib,
        available=available,
        unavailable=node.unhealthy_gpus if available and node.unhealthy else 0,
        whole=whole,
        shared=shared,
        rack=node.rack,
        block=summary.nvlink_block(node, whole) if available else 0,
        domain=node.nvlink_domain,
        cpu_free=node.cpu_free,
        memory_free=node.memory_free,
        mig=mig,
        frag=workload.node_fragmentation(node.model, node.gpu_free, node.cpu_free, node.memory_free)
        if counted
        else None,
    )


def _count(counter: Counter[int], key: int, sign: int) -> None:
    counter[key] += sign
    if not counter[key]:
        del counter[key]


class _Tally:
    """One model's running counts: sums, and multisets of what the summary takes the
    largest of."""

    def __init__(self) -> None:
        self.nodes = 0
        self.total_gpus = 0
        self.unavailable_gpus = 0
        self.free_gpus = 0
        self.shared_free_milli = 0
        self.gpu_counts: Counter[int] = Counter()
        self.gpu_memory: Counter[int] = Counter()
        self.by_free: Counter[int] = Counter()  # available nodes by wholly free GPUs
        self.racks: dict[str, Counter[int]] = {}
        self.blocks: Counter[int] = Counter()
        self.domains: Counter[str] = Counter()  # multi-node NVLink domain -> free GPUs
        self.cpu: Counter[int] = Counter()
        self.memory: Counter[int] = Counter()
        # profile -> [nodes with it, devices, free devices]; and available nodes by free ones
        self.mig: dict[str, list[int]] = {}
        self.mig_by_free: dict[str, Counter[int]] = {}

    def change(self, share: _Share, sign: int) -> None:
        self.nodes += sign
        self.total_gpus += sign * share.gpu_count
        self.unavailable_gpus += sign * (share.unavailable if share.available else share.gpu_count)
        _count(self.gpu_counts, share.gpu_count, sign)
        _count(self.gpu_memory, share.gpu_memory_mib, sign)
        for profile, devices, free in share.mig:
            totals = self.mig.setdefault(profile, [0, 0, 0])
            totals[0] += sign
            totals[1] += sign * devices
            if free >= 0:
                totals[2] += sign * free
                by_free = self.mig_by_free.get(profile)
                if by_free is None:
                    by_free = self.mig_by_free[profile] = Counter()
                _count(by_free, free, sign)
            if not totals[0]:
                del self.mig[profile]
                self.mig_by_free.pop(profile, None)
        if not share.available:
            return
        self.free_gpus += sign * share.whole
        self.shared_free_milli += sign * share.shared
        _count(self.by_free, share.whole, sign)
        if share.rack:
            rack = self.racks.get(share.rack)
            if rack is None:
                rack = self.racks[share.rack] = Counter()
            _count(rack, share.whole, sign)
            if not rack:
                del self.racks[share.rack]
        _count(self.blocks, share.block, sign)
        if share.domain:
            self.domains[share.domain] += sign * share.whole
        _count(self.cpu, share.cpu_free, sign)
        _count(self.memory, share.memory_free, sign)

    def build(self, name: str) -> ModelSummary:
        gpus_per_node = max(self.gpu_counts, default=0)
        width = gpus_per_node + 1
        return ModelSummary(
            model=name,
            gpu_memory_mib=max([0, *self.gpu_memory]),
            gpus_per_node=gpus_per_node,
            nodes=self.nodes,
            total_gpus=self.total_gpus,
            free_gpus=self.free_gpus,
            unavailable_gpus=self.unavailable_gpus,
            nodes_by_free=_histogram(self.by_free, 9)[:width],
            shared_free_milli=self.shared_free_milli,
            largest_free_nvlink_block=max([0, *self.blocks, *self.domains.values()]),
            racks={
                rack: _histogram(counts, 9)[:width] for rack, counts in sorted(self.racks.items())
            },
            max_free_cpu_milli=max([0, *self.cpu]),
            max_free_memory_mib=max([0, *self.memory]),
            mig={
                profile: MIGSummary(
                    total=t[1],
                    free=t[2],
                    nodes_by_free=_histogram(self.mig_by_free.get(profile, Counter()), 0),
                )
                for profile, t in sorted(self.mig.items())
            }
            or None,
        )


def _histogram(counts: Counter[int], least: int) -> list[int]:
    """counts[k] for k = 0.., at least `least` long, as `summary` grows its lists."""
    size = max(least, max(counts, default=-1) + 1)
    return [counts.get(k, 0) for k in range(size)]


class KeptSummary:
    """`summarise` of one inventory, counted again only where it changed (see the module)."""

    def __init__(
        self,
        *,
        workload: fragmentation.Workload | None = None,
        check_every: int = CHECK_EVERY,
    ) -> None:
        self.workload = workload
        self.check_every = check_every
        self.calls = 0
        self.drifts = 0  # whole counts that differed from the kept one
        self._inventory: model.Inventory | None = None
        self._shares: dict[str, _Share] = {}
        self._tallies: dict[str, _Tally] = {}
        self._frags: Counter[float] = Counter()

    def __call__(self, inventory: model.Inventory, *, seq: int = 0) -> ClusterSummary:
        self.calls += 1
        touched = inventory.take_touched()
        if inventory is not self._inventory or touched is None:
            self._inventory = inventory
            self._shares, self._tallies, self._frags = {}, {}, Counter()
            touched = set(inventory.nodes)
        workload = self.workload if self.workload is not None else summary.default_workload()
        for name in touched:
            old = self._shares.pop(name, None)
            if old is not None:
                self._change(old, -1)
            node = inventory.nodes.get(name)
            if node is not None:
                share = self._shares[name] = _share_of(node, workload)
                self._change(share, 1)
        kept = self._build(inventory.cluster, seq)
        if self.check_every and self.calls % self.check_every == 0:
            whole = summary.summarise(inventory, seq=seq, workload=self.workload)
            if not same(kept, whole):
                self.drifts += 1
                self._inventory = None  # counted whole next time
                return whole
        return kept

    def _change(self, share: _Share, sign: int) -> None:
        tally = self._tallies.get(share.model)
        if tally is None:
            tally = self._tallies[share.model] = _Tally()
        tally.change(share, sign)
        if not tally.nodes:
            del self._tallies[share.model]
        if share.frag is not None:
            self._frags[share.frag] += sign
            if not self._frags[share.frag]:
                del self._frags[share.frag]

    def _build(self, cluster: str, seq: int) -> ClusterSummary:
        frag = math.fsum(
            itertools.chain.from_iterable(itertools.repeat(v, n) for v, n in self._frags.items())
        )
        return ClusterSummary(
            cluster=cluster,
            seq=seq,
            models=[self._tallies[name].build(name) for name in sorted(self._tallies)],
            fragmentation_milli=int(frag),
        )


def same(kept: ClusterSummary, whole: ClusterSummary) -> bool:
    """The two summaries agree (the fragmentation within one milli: sums in another order)."""
    if abs(kept.fragmentation_milli - whole.fragmentation_milli) > 1:
        return False
    return kept.model_copy(update={"fragmentation_milli": whole.fragmentation_milli}) == whole
