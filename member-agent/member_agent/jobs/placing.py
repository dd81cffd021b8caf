"""Placing offers' gangs on the live inventory, with a free-capacity index kept between offers.

`handling.JobHandler` calls `Placer.place` for every offer that passed its checks. The choice
itself is `placement.gang.place_gang` (pure); what this adds is the state that lasts from one
offer to the next: the `placement.indexing.FreeIndex` of the live inventory, read again only
for the nodes that changed since the last offer (`mark_stale`: pods created, deleted or moved
there) and built afresh when nodes came, went or changed (`forget`); beside it, the
`placement.ranking.Rankings` of that index (each pod demand's nodes in order, so an offer does
not score every node again), kept by the same refreshes; and the time each placement takes
(`duration`, which `telemetry.AgentCollector` exports).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Histogram

from broker.api import gangs
from member_agent.inventory import model
from member_agent.placement import gang, indexing, policies, ranking

# seconds; the agent's placement target is p99 <= 10 ms
PLACEMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class Placer:
    def __init__(self, *, policy: str = "default") -> None:
        self.policy = policy
        self.scorer = policies.resolve(policy)
        # time to choose nodes and GPUs for an offer's gang
        self.duration = Histogram(
            "gpufed_agent_placement_duration_seconds",
            "Choosing nodes and GPUs for one offer's gang (index refresh and place_gang)",
            buckets=PLACEMENT_BUCKETS,
            registry=None,
        )
        self._index: indexing.FreeIndex | None = None
        self._rankings: ranking.Rankings | None = None
        self._stale_nodes: set[str] = set()

    def place(
        self, inventory: model.Inventory, request: gangs.GangRequest
    ) -> gang.GangPlacement | gang.NoPlacement:
        """Nodes and GPUs for every pod of `request` on `inventory`, or why not."""
        with self.duration.time():
            index = self._fresh_index(inventory)
            if self._rankings is None:  # dropped whenever the index is built anew
                self._rankings = ranking.Rankings(index, self.scorer)
            return gang.place_gang(
                inventory, request, policy=self.scorer, index=index, rankings=self._rankings
            )

    def mark_stale(self, nodes: Iterable[str]) -> None:
        """These nodes changed: read them again before the next placement."""
        self._stale_nodes.update(nodes)

    def forget(self) -> None:
        """Nodes came, went or changed: index them all again."""
        self._index = None

    def _fresh_index(self, inventory: model.Inventory) -> indexing.FreeIndex:
        """The placement index, with the nodes changed since the last offer read again."""
        index = self._index
        if index is not None and all(name in inventory.nodes for name in self._stale_nodes):
            for name in self._stale_nodes:
                index.refresh(inventory.nodes[name])
                if self._rankings is not None:
                    self._rankings.refresh(index.entries[name])
        else:
            index = self._index = indexing.FreeIndex.build(inventory)
            self._rankings = None
        self._stale_nodes.clear()
        return index
