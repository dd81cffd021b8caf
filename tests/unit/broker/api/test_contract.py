"""The wire contract: shipped examples validate, shapes are read the way users write them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from broker.api import gangs, jobs, messages
from tests.builders import make_job

REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize(
    "path", sorted((REPO / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_shipped_examples_are_valid_jobs(path: Path) -> None:
    job = jobs.validate_submitted(yaml.safe_load(path.read_text()))
    assert gangs.gang_request("x", job).gpus > 0


@pytest.mark.parametrize(
    ("limits", "annotations", "expected"),
    [
        pytest.param(
            {"nvidia.com/gpu": 8, "cpu": "96", "memory": "1000Gi"},
            {},
            (8, 1000, 96000, 1024000),
            id="whole GPUs, cpu cores, Gi",
        ),
        pytest.param(
            {"nvidia.com/gpu": "2", "cpu": "500m", "memory": "512Mi"},
            {},
            (2, 1000, 500, 512),
            id="string GPU count, millicores, Mi",
        ),
        pytest.param(
            {"nvidia.com/gpu": 1},
            {"gpufed.io/gpu-milli": "250"},
            (1, 250, 0, 0),
            id="a quarter of one GPU",
        ),
    ],
)
def test_pod_shape(
    limits: dict[str, object], annotations: dict[str, str], expected: tuple[int, int, int, int]
) -> None:
    doc = make_job(gpus=1).document()
    task = doc["spec"]["tasks"][0]
    task["template"]["spec"]["containers"][0]["resources"]["limits"] = limits
    task["template"]["metadata"]["annotations"] = annotations
    shape = jobs.shape_of(jobs.GPUJob.model_validate(doc).spec.tasks[0])
    assert (shape.gpus, shape.gpu_milli, shape.cpu_milli, shape.memory_mib) == expected


def test_models_from_selector_and_affinity() -> None:
    one = make_job(gpus=1).model("NVIDIA-L4").request()
    many = make_job(gpus=1).model("NVIDIA-L4", "Tesla-T4").request()
    assert one.tasks[0][2].models == ("NVIDIA-L4",)
    assert many.tasks[0][2].models == ("NVIDIA-L4", "Tesla-T4")


def test_sharing_needs_exactly_one_gpu() -> None:
    with pytest.raises(ValueError, match="exactly 1 GPU"):
        make_job(gpus=2).shared(500).build()


def test_messages_round_trip_with_trace_context() -> None:
    offer = messages.Offer(
        job_id="j",
        epoch=3,
        tenant="t",
        job=make_job(gpus=8).build(),
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    )
    decoded = messages.decode(messages.encode(offer))
    assert isinstance(decoded, messages.Offer)
    assert decoded.traceparent == offer.traceparent and decoded.job == offer.job
    assert decoded.v == messages.PROTOCOL_VERSION
