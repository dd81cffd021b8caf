"""A simulated cluster: nodes from a YAML description, pods that run for a while.

`load_pools(path)` reads node pools (GPU model, GPUs per node, NVLink islands and domains, racks,
MIG devices per node by profile: `mig: {1g.10gb: 7}`);
`SimulatedBackend` builds the nodes and runs pods: Pending on create, Running after
`start_delay`, then Succeeded after the seconds of their `gpufed.io/sim-duration` annotation, or
Failed if `gpufed.io/sim-outcome` says `Failed:<reason>`. `Failed:<reason>@<attempts>` (a
comma-separated list, matched against the pod's `gpufed.io/attempt`, 1 when absent) fails only
those attempts of the job and lets the others succeed: with `Failed:NodeLost@1` the first
attempt fails with NodeLost and the broker's retry succeeds. Timers are asyncio `call_later`
handles, never polling loops. Fault injection for tests and chaos runs: `fail_creates_after`,
`set_node_ready`, GPU failures (`gpus`, `faults`: `fail_gpu`, or a job's
`gpufed.io/sim-gpu-failure` annotation), and pools whose pods never start (`stay_pending`).

Graceful deletion, as the kubelet does it: a running pod deleted with a grace period gets its
SIGTERM and keeps running, and its GPUs, until it exits or the grace ends, whichever comes
first; then it is gone (a DELETED event). How long the workload takes to exit is
`gpufed.io/sim-exit-after` (a duration; 0 by default: it exits at once, as every simulated
pod did before grace periods were modelled). A pod deleted again with a shorter grace goes
sooner. A workload that checkpoints is `gpufed.io/sim-checkpoint-every`: it
writes `gpufed.io/last-checkpoint` on its pod that often while it runs. Annotations the agent
writes (`annotate_pod`: the preemption notice) are kept on the pod.

A `pods.Journal` (`gpufed agent --sim-journal FILE`) records a JSON line each time
a pod starts or stops running (finished, deleted, or gone with the agent process), and when a
running pod is told to terminate (`terminate`, with its `grace` and the `notice` annotation it
saw then), with the wall-clock time: what the e2e tests read to check that no two copies of a
job ever run at the same moment, and that a preempted pod got its notice and its grace.

The backend outlives an agent given it (`app.run_agent(..., backend=...)`): an agent started
again on the same backend finds the pods it holds (`held_jobs`), as on a real cluster.
Simulated clusters have no ResourceQuotas (`gpu_quotas` is empty): the agent's limits file
stands in for them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.api import jobs, mig, status
from member_agent.cluster import base, errors, gpuhealth
from member_agent.cluster.simulated import faults
from member_agent.cluster.simulated import pods as simulated_pods
from member_agent.inventory import model

logger = logging.getLogger(__name__)

POOL_LABEL = "gpufed.io/pool"
RACK_LABEL = "gpufed.io/rack"
NVLINK_DOMAIN_LABEL = "gpufed.io/nvlink-domain"
SIM_EXIT_AFTER_ANNOTATION = "gpufed.io/sim-exit-after"
SIM_CHECKPOINT_EVERY_ANNOTATION = "gpufed.io/sim-checkpoint-every"
# what a pod of a `stay_pending` pool says, as a kubelet says of an image that never pulls
STUCK_REASON = "ImagePullBackOff: the pool holds its pods Pending (stay_pending)"


class NodesFileError(ValueError):
    """The cluster description cannot be read or does not validate."""


class PoolSpec(BaseModel):
    """One pool of identical nodes."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?$")]
    count: Annotated[int, Field(ge=1, le=100_000)]
    gpu_product: Annotated[str, Field(min_length=1)]
    gpus_per_node: Annotated[int, Field(ge=0, le=16)]
    gpu_memory_mib: Annotated[int, Field(ge=0)] = 0
    cpu: Annotated[float, Field(gt=0, description="cores")]
    memory: Annotated[int | str, Field(description="a quantity (512Gi, 2Ti) or MiB")]
    nvlink_island: Annotated[int, Field(ge=0, le=16)] = 0
    nvlink_domain_nodes: Annotated[int, Field(ge=0)] = 0
    racks: Annotated[int | None, Field(ge=1)] = None
    nodes_per_rack: Annotated[int | None, Field(ge=1)] = None
    labels: dict[str, str] = Field(default_factory=dict)
    # MIG devices of each node by profile ("1g.10gb": 7), besides its whole GPUs
    mig: dict[str, Annotated[int, Field(ge=1, le=1024)]] = Field(default_factory=dict)
    # fault injection: pods on these nodes stay Pending for good (an image that never pulls,
    # an admission webhook that holds them), until deleted
    stay_pending: bool = False

    @field_validator("mig")
    @classmethod
    def _profiles(cls, value: dict[str, int]) -> dict[str, int]:
        for profile in value:
            problem = mig.profile_problem(profile)
            if problem is not None:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _check(self) -> PoolSpec:
        if self.racks is not None and self.nodes_per_rack is not None:
            raise ValueError("give racks or nodes_per_rack, not both")
        if self.nvlink_island > self.gpus_per_node:
            raise ValueError(
                f"nvlink_island ({self.nvlink_island}) is above gpus_per_node "
                f"({self.gpus_per_node})"
            )
        return self

    @field_validator("memory")
    @classmethod
    def _quantity(cls, value: int | str) -> int | str:
        if _memory_mib(value) <= 0:
            raise ValueError("must be above zero")
        return value

    def memory_mib(self) -> int:
        return _memory_mib(self.memory)

    def rack_of(self, index: int) -> str:
        if self.nodes_per_rack:
            return f"{self.name}-rack-{index // self.nodes_per_rack}"
        if self.racks:
            per_rack = math.ceil(self.count / self.racks)
            return f"{self.name}-rack-{index // per_rack}"
        return ""


class ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: str | None = None
    description: str = ""
    pools: Annotated[list[PoolSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique(self) -> ClusterFile:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError("pools: names must be unique")
        return self


def _memory_mib(value: int | str) -> int:
    if isinstance(value, int) or value.strip().isdigit():
        return int(value)
    try:
        return jobs.parse_memory_mib(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a quantity such as 512Gi, 2Ti or MiB") from None


def _describe(exc: pydantic.ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        parts.append(f"{where.lstrip('.') or '(top)'}: {error['msg']}")
    return "; ".join(parts)


def load_pools(path: Path | str) -> list[PoolSpec]:
    """Read a cluster description: a mapping with `pools:` (or a bare list of pools)."""
    try:
        raw: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise NodesFileError(f"{path}: {exc}") from exc
    if isinstance(raw, list):
        raw = {"pools": raw}
    try:
        return ClusterFile.model_validate(raw).pools
    except pydantic.ValidationError as exc:
        raise NodesFileError(f"{path}: {_describe(exc)}") from exc


def build_nodes(pools: list[PoolSpec]) -> list[model.Node]:
    """The nodes of every pool, named `<pool>-<index>`, spread over racks in blocks."""
    nodes = []
    for pool in pools:
        width = max(3, len(str(pool.count - 1)))
        for index in range(pool.count):
            name = f"{pool.name}-{index:0{width}d}"
            rack = pool.rack_of(index)
            domain = (
                f"{pool.name}-nvl-{index // pool.nvlink_domain_nodes}"
                if pool.nvlink_domain_nodes
                else ""
            )
            labels = {
                jobs.GPU_PRODUCT_LABEL: pool.gpu_product,
                "nvidia.com/gpu.count": str(pool.gpus_per_node),
                "nvidia.com/gpu.memory": str(pool.gpu_memory_mib),
                POOL_LABEL: pool.name,
                **({RACK_LABEL: rack} if rack else {}),
                **({NVLINK_DOMAIN_LABEL: domain} if domain else {}),
                **pool.labels,
            }
            nodes.append(
                model.Node(
                    name=name,
                    model=pool.gpu_product,
                    gpu_count=pool.gpus_per_node,
                    gpu_memory_mib=pool.gpu_memory_mib,
                    cpu_milli=int(pool.cpu * 1000),
                    memory_mib=pool.memory_mib(),
                    rack=rack,
                    nvlink_domain=domain,
                    nvlink_island=pool.nvlink_island,
                    labels=labels,
                    mig=dict(pool.mig),
                )
            )
    return nodes


class SimulatedBackend:
    """A ClusterBackend whose nodes come from pools and whose pods run on timers."""

    def __init__(
        self,
        cluster: str,
        pools: list[PoolSpec],
        *,
        start_delay: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        fail_creates_after: int | None = None,
        journal: simulated_pods.Journal | None = None,
        health_settings: gpuhealth.HealthSettings | None = None,
    ) -> None:
        self.cluster = cluster
        self.start_delay = start_delay
        self._clock = clock
        self._inventory = model.Inventory(cluster=cluster)
        for node in build_nodes(pools):
            self._inventory.add(node)
        self._pods: dict[tuple[str, str], simulated_pods.SimPod] = {}
        self._by_job: dict[str, dict[tuple[str, str], simulated_pods.SimPod]] = {}
        self._queue: asyncio.Queue[base.BackendEvent | None] = asyncio.Queue()
        self._fail_after = fail_creates_after
        self._stuck_pools = {pool.name for pool in pools if pool.stay_pending}
        self.creates = 0
        self.journal = journal
        self.gpus = faults.GPUFaults(
            self._inventory,
            health_settings,
            pods=self.pods,
            finish=self._finish,
            emit=self._queue.put_nowait,
            duration=simulated_pods.parse_duration,
        )

    # -- the ClusterBackend protocol -------------------------------------------------------

    async def start(self) -> None:
        logger.info(
            "simulated cluster %s: %d nodes, %d GPUs",
            self.cluster,
            len(self._inventory.nodes),
            sum(n.gpu_count for n in self._inventory),
        )

    async def close(self) -> None:
        for pod in self._pods.values():
            pod.stop_timers()
            if pod.phase == status.PodPhase.RUNNING:  # simulated pods end with the backend
                self._journal("stop", pod, phase="BackendClosed")
        self._queue.put_nowait(None)
        if self.journal is not None:
            self.journal.close()

    def inventory(self) -> model.Inventory:
        return self._inventory

    async def create_pod(self, request: base.PodRequest) -> None:
        key = (request.namespace, request.name)
        if self._fail_after is not None:
            if self._fail_after <= 0:
                self._fail_after = None
                raise errors.TemporaryBackendError(f"{request.name}: injected create failure")
            self._fail_after -= 1
        if key in self._pods or request.name in self._inventory.pods:
            raise errors.PermanentBackendError(f"pod {request.name} already exists")
        node = self._inventory.nodes.get(request.node)
        if node is None:
            raise errors.PermanentBackendError(f"{request.name}: node {request.node} not found")
        if not node.ready:
            raise errors.PermanentBackendError(f"{request.name}: node {request.node} is NotReady")
        annotations = {
            **simulated_pods.template_annotations(request.template),
            **request.annotations,
        }
        try:
            duration = (
                simulated_pods.parse_duration(annotations[jobs.SIM_DURATION_ANNOTATION])
                if jobs.SIM_DURATION_ANNOTATION in annotations
                else None
            )
        except ValueError as exc:
            raise errors.PermanentBackendError(
                f"{request.name}: annotation {jobs.SIM_DURATION_ANNOTATION}: {exc}"
            ) from exc
        try:
            outcome = simulated_pods.parse_outcome(
                annotations.get(jobs.SIM_OUTCOME_ANNOTATION, "Succeeded"),
                attempt=simulated_pods.attempt_of(annotations),
            )
        except ValueError as exc:
            raise errors.PermanentBackendError(
                f"{request.name}: annotation {jobs.SIM_OUTCOME_ANNOTATION}: {exc}"
            ) from exc
        try:
            exit_after = simulated_pods.parse_duration(
                annotations.get(SIM_EXIT_AFTER_ANNOTATION, "0")
            )
            every_text = annotations.get(SIM_CHECKPOINT_EVERY_ANNOTATION)
            every = simulated_pods.parse_duration(every_text) if every_text is not None else None
        except ValueError as exc:
            raise errors.PermanentBackendError(f"{request.name}: {exc}") from exc
        placement = status.PodPlacement(
            name=request.name, task=request.task, node=request.node, gpus=list(request.gpus)
        )
        try:
            self._inventory.apply(
                placement,
                cpu_milli=request.cpu_milli,
                memory_mib=request.memory_mib,
                mig=request.mig,
            )
        except (ValueError, IndexError) as exc:
            raise errors.PermanentBackendError(f"{request.name}: {exc}") from exc
        self.creates += 1
        pod = simulated_pods.SimPod(
            request=request,
            phase=status.PodPhase.PENDING,
            duration=duration,
            outcome=outcome,
            created=self._clock(),
            annotations=annotations,
            exit_after=exit_after,
            checkpoint_every=every if every else None,
        )
        self._pods[key] = pod
        self._by_job.setdefault(request.job_id, {})[key] = pod
        if node.labels.get(POOL_LABEL) not in self._stuck_pools:
            pod.timer = asyncio.get_running_loop().call_later(self.start_delay, self._start, pod)
        else:
            pod.reason = STUCK_REASON
        self._emit(pod)

    async def delete_pod(self, namespace: str, name: str, *, grace_seconds: float) -> None:
        """A running pod deleted with a grace keeps its GPUs until its workload exits
        (`exit_after`) or the grace ends; any other is gone at once."""
        pod = self._pods.get((namespace, name))
        if pod is None:
            return
        if grace_seconds <= 0 or pod.phase != status.PodPhase.RUNNING:
            self._remove(pod)
            return
        now = self._clock()
        until = now + min(grace_seconds, pod.exit_after)
        if pod.terminating_until is not None and pod.terminating_until <= until:
            return  # going sooner already
        if pod.terminating_until is None:
            notice = pod.annotations.get(base.PREEMPTION_NOTICE_ANNOTATION)
            self._journal(
                "terminate", pod, phase=pod.phase.value, grace=grace_seconds, notice=notice
            )
        pod.terminating_until = until
        pod.stop_timers()
        if until <= now:
            self._remove(pod)
        else:
            pod.timer = asyncio.get_running_loop().call_later(until - now, self._remove, pod)

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        pod = self._pods.get((namespace, name))
        if pod is not None:
            pod.annotations.update(annotations)

    def _remove(self, pod: simulated_pods.SimPod) -> None:
        """The pod is gone: its GPUs free, a DELETED event."""
        namespace, name = pod.request.namespace, pod.request.name
        if self._pods.get((namespace, name)) is not pod:
            return
        del self._pods[(namespace, name)]
        job = self._by_job.get(pod.request.job_id)
        if job is not None:
            job.pop((namespace, name), None)
            if not job:
                del self._by_job[pod.request.job_id]
        pod.stop_timers()
        self._inventory.release(name)
        if pod.phase == status.PodPhase.RUNNING:
            self._journal("stop", pod, phase=status.PodPhase.DELETED.value)
        pod.phase = status.PodPhase.DELETED
        self._emit(pod)

    def pods_of(self, job_id: str) -> list[status.PodStatus]:
        return [pod.status() for pod in self._by_job.get(job_id, {}).values()]

    def events(self) -> AsyncIterator[base.BackendEvent]:
        return self._stream()

    def held_jobs(self) -> dict[str, base.HeldJob]:
        out = {}
        for job_id, pods in self._by_job.items():
            if not pods:
                continue
            requests = [pod.request for pod in pods.values()]
            metas = [
                {**simulated_pods.template_annotations(r.template), **r.annotations}
                for r in requests
            ]
            out[job_id] = base.held_job(
                job_id,
                requests[0].namespace,
                max(metas, key=simulated_pods.attempt_of),  # the latest attempt's
                (pod.status() for pod in pods.values()),
                gpus=sum(len(r.gpus) for r in requests),
                queue=requests[0].queue,
            )
        return out

    def gpu_quotas(self, namespace: str) -> list[model.GPUQuota]:
        del namespace
        return []

    def gpu_health(self) -> gpuhealth.HealthBook:
        return self.gpus.book

    # -- fault injection -------------------------------------------------------------------

    def fail_creates_after(self, count: int) -> None:
        """Let `count` more creates succeed, then make the next one raise (once)."""
        self._fail_after = count

    def set_node_ready(self, name: str, ready: bool) -> None:
        """NotReady: the node's pods fail with NodeLost and it leaves the free inventory."""
        node = self._inventory.nodes[name]
        if node.ready == ready:
            return
        node.ready = ready
        self._inventory.touch(name)
        if not ready:
            for pod in list(self._pods.values()):
                if pod.request.node == name and not simulated_pods.done(pod):
                    self._finish(pod, status.PodPhase.FAILED, "NodeLost")
        self._queue.put_nowait(
            base.InventoryChanged(reason=f"node {name} {'Ready' if ready else 'NotReady'}")
        )

    # -- pod lifecycle ---------------------------------------------------------------------

    def pods(self) -> list[simulated_pods.SimPod]:
        """Every pod the backend holds (also finished ones, until deleted)."""
        return list(self._pods.values())

    def _start(self, pod: simulated_pods.SimPod) -> None:
        pod.timer = None
        pod.phase = status.PodPhase.RUNNING
        pod.started = self._clock()
        self._journal("start", pod, phase=pod.phase.value)
        self._emit(pod)
        self.gpus.arm(pod)
        if pod.checkpoint_every is not None:
            pod.checkpoint_timer = asyncio.get_running_loop().call_later(
                pod.checkpoint_every, self._checkpoint, pod
            )
        phase, reason = pod.outcome
        duration = pod.duration
        if duration is None and phase == status.PodPhase.FAILED:
            duration = 0.0  # a failing pod with no duration fails as soon as it starts
        if duration is not None:
            pod.timer = asyncio.get_running_loop().call_later(
                duration, self._finish, pod, phase, reason
            )

    def _checkpoint(self, pod: simulated_pods.SimPod) -> None:
        """The workload checkpointed: its pod says when, and it goes on."""
        pod.checkpoint_timer = None
        if pod.phase != status.PodPhase.RUNNING or pod.checkpoint_every is None:
            return
        pod.annotations[base.LAST_CHECKPOINT_ANNOTATION] = base.rfc3339(datetime.now(UTC))
        self._emit(pod)
        pod.checkpoint_timer = asyncio.get_running_loop().call_later(
            pod.checkpoint_every, self._checkpoint, pod
        )

    def _finish(self, pod: simulated_pods.SimPod, phase: status.PodPhase, reason: str) -> None:
        pod.stop_timers()
        if pod.phase == status.PodPhase.RUNNING:
            self._journal("stop", pod, phase=phase.value)
        pod.phase = phase
        pod.reason = reason
        pod.finished = self._clock()
        # a finished pod holds nothing, as in Kubernetes
        self._inventory.release(pod.request.name)
        self._emit(pod)

    def _journal(
        self, event: str, pod: simulated_pods.SimPod, *, phase: str, **extra: object
    ) -> None:
        if self.journal is not None:
            self.journal.write(event, self.cluster, pod, phase=phase, extra=extra)

    def _emit(self, pod: simulated_pods.SimPod) -> None:
        self._queue.put_nowait(
            base.PodEvent(
                job_id=pod.request.job_id,
                name=pod.request.name,
                phase=pod.phase,
                node=pod.request.node,
                reason=pod.reason,
                checkpoint=pod.annotations.get(base.LAST_CHECKPOINT_ANNOTATION, ""),
            )
        )

    async def _stream(self) -> AsyncIterator[base.BackendEvent]:
        while True:
            event = await self._queue.get()
            if event is None:
                return
            yield event
