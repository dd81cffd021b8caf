"""GPUJob: the job a user submits, Kubernetes style, and what the schedulers read from it.

Two readings of the same model. `validate_submitted` (the broker's `POST /v1/jobs`) applies
every rule of the API: names and queue names are DNS labels, `priority` is within Kubernetes'
range, labels and annotations are what Kubernetes accepts, quantities are finite and bounded,
node affinity is one Kubernetes would take (`affinity.read_pod_spec`), so that nothing later
(the planner, the agent, the pod it creates) can fail on a job the broker accepted.
`GPUJob.model_validate` (a stored record, an offer to an agent) keeps only the older rules and
makes the rest safe instead (a priority out of range is clamped, a node affinity it cannot use
matches no node): a job accepted by an older broker is still read, never a crash at load.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from broker.api import affinity, arrays, clusterchoice, dependencies, mig, policies

# the policies live in `policies`; their names here too, as `jobs.ClusterLostPolicy` is read
ClusterLostPolicy = policies.ClusterLostPolicy
FailurePolicy = policies.FailurePolicy
PreemptionPolicy = policies.PreemptionPolicy

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = affinity.GPU_PRODUCT_LABEL
GPU_MILLI_ANNOTATION = "gpufed.io/gpu-milli"
GPU_MEMORY_ANNOTATION = "gpufed.io/min-gpu-memory-mib"
SIM_DURATION_ANNOTATION = "gpufed.io/sim-duration"
SIM_OUTCOME_ANNOTATION = "gpufed.io/sim-outcome"
MAX_GPUS_PER_POD = 8
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Kubernetes' priority range for user priority classes (int32 below, one billion above)
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 1_000_000_000
MAX_PODS_PER_JOB = 10_000
MAX_CPU_MILLI = 10**9  # a million cores: far above any node, far below any overflow
MAX_MEMORY_MIB = 2**40  # an exbibyte
MAX_GPU_MEMORY_MIB = 2**24  # 16 TiB per GPU
MAX_SIM_SECONDS = 10**9
MAX_ANNOTATIONS_BYTES = 256 * 1024  # Kubernetes' limit on an object's annotations
SUBMIT_CONTEXT = policies.SUBMIT_CONTEXT
_QUANTITY = re.compile(
    r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,3}))?$"
)
_DIGITS = re.compile(r"^[0-9]{1,10}$")
_DURATION = re.compile(r"^[0-9]{1,10}(\.[0-9]{1,17})?[smh]?$")  # any float repr


def validate_submitted(document: object) -> GPUJob:
    """A job as a user submits it, held to every rule of the API (raises ValidationError)."""
    return GPUJob.model_validate(document, context={SUBMIT_CONTEXT: True})


def _at_submit(info: ValidationInfo) -> bool:
    return policies.at_submit(info)


def _check_dns_label(value: str) -> str:
    if len(value) > 63:
        raise ValueError("must be at most 63 characters")
    if not DNS_LABEL.match(value):
        raise ValueError("must be a DNS label: lower-case letters, digits and '-'")
    return value


def _check_labels(labels: Mapping[str, str]) -> None:
    found = affinity.labels_problem(labels)
    if found is not None:
        raise ValueError(found[2])


def _check_annotations(annotations: Mapping[str, str]) -> None:
    size = 0
    for key, value in annotations.items():
        problem = affinity.label_key_problem(key)
        if problem is not None:
            raise ValueError(problem)
        size += len(key.encode("utf-8", "surrogatepass"))
        size += len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ANNOTATIONS_BYTES:
        raise ValueError(
            f"{size} bytes of annotations; Kubernetes takes at most {MAX_ANNOTATIONS_BYTES}"
        )


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
        return _check_dns_label(value)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if _at_submit(info):
            _check_labels(value)
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if _at_submit(info):
            _check_annotations(value)
        return value


class TemplateMeta(_Open):
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if _at_submit(info):
            _check_labels(value)
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if _at_submit(info):
            _check_annotations(value)
        return value


Quantity = int | float | str


class Resources(_Open):
    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)


class Container(_Open):
    name: str
    image: str | None = None
    resources: Resources = Field(default_factory=Resources)

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str, info: ValidationInfo) -> str:
        return _check_dns_label(value) if _at_submit(info) else value


class PodSpec(_Open):
    containers: Annotated[list[Container], Field(min_length=1)]
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    affinity: dict[str, Any] | None = Field(
        None,
        description=(
            "Kubernetes affinity. Required node affinity is honoured (In, NotIn, Exists, "
            "DoesNotExist, Gt, Lt; matchFields on metadata.name); preferred node affinity is "
            "checked and ignored; required pod (anti-)affinity is refused"
        ),
    )

    @model_validator(mode="after")
    def _unique_containers(self, info: ValidationInfo) -> PodSpec:
        names = [c.name for c in self.containers]
        if _at_submit(info) and len(set(names)) != len(names):
            raise ValueError("containers: names must be unique in a pod")
        return self


class PodTemplateSpec(_Open):
    metadata: TemplateMeta = Field(default_factory=TemplateMeta)
    spec: PodSpec


class PodTemplate:
    """A task's pod template, validated as a `PodTemplateSpec` and then held as its JSON.

    Why: the broker holds every live job, and a template's nested models (each with its own
    `__dict__`, fields set and extras) were half of a queued job's memory: 3.1 KB of the 6.7 KB
    of a 1-container job, against under 0.4 KB as JSON. The template is read seldom (a job's
    shape when it is validated, an agent's binding, a dump) and each read parses it again, so
    a value read from `spec` or `metadata` is a copy: change a template by building a new job.
    A dump goes through the parsed model, so every option (`exclude_defaults`, `by_alias`, ...)
    gives what it gave when the template was a model. The model `GPUJob` validation made stays
    until the job's shapes are checked (`compact`), so a submit parses the template once."""

    __slots__ = ("_json", "_model", "_shape")

    def __init__(self, model: PodTemplateSpec) -> None:
        self._json = model.model_dump_json(by_alias=True)
        self._model: PodTemplateSpec | None = model
        # the pod's shape as the job's validation found it (`shape_of` returns it, unparsed)
        self._shape: PodShape | None = None

    def model(self) -> PodTemplateSpec:
        """The template parsed (the same object until `compact`, a fresh one after)."""
        if self._model is not None:
            return self._model
        return PodTemplateSpec.model_validate_json(self._json)

    @property
    def metadata(self) -> TemplateMeta:
        return self.model().metadata

    @property
    def spec(self) -> PodSpec:
        return self.model().spec

    def compact(self, shape: PodShape) -> None:
        """Let go of the parsed model: from now on, the JSON alone, and its pod's `shape`."""
        self._model = None
        self._shape = shape

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PodTemplate):
            return NotImplemented
        return self._json == other._json or self.model() == other.model()

    __hash__ = None  # type: ignore[assignment]  # equal by value, mutable as a model is

    def __repr__(self) -> str:
        return f"PodTemplate({self._json})"

    def __copy__(self) -> PodTemplate:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> PodTemplate:
        copied = PodTemplate.__new__(PodTemplate)
        copied._json = self._json
        copied._model = None if self._model is None else self._model.model_copy(deep=True)
        copied._shape = self._shape  # frozen
        return copied

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        model = handler.generate_schema(PodTemplateSpec)

        def validate(value: object, inner: core_schema.ValidatorFunctionWrapHandler) -> object:
            # a wrap, not a union: a bad template's errors keep their locations
            return value if isinstance(value, PodTemplate) else PodTemplate(inner(value))

        return core_schema.no_info_wrap_validator_function(
            validate,
            model,
            serialization=core_schema.plain_serializer_function_ser_schema(
                PodTemplate._dump, info_arg=True
            ),
        )

    def _dump(self, info: core_schema.SerializationInfo) -> object:
        # the API's and the store's usual dump (JSON, by alias, nothing left out) is the JSON
        # held: a page of 500 jobs costs no 500 parses; any other goes through the model
        plain = not (info.exclude_defaults or info.exclude_none or info.exclude_unset)
        if plain and info.mode_is_json() and info.by_alias and not info.round_trip:
            return json.loads(self._json)
        return self.model()

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # the serializer returns a dict or a model: the schema is the model's, in both modes
        assert schema["type"] == "function-wrap"
        return handler(schema["schema"])


class Task(_Strict):
    name: str
    replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    template: PodTemplate

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        return _check_dns_label(value)


class Gang(_Strict):
    # frozen: the jobs that leave it out share one (`_NO_GANG`), as `Topology`
    model_config = ConfigDict(frozen=True)

    min_member: Annotated[int | None, Field(ge=1, alias="minMember")] = None


class TopologyMode(StrEnum):
    NONE = "none"
    PREFERRED = "preferred"
    REQUIRED = "required"


class Topology(_Strict):
    """Where the pods of a gang should sit relative to each other."""

    model_config = ConfigDict(frozen=True)

    nvlink: TopologyMode = TopologyMode.NONE
    rack: TopologyMode = TopologyMode.NONE


_NO_GANG = Gang()  # a job's spec without `gang` or `topology` holds these (about 1 KB less)
_NO_TOPOLOGY = Topology()


_DEFAULT_FAILURES = FailurePolicy()


class JobSpec(_Strict):
    queue: Annotated[
        str,
        Field(
            min_length=1,
            max_length=63,
            json_schema_extra={"pattern": DNS_LABEL.pattern},
            description="the job's queue, a DNS label",
        ),
    ]
    priority: Annotated[
        int,
        Field(
            json_schema_extra={"minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY},
            description="Kubernetes' priority range: -2147483648 to 1000000000",
        ),
    ] = 0
    # a priority class of the broker's queues configuration; wins over `priority`
    priority_class: Annotated[str | None, Field(max_length=63, alias="priorityClass")] = None
    tasks: Annotated[list[Task], Field(min_length=1, max_length=64)]
    gang: Gang = Field(default_factory=lambda: _NO_GANG)
    topology: Topology = Field(default_factory=lambda: _NO_TOPOLOGY)
    # None: the defaults, and left out of offers (agents of protocol 2 do not know the field)
    failure_policy: FailurePolicy | None = Field(
        None,
        alias="failurePolicy",
        description="what happens when something fails under the job; absent: the defaults",
    )
    preemption: PreemptionPolicy | None = Field(
        None, description="how the job's pods stop when it is preempted; absent: the defaults"
    )
    ttl_seconds_after_finished: policies.TTLSeconds = None
    clusters: clusterchoice.ClusterChoice | None = Field(
        None,
        description="which member clusters the job may run on (selector), which it prefers "
        "(preferred) and in what order it spills over (order), by the clusters' labels; "
        "absent: any cluster",
    )
    depends_on: dependencies.DependsOn = None
    array: arrays.ArraySpec | None = Field(
        None,
        description="count indexed jobs from this one (`<name>-<i>`, GPUFED_ARRAY_INDEX=i in "
        "every pod), at most parallelism of them holding GPUs at once; absent: one job",
    )

    @property
    def cluster_lost(self) -> ClusterLostPolicy:
        """The job's `failurePolicy.clusterLost`, the default when it gives none."""
        policy = self.failure_policy
        return ClusterLostPolicy.REQUEUE if policy is None else policy.cluster_lost

    @property
    def failures(self) -> FailurePolicy:
        """The job's failure policy, the defaults where it gives none."""
        return self.failure_policy or _DEFAULT_FAILURES

    @field_validator("ttl_seconds_after_finished", mode="before")
    @classmethod
    def _ttl(cls, value: object, info: ValidationInfo) -> object:
        return policies.read_ttl(value, info)

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str, info: ValidationInfo) -> str:
        # a queue name is a key of the queues configuration and a label value on every pod
        return _check_dns_label(value) if _at_submit(info) else value

    @field_validator("priority")
    @classmethod
    def _priority(cls, value: int, info: ValidationInfo) -> int:
        if MIN_PRIORITY <= value <= MAX_PRIORITY:
            return value
        if _at_submit(info):
            raise ValueError(f"must be from {MIN_PRIORITY} to {MAX_PRIORITY}")
        return min(max(value, MIN_PRIORITY), MAX_PRIORITY)

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> JobSpec:
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError("tasks: names must be unique")
        total = sum(t.replicas for t in self.tasks)
        if self.gang.min_member is not None and self.gang.min_member > total:
            raise ValueError(
                f"gang.minMember: {self.gang.min_member} is above the total replicas ({total})"
            )
        if _at_submit(info) and total > MAX_PODS_PER_JOB:
            raise ValueError(f"tasks: {total} pods in all; a job has at most {MAX_PODS_PER_JOB}")
        return self


class GPUJob(_Strict):
    api_version: Literal["gpufed.io/v1"] = Field("gpufed.io/v1", alias="apiVersion")
    kind: Literal["GPUJob"] = "GPUJob"
    metadata: ObjectMeta
    spec: JobSpec

    @model_validator(mode="after")
    def _check_shapes(self, info: ValidationInfo) -> GPUJob:
        strict = _at_submit(info)
        if strict:
            _check_sequencing(self)
        gpus = 0
        shapes = []
        for index, task in enumerate(self.spec.tasks):
            shape = shape_of(task, where=f"spec.tasks[{index}]", strict=strict)
            shapes.append(shape)
            gpus += shape.gpus + shape.mig_slices
        if gpus == 0:
            raise ValueError(
                f"spec.tasks[0].template.spec.containers[0].resources.limits[{GPU_RESOURCE}]: "
                "a GPUJob asks for at least one GPU"
            )
        for task, shape in zip(self.spec.tasks, shapes, strict=True):
            task.template.compact(_interned(shape))
        return self


def _check_sequencing(job: GPUJob) -> None:
    """At submit: the broker's array labels are the broker's, an array's names fit."""
    for key in job.metadata.labels:
        if key in arrays.LABELS:
            raise ValueError(f"metadata.labels[{key}]: set by the broker on an array's jobs")
    if job.spec.array is not None:
        problem = arrays.name_problem(job.metadata.name, job.spec.array.count)
        if problem is not None:
            raise ValueError(f"metadata.name: {problem}")


class ShapeError(ValueError):
    """A task whose resources cannot be turned into a placement request."""


class PodShape(BaseModel):
    """What one pod of a task needs from a node: the placement request.

    `models` lists the GPU models (product label values) the pod may use, when its selector
    names them (empty: any); `selector` is the rest of its node selection, when there is more
    to it than `models` (e.g. `NotIn`, or a label other than the GPU model). `admits_model`
    says whether a node of a model may take the pod as far as the model tells. A pod of MIG
    slices (`broker.api.mig`) has no `gpus`: `mig_slices` slices of profile `mig_profile`."""

    model_config = ConfigDict(frozen=True)

    gpus: int
    gpu_milli: int = 1000
    mig_profile: str = ""
    mig_slices: int = 0
    models: tuple[str, ...] = ()
    min_gpu_memory_mib: int = 0
    cpu_milli: int = 0
    memory_mib: int = 0
    selector: affinity.NodeSelector | None = None

    @property
    def gpu_milli_total(self) -> int:
        return self.gpus * self.gpu_milli

    @property
    def uses_gpus(self) -> bool:
        """Whole GPUs, a share of one or MIG slices: not a CPU-only pod."""
        return bool(self.gpus or self.mig_slices)

    def admits_model(self, model: str) -> bool:
        if self.models and model not in self.models:
            return False
        return self.selector is None or self.selector.admits_model(model)


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"not a finite quantity: {text!r}")
    return number


def parse_cpu_milli(value: Quantity) -> int:
    text = str(value).strip()
    try:
        if text.endswith("m"):
            return int(_finite(text[:-1]))
        return round(_finite(text) * 1000)
    except OverflowError:
        raise ValueError(f"not a finite quantity: {text!r}") from None


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
    try:
        for unit, factor in sorted(_MEM_UNITS.items(), key=lambda kv: -len(kv[0])):
            if text.endswith(unit):
                return int(_finite(text[: -len(unit)]) * factor + 0.999999)
        return int(_finite(text) / 1048576 + 0.999999)
    except OverflowError:
        raise ValueError(f"not a finite quantity: {text!r}") from None


def _gpu_count(value: Quantity, where: str, *, strict: bool) -> int:
    if isinstance(value, bool):
        raise ShapeError(f"{where}: must be a whole number of GPUs")
    if isinstance(value, float) and not value.is_integer():
        raise ShapeError(f"{where}: must be a whole number of GPUs, got {value}")
    if strict and isinstance(value, str) and not _DIGITS.match(value.strip()):
        raise ShapeError(f"{where}: must be a whole number of GPUs, got {value!r}")
    try:
        count = int(str(value)) if not isinstance(value, float) else int(value)
    except ValueError:
        raise ShapeError(f"{where}: must be a whole number of GPUs, got {value!r}") from None
    if count < 1:
        raise ShapeError(f"{where}: must be at least 1, got {count}")
    if count > MAX_GPUS_PER_POD:
        raise ShapeError(f"{where}: at most {MAX_GPUS_PER_POD} GPUs fit one pod, got {count}")
    return count


def _check_quantity(name: str, qty: Quantity, where: str) -> None:
    """What Kubernetes accepts as a resource: a qualified name, a quantity that is >= 0."""
    problem = affinity.label_key_problem(name)
    if problem is not None:
        raise ShapeError(f"{where}: {problem}")
    awhere = f"{where}[{name}]"
    if isinstance(qty, bool):
        raise ShapeError(f"{awhere}: must be a quantity, got {qty}")
    if isinstance(qty, str):
        if not _QUANTITY.match(qty.strip()):
            raise ShapeError(f"{awhere}: {qty!r} is not a Kubernetes quantity")
        negative = qty.strip().startswith("-")
    else:
        if not math.isfinite(qty):
            raise ShapeError(f"{awhere}: must be a finite quantity")
        negative = qty < 0
    if negative:
        raise ShapeError(f"{awhere}: must be at least 0")


def _bounded(value: int, limit: int, where: str, what: str, *, strict: bool) -> int:
    if 0 <= value <= limit:
        return value
    if strict:
        raise ShapeError(f"{where}: {what} must be from 0 to {limit}, got {value}")
    return min(max(value, 0), limit)


def _selection(
    spec: PodSpec, where: str, *, strict: bool
) -> tuple[tuple[str, ...], affinity.NodeSelector | None]:
    """The pod's allowed models and the selector beyond them (see `PodShape`)."""
    reading = affinity.read_pod_spec(spec.node_selector, spec.affinity)
    if strict and reading.problems:
        raise ShapeError(f"{where}.template.spec.{reading.problems[0]}")
    selector = reading.selector
    if selector is None:
        return (), None
    models = selector.models()
    return models, (None if selector.only_models() else selector)


def model_selector(models: Sequence[str]) -> dict[str, Any]:
    """The pod spec fields that allow these GPU models (read back as `PodShape.models`):
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


# the pod shapes validated jobs hold, one object per kind (100,000 jobs of one template: one
# shape, not 100,000 of about 1 KB each); forgotten wholesale past `MAX_SHAPES` kinds
_SHAPES: dict[PodShape, PodShape] = {}
MAX_SHAPES = 4096


def _interned(shape: PodShape) -> PodShape:
    found = _SHAPES.get(shape)
    if found is None:
        if len(_SHAPES) >= MAX_SHAPES:
            _SHAPES.clear()
        found = _SHAPES[shape] = shape
    return found


def shape_of(task: Task, *, where: str = "task", strict: bool = False) -> PodShape:
    """The per-pod request of a task: GPUs from limits, models and node selection from its
    node selector and affinity. `strict`: the rules of a submit (see the module). A task of a
    validated job has it already (a shape that passes the strict rules is the same without)."""
    if not strict and task.template._shape is not None:
        return task.template._shape
    spec = task.template.spec
    gpus = 0
    cpu = 0
    mem = 0
    for ci, container in enumerate(spec.containers):
        res = container.resources
        cwhere = f"{where}.template.spec.containers[{ci}].resources"
        if strict:
            for kind, quantities in (("limits", res.limits), ("requests", res.requests)):
                for name, qty in quantities.items():
                    _check_quantity(name, qty, f"{cwhere}.{kind}")
        if GPU_RESOURCE in res.limits:
            gpus += _gpu_count(
                res.limits[GPU_RESOURCE], f"{cwhere}.limits[{GPU_RESOURCE}]", strict=strict
            )
        elif GPU_RESOURCE in res.requests:
            gpus += _gpu_count(
                res.requests[GPU_RESOURCE], f"{cwhere}.requests[{GPU_RESOURCE}]", strict=strict
            )
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
    rwhere = f"{where}.template.spec.containers"
    cpu = _bounded(cpu, MAX_CPU_MILLI, rwhere, "milli-CPU in all", strict=strict)
    mem = _bounded(mem, MAX_MEMORY_MIB, rwhere, "memory (MiB) in all", strict=strict)
    annotations = task.template.metadata.annotations
    milli = 1000
    if GPU_MILLI_ANNOTATION in annotations:
        raw = annotations[GPU_MILLI_ANNOTATION]
        awhere = f"{where}.template.metadata.annotations[{GPU_MILLI_ANNOTATION}]"
        if (strict and not _DIGITS.match(raw)) or not raw.isdigit() or not 1 <= int(raw) <= 1000:
            raise ShapeError(f"{awhere}: must be a whole number from 1 to 1000, got {raw!r}")
        milli = int(raw)
        if milli < 1000 and gpus != 1:
            raise ShapeError(f"{awhere}: a shared GPU pod asks for exactly 1 GPU")
    min_mem = 0
    if GPU_MEMORY_ANNOTATION in annotations:
        raw = annotations[GPU_MEMORY_ANNOTATION]
        awhere = f"{where}.template.metadata.annotations[{GPU_MEMORY_ANNOTATION}]"
        if (strict and not _DIGITS.match(raw)) or not raw.isdigit():
            raise ShapeError(f"{awhere}: must be a whole number of MiB")
        min_mem = _bounded(int(raw), MAX_GPU_MEMORY_MIB, awhere, "MiB", strict=strict)
    if strict and SIM_DURATION_ANNOTATION in annotations:
        raw = annotations[SIM_DURATION_ANNOTATION].strip()
        awhere = f"{where}.template.metadata.annotations[{SIM_DURATION_ANNOTATION}]"
        unit = {"s": 1, "m": 60, "h": 3600}.get(raw[-1:], 1)
        if not _DURATION.match(raw) or float(raw.rstrip("smh")) * unit > MAX_SIM_SECONDS:
            raise ShapeError(
                f"{awhere}: a duration such as 12, 1.5, 30s, 5m or 2h, at most "
                f"{MAX_SIM_SECONDS} seconds, got {raw!r}"
            )
    try:
        profile, slices = mig.read_request(
            [
                (f"{where}.template.spec.containers[{ci}].resources", c.resources.limits,
                 c.resources.requests)
                for ci, c in enumerate(spec.containers)
            ],
            annotations, gpus=gpus, where=where, strict=strict,
        )  # fmt: skip
    except mig.Problem as exc:
        raise ShapeError(str(exc)) from None
    if profile and gpus:  # gpufed.io/mig-profile with nvidia.com/gpu: N slices of the profile
        gpus, milli = 0, 1000
    models, selector = _selection(spec, where, strict=strict)
    return PodShape(
        gpus=gpus,
        gpu_milli=milli if gpus else 0,
        mig_profile=profile,
        mig_slices=slices,
        models=models,
        min_gpu_memory_mib=min_mem,
        cpu_milli=cpu,
        memory_mib=mem,
        selector=selector,
    )
