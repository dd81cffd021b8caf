"""A task's pod template held as JSON (`jobs.PodTemplate`): it reads, dumps and compares as
the model it was, a validated job holds no parsed template, and jobs of one template hold one."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from broker.api import gangs, jobs
from broker.state import records


def document() -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "trainer:1",
        "resources": {"limits": {"nvidia.com/gpu": 2, "cpu": "4"}},
        "env": [{"name": "A", "value": "1"}],  # a field gpufed does not model: passed through
    }
    template = {
        "metadata": {"labels": {"team": "a"}, "annotations": {"gpufed.io/sim-duration": "5"}},
        "spec": {"containers": [container], "nodeSelector": {"zone": "z1"}},
    }
    return {
        "metadata": {"name": "train"},
        "spec": {"queue": "q", "tasks": [{"name": "w", "replicas": 2, "template": template}]},
    }


def test_a_validated_job_holds_its_templates_as_json_only() -> None:
    job = jobs.validate_submitted(document())
    template = job.spec.tasks[0].template
    assert template._model is None
    assert template.metadata.labels == {"team": "a"}
    assert template.spec.node_selector == {"zone": "z1"}
    assert template.spec.containers[0].model_extra == {"env": [{"name": "A", "value": "1"}]}


def test_dumps_give_what_the_model_gave() -> None:
    job = jobs.validate_submitted(document())
    model = jobs.PodTemplateSpec.model_validate(document()["spec"]["tasks"][0]["template"])
    dumped = job.model_dump(mode="json", by_alias=True)["spec"]["tasks"][0]["template"]
    assert dumped == model.model_dump(mode="json", by_alias=True)
    lean = job.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    assert lean["spec"]["tasks"][0]["template"] == model.model_dump(
        mode="json", by_alias=True, exclude_defaults=True
    )
    bare = job.model_dump(exclude_none=True)["spec"]["tasks"][0]["template"]
    assert bare == model.model_dump(exclude_none=True)
    assert "affinity" not in bare["spec"]
    again = jobs.GPUJob.model_validate_json(job.model_dump_json(by_alias=True))
    assert again == job
    assert records.body_digest(again) == records.body_digest(job)


def test_equal_by_value_and_copies_independent() -> None:
    first = jobs.validate_submitted(document())
    changed = document()
    changed["spec"]["tasks"][0]["template"]["metadata"]["labels"] = {"team": "b"}
    other = jobs.validate_submitted(changed)
    assert first == jobs.validate_submitted(document())
    assert first != other
    deep = copy.deepcopy(first)
    assert deep == first and deep.spec.tasks[0].template is not first.spec.tasks[0].template


def test_a_bad_template_keeps_its_error_location() -> None:
    bad = document()
    bad["spec"]["tasks"][0]["template"]["spec"]["containers"] = []
    with pytest.raises(ValidationError) as caught:
        jobs.validate_submitted(bad)
    [error] = caught.value.errors()
    assert error["loc"] == ("spec", "tasks", 0, "template", "spec", "containers")


def test_a_validated_jobs_shapes_are_read_without_parsing_its_templates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    submitted = jobs.validate_submitted(document())
    # as the store reads it back: validated again, not by a submit's rules
    stored = jobs.GPUJob.model_validate_json(submitted.model_dump_json(by_alias=True))
    fresh = jobs.shape_of(jobs.Task.model_validate(document()["spec"]["tasks"][0]), strict=True)

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the template was parsed")

    monkeypatch.setattr(jobs.PodTemplateSpec, "model_validate_json", no_parse)
    for job in (submitted, stored):
        request = gangs.gang_request("j1", job)
        assert [shape for _, _, shape in request.tasks] == [fresh]
        assert request.pods == 2


def test_jobs_of_one_template_hold_one_shape_where_a_holder_keeps_them() -> None:
    interning = records.Interners()
    first = jobs.validate_submitted(document(), interning=interning)
    second = jobs.validate_submitted(document(), interning=interning)
    assert first.spec.tasks[0].template.shape is second.spec.tasks[0].template.shape
    request = gangs.gang_request("a", first, interning=interning)
    assert gangs.gang_request("b", second, interning=interning).tasks is request.tasks


def test_without_a_holder_every_job_holds_its_own() -> None:
    """No table of the process: a job validated without an `Interning` (the agent's offers,
    the CLI) shares nothing, and two holders share nothing with each other."""
    first, second = jobs.validate_submitted(document()), jobs.validate_submitted(document())
    assert first.spec.tasks[0].template is not second.spec.tasks[0].template
    assert first.spec.tasks[0].template.shape == second.spec.tasks[0].template.shape
    one, other = records.Interners(), records.Interners()
    mine = jobs.validate_submitted(document(), interning=one).spec.tasks[0].template
    theirs = jobs.validate_submitted(document(), interning=other).spec.tasks[0].template
    assert mine is not theirs


def test_jobs_of_one_template_hold_one_template_and_others_their_own() -> None:
    interning = records.Interners()
    first = jobs.validate_submitted(document(), interning=interning)
    second = jobs.validate_submitted(document(), interning=interning)
    assert first.spec.tasks[0].template is second.spec.tasks[0].template
    text = first.model_dump_json(by_alias=True)
    stored = jobs.GPUJob.model_validate_json(text, context={jobs.INTERNING: interning})
    assert stored.spec.tasks[0].template is first.spec.tasks[0].template  # read back: the same
    changed = document()
    changed["spec"]["tasks"][0]["template"]["metadata"]["labels"] = {"team": "b"}
    other = jobs.validate_submitted(changed, interning=interning).spec.tasks[0].template
    template = first.spec.tasks[0].template
    assert other is not template
    assert other.metadata.labels == {"team": "b"} and other.shape == template.shape


def test_a_template_read_leniently_first_is_still_held_to_a_submits_rules() -> None:
    """A stored record is read leniently (a duration past the bound is no error there); the
    same template submitted after is refused: the one object was never checked by those rules,
    and the lenient one is not changed by the refusal."""
    interning = records.Interners()
    lenient_context = {jobs.INTERNING: interning}
    long = document()
    long["spec"]["tasks"][0]["template"]["metadata"]["annotations"] = {
        "gpufed.io/sim-duration": "2000000000"
    }
    lenient = jobs.GPUJob.model_validate(long, context=lenient_context)
    held = lenient.spec.tasks[0].template
    assert held.shape is not None and not held.checked
    with pytest.raises(ValidationError, match="sim-duration"):
        jobs.validate_submitted(long, interning=interning)
    assert lenient.spec.tasks[0].template is held and not held.checked
    # one read leniently first, then submitted: the submit checks it and keeps the checked one
    read = jobs.GPUJob.model_validate(document(), context=lenient_context).spec.tasks[0].template
    assert not read.checked
    submitted = jobs.validate_submitted(document(), interning=interning)
    assert submitted.spec.tasks[0].template.checked and not read.checked  # a new object
    again = jobs.GPUJob.model_validate(document(), context=lenient_context)
    assert again.spec.tasks[0].template is submitted.spec.tasks[0].template


def test_the_stores_dump_of_a_sweep_parses_its_template_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = jobs.validate_submitted(document()), jobs.validate_submitted(document())
    lean = records.encode_job(first)
    assert lean == first.model_dump_json(by_alias=True, exclude_defaults=True)  # the same text

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the template was parsed")

    monkeypatch.setattr(jobs.PodTemplateSpec, "model_validate_json", no_parse)
    assert records.encode_job(second) == lean
    template = jobs.PodTemplateSpec.model_validate(document()["spec"]["tasks"][0]["template"])
    assert json.loads(lean)["spec"]["tasks"][0]["template"] == template.model_dump(
        mode="json", by_alias=True, exclude_defaults=True
    )


def test_held_jobs_share_their_models_field_names_and_stay_apart() -> None:
    """A holder's jobs share one set of field names per model class (pydantic keeps one in
    every instance); every name is in it, so an assignment to one job's model changes no
    other's, and a copy takes a set of its own. The dumps are the same as without."""
    interning = records.Interners()
    first = jobs.validate_submitted(document(), interning=interning)
    second = jobs.validate_submitted(document(), interning=interning)
    alone = jobs.validate_submitted(document())
    for a, b in ((first, second), (first.spec, second.spec), (first.metadata, second.metadata)):
        assert a.__pydantic_fields_set__ is b.__pydantic_fields_set__
    names = set(first.spec.__pydantic_fields_set__)
    second.spec.priority = 5  # an assignment: a name already there
    assert first.spec.__pydantic_fields_set__ == names and first.spec.priority == 0
    copied = first.spec.model_copy(update={"priority": 7})
    assert copied.__pydantic_fields_set__ is not first.spec.__pydantic_fields_set__
    for dump in (
        {"by_alias": True, "exclude_defaults": True},
        {"by_alias": True, "exclude_none": True},
    ):
        assert first.model_dump_json(**dump) == alone.model_dump_json(**dump)  # type: ignore[arg-type]


def test_held_jobs_share_the_names_they_repeat() -> None:
    """Jobs read from texts of their own: a holder's share one string for each name they
    repeat (queue, namespace, priority class, task names), and read and dump the same."""
    text = json.dumps(
        {
            "metadata": {"name": "train", "namespace": "research"},
            "spec": {
                "queue": "vision",
                "priorityClass": "batch",
                "tasks": [
                    {"name": "worker", "template": document()["spec"]["tasks"][0]["template"]}
                ],
            },
        }
    )
    interning = records.Interners()
    first, second = (jobs.validate_submitted(json.loads(text), interning=interning) for _ in "ab")
    alone = jobs.validate_submitted(json.loads(text))

    def names(job: jobs.GPUJob) -> list[str | None]:
        meta, spec = job.metadata, job.spec
        return [meta.name, meta.namespace, spec.queue, spec.priority_class, spec.tasks[0].name]

    assert all(a is b for a, b in zip(names(first), names(second), strict=True))
    assert not any(a is b for a, b in zip(names(first), names(alone), strict=True))
    assert names(first) == names(alone)
    assert first.model_dump_json(by_alias=True) == alone.model_dump_json(by_alias=True)
