"""A pod's shape: what one pod of a task needs from a node, read from its pod template.

`shape_of` turns a task's template into a `PodShape` (GPUs from limits or requests, a share
of one, MIG slices, CPU and memory, the GPU models and node selection it allows). Called by
`jobs.GPUJob` validation for every task (strictly at a submit: the rules of the API, so that
nothing later can fail on the job; leniently for a stored record, making the rest safe), by
`gangs` for the schedulers and by the agent's placement. A validated job keeps each task's
shape with its template, one object per kind (`interned`), so reading it again parses nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from broker.api import affinity, mig

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = affinity.GPU_PRODUCT_LABEL
GPU_MILLI_ANNOTATION = "gpufed.io/gpu-milli"
GPU_MEMORY_ANNOTATION = "gpufed.io/min-gpu-memory-mib"
SIM_DURATION_ANNOTATION = "gpufed.io/sim-duration"
MAX_GPUS_PER_POD = 8
MAX_CPU_MILLI = 10**9  # a million cores: far above any node, far below any overflow
MAX_MEMORY_MIB = 2**40  # an exbibyte
MAX_GPU_MEMORY_MIB = 2**24  # 16 TiB per GPU
MAX_SIM_SECONDS = 10**9
_QUANTITY = re.compile(
    r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,3}))?$"
)
_DIGITS = re.compile(r"^[0-9]{1,10}$")
_DURATION = re.compile(r"^[0-9]{1,10}(\.[0-9]{1,17})?[smh]?$")  # any float repr
Quantity = int | float | str


# what `shape_of` reads of a task (a `jobs.Task`: `jobs` imports this module, not the reverse)
class _Resources(Protocol):
    @property
    def limits(self) -> Mapping[str, Quantity]: ...

    @property
    def requests(self) -> Mapping[str, Quantity]: ...


class _Container(Protocol):
    @property
    def resources(self) -> _Resources: ...


class _PodSpec(Protocol):
    @property
    def containers(self) -> Sequence[_Container]: ...

    @property
    def node_selector(self) -> Mapping[str, str]: ...

    @property
    def affinity(self) -> object: ...


class _Meta(Protocol):
    @property
    def annotations(self) -> Mapping[str, str]: ...


class _Template(Protocol):
    @property
    def spec(self) -> _PodSpec: ...

    @property
    def metadata(self) -> _Meta: ...

    @property
    def shape(self) -> PodShape | None: ...


class TaskLike(Protocol):
    @property
    def template(self) -> _Template: ...


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
    spec: _PodSpec, where: str, *, strict: bool
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


def shape_of(task: TaskLike, *, where: str = "task", strict: bool = False) -> PodShape:
    """The per-pod request of a task: GPUs from limits, models and node selection from its
    node selector and affinity. `strict`: the rules of a submit (see the module). A task of a
    validated job has it already (a shape that passes the strict rules is the same without)."""
    known = task.template.shape
    if not strict and known is not None:
        return known
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
