"""A small world for backlog tests: clusters of nodes (two GPU models, racks), running jobs,
pending jobs, victims releasing their GPUs, the queues configuration and the clock; and
`Twins`, which plans each cycle twice over the same world — `planning.plan_cycle` over every
pending job (the full re-plan) and `parking.plan_backlog` over the backlog it keeps — and
says where they differ. The world applies the full plan, so both see the same next cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from broker.api import clusterchoice
from broker.api import queues as api
from broker.planning import planning, plans, quotas, snapshot
from broker.planning.backlog import backlog, parking
from tests.builders import T0, make_job

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"


@dataclass
class Node:
    name: str
    model: str
    size: int
    rack: str | None
    free: int


@dataclass
class Cluster:
    name: str
    nodes: list[Node]
    present: bool = True
    healthy: bool = True
    shared: dict[str, int] = field(default_factory=dict)  # model -> free milli on opened GPUs
    labels: dict[str, str] = field(default_factory=dict)  # what spec.clusters selects on

    def capacity(self) -> snapshot.ClusterCapacity:
        models: dict[str, snapshot.ModelCapacity] = {}
        for node in self.nodes:
            found = models.get(node.model)
            if found is None:
                found = models[node.model] = snapshot.ModelCapacity(
                    model=node.model,
                    gpu_memory_mib=81920,
                    nodes_by_free=[0] * (node.size + 1),
                    shared_free_milli=self.shared.get(node.model, 0),
                    largest_free_nvlink_block=0,
                    racks={},
                    gpus_per_node=node.size,
                )
            found.nodes_by_free[node.free] += 1
            found.total_gpus += node.size
            found.largest_free_nvlink_block = max(found.largest_free_nvlink_block, node.free)
            if node.rack is not None:
                hist = found.racks.setdefault(node.rack, [0] * (node.size + 1))
                hist[node.free] += 1
        return snapshot.ClusterCapacity(self.name, self.healthy, models, labels=self.labels)


def make_clusters() -> list[Cluster]:
    def nodes(prefix: str, model: str, size: int, count: int, racks: int) -> list[Node]:
        return [
            Node(f"{prefix}-{i}", model, size, f"r{i % racks}" if racks else None, size)
            for i in range(count)
        ]

    return [
        Cluster("c1", nodes("c1h", H100, 8, 4, 2), labels=dict(LABELS[0])),
        Cluster(
            "c2", nodes("c2a", A100, 8, 3, 2) + nodes("c2h", H100, 4, 2, 0), labels=dict(LABELS[1])
        ),
        Cluster("c3", nodes("c3h", H100, 8, 2, 0), present=False, labels=dict(LABELS[2])),
    ]


# the labels a cluster may have (`World.relabel`), and the `spec.clusters` a job may give
LABELS: list[dict[str, str]] = [
    {"region": "eu"},
    {"region": "us", "tier": "spot"},
    {"region": "eu", "tier": "spot"},
    {},
]
CHOICES: dict[str, dict[str, Any]] = {
    "": {},
    "eu": {"selector": {"matchLabels": {"region": "eu"}}},
    "spot": {"selector": {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}},
    "nowhere": {"selector": {"matchLabels": {"region": "mars"}}},
    "order": {"order": ["c2", "c3"]},
    "prefer": {"preferred": [{"weight": 10, "selector": {"matchLabels": {"tier": "spot"}}}]},
}


def _queue(name: str, quotas: dict[str, tuple[int, int | None]], **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "tenant": name,
        "quotas": {m: {"guaranteed": g, "limit": lim} for m, (g, lim) in quotas.items()},
        **more,
    }


CLASSES = [
    {"name": "low", "value": -10, "preempts": False},
    {"name": "high", "value": 100, "minRunSeconds": 30},
]


def configs() -> list[api.QueuesConfig | None]:
    """The configurations a test switches between (each object kept: the same object is
    the same configuration, a switch is an edit)."""
    queues = [
        _queue("a", {H100: (8, 16), A100: (0, 8)}),
        _queue("b", {"*": (0, 8)}, priorityClass="low"),
        _queue("c", {A100: (4, None), "*": (0, None)}, cohort="small"),
    ]
    cohorts = [{"name": "small", "capacity": {A100: 8}}]

    def make(policy: dict[str, Any], declared: list[dict[str, Any]]) -> api.QueuesConfig:
        return api.QueuesConfig.model_validate(
            {
                "policy": policy,
                "priorityClasses": CLASSES,
                "cohorts": cohorts if declared else [],
                "queues": declared,
            }
        )

    bigger = [_queue("a", {H100: (16, 32), A100: (8, 16)}), *queues[1:]]
    return [
        None,
        make(
            {
                "maxPreemptionsPerCycle": 2,
                "reserveAfterSeconds": 120,
                "maxReservations": 1,
                "minRunSeconds": 20,
            },
            queues,
        ),
        make({"maxPreemptionsPerCycle": 0, "reserveAfterSeconds": None}, queues),
        make(
            {"maxPreemptionsPerCycle": 8, "reserveAfterSeconds": 60, "maxReservations": 2},
            bigger,
        ),
        make({"maxPreemptionsPerCycle": 1, "reserveAfterSeconds": 100}, []),
    ]


@dataclass(frozen=True)
class JobSpec:
    gpus: int = 8
    pods: int = 1
    models: tuple[str, ...] = ()
    rack: str = "none"
    nvlink: str = "none"
    queue: str = "a"
    priority: int = 0
    klass: str | None = None
    shared: bool = False  # one pod of half a GPU
    cpu_task: bool = False  # and a CPU-only pod
    clusters: str = ""  # its spec.clusters, a key of CHOICES


def request_of(spec: JobSpec, job_id: str) -> tuple[Any, Any]:
    if spec.shared:
        builder = make_job(job_id, gpus=1, queue=spec.queue).shared(500)
    else:
        builder = make_job(job_id, gpus=spec.gpus, queue=spec.queue).gang(spec.pods)
    if spec.models:
        builder.model(*spec.models)
    builder.topology(nvlink=spec.nvlink, rack=spec.rack)
    if spec.priority:
        builder.priority(spec.priority)
    if spec.klass:
        builder.doc["spec"]["priorityClass"] = spec.klass
    if spec.cpu_task:
        builder.task("side", gpus=0)
    if CHOICES[spec.clusters]:
        builder.clusters(**CHOICES[spec.clusters])
    job = builder.build()
    return job, builder.request(job_id)


@dataclass
class Run:
    job: snapshot.PendingJob
    cluster: str
    pods: list[tuple[str, str, int]]  # (node, model, gpus)
    started: datetime
    preempting: bool = False

    def view(self) -> snapshot.RunningJob:
        gpus: dict[str, int] = {}
        for _, model, count in self.pods:
            gpus[model] = gpus.get(model, 0) + max(count, 0)
        return snapshot.RunningJob(
            job_id=self.job.job_id,
            queue=self.job.queue,
            priority=self.job.priority,
            cluster=self.cluster,
            gpus={m: n for m, n in gpus.items() if n} or {self.pods[0][1]: 0},
            pods=tuple(snapshot.PodSlot(node, count) for node, _, count in self.pods),
            started=self.started,
            created=self.job.created,
            priority_class=self.job.priority_class,
            preempting=self.preempting,
        )


@dataclass
class Releasing:
    victim: str
    preemptor: str
    cluster: str
    stage: int = 0  # 0: still stopping; 1: stopped, its GPUs free (told once)


class World:
    def __init__(self) -> None:
        self.clusters = {c.name: c for c in make_clusters()}
        self.configs = configs()
        self.config: api.QueuesConfig | None = self.configs[0]
        self.now = T0
        self.pending: dict[str, snapshot.PendingJob] = {}
        self.running: dict[str, Run] = {}
        self.releasing: list[Releasing] = []
        self.seq = 0

    # ---- what the planner sees ------------------------------------------------------------

    def snapshot(self) -> snapshot.FleetSnapshot:
        return snapshot.FleetSnapshot.build(
            [c.capacity() for c in self.clusters.values() if c.present]
        )

    def views(self) -> list[snapshot.RunningJob]:
        return [run.view() for run in self.running.values()]

    def releasing_items(self) -> list[snapshot.Releasing]:
        out = []
        for item in self.releasing:
            victim = self.running.get(item.victim)
            held = victim.view().gpus if victim is not None else {}
            out.append(
                snapshot.Releasing(
                    item.victim,
                    item.preemptor,
                    item.cluster,
                    released=item.stage == 1,
                    queue=victim.job.queue if victim is not None else "",
                    gpus=dict(held) if item.stage == 0 else {},
                )
            )
        return out

    # ---- events -----------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> str:
        self.seq += 1
        job_id = f"j{self.seq:03d}"
        job, request = request_of(spec, job_id)
        self.pending[job_id] = snapshot.PendingJob(
            job_id=job_id,
            queue=job.spec.queue,
            priority=job.spec.priority,
            created=self.now,
            request=request,
            priority_class=job.spec.priority_class,
            clusters=clusterchoice.choice_of(job.spec.clusters),
        )
        return job_id

    def finish(self, index: int) -> None:
        done = [r for r in self.running.values() if not r.preempting]
        if done:
            self._end(done[index % len(done)].job.job_id)

    def requeue(self, index: int) -> None:
        """A running job back to the queue (its node lost, say)."""
        done = [r for r in self.running.values() if not r.preempting]
        if done:
            run = done[index % len(done)]
            self._end(run.job.job_id)
            self.pending[run.job.job_id] = _requeued(run.job, self.now)

    def cancel(self, index: int) -> None:
        if self.pending:
            del self.pending[sorted(self.pending)[index % len(self.pending)]]

    def reject(self, index: int, cluster: str) -> None:
        """A pending job a cluster turned down: excluded there until it refreshes."""
        if self.pending:
            job = self.pending[sorted(self.pending)[index % len(self.pending)]]
            self.pending[job.job_id] = _with(job, excluded=frozenset({cluster}))

    def refresh(self) -> None:
        for job_id, job in list(self.pending.items()):
            if job.excluded:
                self.pending[job_id] = _with(job, excluded=frozenset())

    def set_free(self, cluster: str, node: int, free: int) -> None:
        """Someone else's pods (or a node coming back): a node's free GPUs change."""
        nodes = self.clusters[cluster].nodes
        target = nodes[node % len(nodes)]
        target.free = max(0, min(target.size, free))

    def toggle(self, cluster: str, what: str) -> None:
        found = self.clusters[cluster]
        if what == "present":
            found.present = not found.present
        elif what == "healthy":
            found.healthy = not found.healthy
        else:  # a node added
            model = found.nodes[0]
            found.nodes.append(
                Node(f"{cluster}-x{len(found.nodes)}", model.model, model.size, model.rack, 0)
            )

    def relabel(self, cluster: str, index: int) -> None:
        """A cluster's agent restarted with other --cluster-label flags."""
        self.clusters[cluster].labels = dict(LABELS[index % len(LABELS)])

    def configure(self, index: int) -> None:
        self.config = self.configs[index % len(self.configs)]

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    # ---- a cycle's outcome ----------------------------------------------------------------

    def step_releasing(self) -> None:
        """Victims: stopping for one cycle, then stopped (their GPUs free, requeued), told
        released for one cycle, then forgotten."""
        kept = []
        for item in self.releasing:
            if item.stage == 0:
                run = self.running.get(item.victim)
                if run is not None:
                    self._end(item.victim)
                    self.pending[item.victim] = _requeued(run.job, self.now)
                item.stage = 1
                kept.append(item)
        self.releasing = kept

    def apply(self, plan: planning.CyclePlan) -> None:
        for assignment in plan.assignments:
            job = self.pending.pop(assignment.job_id)
            cluster = self.clusters[assignment.cluster]
            pods = [self._take(cluster, take) for take in assignment.takes]
            self.running[job.job_id] = Run(job, cluster.name, pods, self.now)
        for item in plan.preemptions:
            run = self.running.get(item.job_id)
            if run is not None and not run.preempting:
                run.preempting = True
                self.releasing.append(Releasing(item.job_id, item.preemptor, item.cluster))

    def _take(self, cluster: Cluster, take: Any) -> tuple[str, str, int]:
        if take.shared_milli:
            cluster.shared[take.model] = max(
                0, cluster.shared.get(take.model, 0) - take.shared_milli
            )
            node = next(n for n in cluster.nodes if n.model == take.model)
            return (node.name, take.model, 0)
        candidates = [
            n
            for n in cluster.nodes
            if n.model == take.model
            and n.free >= take.gpus
            and (take.rack is None or n.rack == take.rack)
        ]
        candidates.sort(key=lambda n: (n.free != take.from_free, n.free, n.name))
        if not candidates:  # the world moved on under the plan: take what there is
            candidates = [n for n in cluster.nodes if n.model == take.model]
        node = candidates[0]
        node.free = max(0, node.free - take.gpus)
        if take.adds_shared:
            cluster.shared[take.model] = cluster.shared.get(take.model, 0) + take.adds_shared
        return (node.name, take.model, take.gpus)

    def _end(self, job_id: str) -> None:
        run = self.running.pop(job_id)
        cluster = self.clusters[run.cluster]
        by_name = {n.name: n for n in cluster.nodes}
        for node, _, gpus in run.pods:
            found = by_name[node]
            found.free = min(found.size, found.free + gpus)


def _with(job: snapshot.PendingJob, **changes: Any) -> snapshot.PendingJob:
    fields = {
        "job_id": job.job_id,
        "queue": job.queue,
        "priority": job.priority,
        "created": job.created,
        "request": job.request,
        "excluded": job.excluded,
        "priority_class": job.priority_class,
        "queued_since": job.queued_since,
        "clusters": job.clusters,
    }
    fields.update(changes)
    return snapshot.PendingJob(**fields)


def _requeued(job: snapshot.PendingJob, now: datetime) -> snapshot.PendingJob:
    return _with(job, queued_since=now, excluded=frozenset())


@dataclass
class Outcome:
    full: planning.CyclePlan
    parked: parking.BacklogPlan


class Twins:
    """The full re-plan and the parked backlog over one world."""

    def __init__(self, world: World, *, max_assignments: int = 10_000) -> None:
        self.world = world
        self.max_assignments = max_assignments
        self.backlog = backlog.Backlog()
        self.reference: parking.Reference | None = None
        self.kept_full: dict[str, plans.Reservation] = {}
        self.kept_parked: dict[str, plans.Reservation] = {}
        self.most_parked = 0
        self.cycles_parked = 0
        self.why: dict[str, planning.Unplaceable] = {}  # what `why` shows: the last reasons

    def sync(self) -> None:
        """What the scheduler's book observer does: every pending job put, the rest dropped."""
        pending = self.world.pending
        for job_id in [j for j in self.backlog.ids() if j not in pending]:
            self.backlog.drop(job_id)
        for job in pending.values():
            self.backlog.put(job)

    def cycle(self) -> Outcome:
        world = self.world
        self.sync()
        fleet = world.snapshot()
        views = world.views()
        usage = quotas.Usage.of(views)
        releasing = world.releasing_items()
        kwargs: dict[str, Any] = {
            "running": views,
            "usage": usage,
            "queues": world.config,
            "releasing": releasing,
            "now": world.now,
            "max_assignments": self.max_assignments,
        }
        full = planning.plan_cycle(
            fleet.copy(), list(world.pending.values()), reservations=self.kept_full, **kwargs
        )
        parked = parking.plan_backlog(
            self.backlog,
            fleet,
            previous=self.reference,
            reservations=self.kept_parked,
            **kwargs,
        )
        self.backlog.settle(parked.woken, parked.parks)
        self.reference = parked.reference
        for miss in parked.plan.unplaceable:  # the shell's `note_unplaced`
            self.why[miss.job_id] = miss
        for job_id in [j for j in self.why if j not in world.pending]:
            del self.why[job_id]
        self.kept_full = full.reservations
        self.kept_parked = parked.plan.reservations
        self.most_parked = max(self.most_parked, len(self.backlog.parked()))
        if len(parked.planned) < len(world.pending):
            self.cycles_parked += 1
        world.step_releasing()
        world.apply(full)
        return Outcome(full, parked)


def settled(outcome: Outcome, before: dict[str, plans.Reservation]) -> bool:
    """Did the cycle change nothing: no dispatch, no preemption, the same reservations?"""
    full = outcome.full
    return not full.assignments and not full.preemptions and full.reservations == before


ROOM = {"Capacity", "Topology"}  # which of the two a fit fails with may lag (see parking)


def codes_of(miss: planning.Unplaceable | None) -> set[tuple[str, str]]:
    if miss is None:
        return set()
    return {(r.cluster, "Room" if r.code in ROOM else r.code.value) for r in miss.details}


def stale(twins: Twins, outcome: Outcome) -> list[str]:
    """Parked jobs whose `why` (their last reasons) the full plan contradicts, by code."""
    told = {u.job_id: u for u in outcome.full.unplaceable}
    out = []
    for job_id in twins.backlog.parked():
        if codes_of(twins.why.get(job_id)) != codes_of(told.get(job_id)):
            out.append(
                f"{job_id}: why says {sorted(codes_of(twins.why.get(job_id)))}, the full plan "
                f"{sorted(codes_of(told.get(job_id)))}"
            )
    return out


def differences(outcome: Outcome) -> list[str]:
    """Where the backlog's plan decides otherwise than the full re-plan (empty: nowhere)."""
    full, plan = outcome.full, outcome.parked.plan
    out = []
    if plan.assignments != full.assignments:
        out.append(f"assignments {plan.assignments} != {full.assignments}")
    if plan.preemptions != full.preemptions:
        out.append(f"preemptions {plan.preemptions} != {full.preemptions}")
    if plan.reservations != full.reservations:
        out.append(f"reservations {plan.reservations} != {full.reservations}")
    if plan.set_aside != full.set_aside:
        out.append(f"set aside {plan.set_aside} != {full.set_aside}")
    reasons = {u.job_id: u for u in full.unplaceable}
    for miss in plan.unplaceable:  # a planned job is told what the full plan tells it
        if reasons.get(miss.job_id) != miss:
            out.append(f"why of {miss.job_id}: {miss.reasons} != {reasons.get(miss.job_id)}")
    planned = {j.job_id for j in outcome.parked.planned}
    decided = {a.job_id for a in full.assignments} | {p.preemptor for p in full.preemptions}
    decided |= set(full.reservations)
    for job_id in decided - planned:
        out.append(f"{job_id} parked, yet the full plan decides for it")
    return out
