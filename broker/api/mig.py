"""MIG (NVIDIA Multi-Instance GPU) slices as a job asks for them. Pure.

A pod asks for MIG slices of one profile in either of two ways:

- `nvidia.com/mig-<profile>: N` in a container's limits (as NVIDIA's device plugin names them
  with its `mixed` strategy), N slices; several containers add up;
- the pod template annotation `gpufed.io/mig-profile: <profile>` with `nvidia.com/gpu: N`:
  the pod's GPUs are N slices of that profile (what a user who thinks "one GPU, a small one"
  writes). With a `nvidia.com/mig-<profile>` resource too, the annotation must name its profile.

A pod of MIG slices asks for no whole GPU and no share of one (`gpufed.io/gpu-milli`), and for
one profile only. A profile is NVIDIA's name, `<compute>g.<memory>gb` with an optional suffix
(`1g.10gb`, `3g.40gb`, `1g.10gb+me`, `1g.10gb.me`); `profile_problem` says what is wrong with one.
`jobs.shape_of` applies these rules; the shape carries `mig_profile` and `mig_slices`.

What a pod of MIG slices counts toward its queue's quota (`quota_gpus`): whole GPUs, the
fewest its slices fill: NVIDIA's GPUs with MIG (A100, H100, H200, B200) have 7 compute
slices, so a GPU holds `7 // c` instances of a `<c>g.<m>gb` profile (seven 1g, three 2g, two
3g, one 4g or 7g), and `n` slices fill `ceil(n / (7 // c))` GPUs; one slice is one GPU. Not
`c/7` of a GPU: quotas, fair share, `GET /v1/queues` and the parking thresholds count whole
GPUs (integers, as the queues file declares them), and a GPU partitioned for MIG is not there
for whole-GPU work while one instance on it runs. Rounding up per pod means a tenant never
holds more GPUs than its quota allows, at the price of charging a small pod a whole GPU, as a
sharing pod (`gpufed.io/gpu-milli`) is charged one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

MIG_PROFILE_ANNOTATION = "gpufed.io/mig-profile"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MAX_SLICES_PER_POD = 64  # 8 GPUs of 7 slices each, with room
# <compute slices>g.<memory>gb, an optional compute-instance prefix (`1c.`), optional suffixes
# (`+me`, `.me`: media extensions; `+gfx`)
_DIGITS = re.compile(r"^[0-9]{1,10}$")
_PROFILE = re.compile(r"^([1-9]c\.)?[1-9][0-9]?g\.[0-9]{1,4}gb([.+][a-z]{1,8}){0,2}$")
_COMPUTE = re.compile(r"^(?:[1-9]c\.)?([1-9][0-9]?)g\.")
COMPUTE_SLICES_PER_GPU = 7  # A100, H100, H200, B200


def _check_profile(profile: str, field: str) -> None:
    """Problem naming `field` unless `profile` is a MIG profile gpufed knows."""
    problem = profile_problem(profile)
    if problem is not None:
        raise Problem(f"{field}: {problem}")


def profile_problem(profile: str) -> str | None:
    """Why `profile` is not a MIG profile name (None when it is one)."""
    if _PROFILE.match(profile):
        return None
    return f"{profile!r} is not a MIG profile (such as 1g.10gb, 3g.40gb or 1g.10gb+me)"


def quota_gpus(profile: str, slices: int) -> int:
    """The whole GPUs `slices` MIG devices of `profile` count toward a quota: the fewest GPUs
    they fill (`7 // c` instances of a `<c>g` profile on one GPU), at least one; 0 slices, 0.
    A profile whose compute slices cannot be read counts one GPU per slice."""
    if slices <= 0:
        return 0
    found = _COMPUTE.match(profile)
    compute = int(found.group(1)) if found else COMPUTE_SLICES_PER_GPU
    per_gpu = COMPUTE_SLICES_PER_GPU // compute
    if per_gpu == 0:  # an instance larger than a GPU of 7 slices: whole GPUs each
        return slices * -(-compute // COMPUTE_SLICES_PER_GPU)
    return -(-slices // per_gpu)


def resource_of(profile: str) -> str:
    """The device plugin's resource for a profile: `nvidia.com/mig-1g.10gb`."""
    return MIG_RESOURCE_PREFIX + profile


def profile_of(resource: str) -> str | None:
    """The profile a `nvidia.com/mig-<profile>` resource names (None for another resource)."""
    if resource.startswith(MIG_RESOURCE_PREFIX):
        return resource[len(MIG_RESOURCE_PREFIX) :]
    return None


class Problem(ValueError):
    """A pod's MIG request breaks a rule; the message starts with the field."""


Limits = Mapping[str, int | float | str]


def read_request(
    containers: Sequence[tuple[str, Limits, Limits]],
    annotations: Mapping[str, str],
    *,
    gpus: int,
    where: str,
    strict: bool,
) -> tuple[str, int]:
    """The MIG profile and slices one pod asks for (`("", 0)`: none), from its containers'
    (field, limits, requests) and its template's annotations; `gpus` is its `nvidia.com/gpu`
    count. Raises Problem naming the field. Not `strict` (a stored record, an offer): a request
    that breaks a rule is read as no MIG at all, as brokers before MIG read it."""
    try:
        return _read(containers, annotations, gpus=gpus, where=where)
    except Problem:
        if strict:
            raise
        return "", 0


def _read(
    containers: Sequence[tuple[str, Limits, Limits]],
    annotations: Mapping[str, str],
    *,
    gpus: int,
    where: str,
) -> tuple[str, int]:
    asked: dict[str, int] = {}
    first = ""
    for cwhere, limits, requests in containers:
        for part, quantities in (("limits", limits), ("requests", requests)):
            for name, qty in quantities.items():
                profile = profile_of(name)
                if profile is None or (part == "requests" and name in limits):
                    continue
                field = f"{cwhere}.{part}[{name}]"
                _check_profile(profile, field)
                if asked and profile not in asked:
                    raise Problem(f"{field}: a pod asks for MIG slices of one profile only")
                if gpus:
                    raise Problem(
                        f"{field}: a pod asks for MIG slices or whole GPUs (nvidia.com/gpu), "
                        "not both"
                    )
                asked[profile] = asked.get(profile, 0) + _count(qty, field)
                first = first or field
    awhere = f"{where}.template.metadata.annotations"
    named = annotations.get(MIG_PROFILE_ANNOTATION)
    if named is None and not asked:
        return "", 0
    if named is not None:
        field = f"{awhere}[{MIG_PROFILE_ANNOTATION}]"
        _check_profile(named, field)
        if asked and named not in asked:
            raise Problem(f"{field}: names {named}, the limits ask for {next(iter(asked))}")
        if not asked and not gpus:
            raise Problem(
                f"{field}: a pod of MIG slices asks for them in its limits "
                f"(nvidia.com/gpu: N, or {resource_of(named)}: N)"
            )
    if "gpufed.io/gpu-milli" in annotations:
        raise Problem(
            f"{awhere}[gpufed.io/gpu-milli]: a pod of MIG slices takes whole slices, "
            "not a share of a GPU"
        )
    profile, slices = next(iter(asked.items())) if asked else (str(named), gpus)
    if slices > MAX_SLICES_PER_POD:
        raise Problem(
            f"{first or where}: at most {MAX_SLICES_PER_POD} MIG slices fit one pod, got {slices}"
        )
    return profile, slices


def _count(value: int | float | str, field: str) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise Problem(f"{field}: must be a whole number of MIG slices, got {value!r}")
    text = str(int(value)) if isinstance(value, float) else str(value).strip()
    if not _DIGITS.match(text) or int(text) < 1:
        raise Problem(f"{field}: must be a whole number of MIG slices, at least 1, got {value!r}")
    return int(text)
