"""Does a whole gang fit a cluster, judged from the cluster's summary? Pure.

Called by `planning.plan_cycle` for every (job, cluster) pair, and by `preemption` on scratch
copies with the victims' GPUs given back. Works on per-model histograms of nodes by whole free
GPUs, so a check costs O(pods × GPUs per node), never O(nodes); a run of equal whole-GPU pods
that cannot all fit is told so from the room it has left (`_room_for`), without trying each
pod, so a gang bigger than the cluster costs O(GPUs per node). A fit also says how to deduct
the gang (`assume`), so later decisions in the cycle see it. `models` narrows the GPU models a
fit may use (the ones the job's queue has quota for, less those held for a reservation).

A GPU pod may use a model its node selection admits (`PodShape.admits_model`: the pod's
`nodeSelector` and required node affinity on the GPU product label, with Kubernetes operators;
requirements on other labels are the agent's to judge). A CPU-only pod is judged by its
`models` alone: the broker does not see the CPU-only nodes such a selector may point at.

A pod of MIG slices (`PodShape.mig_slices` of `mig_profile`) takes a node with that many free
devices of its profile from the model's MIG histogram (`ModelCapacity.mig`, from the agent's
summary), the fullest that still has room, as whole-GPU pods do; a cluster whose summary shows
no such node does not fit. MIG devices are counted per model, not per rack: a gang's MIG pods
are not held to one rack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from broker.api import gangs, jobs, mig
from broker.api.queues import ReasonCode
from broker.planning import snapshot

GPU_MILLI = 1000


@dataclass(frozen=True)
class Take:
    """One pod's share of a cluster: `gpus` whole GPUs from a node with `from_free` free."""

    model: str
    rack: str | None
    from_free: int
    gpus: int
    shared_milli: int = 0  # milli taken from partly used GPUs
    adds_shared: int = 0  # milli a sharing pod leaves free on the whole GPU it opened
    mig_profile: str = ""  # a MIG pod: `mig_slices` devices of this profile from a node that
    mig_slices: int = 0  # had `from_free` of them free

    @property
    def leftover(self) -> int:
        """What the pod leaves free on its node: GPUs, or MIG devices of its profile."""
        return self.from_free - (self.mig_slices or self.gpus)


@dataclass(frozen=True)
class Fit:
    cluster: str
    takes: tuple[Take, ...]
    leftover: int  # whole GPUs left free on the nodes taken: lower is a tighter fit

    @property
    def gpus_by_model(self) -> dict[str, int]:
        """GPUs the fit takes per model as quotas count them (a sharing pod: one GPU; a MIG
        pod: the GPUs its slices fill, `mig.quota_gpus`)."""
        out: dict[str, int] = {}
        for take in self.takes:
            if take.mig_slices:
                count = mig.quota_gpus(take.mig_profile, take.mig_slices)
            else:
                count = take.gpus or (1 if take.shared_milli else 0)
            if count:
                out[take.model] = out.get(take.model, 0) + count
        return out


@dataclass(frozen=True)
class NoFit:
    cluster: str
    reason: str
    code: ReasonCode = ReasonCode.CAPACITY


def _eligible_models(
    cluster: snapshot.ClusterCapacity,
    shape: jobs.PodShape,
    allowed: frozenset[str] | None = None,
) -> list[snapshot.ModelCapacity]:
    return [
        m
        for name, m in sorted(cluster.models.items())
        if _admits(shape, name)
        and (allowed is None or name in allowed)
        and m.gpu_memory_mib >= shape.min_gpu_memory_mib
    ]


def _admits(shape: jobs.PodShape, model: str) -> bool:
    """A GPU pod: what its node selection admits; a CPU-only pod: its `models` alone."""
    if shape.uses_gpus:
        return shape.admits_model(model)
    return not shape.models or model in shape.models


def _take_whole(hist: list[int], gpus: int, *, max_block: int | None = None) -> int | None:
    """Best fit: the fullest node that still has `gpus` free. Mutates `hist`."""
    for free in range(gpus, len(hist)):
        if hist[free] > 0 and (max_block is None or gpus <= max_block):
            hist[free] -= 1
            hist[free - gpus] += 1
            return free
    return None


def _runs_by_size(request: gangs.GangRequest) -> list[tuple[jobs.PodShape, int]]:
    """The gang's pods, largest first, as runs of one shape: its tasks sorted (stably) by
    their pods' size, so each task's pods stay together in the task's order."""
    tasks = sorted(
        ((shape, replicas) for _, replicas, shape in request.tasks if replicas > 0),
        key=lambda task: (-task[0].gpus, -task[0].gpu_milli, -task[0].mig_slices),
    )
    runs: list[tuple[jobs.PodShape, int]] = []
    for shape, replicas in tasks:
        if runs and runs[-1][0] is shape:
            runs[-1] = (shape, runs[-1][1] + replicas)
        else:
            runs.append((shape, replicas))
    return runs


@dataclass
class _Gang:
    """What fitting one gang needs, computed once per (gang, cluster) and reused per rack."""

    runs: list[tuple[jobs.PodShape, int]]  # its pods, largest first: (shape, how many)
    eligible: dict[jobs.PodShape, list[snapshot.ModelCapacity]]
    nvlink: bool

    @classmethod
    def of(
        cls,
        cluster: snapshot.ClusterCapacity,
        request: gangs.GangRequest,
        allowed: frozenset[str] | None,
    ) -> _Gang:
        runs = _runs_by_size(request)
        eligible = {shape: _eligible_models(cluster, shape, allowed) for shape, _ in runs}
        return cls(runs, eligible, request.topology.nvlink == jobs.TopologyMode.REQUIRED)


def _fit_pods(
    cluster: snapshot.ClusterCapacity,
    gang: _Gang,
    *,
    rack: str | None,
    allowed: frozenset[str] | None = None,
) -> tuple[list[Take], NoFit] | tuple[list[Take], None]:
    """Try every pod of the gang on scratch histograms; (takes, None) or (partial, why not)."""
    scratch = {
        m.model: (list(m.racks[rack]) if rack is not None else list(m.nodes_by_free))
        for models in gang.eligible.values()
        for m in models
        if rack is None or rack in m.racks
    }
    shared = {name: m.shared_free_milli for name, m in cluster.models.items()}
    mig: dict[str, dict[str, list[int]]] = {}  # scratch MIG histograms, made when first used
    takes: list[Take] = []
    for shape, count in gang.runs:
        models = [m for m in gang.eligible[shape] if m.model in scratch]
        if not models:
            return takes, _model_miss(cluster, shape, allowed)
        if _whole(shape) and _room_for(shape, models, scratch, gang.nvlink) < count:
            # the run cannot all fit: no need to try it pod by pod (a gang bigger than the
            # cluster costs O(models × GPUs per node), not O(pods)); the loop would say the same
            return takes, _capacity_miss(cluster, gang, shape, models, rack)
        for _ in range(count):
            take = _fit_pod(shape, models, scratch, shared, mig, rack=rack, nvlink=gang.nvlink)
            if take is None:
                if shape.mig_slices:
                    why = _mig_miss(gang, shape, models, rack)
                    return takes, NoFit(cluster.name, why, ReasonCode.CAPACITY)
                return takes, _capacity_miss(cluster, gang, shape, models, rack)
            takes.append(take)
    return takes, None


def _whole(shape: jobs.PodShape) -> bool:
    """A pod of whole GPUs (not MIG slices, not a share of one, not CPU only)."""
    return shape.gpus > 0 and shape.gpu_milli >= GPU_MILLI and not shape.mig_slices


def _room_for(
    shape: jobs.PodShape,
    models: list[snapshot.ModelCapacity],
    scratch: Mapping[str, list[int]],
    nvlink: bool,
) -> int:
    """How many pods of `shape` (whole GPUs) fit on the scratch histograms: best fit of equal
    pods fills each node as far as it goes, so a node with f free takes f // gpus of them."""
    room = 0
    for m in models:
        block = _nvlink_block(m, nvlink)
        if block is not None and shape.gpus > block:
            continue
        room += sum(nodes * (free // shape.gpus) for free, nodes in enumerate(scratch[m.model]))
    return room


def _nvlink_block(model: snapshot.ModelCapacity, nvlink: bool) -> int | None:
    """The most GPUs an NVLink-required pod may take on one node of the model (None: any)."""
    return model.largest_free_nvlink_block if nvlink and model.largest_free_nvlink_block else None


def _fit_pod(
    shape: jobs.PodShape,
    models: list[snapshot.ModelCapacity],
    scratch: dict[str, list[int]],
    shared: dict[str, int],
    mig: dict[str, dict[str, list[int]]],
    *,
    rack: str | None,
    nvlink: bool,
) -> Take | None:
    """One pod of `shape` on the first of `models` with room (scratch histograms updated), or
    None."""
    for m in models:
        hist = scratch[m.model]
        if shape.mig_slices:
            profiles = mig.get(m.model)
            if profiles is None:
                profiles = mig[m.model] = {p: list(h) for p, h in m.mig.items()}
            slices = profiles.get(shape.mig_profile)
            free = _take_whole(slices, shape.mig_slices) if slices else None
            if free is not None:
                return Take(m.model, None, free, 0, mig_profile=shape.mig_profile,
                            mig_slices=shape.mig_slices)  # fmt: skip
            continue
        if shape.gpus == 0:
            if sum(hist) > 0:
                return Take(m.model, rack, 0, 0)
            continue
        if shape.gpu_milli < GPU_MILLI:
            if shared[m.model] >= shape.gpu_milli:
                shared[m.model] -= shape.gpu_milli
                return Take(m.model, rack, 0, 0, shape.gpu_milli)
            free = _take_whole(hist, 1)
            if free is not None:
                shared[m.model] += GPU_MILLI - shape.gpu_milli
                return Take(m.model, rack, free, 1, adds_shared=GPU_MILLI - shape.gpu_milli)
            continue
        free = _take_whole(hist, shape.gpus, max_block=_nvlink_block(m, nvlink))
        if free is not None:
            return Take(m.model, rack, free, shape.gpus)
    return None


def _model_miss(
    cluster: snapshot.ClusterCapacity, shape: jobs.PodShape, allowed: frozenset[str] | None
) -> NoFit:
    """Why no GPU model of the cluster can take a pod of `shape`."""
    if allowed is not None and _eligible_models(cluster, shape):
        return NoFit(
            cluster.name,
            "the GPU models of this cluster the job could use are not available to its "
            f"queue here ({'/'.join(m.model for m in _eligible_models(cluster, shape))})",
            ReasonCode.QUOTA,
        )
    if shape.selector is not None and shape.uses_gpus:
        wanted = f"matching {shape.selector.describe()}"
    else:
        wanted = f"of model {'/'.join(shape.models) or 'any'}"
    have = "/".join(sorted(cluster.models)) or "none"
    return NoFit(
        cluster.name, f"no GPU {wanted} with enough memory (has {have})", ReasonCode.GPU_MODEL
    )


def _capacity_miss(
    cluster: snapshot.ClusterCapacity,
    gang: _Gang,
    shape: jobs.PodShape,
    models: list[snapshot.ModelCapacity],
    rack: str | None,
) -> NoFit:
    """The gang's pods of `shape` (GPUs or a share of one) find no room."""
    need = sum(count for s, count in gang.runs if s.gpus == shape.gpus)
    where = f" in rack {rack}" if rack else ""
    text = (
        f"needs {need} node(s) with {shape.gpus} free GPU(s) of "
        f"{'/'.join(m.model for m in models)}{where}; not enough free"
    )
    return NoFit(cluster.name, text, ReasonCode.CAPACITY)


def _mig_miss(
    gang: _Gang, shape: jobs.PodShape, models: list[snapshot.ModelCapacity], rack: str | None
) -> str:
    """Why the cluster's nodes have no room for the gang's MIG pods of this shape."""
    need = sum(
        count
        for s, count in gang.runs
        if (s.mig_profile, s.mig_slices) == (shape.mig_profile, shape.mig_slices)
    )
    having = [m.model for m in models if shape.mig_profile in m.mig]
    where = f" (with the gang's other pods in rack {rack})" if rack else ""
    if not having:
        return f"no node with MIG devices of profile {shape.mig_profile}"
    return (
        f"needs {need} node(s) with {shape.mig_slices} free MIG device(s) of {shape.mig_profile} "
        f"on {'/'.join(having)}{where}; not enough free"
    )


def fit_gang(
    cluster: snapshot.ClusterCapacity,
    request: gangs.GangRequest,
    *,
    models: frozenset[str] | None = None,
) -> Fit | NoFit:
    """Whether the whole gang fits `cluster` now (on `models` only, if given), tightest way."""
    if not cluster.healthy:
        return NoFit(cluster.name, "cluster unhealthy", ReasonCode.CLUSTER_UNHEALTHY)
    gang = _Gang.of(cluster, request, models)
    takes, miss = _fit_pods(cluster, gang, rack=None, allowed=models)
    if miss is not None:
        return miss  # if the whole cluster cannot hold it, no rack of it can
    anywhere = Fit(cluster.name, tuple(takes), sum(t.leftover for t in takes))
    rack_mode = request.topology.rack
    if rack_mode == jobs.TopologyMode.NONE or request.pods <= 1:
        return anywhere
    racks = sorted({r for ms in gang.eligible.values() for m in ms for r in m.racks})
    best: Fit | None = None
    for rack in racks:
        takes, miss = _fit_pods(cluster, gang, rack=rack, allowed=models)
        if miss is None:
            fit = Fit(cluster.name, tuple(takes), sum(t.leftover for t in takes))
            if best is None or fit.leftover < best.leftover:
                best = fit
                if fit.leftover == 0:
                    break
    if best is not None:
        return best
    if rack_mode == jobs.TopologyMode.REQUIRED:
        return NoFit(
            cluster.name,
            "topology: no single rack has room for the whole gang",
            ReasonCode.TOPOLOGY,
        )
    return anywhere


def largest_whole_pod(request: gangs.GangRequest) -> int | None:
    """The GPUs of the gang's largest pod, the first it fits (`_runs_by_size`), if that pod
    takes whole GPUs; None for a pod of MIG slices, of a share of a GPU, or of none."""
    largest = max((shape for _, replicas, shape in request.tasks if replicas > 0),
                  key=lambda shape: (shape.gpus, shape.gpu_milli, shape.mig_slices),
                  default=None)  # fmt: skip
    return largest.gpus if largest is not None and _whole(largest) else None


def could_leave_less(cluster: snapshot.ClusterCapacity, gpus: int | None, leftover: int) -> bool:
    """Could a fit of the gang on the cluster leave fewer than `leftover` GPUs idle? Read off
    the free GPUs its nodes have (`ClusterCapacity.free_buckets`), without fitting: the
    gang's largest pod (of `gpus` whole GPUs) is fitted first, on the fullest node with room,
    and leaves that node's surplus idle, so no fit leaves less than the surplus of the
    fullest node with room on any model, in any rack. Always True when `gpus` is None."""
    if gpus is None:
        return True
    window = ((1 << leftover) - 1) << gpus  # nodes with gpus .. gpus + leftover - 1 free
    return bool(cluster.free_buckets & window)


def assume(cluster: snapshot.ClusterCapacity, fit: Fit) -> None:
    """Deduct a chosen fit from the cluster's capacity (in place, on the cycle's scratch copy)."""
    cluster.changed()
    for take in fit.takes:
        model = cluster.models[take.model]
        if take.mig_slices:
            slices = model.mig.get(take.mig_profile)
            if slices and take.from_free < len(slices) and slices[take.from_free] > 0:
                slices[take.from_free] -= 1
                slices[take.from_free - take.mig_slices] += 1
            continue
        if take.shared_milli:
            model.shared_free_milli = max(0, model.shared_free_milli - take.shared_milli)
            continue
        gpus, free, rack = take.gpus, take.from_free, take.rack
        if gpus == 0:
            continue
        model.shared_free_milli += take.adds_shared
        hist = model.nodes_by_free
        if hist[free] > 0:
            hist[free] -= 1
            hist[free - gpus] += 1
        if rack:
            hist = model.racks[rack]
            if hist[free] > 0:
                hist[free] -= 1
                hist[free - gpus] += 1
        elif rack is None:
            # which rack the agent will use is unknown: deduct from the rack that has such a node
            for hist in model.racks.values():
                if hist[free] > 0:
                    hist[free] -= 1
                    hist[free - gpus] += 1
                    break
