"""Trusted images (`broker.api.images`): how references are read, which prefixes match, how a
queue's list narrows its allotment's, and which fields of a job name images."""

from __future__ import annotations

from typing import Any

import pytest

from broker.api import images, jobs


@pytest.mark.parametrize(
    ("image", "normalized"),
    [
        pytest.param("busybox", "docker.io/library/busybox", id="a bare name is Docker Hub's"),
        pytest.param("busybox:1.36", "docker.io/library/busybox:1.36", id="with a tag"),
        pytest.param("team/app:1", "docker.io/team/app:1", id="a Hub namespace"),
        pytest.param("index.docker.io/team/app", "docker.io/team/app", id="index.docker.io"),
        pytest.param("docker.io/busybox", "docker.io/library/busybox", id="docker.io/name"),
        pytest.param("NVCR.io/nvidia/cuda", "nvcr.io/nvidia/cuda", id="host without case"),
        pytest.param("localhost/app", "localhost/app", id="localhost is a host"),
        pytest.param("localhost:5000/app", "localhost:5000/app", id="a host with a port"),
        pytest.param(
            "nvcr.io/nvidia/pytorch:24.01-py3@sha256:" + "a" * 64,
            "nvcr.io/nvidia/pytorch:24.01-py3@sha256:" + "a" * 64,
            id="tag and digest",
        ),
        pytest.param("", None, id="empty"),
        pytest.param("reg.io/team/../evil/app", None, id="dot-dot"),
        pytest.param("reg.io/Team/app", None, id="upper-case path"),
        pytest.param(" busybox", None, id="a space"),
        pytest.param("reg.io/app:", None, id="an empty tag"),
        pytest.param("reg.io//app", None, id="an empty component"),
        pytest.param("[::1]:5000/app", None, id="an IPv6 host is not read"),
    ],
)
def test_references_are_read_as_the_runtime_reads_them(image: str, normalized: str | None) -> None:
    assert images.normalize(image) == normalized


@pytest.mark.parametrize(
    ("prefix", "normalized"),
    [
        pytest.param("registry.example.com", "registry.example.com/", id="a host alone"),
        pytest.param("registry.example.com/", "registry.example.com/", id="a host and slash"),
        pytest.param("Registry.Example.com/team-a/", "registry.example.com/team-a/", id="case"),
        pytest.param("nvcr.io/nvidia/pytorch:", "nvcr.io/nvidia/pytorch:", id="any tag"),
        pytest.param("docker.io/busybox", "docker.io/library/busybox", id="docker.io/name"),
        pytest.param("docker.io/team/", "docker.io/team/", id="a Hub namespace"),
        pytest.param("index.docker.io/library/", "docker.io/library/", id="index.docker.io"),
        pytest.param("localhost:5000/", "localhost:5000/", id="localhost with a port"),
    ],
)
def test_prefixes_are_normalized(prefix: str, normalized: str) -> None:
    assert images.check_prefix(prefix) == normalized


@pytest.mark.parametrize(
    "prefix",
    [
        pytest.param("busybox", id="no host: ambiguous, refused"),
        pytest.param("team-a/", id="a Hub namespace without its host"),
        pytest.param("", id="empty"),
        pytest.param("reg.io/Team/", id="upper-case path"),
        pytest.param("reg.io//", id="an empty component"),
        pytest.param("reg.io/team/../", id="dot-dot"),
        pytest.param("-bad.io/", id="not a host name"),
    ],
)
def test_a_prefix_that_names_no_registry_or_cannot_begin_a_reference_is_refused(
    prefix: str,
) -> None:
    with pytest.raises(ValueError, match=r"prefix|reference"):
        images.check_prefix(prefix)


@pytest.mark.parametrize(
    ("image", "prefix", "allowed"),
    [
        pytest.param("registry.example.com/team-a/app:1", "registry.example.com", True, id="host"),
        pytest.param(
            "registry.example.com.evil.io/team-a/app",
            "registry.example.com",
            False,
            id="a longer host is another host",
        ),
        pytest.param(
            "registry.example.com:5000/team-a/app",
            "registry.example.com",
            False,
            id="another port is another registry",
        ),
        pytest.param(
            "registry.example.com/team-ab/app", "registry.example.com/team-a", False, id="team-ab"
        ),
        pytest.param(
            "registry.example.com/team-a/app", "registry.example.com/team-a", True, id="team-a/"
        ),
        pytest.param("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io/nvidia/pytorch", True, id="tag"),
        pytest.param("nvcr.io/nvidia/pytorch@sha256:" + "a" * 64, "nvcr.io/nvidia/pytorch", True),
        pytest.param("nvcr.io/nvidia/pytorch-x:1", "nvcr.io/nvidia/pytorch", False, id="-x"),
        pytest.param("nvcr.io/nvidia/pytorch:24.01", "nvcr.io/nvidia/pytorch:24.01", True),
        pytest.param(
            "nvcr.io/nvidia/pytorch:24.01-py3",
            "nvcr.io/nvidia/pytorch:24.01",
            False,
            id="a pinned tag is the tag",
        ),
        pytest.param("busybox", "docker.io/library/", True, id="Hub official images"),
        pytest.param("busybox", "docker.io/busybox", True, id="docker.io/busybox"),
        pytest.param("evil/busybox", "docker.io/library/", False, id="a Hub user's image"),
        pytest.param("docker.io.evil.io/library/busybox", "docker.io/", False, id="docker.io."),
        pytest.param("reg.io/Team/app", "reg.io/", False, id="unreadable: refused"),
    ],
)
def test_a_prefix_matches_at_a_boundary_only(image: str, prefix: str, allowed: bool) -> None:
    assert images.allowed(image, [images.check_prefix(prefix)]) is allowed


@pytest.mark.parametrize(
    ("allotment", "queue", "both"),
    [
        pytest.param(None, None, None, id="neither restricts"),
        pytest.param(["reg.io/"], None, ["reg.io/"], id="the allotment alone"),
        pytest.param(None, ["reg.io/a/"], ["reg.io/a/"], id="the queue alone"),
        pytest.param(["reg.io/"], ["reg.io/a/"], ["reg.io/a/"], id="the queue narrows"),
        pytest.param(["reg.io/a/"], ["reg.io/"], ["reg.io/a/"], id="the queue cannot widen"),
        pytest.param(["reg.io/a/"], ["quay.io/"], [], id="nothing in common: no image"),
        pytest.param(
            ["nvcr.io/", "docker.io/library/"],
            ["nvcr.io/nvidia/", "docker.io/library/busybox", "quay.io/"],
            ["docker.io/library/busybox", "nvcr.io/nvidia/"],
            id="pairwise",
        ),
        pytest.param(["reg.io/a"], ["reg.io/a/"], ["reg.io/a/"], id="a/ is within a"),
        pytest.param(["reg.io/"], [], [], id="an empty queue list: no image"),
    ],
)
def test_a_queue_narrows_its_allotment(
    allotment: list[str] | None, queue: list[str] | None, both: list[str] | None
) -> None:
    assert images.narrow(allotment, queue) == both
    assert images.narrow(queue, allotment) == both


def test_within_names_the_prefixes_that_widen() -> None:
    wide = ["reg.io/team-a/", "nvcr.io/nvidia/pytorch"]
    narrow = ["reg.io/team-a/x/", "reg.io/team-ab/", "nvcr.io/nvidia/pytorch:", "nvcr.io/"]
    assert images.within(narrow, wide) == ["reg.io/team-ab/", "nvcr.io/"]


def job_of(pod: dict[str, Any]) -> jobs.GPUJob:
    gpu = {"limits": {jobs.GPU_RESOURCE: 1}}
    main = {"name": "main", "image": "reg.io/team-a/app:1", "resources": gpu}
    return jobs.GPUJob.model_validate(
        {
            "metadata": {"name": "j"},
            "spec": {
                "queue": "q",
                "tasks": [
                    {"name": "a", "template": {"spec": {"containers": [main]}}},
                    {"name": "b", "template": {"spec": {"containers": [main], **pod}}},
                ],
            },
        }
    )


@pytest.mark.parametrize(
    ("pod", "fields"),
    [
        pytest.param(
            {"containers": [{"name": "a", "image": "reg.io/team-a/x"}]}, [], id="all allowed"
        ),
        pytest.param(
            {"containers": [{"name": "a", "image": "reg.io/team-a/x"}, {"name": "b"}]},
            ["spec.tasks[1].template.spec.containers[1].image"],
            id="a container without an image",
        ),
        pytest.param(
            {
                "containers": [
                    {"name": "a", "image": "reg.io/team-a/x"},
                    {"name": "b", "image": "evil.io/x"},
                ]
            },
            ["spec.tasks[1].template.spec.containers[1].image"],
            id="the second container",
        ),
        pytest.param(
            {"initContainers": [{"name": "i", "image": "busybox"}]},
            ["spec.tasks[1].template.spec.initContainers[0].image"],
            id="an init container",
        ),
        pytest.param(
            {"ephemeralContainers": [{"name": "e", "image": "evil.io/debug"}]},
            ["spec.tasks[1].template.spec.ephemeralContainers[0].image"],
            id="an ephemeral container",
        ),
        pytest.param(
            {"volumes": [{"name": "v", "image": {"reference": "evil.io/data:1"}}]},
            ["spec.tasks[1].template.spec.volumes[0].image.reference"],
            id="an image volume",
        ),
        pytest.param(
            {"initContainers": ["reg.io/team-a/x"]},
            ["spec.tasks[1].template.spec.initContainers[0].image"],
            id="an init container that is no object",
        ),
        pytest.param(
            {"initContainers": {"name": "i", "image": "evil.io/x"}},
            ["spec.tasks[1].template.spec.initContainers"],
            id="init containers that are no list",
        ),
    ],
)
def test_every_image_field_of_a_job_is_checked(pod: dict[str, Any], fields: list[str]) -> None:
    found = images.refusals(job_of(pod), ["reg.io/team-a/"])
    assert [r.field for r in found] == fields


def test_no_list_restricts_nothing_and_an_empty_list_everything() -> None:
    job = job_of({})
    assert images.refusals(job, None) == []
    found = images.refusals(job, [])
    assert [r.field for r in found] == [
        "spec.tasks[0].template.spec.containers[0].image",
        "spec.tasks[1].template.spec.containers[0].image",
    ]
    assert "allowed: none" in found[0].message
