"""`GET /v1/clusters/{name}/gpus`: a cluster's GPU map (`api.gpumap`), what the console draws.

Built on request from what the leader holds: the agent's latest summary (per GPU model, the
histogram of nodes by free GPUs) and the pods of the jobs holding GPUs there (node, GPU index,
milli-GPU, as the agent reported them). The nodes with gpufed pods are named and exact; the
others are the summary's histogram less those nodes (`build_map`). It costs O(nodes with
pods + GPU models), however large the cluster.

The summaries live with the leader: a follower forwards the question with the caller's token
(`forwarding`) and, when the leader does not answer, says so (503). Job ids are shown only
where the caller may see the job (`auth.Principal.sees`); other tenants' pods still colour
their cells.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from broker.api import errors, gpumap, inventory, status
from broker.http import auth, forwarding, keys

WHOLE_MILLI = 1000
_GONE = frozenset({status.PodPhase.DELETED, status.PodPhase.SUCCEEDED, status.PodPhase.FAILED})


@dataclass
class Holder:
    """A job holding GPUs on the cluster, and the GPUs per model it holds (None: unknown)."""

    record: status.JobRecord
    models: Mapping[str, int] | None = None


@dataclass
class _Node:
    model: str
    whole: set[int] = field(default_factory=set)
    shared: dict[int, int] = field(default_factory=dict)  # index -> milli held
    jobs: set[str] = field(default_factory=set)

    def cells(self, width: int) -> str:
        top = max([*self.whole, *self.shared, width - 1])
        out = []
        for index in range(top + 1):
            if index in self.whole:
                out.append(gpumap.Cell.WHOLE.value)
            elif index in self.shared:
                out.append(gpumap.Cell.SHARED.value)
            else:
                out.append(gpumap.Cell.FREE.value)
        return "".join(out)


def _model_of(holder: Holder, summary: inventory.ClusterSummary) -> str:
    """The GPU model of the nodes a job's pods are on: the one it holds, if one."""
    known = [m.model for m in summary.models]
    held = sorted(holder.models) if holder.models else []
    for model in held:
        if model in known:
            return model
    return known[0] if known else (held[0] if held else "unknown")


def build_map(
    name: str,
    health: str,
    summary: inventory.ClusterSummary | None,
    holders: Iterable[Holder],
    *,
    sees: Callable[[str], bool],
) -> gpumap.GpuMap:
    """The map of cluster `name` from its summary and the jobs holding GPUs on it."""
    if summary is None:
        return gpumap.GpuMap(
            cluster=name, health=health, message="no summary from this cluster's agent yet"
        )
    nodes: dict[str, _Node] = {}
    for holder in holders:
        model = _model_of(holder, summary)
        for pod in holder.record.status.pods:
            if pod.phase in _GONE or not pod.node:
                continue
            node = nodes.setdefault(pod.node, _Node(model))
            if sees(holder.record.tenant):
                node.jobs.add(holder.record.id)
            for slot in pod.gpus:
                if slot.milli >= WHOLE_MILLI:
                    node.whole.add(slot.index)
                else:
                    node.shared[slot.index] = node.shared.get(slot.index, 0) + slot.milli
    models = []
    named = []
    others = []
    for item in summary.models:
        if not item.gpus_per_node:  # CPU-only nodes: no GPU cells to draw
            continue
        width = item.gpus_per_node
        models.append(
            gpumap.MapModel(
                model=item.model,
                gpus_per_node=width,
                nodes=item.nodes,
                total=item.total_gpus,
                free=item.free_gpus,
            )
        )
        histogram = [*item.nodes_by_free, *[0] * (width + 1 - len(item.nodes_by_free))]
        unmatched = 0
        for node_name in sorted(n for n, node in nodes.items() if node.model == item.model):
            node = nodes[node_name]
            cells = node.cells(width)
            named.append(
                gpumap.MapNode(
                    name=node_name, model=item.model, cells=cells, jobs=sorted(node.jobs)
                )
            )
            free = cells.count(gpumap.Cell.FREE.value)
            if free < len(histogram) and histogram[free] > 0:
                histogram[free] -= 1
            else:  # the summary is older than the pods, or the node is not ready
                unmatched += 1
        for free in range(len(histogram) - 1, -1, -1):
            if histogram[free]:
                cells = gpumap.Cell.FREE.value * free + gpumap.Cell.OTHER.value * (width - free)
                others.append(gpumap.MapGroup(model=item.model, cells=cells, count=histogram[free]))
        not_ready = item.nodes - sum(item.nodes_by_free) - unmatched
        if not_ready > 0:
            others.append(
                gpumap.MapGroup(
                    model=item.model, cells=gpumap.Cell.OTHER.value * width, count=not_ready
                )
            )
    return gpumap.GpuMap(
        cluster=name,
        health=health,
        models=models,
        nodes=named,
        others=others,
        message=(
            f"{len(named)} {'node holds' if len(named) == 1 else 'nodes hold'} gpufed pods "
            "(named, exact); the other nodes are drawn from the agent's summary (free GPUs "
            "per node, names not reported)"
        ),
    )


async def cluster_gpus(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    app = request.app
    work = app[keys.LEADER_WORK]
    leadership = app[keys.LEADERSHIP]
    if leadership.replicated and not work.active:  # the summaries are the leader's
        leader = leadership.leader_url
        if forwarding.forwardable(request, leader, leadership.url):
            assert leader is not None
            answered = await forwarding.ask_leader(request, leader)
            if answered is not None:
                return web.json_response(answered)
        raise errors.Unavailable(
            "the GPU map is drawn by the leader, which holds the agents' summaries, and it "
            f"did not answer ({leader or 'no leader yet'})",
            title="Leader not answering",
        )
    clusters = app[keys.FLEET]
    cluster = clusters.clusters.get(name)
    if cluster is None:
        raise errors.NotFound(f"no cluster {name!r}")
    book = app[keys.JOBS]
    holders = [
        Holder(record, held[1] if (held := book.accounts.held_by(record.id)) else None)
        for record in book.book.on_cluster(name)
        if record.status.state in (status.JobState.DISPATCHED, status.JobState.RUNNING)
    ]
    principal = auth.caller(request)
    health = cluster.health(now=time.monotonic(), stale_after=clusters.stale_after)
    answer = build_map(name, health, cluster.summary, holders, sees=principal.sees)
    return web.json_response(answer.model_dump(mode="json", by_alias=True))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/clusters/{name}/gpus", cluster_gpus)
