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
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol

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

from broker.api import affinity, arrays, clusterchoice, dependencies, policies, shapes

# the policies live in `policies`; their names here too, as `jobs.ClusterLostPolicy` is read
ClusterLostPolicy = policies.ClusterLostPolicy
FailurePolicy = policies.FailurePolicy
PreemptionPolicy = policies.PreemptionPolicy

# how a pod's shape is read lives in `shapes`; its names here too, as `jobs.PodShape` is read
GPU_RESOURCE = shapes.GPU_RESOURCE
GPU_PRODUCT_LABEL = shapes.GPU_PRODUCT_LABEL
GPU_MILLI_ANNOTATION = shapes.GPU_MILLI_ANNOTATION
GPU_MEMORY_ANNOTATION = shapes.GPU_MEMORY_ANNOTATION
SIM_DURATION_ANNOTATION = shapes.SIM_DURATION_ANNOTATION
MAX_GPUS_PER_POD = shapes.MAX_GPUS_PER_POD
Quantity = shapes.Quantity
PodShape = shapes.PodShape
ShapeError = shapes.ShapeError
shape_of = shapes.shape_of
parse_cpu_milli = shapes.parse_cpu_milli
parse_memory_mib = shapes.parse_memory_mib
model_selector = shapes.model_selector
SIM_OUTCOME_ANNOTATION = "gpufed.io/sim-outcome"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Kubernetes' priority range for user priority classes (int32 below, one billion above)
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 1_000_000_000
MAX_PODS_PER_JOB = 10_000
MAX_ANNOTATIONS_BYTES = 256 * 1024  # Kubernetes' limit on an object's annotations
SUBMIT_CONTEXT = policies.SUBMIT_CONTEXT


# validation context: where the jobs validated keep one object per kind of template, shape
# and gang (an `Interning`); without one, every job holds its own
INTERNING = "gpufed.interning"

Tasks = tuple[tuple[str, int, PodShape], ...]  # a gang's (task name, replicas, shape)


class Interning(Protocol):
    """One object per kind of pod template, pod shape and gang's tasks, for the jobs of one
    holder (the broker's job book: 100,000 jobs of one sweep hold one of each). Bounded by
    the holder; a kind forgotten only costs a copy."""

    def template(self, text: str) -> PodTemplate | None:
        """The settled template kept for this JSON, if any."""

    def keep(self, template: PodTemplate) -> PodTemplate:
        """The settled template to hold for `template`'s JSON (a checked one is kept over
        one that is not)."""

    def shape(self, shape: PodShape) -> PodShape: ...

    def tasks(self, tasks: Tasks) -> Tasks: ...

    def name(self, text: str) -> str:
        """One string object for every equal `text` the holder's jobs repeat (their queue's
        name, their namespace, their tasks' names)."""

    def fields(self, model: BaseModel) -> None:
        """Let `model` share one set of field names with its class's models the holder keeps
        (a job's models are never dumped with `exclude_unset`)."""

    def pack(self, model: BaseModel) -> None:
        """Let `model` keep its attributes in one table of keys shared with its class's models
        (the same attributes, held in less memory)."""


def validate_submitted(document: object, *, interning: Interning | None = None) -> GPUJob:
    """A job as a user submits it, held to every rule of the API (raises ValidationError).
    `interning`: where its template and shapes are kept (see `Interning`)."""
    context: dict[str, object] = {SUBMIT_CONTEXT: True}
    if interning is not None:
        context[INTERNING] = interning
    return GPUJob.model_validate(document, context=context)


def _interning(info: ValidationInfo) -> Interning | None:
    context = info.context
    return context.get(INTERNING) if isinstance(context, dict) else None


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


# serialization context: how a template is written instead of its model (a function of the
# template to its JSON text); `AS_VALIDATED` writes the JSON held, the store its own
TEMPLATE_JSON = "gpufed.template-json"


class PodTemplate:
    """A task's pod template, validated as a `PodTemplateSpec` and then held as its JSON.

    Why: the broker holds every live job, and a template's nested models (each with its own
    `__dict__`, fields set and extras) weigh several times its JSON, and would be a large part
    of a queued job's memory. The template is read seldom (a job's shape when it is validated,
    an agent's binding, a dump) and each read parses it again, so a value read from `spec` or
    `metadata` is a copy: change a template by building a new job.

    Never changed once made. Validation makes a *parsed* one (its JSON and the model, so a
    submit parses the template once); the job's validation then puts a *settled* one in its
    place (`settled`: the JSON and the pod's shape, no model), which an `Interning` may share
    among the jobs of one template. A dump goes through the parsed model, so every option
    (`exclude_defaults`, `by_alias`, ...) gives what it gave when the template was a model,
    unless the caller says how templates are written (`TEMPLATE_JSON`, `AS_VALIDATED`)."""

    __slots__ = ("_checked", "_json", "_model", "_shape")

    def __init__(
        self,
        text: str,
        *,
        model: PodTemplateSpec | None = None,
        shape: PodShape | None = None,
        checked: bool = False,
    ) -> None:
        self._json = text
        self._model = model
        self._shape = shape  # the pod's shape as the job's validation found it
        self._checked = checked  # `shape` passed a submit's rules

    @classmethod
    def parsed(cls, model: PodTemplateSpec) -> PodTemplate:
        """The template of a model just validated (held with it until the job settles it)."""
        return cls(model.model_dump_json(by_alias=True), model=model)

    def settled(self, shape: PodShape, *, checked: bool) -> PodTemplate:
        """This template as a validated job holds it: the JSON and its pod's `shape` (found by
        a submit's rules if `checked`), without the model."""
        return PodTemplate(self._json, shape=shape, checked=checked)

    @property
    def json(self) -> str:
        """The template as validated, JSON by alias with nothing left out."""
        return self._json

    def model(self) -> PodTemplateSpec:
        """The template parsed (the model validated, if this is the parsed one; a fresh one
        from the JSON otherwise)."""
        if self._model is not None:
            return self._model
        return PodTemplateSpec.model_validate_json(self._json)

    @property
    def metadata(self) -> TemplateMeta:
        return self.model().metadata

    @property
    def spec(self) -> PodSpec:
        return self.model().spec

    @property
    def shape(self) -> PodShape | None:
        """The pod's shape, once the job's validation settled the template."""
        return self._shape

    @property
    def checked(self) -> bool:
        """Whether `shape` was found by a submit's rules (`shape_of(strict=True)`)."""
        return self._checked

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
        model = None if self._model is None else self._model.model_copy(deep=True)
        return PodTemplate(self._json, model=model, shape=self._shape, checked=self._checked)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        model = handler.generate_schema(PodTemplateSpec)

        def validate(value: object, inner: core_schema.ValidatorFunctionWrapHandler) -> object:
            # a wrap, not a union: a bad template's errors keep their locations
            return value if isinstance(value, PodTemplate) else PodTemplate.parsed(inner(value))

        return core_schema.no_info_wrap_validator_function(
            validate,
            model,
            serialization=core_schema.plain_serializer_function_ser_schema(
                PodTemplate._dump, info_arg=True
            ),
        )

    def _dump(self, info: core_schema.SerializationInfo) -> object:
        # a caller that says how templates are written (`TEMPLATE_JSON`) gets that; any
        # other dump goes through the model, with the caller's options
        context = info.context
        write = context.get(TEMPLATE_JSON) if isinstance(context, dict) else None
        if write is not None:
            return json.loads(write(self))
        return self.model()

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # the serializer returns a dict or a model: the schema is the model's, in both modes
        assert schema["type"] == "function-wrap"
        return handler(schema["schema"])


def _as_validated(template: PodTemplate) -> str:
    return template.json


# serialization context: templates written as validated (JSON by alias with nothing left
# out), the text held, not parsed again (a page of 500 jobs costs no 500 parses); for a dump
# by alias, in JSON, with no field left out by default, none or unset
AS_VALIDATED: dict[str, object] = {TEMPLATE_JSON: _as_validated}


class Task(_Strict):
    name: str
    replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    template: PodTemplate

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        return _check_dns_label(value)


class Gang(_Strict):
    # frozen: the jobs that leave it out share one (`NO_GANG`), as `Topology`
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


NO_GANG = Gang()  # a job's spec without `gang` or `topology` holds these: shared, not its own
NO_TOPOLOGY = Topology()


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
    gang: Gang = Field(default_factory=lambda: NO_GANG)
    topology: Topology = Field(default_factory=lambda: NO_TOPOLOGY)
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
        interning = _interning(info)
        gpus = 0
        for index, task in enumerate(self.spec.tasks):
            template = _settle(
                task, where=f"spec.tasks[{index}]", strict=strict, interning=interning
            )
            task.template = template  # (a job that fails is dropped whole)
            shape = template.shape
            assert shape is not None  # settled
            gpus += shape.gpus + shape.mig_slices
        if interning is not None:  # a holder of many jobs: their models share their names
            _intern_names(self, interning)
            for model in (self, self.metadata, self.spec, *self.spec.tasks):
                interning.fields(model)
                interning.pack(model)
        if gpus == 0:
            raise ValueError(
                f"spec.tasks[0].template.spec.containers[0].resources.limits[{GPU_RESOURCE}]: "
                "a GPUJob asks for at least one GPU"
            )
        return self


def _intern_names(job: GPUJob, interning: Interning) -> None:
    """The names a holder's jobs repeat (name, namespace, queue, priority class, task names)
    as `interning` keeps them: one string for every job that repeats one. Set in the models'
    dicts: the values as validated, no assignment recorded."""
    parts: tuple[tuple[BaseModel, tuple[str, ...]], ...] = (
        (job.metadata, ("name", "namespace")),
        (job.spec, ("queue", "priority_class")),
        *((task, ("name",)) for task in job.spec.tasks),
    )
    for model, fields in parts:
        values = model.__dict__
        for field in fields:
            text = values[field]
            if text is not None:
                values[field] = interning.name(text)


def _settle(task: Task, *, where: str, strict: bool, interning: Interning | None) -> PodTemplate:
    """The template `task` is to hold: settled with its pod's shape (`PodTemplate`), the one
    `interning` keeps for its JSON when there is one (found by a submit's rules, if `strict`)."""
    template = task.template
    known = interning.template(template.json) if interning is not None else None
    if known is not None and (known.checked or not strict):
        return known  # one object of this template, held to the same rules
    if template.shape is not None and (template.checked or not strict):
        return template  # settled already (a job built from a validated one's parts)
    shape = shape_of(task, where=where, strict=strict)
    if interning is None:
        return template.settled(shape, checked=strict)
    return interning.keep(template.settled(interning.shape(shape), checked=strict))


def _check_sequencing(job: GPUJob) -> None:
    """At submit: the broker's array labels are the broker's, an array's names fit."""
    for key in job.metadata.labels:
        if key in arrays.LABELS:
            raise ValueError(f"metadata.labels[{key}]: set by the broker on an array's jobs")
    if job.spec.array is not None:
        problem = arrays.name_problem(job.metadata.name, job.spec.array.count)
        if problem is not None:
            raise ValueError(f"metadata.name: {problem}")
