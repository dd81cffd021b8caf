"""Feasible nodes per pod demand, best first, kept from one placement to the next. Pure.

`gang.choose_node` scores every candidate node for every pod: on a cluster of 1,000 mostly
empty nodes that is 1,000 feasibility checks and scores per 1-GPU pod, most of an agent's
time under a stream of small offers. Yet between two offers only the nodes the first one
took (or that pods left, or whose health changed) are different, and a node's score
depends only on its own state and the demand (`scoring.Scorer`). So the agent's `Placer`,
which keeps one `FreeIndex` across offers, keeps one `Rankings` beside it:

- the first pod of a demand (GPUs, milli, CPU, memory, models, selector: `filtering.Demand`,
  hashable) builds that demand's order once: the feasible nodes, sorted by (-score, rank,
  name), the same order `choose_node` decides in;
- `refresh(entry)` (the placer calls it for every node it reads again) takes the node out of
  each order and puts it back where its new score places it, or leaves it out if it no
  longer fits;
- `choose` answers the best node not yet taken by the gang being placed, weighing the gang's
  scratch copies (the nodes it already put pods on) as `choose_node` does.

The answer is `choose_node`'s, node for node
(`tests/unit/member_agent/placement/test_ranking.py` checks it against the scan over random
clusters and placements). Orders are kept for the
`MAX_DEMANDS` demands used last; randomised scorers, MIG pods and topology groups (a subset
of the nodes) are decided by the scan.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping

from member_agent.placement import filtering, indexing, scoring

MAX_DEMANDS = 16  # orders kept (least recently used forgotten): few shapes are live at once

Item = tuple[float, int, str]  # (-score, rank, name): smallest first


class _Order:
    """One demand's feasible nodes, best first."""

    __slots__ = ("demand", "items", "keys")

    def __init__(self, demand: filtering.Demand) -> None:
        self.demand = demand
        self.items: list[Item] = []
        self.keys: dict[str, Item] = {}

    def build(self, index: indexing.FreeIndex, scorer: scoring.Scorer) -> None:
        demand = self.demand
        fits, score = filtering.fits, scorer.score
        items = [
            (-score(entry, demand), entry.rank, entry.name)
            for entry in index.candidates(
                models=demand.models,
                gpus=demand.gpus,
                gpu_milli=demand.gpu_milli,
                selector=demand.selector,
            )
            if fits(entry, demand)
        ]
        items.sort()
        self.items = items
        self.keys = {item[2]: item for item in items}

    def refresh(self, entry: indexing.Entry, scorer: scoring.Scorer) -> None:
        old = self.keys.pop(entry.name, None)
        if old is not None:
            at = bisect.bisect_left(self.items, old)
            del self.items[at]
        if filtering.fits(entry, self.demand):
            item = (-scorer.score(entry, self.demand), entry.rank, entry.name)
            bisect.insort(self.items, item)
            self.keys[entry.name] = item

    def best(
        self,
        entries: Mapping[str, indexing.Entry],
        scorer: scoring.Scorer,
        scratch: Mapping[str, indexing.Entry],
    ) -> indexing.Entry | None:
        best: indexing.Entry | None = None
        best_key: tuple[float, int] = (0.0, 0)
        for negative, rank, name in self.items:
            if name not in scratch:
                best, best_key = entries[name], (negative, rank)
                break
        demand = self.demand
        for entry in scratch.values():  # the gang's own nodes, as it left them
            if not filtering.fits(entry, demand):
                continue
            key = (-scorer.score(entry, demand), entry.rank)
            if best is None or key < best_key:
                best, best_key = entry, key
        return best


class Rankings:
    """The orders of one `FreeIndex` for one scorer; `refresh` every node the index reads
    again, and make a new one when the index is built anew."""

    def __init__(self, index: indexing.FreeIndex, scorer: scoring.Scorer) -> None:
        self.index = index
        self.scorer = scorer
        self._orders: OrderedDict[filtering.Demand, _Order] = OrderedDict()

    @staticmethod
    def applies(scorer: scoring.Scorer, demand: filtering.Demand) -> bool:
        """Whether an order decides like the scan for this pod (else: the scan)."""
        return not scorer.randomised and not demand.mig_slices

    def choose(
        self, demand: filtering.Demand, scratch: Mapping[str, indexing.Entry]
    ) -> indexing.Entry | None:
        """The best node for one pod of `demand` (scratch copies override indexed entries),
        what `gang.choose_node` over every node would answer."""
        order = self._orders.get(demand)
        if order is None:
            order = self._orders[demand] = _Order(demand)
            order.build(self.index, self.scorer)
            if len(self._orders) > MAX_DEMANDS:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(demand)
        return order.best(self.index.entries, self.scorer, scratch)

    def refresh(self, entry: indexing.Entry) -> None:
        """`entry` changed (the index read its node again): re-place it in every order."""
        for order in self._orders.values():
            order.refresh(entry, self.scorer)

    def __len__(self) -> int:
        return len(self._orders)
