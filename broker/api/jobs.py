"""GPUJob: the job a user submits, Kubernetes style, and what the schedulers read from it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MILLI_ANNOTATION = "gpufed.io/gpu-milli"
GPU_MEMORY_ANNOTATION = "gpufed.io/min-gpu-memory-mib"
SIM_DURATION_ANNOTATION = "gpufed.io/sim-duration"
SIM_OUTCOME_ANNOTATION = "gpufed.io/sim-outcome"
MAX_GPUS_PER_POD = 8
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Open(BaseModel):
    """A Kubernetes object part we read some fields of and pass the rest through."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ObjectMeta(_Strict):
    name: str
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name", "namespace")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if len(value) > 63:
            raise ValueError("must be at most 63 characters")
        if not DNS_LABEL.match(value):
            raise ValueError("must be a DNS label: lower-case letters, digits and '-'")
        return value


class TemplateMeta(_Open):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


Quantity = int | float | str


class Resources(_Open):
    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)


class Container(_Open):
    name: str
    image: str | None = None
    resources: Resources = Field(default_factory=Resources)


class PodSpec(_Open):
    containers: Annotated[list[Container], Field(min_length=1)]
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    affinity: dict[str, Any] | None = None


class PodTemplateSpec(_Open):
    metadata: TemplateMeta = Field(default_factory=TemplateMeta)
    spec: PodSpec


class Task(_Strict):
    name: str
    replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    template: PodTemplateSpec

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        return ObjectMeta._dns_label(value)


class Gang(_Strict):
    min_member: Annotated[int | None, Field(ge=1, alias="minMember")] = None


class TopologyMode(StrEnum):
    NONE = "none"
    PREFERRED = "preferred"
    REQUIRED = "required"


class Topology(_Strict):
    """Where the pods of a gang should sit relative to each other."""

    nvlink: TopologyMode = TopologyMode.NONE
    rack: TopologyMode = TopologyMode.NONE


class JobSpec(_Strict):
    queue: Annotated[str, Field(min_length=1, max_length=63)]
    priority: int = 0
    # a priority class of the broker's queues configuration; wins over `priority`
    priority_class: Annotated[str | None, Field(max_length=63, alias="priorityClass")] = None
    tasks: Annotated[list[Task], Field(min_length=1, max_length=64)]
    gang: Gang = Field(default_factory=Gang)
    topology: Topology = Field(default_factory=Topology)

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError("tasks: names must be unique")
        total = sum(t.replicas for t in self.tasks)
        if self.gang.min_member is not None and self.gang.min_member > total:
            raise ValueError(
                f"gang.minMember: {self.gang.min_member} is above the total replicas ({total})"
            )
        return self


class GPUJob(_Strict):
    api_version: Literal["gpufed.io/v1"] = Field("gpufed.io/v1", alias="apiVersion")
    kind: Literal["GPUJob"] = "GPUJob"
    metadata: ObjectMeta
    spec: JobSpec

    @model_validator(mode="after")
    def _check_shapes(self) -> GPUJob:
        gpus = 0
        for index, task in enumerate(self.spec.tasks):
            gpus += shape_of(task, where=f"spec.tasks[{index}]").gpus
        if gpus == 0:
            raise ValueError(
                f"spec.tasks[0].template.spec.containers[0].resources.limits[{GPU_RESOURCE}]: "
                "a GPUJob asks for at least one GPU"
            )
        return self


class ShapeError(ValueError):
    """A task whose resources cannot be turned into a placement request."""


class PodShape(BaseModel):
    """What one pod of a task needs from a node: the placement request."""

    model_config = ConfigDict(frozen=True)

    gpus: int
    gpu_milli: int = 1000
    models: tuple[str, ...] = ()
    min_gpu_memory_mib: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def gpu_milli_total(self) -> int:
        return self.gpus * self.gpu_milli


def parse_cpu_milli(value: Quantity) -> int:
    text = str(value).strip()
    if text.endswith("m"):
        return int(float(text[:-1]))
    return round(float(text) * 1000)


_MEM_UNITS = {
    "Ki": 1 / 1024,
    "Mi": 1,
    "Gi": 1024,
    "Ti": 1024 * 1024,
    "K": 1000 / 1048576,
    "M": 1_000_000 / 1048576,
    "G": 1e9 / 1048576,
    "T": 1e12 / 1048576,
}


def parse_memory_mib(value: Quantity) -> int:
    text = str(value).strip()
    for unit, factor in sorted(_MEM_UNITS.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor + 0.999999)
    return int(float(text) / 1048576 + 0.999999)


def _gpu_count(value: Quantity, where: str) -> int:
    if isinstance(value, bool):
        raise ShapeError(f"{where}: must be a whole number of GPUs")
    if isinstance(value, float) and not value.is_integer():
        raise ShapeError(f"{where}: must be a whole number of GPUs, got {value}")
    try:
        count = int(str(value)) if not isinstance(value, float) else int(value)
    except ValueError:
        raise ShapeError(f"{where}: must be a whole number of GPUs, got {value!r}") from None
    if count < 1:
        raise ShapeError(f"{where}: must be at least 1, got {count}")
    if count > MAX_GPUS_PER_POD:
        raise ShapeError(f"{where}: at most {MAX_GPUS_PER_POD} GPUs fit one pod, got {count}")
    return count


def _allowed_models(spec: PodSpec) -> tuple[str, ...]:
    models: set[str] = set()
    if GPU_PRODUCT_LABEL in spec.node_selector:
        models.add(spec.node_selector[GPU_PRODUCT_LABEL])
    affinity = spec.affinity or {}
    required = (affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for expr in term.get("matchExpressions") or []:
            if expr.get("key") == GPU_PRODUCT_LABEL and expr.get("operator") == "In":
                models.update(str(v) for v in expr.get("values") or [])
    return tuple(sorted(models))


def model_selector(models: Sequence[str]) -> dict[str, Any]:
    """The pod spec fields that allow these GPU models (the inverse of `_allowed_models`):
    a `nodeSelector` for one model, a required node affinity (`In`) for several."""
    if len(models) == 1:
        return {"nodeSelector": {GPU_PRODUCT_LABEL: models[0]}}
    if not models:
        return {}
    term = {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(models)}
    required = {"nodeSelectorTerms": [{"matchExpressions": [term]}]}
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    }


def shape_of(task: Task, *, where: str = "task") -> PodShape:
    """The per-pod request of a task: GPUs from limits, models from GFD selectors."""
    spec = task.template.spec
    gpus = 0
    cpu = 0
    mem = 0
    for ci, container in enumerate(spec.containers):
        res = container.resources
        cwhere = f"{where}.template.spec.containers[{ci}].resources"
        if GPU_RESOURCE in res.limits:
            gpus += _gpu_count(res.limits[GPU_RESOURCE], f"{cwhere}.limits[{GPU_RESOURCE}]")
        elif GPU_RESOURCE in res.requests:
            gpus += _gpu_count(res.requests[GPU_RESOURCE], f"{cwhere}.requests[{GPU_RESOURCE}]")
        try:
            for name, qty in (res.requests or res.limits).items():
                if name == "cpu":
                    cpu += parse_cpu_milli(qty)
                elif name == "memory":
                    mem += parse_memory_mib(qty)
        except ValueError:
            raise ShapeError(f"{cwhere}: cpu or memory is not a Kubernetes quantity") from None
    if gpus > MAX_GPUS_PER_POD:
        raise ShapeError(f"{where}: at most {MAX_GPUS_PER_POD} GPUs fit one pod, got {gpus}")
    annotations = task.template.metadata.annotations
    milli = 1000
    if GPU_MILLI_ANNOTATION in annotations:
        raw = annotations[GPU_MILLI_ANNOTATION]
        awhere = f"{where}.template.metadata.annotations[{GPU_MILLI_ANNOTATION}]"
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            raise ShapeError(f"{awhere}: must be a whole number from 1 to 1000, got {raw!r}")
        milli = int(raw)
        if milli < 1000 and gpus != 1:
            raise ShapeError(f"{awhere}: a shared GPU pod asks for exactly 1 GPU")
    min_mem = 0
    if GPU_MEMORY_ANNOTATION in annotations:
        raw = annotations[GPU_MEMORY_ANNOTATION]
        if not raw.isdigit():
            raise ShapeError(
                f"{where}.template.metadata.annotations[{GPU_MEMORY_ANNOTATION}]: "
                f"must be a whole number of MiB"
            )
        min_mem = int(raw)
    return PodShape(
        gpus=gpus,
        gpu_milli=milli if gpus else 0,
        models=_allowed_models(spec),
        min_gpu_memory_mib=min_mem,
        cpu_milli=cpu,
        memory_mib=mem,
    )


class GangRequest(BaseModel):
    """A whole job as the schedulers see it: every pod, placed all-or-nothing."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    tasks: tuple[tuple[str, int, PodShape], ...]  # (task name, replicas, shape)
    min_member: int
    topology: Topology = Topology()
    priority: int = 0
    # the broker's dispatch count: pods of a job run again get names of their own
    attempt: int = 1

    @property
    def pods(self) -> int:
        return sum(r for _, r, _ in self.tasks)

    @property
    def gpus(self) -> int:
        return sum(r * s.gpus for _, r, s in self.tasks)

    def pod_names(self) -> list[tuple[str, str, PodShape]]:
        """(pod name, task, shape) for every pod, in a stable order."""
        out = []
        for task, replicas, shape in self.tasks:
            for i in range(replicas):
                out.append((pod_name(self.job_id, task, i, attempt=self.attempt), task, shape))
        return out


def gang_request(job_id: str, job: GPUJob, *, attempt: int = 1) -> GangRequest:
    tasks = tuple((t.name, t.replicas, shape_of(t)) for t in job.spec.tasks)
    total = sum(r for _, r, _ in tasks)
    return GangRequest(
        job_id=job_id,
        tasks=tasks,
        min_member=job.spec.gang.min_member or total,
        topology=job.spec.topology,
        priority=job.spec.priority,
        attempt=attempt,
    )


_ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")


def pod_name(job_id: str, task: str, index: int, *, attempt: int = 1) -> str:
    """The name of a job's pod: `{job}-{task}-{index}` on the first attempt, with `-a{attempt}`
    after it from the second on, so that the pods an earlier attempt left behind (a failed pod
    stays for its logs) never clash with the new ones.

    The attempt goes last because a first attempt's name always ends in digits: with it in
    front (`{job}-a2-{task}-{index}`) a task named `a2-x` would take the name of task `x`'s
    pod on attempt 2. Job ids (at most 59 characters) and task names (DNS labels of at most
    63) keep the name a valid DNS subdomain far below 253 characters.
    """
    name = f"{job_id}-{task}-{index}"
    return name if attempt <= 1 else f"{name}-a{attempt}"


def attempt_of_pod(name: str) -> int:
    """The attempt a pod named by `pod_name` belongs to."""
    found = _ATTEMPT_SUFFIX.search(name)
    return int(found.group(1)) if found else 1
