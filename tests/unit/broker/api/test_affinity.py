"""Node selection as Kubernetes reads it (`broker.api.affinity`), and the job rules of a submit
against the job as a stored record or an offer reads it (`broker.api.jobs`)."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from broker.api import affinity, gangs, jobs, status
from tests.builders import expr, make_job

GPU = jobs.GPU_PRODUCT_LABEL
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
In, NotIn, Exists, DoesNotExist, Gt, Lt = (op for op in affinity.Operator)


def requirement(key: str, operator: affinity.Operator, *values: str) -> affinity.Requirement:
    if operator in (Gt, Lt):
        return affinity.Requirement(key, operator, number=int(values[0]))
    return affinity.Requirement(key, operator, frozenset(values))


@pytest.mark.parametrize(
    ("req", "labels", "expected"),
    [
        pytest.param(requirement("z", In, "a", "b"), {"z": "b"}, True, id="In: value listed"),
        pytest.param(requirement("z", In, "a"), {"z": "c"}, False, id="In: value not listed"),
        pytest.param(requirement("z", In, "a"), {}, False, id="In: label absent"),
        pytest.param(requirement("z", NotIn, "a"), {"z": "a"}, False, id="NotIn: value listed"),
        pytest.param(requirement("z", NotIn, "a"), {"z": "c"}, True, id="NotIn: other value"),
        pytest.param(requirement("z", NotIn, "a"), {}, True, id="NotIn: label absent matches"),
        pytest.param(requirement("z", Exists), {"z": ""}, True, id="Exists: empty value"),
        pytest.param(requirement("z", Exists), {}, False, id="Exists: absent"),
        pytest.param(requirement("z", DoesNotExist), {}, True, id="DoesNotExist: absent"),
        pytest.param(requirement("z", DoesNotExist), {"z": "a"}, False, id="DoesNotExist: set"),
        pytest.param(requirement("g", Gt, "8"), {"g": "9"}, True, id="Gt: above"),
        pytest.param(requirement("g", Gt, "8"), {"g": "8"}, False, id="Gt: equal is not above"),
        pytest.param(requirement("g", Gt, "8"), {"g": "+10"}, True, id="Gt: signed label"),
        pytest.param(requirement("g", Gt, "8"), {"g": "1e3"}, False, id="Gt: not an integer"),
        pytest.param(requirement("g", Gt, "8"), {"g": "H100"}, False, id="Gt: a word"),
        pytest.param(requirement("g", Gt, "8"), {}, False, id="Gt: label absent"),
        pytest.param(requirement("g", Gt, "8"), {"g": "9" * 20}, False, id="Gt: beyond 64 bits"),
        pytest.param(requirement("g", Lt, "0"), {"g": "-3"}, True, id="Lt: negative"),
        pytest.param(requirement("g", Lt, "3"), {"g": "3"}, False, id="Lt: equal is not below"),
    ],
)
def test_requirement_matches_like_kubernetes(
    req: affinity.Requirement, labels: dict[str, str], expected: bool
) -> None:
    assert req.matches(labels) is expected


def test_node_name_field() -> None:
    named = affinity.Requirement("metadata.name", In, frozenset({"n1"}), field=True)
    assert named.matches({}, "n1") and not named.matches({"metadata.name": "n1"}, "n2")


def reading(doc_spec: dict[str, Any]) -> affinity.Reading:
    return affinity.read_pod_spec(doc_spec.get("nodeSelector", {}), doc_spec.get("affinity"))


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": list(terms)
        }}
    }  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "models", "kept", "labels", "expected"),
    [
        pytest.param(
            {"nodeSelector": {GPU: H100}}, (H100,), False, {GPU: H100}, True, id="nodeSelector"
        ),
        pytest.param(
            {"affinity": required({"matchExpressions": [expr(GPU, "In", H100, A100)]})},
            (A100, H100), False, {GPU: A100}, True, id="In on the model: models only",
        ),
        pytest.param(
            {"affinity": required({"matchExpressions": [expr(GPU, "NotIn", H100)]})},
            (), True, {GPU: H100}, False, id="NotIn keeps a selector",
        ),
        pytest.param(
            {"affinity": required({"matchExpressions": [
                expr(GPU, "In", H100, A100), expr(GPU, "NotIn", H100)
            ]})},
            (A100,), True, {GPU: A100}, True, id="In less NotIn in one term",
        ),
        pytest.param(
            {"affinity": required(
                {"matchExpressions": [expr(GPU, "In", H100)]},
                {"matchExpressions": [expr("zone", "In", "b")]},
            )},
            (), True, {GPU: A100, "zone": "b"}, True, id="terms are ORed",
        ),
        pytest.param(
            {"affinity": required({"matchExpressions": [
                expr("zone", "In", "a"), expr(GPU, "Exists")
            ]})},
            (), True, {"zone": "a"}, False, id="expressions are ANDed",
        ),
        pytest.param(
            {"nodeSelector": {"zone": "a"},
             "affinity": required({"matchExpressions": [expr(GPU, "In", H100)]})},
            (H100,), True, {GPU: H100, "zone": "b"}, False, id="nodeSelector ANDed into terms",
        ),
        pytest.param(
            {"affinity": required({}, {"matchExpressions": [expr("zone", "In", "a")]})},
            (), True, {"zone": "a"}, True, id="an empty term matches nothing, others decide",
        ),
        pytest.param(
            {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "preference": {"matchExpressions": [expr(GPU, "In", H100)]}}
            ]}}},
            (), False, {GPU: A100}, True, id="preferred affinity is ignored",
        ),
    ],
)  # fmt: skip
def test_reading_a_pod_spec(
    spec: dict[str, Any],
    models: tuple[str, ...],
    kept: bool,
    labels: dict[str, str],
    expected: bool,
) -> None:
    read = reading(spec)
    assert read.problems == ()
    selector = read.selector
    assert (selector.models() if selector else ()) == models
    assert (selector is not None and not selector.only_models()) is kept
    assert (selector.matches(labels) if selector else True) is expected


@pytest.mark.parametrize(
    ("spec", "admitted"),
    [
        pytest.param([expr(GPU, "NotIn", H100)], {A100}, id="NotIn excludes the model"),
        pytest.param([expr(GPU, "Exists")], {A100, H100}, id="Exists: any GPU model"),
        pytest.param([expr(GPU, "DoesNotExist")], set(), id="DoesNotExist: no GPU node"),
        pytest.param([expr(GPU, "Gt", "3")], set(), id="Gt on a model name: never"),
        pytest.param([expr("zone", "In", "a")], {A100, H100}, id="another label: permissive"),
        pytest.param(
            [expr("zone", "In", "a"), expr(GPU, "In", A100)], {A100}, id="model and label"
        ),
    ],
)
def test_models_the_broker_admits(spec: list[dict[str, Any]], admitted: set[str]) -> None:
    shape = make_job(gpus=1).node_affinity(spec).request().tasks[0][2]
    assert {m for m in (A100, H100) if shape.admits_model(m)} == admitted


NODE_TERMS = (
    "spec.tasks[0].template.spec.affinity.nodeAffinity."
    "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
)
FIRST = f"{NODE_TERMS}[0].matchExpressions[0]"


def _affinity(value: Any) -> dict[str, Any]:
    doc = make_job("bad", gpus=1).document()
    doc["spec"]["tasks"][0]["template"]["spec"]["affinity"] = value
    return doc


def _terms(*expressions: Any) -> dict[str, Any]:
    return _affinity(required({"matchExpressions": list(expressions)}))


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        pytest.param(_terms(expr(GPU, "In")), f"{FIRST}.values", id="In without values"),
        pytest.param(_terms(expr(GPU, "NotIn")), f"{FIRST}.values", id="NotIn without values"),
        pytest.param(
            _terms(expr(GPU, "Exists", "x")), f"{FIRST}.values", id="Exists with values"
        ),
        pytest.param(_terms(expr("g", "Gt", "1", "2")), f"{FIRST}.values", id="Gt, two values"),
        pytest.param(_terms(expr("g", "Lt", "abc")), f"{FIRST}.values[0]", id="Lt, not integer"),
        pytest.param(_terms(expr(GPU, "Near", "x")), f"{FIRST}.operator", id="unknown operator"),
        pytest.param(_terms({"key": GPU, "values": ["x"]}), f"{FIRST}.operator", id="no operator"),
        pytest.param(_terms(expr("not a key", "Exists")), f"{FIRST}.key", id="bad label key"),
        pytest.param(
            _terms({**expr(GPU, "In", "x"), "value": "x"}), f"{FIRST}.value", id="unknown field"
        ),
        pytest.param(_affinity(required()), NODE_TERMS, id="no terms"),
        pytest.param(_affinity(required({}, {})), NODE_TERMS, id="every term empty"),
        pytest.param(
            _affinity(required({"matchFields": [expr("metadata.uid", "In", "x")]})),
            f"{NODE_TERMS}[0].matchFields[0].key",
            id="matchFields on another field",
        ),
        pytest.param(
            _affinity(required({"matchFields": [expr("metadata.name", "In", "a", "b")]})),
            f"{NODE_TERMS}[0].matchFields[0].values",
            id="matchFields with two values",
        ),
        pytest.param(
            _affinity({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 0, "preference": {"matchExpressions": [expr(GPU, "In", H100)]}}
            ]}}),
            "preferredDuringSchedulingIgnoredDuringExecution[0].weight",
            id="preferred weight out of range",
        ),
        pytest.param(
            _affinity({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname"}
            ]}}),
            "podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution",
            id="required pod anti-affinity",
        ),
    ],
)  # fmt: skip
def test_a_submit_refuses_what_kubernetes_would(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        jobs.validate_submitted(doc)
    assert field in str(caught.value)
    # a job stored before these rules is still read, and a bad required term matches nothing
    job = jobs.GPUJob.model_validate(doc)
    shape = gangs.gang_request("old", job).tasks[0][2]
    if field.startswith(NODE_TERMS):
        assert not shape.admits_model(H100)


def _spec(**changes: Any) -> dict[str, Any]:
    doc = make_job("ok", gpus=1).document()
    doc["spec"].update(changes)
    return doc


def _template(*, labels: Any = None, annotations: Any = None, **limits: Any) -> dict[str, Any]:
    doc = make_job("ok", gpus=1).document()
    template = doc["spec"]["tasks"][0]["template"]
    if labels is not None:
        template["metadata"]["labels"] = labels
    if annotations is not None:
        template["metadata"]["annotations"] = annotations
    template["spec"]["containers"][0]["resources"]["limits"].update(limits)
    return doc


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        pytest.param(_spec(queue="Team_A"), "spec.queue", id="queue not a DNS label"),
        pytest.param(_spec(queue="-a"), "spec.queue", id="queue starting with -"),
        pytest.param(_spec(priority=2**31), "spec.priority", id="priority above int32"),
        pytest.param(_spec(priority=10**40), "spec.priority", id="priority of 41 digits"),
        pytest.param(_spec(priority=-(2**31) - 1), "spec.priority", id="priority below int32"),
        pytest.param(_template(labels={"a": "x y"}), "labels", id="label value with a space"),
        pytest.param(_template(labels={"-a": "x"}), "labels", id="label key starting with -"),
        pytest.param(
            _template(annotations={"a/b/c": "x"}), "annotations", id="annotation key, two /"
        ),
        pytest.param(
            _template(annotations={"big": "x" * (256 * 1024)}),
            "annotations",
            id="annotations over 256 KiB",
        ),
        pytest.param(_template(cpu="inf"), "resources", id="cpu infinite"),
        pytest.param(_template(cpu=-1), "limits[cpu]", id="cpu negative"),
        pytest.param(_template(cpu=1e300), "containers", id="cpu beyond any node"),
        pytest.param(_template(memory="1Qi"), "limits[memory]", id="memory unit unknown"),
        pytest.param(_template(**{"bad key!": "1"}), "limits", id="resource name"),
        pytest.param(
            _template(**{"nvidia.com/gpu": "\u0668"}), "limits[nvidia.com/gpu]", id="GPUs: ٨"
        ),
        pytest.param(
            _template(annotations={jobs.GPU_MEMORY_ANNOTATION: "9" * 12}),
            jobs.GPU_MEMORY_ANNOTATION,
            id="GPU memory beyond any GPU",
        ),
        pytest.param(
            _template(annotations={jobs.SIM_DURATION_ANNOTATION: "1e400"}),
            jobs.SIM_DURATION_ANNOTATION,
            id="duration not finite",
        ),
    ],
)
def test_a_submit_bounds_every_field_later_code_reads(doc: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        jobs.validate_submitted(doc)
    assert field in str(caught.value)


def test_a_gang_over_the_pod_limit_is_refused_at_submit() -> None:
    doc = make_job("big", gpus=1).gang(10_000).task("more", gpus=1, replicas=1).document()
    with pytest.raises(pydantic.ValidationError, match="at most 10000"):
        jobs.validate_submitted(doc)


def test_container_names_are_dns_labels_and_unique_at_submit() -> None:
    doc = make_job("c", gpus=1).document()
    containers = doc["spec"]["tasks"][0]["template"]["spec"]["containers"]
    containers.append({**containers[0], "resources": {}})
    with pytest.raises(pydantic.ValidationError, match="names must be unique"):
        jobs.validate_submitted(doc)
    containers[1]["name"] = "Side_Car"
    with pytest.raises(pydantic.ValidationError, match="DNS label"):
        jobs.validate_submitted(doc)


def test_a_record_stored_before_the_rules_still_loads_and_is_safe() -> None:
    """Queue `Team_A`, priority 10^40, cpu -1 and `In []`, as an older broker stored them:
    the record loads, the priority is clamped, nothing matches the broken term."""
    doc = _template(cpu=-1)
    doc["spec"].update(queue="Team_A", priority=10**40)
    doc["spec"]["tasks"][0]["template"]["spec"]["affinity"] = required(
        {"matchExpressions": [expr(GPU, "In")]}
    )
    record = status.JobRecord(id="old-1", tenant="team-a", job=jobs.GPUJob.model_validate(doc))
    stored = json.dumps(record.model_dump(mode="json", by_alias=True))
    stored = stored.replace('"priority": 1000000000', f'"priority": {10**40}')
    loaded = status.JobRecord.model_validate_json(stored)
    assert loaded.job.spec.queue == "Team_A"
    assert loaded.job.spec.priority == jobs.MAX_PRIORITY
    request = gangs.gang_request(loaded.id, loaded.job)
    shape = request.tasks[0][2]
    assert shape.cpu_milli == 0 and not shape.admits_model(H100)


def test_a_job_at_the_bounds_passes_a_submit() -> None:
    doc = make_job("fine", gpus=8, queue="team-a").gang(2).model(H100, A100).document()
    doc["spec"]["priority"] = jobs.MAX_PRIORITY
    job = jobs.validate_submitted(doc)
    assert gangs.gang_request("x", job).tasks[0][2].models == (A100, H100)
