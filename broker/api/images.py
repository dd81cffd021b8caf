"""Trusted images: which container images a job may run, by registry and repository prefix.

Pure: the broker calls it at submit (`broker.state.registry.QueueRegistry.check_job`, a 422
naming the image's field) and when a tenant-admin PUTs a queue; the agent calls it again
before it creates a job's pods, with the list the offer carries (`messages.Offer
.allowed_images`), so a job submitted before the list was narrowed is refused where it would
run. No await, no clock, no I/O.

Lists. The fleet admin's allotment of a tenant (`allotments[].allowedImages` in the queues
file) is the authoritative list; a queue's (`queues[].allowedImages`, which a tenant-admin may
PUT) narrows it and never widens it: an image must match both (`narrow`). Unset (null) is no
restriction from that list; an empty list lets no image run.

Image references are read as the container runtimes read them (the grammar of
`distribution/reference`), then normalized:

- a reference whose first component names no registry host (no `.` or `:` in it and not
  `localhost`) is on Docker Hub: `busybox` is `docker.io/library/busybox`, `team/app:1` is
  `docker.io/team/app:1`; `index.docker.io` is `docker.io`;
- the host is compared without case; repository paths, tags and digests are compared exactly;
- a reference that does not parse (upper-case path, `..`, spaces, an empty image, a missing
  image) is refused whenever a list applies: what cannot be read cannot be trusted.

Prefixes must name their registry host (`nvcr.io/nvidia/`, `docker.io/library/`,
`registry.example.com:5000/`); `docker.io/busybox` means `docker.io/library/busybox`. A prefix
matches an image whose normalized reference equals it, or starts with it and goes on at a
boundary: after `/`, `:` or `@` (the prefix ends with one, or the image's next character is
one). A host alone is the host and `/`. So `registry.example.com` matches
`registry.example.com/team/app` but neither `registry.example.com.evil.io/app` nor
`registry.example.com:5000/app` (another port is another registry); `nvcr.io/nvidia/pytorch` matches
`nvcr.io/nvidia/pytorch:24.01-py3` and `...@sha256:...` but not `nvcr.io/nvidia/pytorch-x`;
`nvcr.io/nvidia/pytorch:24.01` pins a tag.

Where a pod names images: `containers[].image`, `initContainers[].image`,
`ephemeralContainers[].image` and image volumes (`volumes[].image.reference`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.api import jobs

DOCKER_HUB = "docker.io"
MAX_PREFIXES = 256  # entries of one list
MAX_PREFIX_LENGTH = 512
_BOUNDARIES = "/:@"

# distribution/reference's grammar (reference/regexp.go), without IPv6 hosts
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_DOMAIN_RE = re.compile(rf"^{_DOMAIN}$")
_REST_RE = re.compile(rf"^(?P<path>{_PATH})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$")
_MAX_REFERENCE = 4096


@dataclass(frozen=True)
class Refusal:
    """One image a job may not run: the field that names it and why."""

    field: str
    message: str


def _looks_like_host(first: str) -> bool:
    """docker's `splitDockerDomain`: is the reference's first component a registry host?"""
    return "." in first or ":" in first or first == "localhost" or first != first.lower()


def _host(domain: str) -> str:
    host = domain.lower()
    return DOCKER_HUB if host == "index.docker.io" else host


def normalize(image: str) -> str | None:
    """`image` as the runtime reads it (`busybox` → `docker.io/library/busybox`); None if it
    does not parse as an image reference."""
    if not image or len(image) > _MAX_REFERENCE:
        return None
    first, slash, rest = image.partition("/")
    if slash and _looks_like_host(first):
        domain = first
    else:
        domain, rest = DOCKER_HUB, image
    if not _DOMAIN_RE.match(domain):
        return None
    parsed = _REST_RE.match(rest)
    if parsed is None:
        return None
    host = _host(domain)
    if host == DOCKER_HUB and "/" not in parsed["path"]:
        rest = f"library/{rest}"
    return f"{host}/{rest}"


def check_prefix(prefix: str) -> str:
    """The normalized form of an allowed-images prefix; ValueError (in words) if it names no
    registry host or is no reference's beginning."""
    if not prefix or len(prefix) > MAX_PREFIX_LENGTH:
        raise ValueError(f"a prefix is 1 to {MAX_PREFIX_LENGTH} characters ({len(prefix)})")
    domain, _, rest = prefix.partition("/")
    if not _DOMAIN_RE.match(domain) or not _looks_like_host(domain):
        raise ValueError(
            f"{prefix!r} names no registry host: a prefix starts with one (a name with a dot "
            "or a port, or localhost), e.g. docker.io/library/ or registry.example.com/team-a/"
        )
    host = _host(domain)
    if not rest:  # a host alone: what `host/` lets through (`host:port` is another host)
        return f"{host}/"
    body, end = (rest[:-1], rest[-1]) if rest[-1] in _BOUNDARIES else (rest, "")
    parsed = _REST_RE.match(body)
    if parsed is None:
        raise ValueError(
            f"{prefix!r} is no image reference's beginning: after the host, a repository "
            "path (lower case), optionally a tag or digest, ending at a component (e.g. "
            "nvcr.io/nvidia/ or nvcr.io/nvidia/pytorch:24.01)"
        )
    if host == DOCKER_HUB and "/" not in parsed["path"] and end != "/":
        body = f"library/{body}"
    return f"{host}/{body}{end}"


def matches(reference: str, prefix: str) -> bool:
    """Does a normalized `reference` (or prefix) start with the normalized `prefix` at a
    boundary?"""
    if reference == prefix:
        return True
    if not reference.startswith(prefix):
        return False
    return prefix[-1] in _BOUNDARIES or reference[len(prefix)] in _BOUNDARIES


def allowed(image: str, prefixes: Sequence[str]) -> bool:
    """May `image` run under the normalized `prefixes`?"""
    reference = normalize(image)
    return reference is not None and any(matches(reference, p) for p in prefixes)


def within(narrow: Sequence[str], wide: Sequence[str]) -> list[str]:
    """The prefixes of `narrow` that let through an image no prefix of `wide` does (both
    normalized): [] when `narrow` widens nothing."""
    return [p for p in narrow if not any(matches(p, w) for w in wide)]


def narrow(first: Sequence[str] | None, second: Sequence[str] | None) -> list[str] | None:
    """The images both lists let through, as one list (None: neither restricts). For each
    pair of prefixes where one lies within the other, the narrower one."""
    if first is None:
        return None if second is None else sorted(set(second))
    if second is None:
        return sorted(set(first))
    out = set()
    for a in first:
        for b in second:
            if matches(a, b):
                out.add(a)
            elif matches(b, a):
                out.add(b)
    return sorted(out)


def images_of(pod: dict[str, Any], where: str) -> Iterator[tuple[str, object]]:
    """Every (field, image) a pod spec (its JSON) names; an image missing or not a string
    comes out as it is (refused by `refusals`)."""
    for key in ("containers", "initContainers", "ephemeralContainers"):
        items = pod.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            yield f"{where}.{key}", items
            continue
        for index, item in enumerate(items):
            value = item.get("image") if isinstance(item, dict) else None
            yield f"{where}.{key}[{index}].image", value
    volumes = pod.get("volumes")
    if isinstance(volumes, list):
        for index, volume in enumerate(volumes):
            if isinstance(volume, dict) and "image" in volume:
                source = volume["image"]
                value = source.get("reference") if isinstance(source, dict) else source
                yield f"{where}.volumes[{index}].image.reference", value
    elif volumes is not None:
        yield f"{where}.volumes", volumes


def refusals(job: jobs.GPUJob, prefixes: Sequence[str] | None) -> list[Refusal]:
    """The images of `job` that `prefixes` (normalized; None: no restriction) do not let run,
    in the order of the job's spec."""
    if prefixes is None:
        return []
    out = []
    shown = ", ".join(prefixes) if prefixes else "none"
    for t, task in enumerate(job.spec.tasks):
        pod = json.loads(task.template.json)["spec"]  # the JSON held: no parse, no dump
        for field, image in images_of(pod, f"spec.tasks[{t}].template.spec"):
            if not isinstance(image, str) or not image:
                out.append(Refusal(field, f"no image named; images allowed: {shown}"))
                continue
            reference = normalize(image)
            if reference is None:
                out.append(Refusal(field, f"{image!r} is not an image reference"))
            elif not any(matches(reference, p) for p in prefixes):
                out.append(Refusal(field, f"image {reference} is not allowed (allowed: {shown})"))
    return out
