"""ResourceClaims as gpufed writes and reads them in DRA mode. Pure: JSON dicts in and out;
`claiming` sends them.

Every pod gpufed creates holds its GPUs through one claim allocated to exactly the devices
placement chose, written as the scheduler would write it (`allocation`, `reservation`):

- a whole-GPU pod gets a claim of its own, `<pod>-gpus`: one request per container that asks
  for GPUs (named after the container, `count` its GPUs, in the container's order of the
  chosen indices), each pinned by a CEL selector to the UUIDs of its devices when the driver
  publishes them, so that the claim's spec says what its allocation does;
- sharing pods (gpu-milli below 1000) on one GPU share one claim in their namespace,
  `gpufed-<node>-gpu<index>-<sharing>`: one request `gpu` of one device, with the driver's
  sharing configuration (`GpuConfig`, `sharing.strategy` `TimeSlicing` or `MPS`) chosen by the
  job's `gpufed.io/gpu-sharing` annotation (`timeslice`, the default, or `mps`);
- a MIG pod gets a claim of its own, `<pod>-gpus`, as a whole-GPU pod does, its requests
  asking the driver's MIG DeviceClass (`DeviceKeys.mig_device_class`) for exactly the MIG
  devices placement chose (by UUID), per container as its `nvidia.com/mig-<profile>` (or
  `nvidia.com/gpu` under `gpufed.io/mig-profile`) says.

The pod names it in `spec.resourceClaims` (`gpufed-gpus`) and each GPU container in its
`resources.claims` (its request; init containers the whole claim), and asks no `nvidia.com/gpu`
any more. The claim's status: `allocation.devices.results` (request, driver, pool, device),
the claim's configuration copied as `FromClaim`, a node selector on the pod's node, and the pod
in `reservedFor`; its metadata: the pod as owner (controller of its own claim; one owner
among several of a shared claim) and the finalizer the scheduler adds,
`resource.kubernetes.io/delete-protection`. Claims are labelled `gpufed.io/claim` (`pod` or
`shared`); the watch holds the devices of every other allocated claim (`allocated`).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker.api import jobs, mig
from member_agent.cluster import base
from member_agent.cluster.kubernetes import devices, objects
from member_agent.cluster.kubernetes import mig as migs

GROUP = "resource.k8s.io"
VERSIONS = ("v1", "v1beta2")  # in the order preferred
CLAIM_LABEL = "gpufed.io/claim"
POD_CLAIM = "gpufed-gpus"  # the pod's name for its claim (spec.resourceClaims[].name)
SHARED_REQUEST = "gpu"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"
SHARING = {"timeslice": "TimeSlicing", "mps": "MPS"}
DEFAULT_SHARING = "timeslice"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_NAME = 253


class ClaimProblem(ValueError):
    """A pod whose GPUs no claim can hold as placement chose them."""


@dataclass(frozen=True)
class ClaimPlan:
    """The claim of one pod: its name, node and, per request, the devices it is allocated."""

    namespace: str
    name: str
    pod: str
    job_id: str
    node: str
    sharing: str  # "" for a pod's own claim; timeslice or mps for a shared one
    requests: tuple[tuple[str, tuple[devices.Device, ...]], ...]

    @property
    def shared(self) -> bool:
        return bool(self.sharing)

    @property
    def devices(self) -> list[devices.Device]:
        return [device for _, found in self.requests for device in found]

    @property
    def mig(self) -> dict[str, tuple[int, ...]]:
        """The MIG devices of the claim by profile (their indices), if it holds MIG devices."""
        out: dict[str, tuple[int, ...]] = {}
        for device in self.devices:
            if device.profile:
                out[device.profile] = (*out.get(device.profile, ()), device.index)
        return out


def choose_version(group: Mapping[str, Any]) -> str:
    """The version of resource.k8s.io to use, from the server's APIGroup."""
    offered = [str(v.get("version")) for v in group.get("versions") or []]
    for version in VERSIONS:
        if version in offered:
            return version
    raise ClaimProblem(
        f"the API server offers {GROUP} {', '.join(offered) or 'in no version'}: DRA mode "
        f"needs v1 (Kubernetes 1.34+) or v1beta2 (1.33)"
    )


def sharing_of(request: base.PodRequest) -> str:
    """The sharing a pod asks for (`gpufed.io/gpu-sharing`), checked."""
    raw = request.annotations.get(objects.SHARING_ANNOTATION, DEFAULT_SHARING).strip().lower()
    if raw not in SHARING:
        raise ClaimProblem(
            f"{objects.SHARING_ANNOTATION}: {raw!r} is not one of {', '.join(sorted(SHARING))}"
        )
    return raw


def shared_name(node: str, index: int, sharing: str) -> str:
    """The name of the claim through which sharing pods hold one GPU."""
    name = f"gpufed-{node}-gpu{index}-{sharing}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"gpufed-{node[:200].rstrip('.-')}-{digest}-gpu{index}-{sharing}"


def _gpu_count(container: Mapping[str, Any]) -> int:
    """The devices a container asks: GPUs, or MIG devices (`nvidia.com/mig-<profile>`)."""
    res = container.get("resources") or {}
    for part in ("limits", "requests"):
        quantities = res.get(part) or {}
        value = quantities.get(jobs.GPU_RESOURCE)
        if value is not None:
            return objects.parse_count(value)
        found = [q for name, q in quantities.items() if mig.profile_of(str(name))]
        if found:
            return sum(objects.parse_count(q) for q in found)
    return 0


def pod_claim_name(pod: str) -> str:
    """The name of a whole-GPU pod's own claim."""
    return f"{pod}-gpus"


def is_pod_claim(pod: str, claim: str) -> bool:
    return claim == pod_claim_name(pod)


def plan_claim(
    request: base.PodRequest,
    found: Mapping[int, devices.Device],
    mig_found: Mapping[str, Sequence[devices.Device]] | None = None,
) -> ClaimPlan:
    """The claim holding the GPUs (or MIG devices) placement chose for a pod, from the
    devices of its node."""
    chosen = []
    for slot in request.gpus:
        device = found.get(slot.index)
        if device is None:
            raise ClaimProblem(f"GPU {slot.index} of {request.node} is published by no slice")
        chosen.append(device)
    for profile, indices in request.mig.items():
        published = (mig_found or {}).get(profile, ())
        for index in indices:
            if not 0 <= index < len(published):
                raise ClaimProblem(
                    f"MIG device {index} of profile {profile} of {request.node} is published "
                    "by no slice"
                )
            chosen.append(published[index])
    if objects.is_sharing(request):
        sharing = sharing_of(request)
        return ClaimPlan(
            namespace=request.namespace,
            name=shared_name(request.node, request.gpus[0].index, sharing),
            pod=request.name,
            job_id=request.job_id,
            node=request.node,
            sharing=sharing,
            requests=((SHARED_REQUEST, (chosen[0],)),),
        )
    containers = (request.template.get("spec") or {}).get("containers") or []
    counts = [(str(c.get("name", "")), _gpu_count(c)) for c in containers]
    counts = [(name, count) for name, count in counts if count > 0]
    requests: list[tuple[str, tuple[devices.Device, ...]]] = []
    if sum(count for _, count in counts) == len(chosen) and all(name for name, _ in counts):
        at = 0
        for name, count in counts:
            requests.append((name, tuple(chosen[at : at + count])))
            at += count
    else:
        requests.append(("gpus", tuple(chosen)))
    return ClaimPlan(
        namespace=request.namespace,
        name=pod_claim_name(request.name),
        pod=request.name,
        job_id=request.job_id,
        node=request.node,
        sharing="",
        requests=tuple(requests),
    )


def claim_pod(body: dict[str, Any], plan: ClaimPlan) -> dict[str, Any]:
    """The pod holding its GPUs through the plan's claim instead of `nvidia.com/gpu`."""
    pod = copy.deepcopy(body)
    spec = pod.setdefault("spec", {})
    names = iter(name for name, _ in plan.requests)
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            if _gpu_count(container) <= 0:
                continue
            res = container.setdefault("resources", {})
            for part in ("limits", "requests"):
                quantities = res.get(part)
                if quantities:
                    quantities.pop(jobs.GPU_RESOURCE, None)
                    for name in [n for n in quantities if mig.profile_of(str(n))]:
                        del quantities[name]
                if part in res and not res[part]:
                    del res[part]
            claim: dict[str, str] = {"name": POD_CLAIM}
            if kind == "containers" and len(plan.requests) > 1:
                claim["request"] = next(names)
            res["claims"] = [*(res.get("claims") or []), claim]
    claims = [c for c in spec.get("resourceClaims") or [] if c.get("name") != POD_CLAIM]
    spec["resourceClaims"] = [*claims, {"name": POD_CLAIM, "resourceClaimName": plan.name}]
    pod["metadata"].setdefault("annotations", {})[objects.CLAIM_ANNOTATION] = plan.name
    return pod


def _selector(found: Sequence[devices.Device], keys: devices.DeviceKeys) -> list[dict[str, Any]]:
    """A CEL selector naming exactly these devices by UUID (none when a UUID is unknown)."""
    attribute = keys.uuid.rpartition("/")[2]
    if not found or not all(d.uuid for d in found) or not _IDENTIFIER.match(attribute):
        return []
    uuids = ", ".join(f'"{d.uuid}"' for d in found)
    expression = f'device.attributes["{keys.driver}"].{attribute} in [{uuids}]'
    return [{"cel": {"expression": expression}}]


def _config(plan: ClaimPlan, keys: devices.DeviceKeys) -> list[dict[str, Any]]:
    if not plan.shared:
        return []
    parameters = {
        "apiVersion": keys.config_api,
        "kind": "GpuConfig",
        "sharing": {"strategy": SHARING[plan.sharing]},
    }
    opaque = {"driver": keys.driver, "parameters": parameters}
    return [{"requests": [SHARED_REQUEST], "opaque": opaque}]


def build_claim(plan: ClaimPlan, *, version: str, keys: devices.DeviceKeys) -> dict[str, Any]:
    """The ResourceClaim to create (its status is written once the pod exists)."""
    requests = [
        {
            "name": name,
            "exactly": {
                "deviceClassName": keys.mig_device_class
                if found and found[0].profile
                else keys.device_class,
                "allocationMode": "ExactCount",
                "count": len(found),
                **({"selectors": sel} if (sel := _selector(found, keys)) else {}),
            },
        }
        for name, found in plan.requests
    ]
    labels = {CLAIM_LABEL: "shared" if plan.shared else "pod"}
    if not plan.shared:
        labels[objects.JOB_LABEL] = objects.label_value(plan.job_id)
    annotations = {
        objects.GPUS_ANNOTATION: ",".join(str(d.index) for d in plan.devices if not d.profile)
    }
    if plan.mig:
        annotations[migs.MIG_ANNOTATION] = migs.format_slots(plan.mig)
    if plan.shared:
        annotations[objects.SHARING_ANNOTATION] = plan.sharing
    config = _config(plan, keys)
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "ResourceClaim",
        "metadata": {
            "name": plan.name,
            "namespace": plan.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {"devices": {"requests": requests, **({"config": config} if config else {})}},
    }


def allocation(plan: ClaimPlan, keys: devices.DeviceKeys) -> dict[str, Any]:
    """`status.allocation`: the chosen devices, the claim's configuration, the pod's node."""
    results = [
        {"request": name, "driver": d.driver, "pool": d.pool, "device": d.name}
        for name, found in plan.requests
        for d in found
    ]
    config = [{"source": "FromClaim", **entry} for entry in _config(plan, keys)]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [plan.node]}]}
    return {
        "devices": {"results": results, **({"config": config} if config else {})},
        "nodeSelector": {"nodeSelectorTerms": [term]},
    }


def ownership(claim: Mapping[str, Any], plan: ClaimPlan, *, uid: str) -> dict[str, Any]:
    """The metadata patch: the pod among the claim's owners, the scheduler's finalizer.

    No `blockOwnerDeletion`: setting it needs `update` on `pods/finalizers` where the
    OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift), and the claim is
    garbage-collected with its pod without it (it only holds a foreground deletion of the pod
    until the claim is gone, which nothing here asks for)."""
    meta = claim.get("metadata") or {}
    owner: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "name": plan.pod, "uid": uid}
    if not plan.shared:
        owner["controller"] = True
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("uid") != uid]
    finalizers = list(meta.get("finalizers") or [])
    if DELETE_PROTECTION not in finalizers:
        finalizers.append(DELETE_PROTECTION)
    return {
        "metadata": {
            "resourceVersion": meta.get("resourceVersion"),
            "ownerReferences": [*owners, owner],
            "finalizers": finalizers,
        }
    }


def reservation(
    claim: Mapping[str, Any], plan: ClaimPlan, *, uid: str, keys: devices.DeviceKeys
) -> dict[str, Any]:
    """The status patch: allocated (unless it already is: an allocation is never changed)
    and reserved for the pod too."""
    current = claim.get("status") or {}
    reserved = [r for r in current.get("reservedFor") or [] if r.get("uid") != uid]
    reserved.append({"resource": "pods", "name": plan.pod, "uid": uid})
    status: dict[str, Any] = {"reservedFor": reserved}
    if not current.get("allocation"):
        status["allocation"] = allocation(plan, keys)
    meta = claim.get("metadata") or {}
    return {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": status}


def is_ours(claim: Mapping[str, Any]) -> bool:
    return CLAIM_LABEL in ((claim.get("metadata") or {}).get("labels") or {})


_IDENTITY_LABELS = (CLAIM_LABEL, objects.JOB_LABEL)
_IDENTITY_ANNOTATIONS = (
    objects.GPUS_ANNOTATION,
    migs.MIG_ANNOTATION,
    objects.SHARING_ANNOTATION,
)


def identity_problem(existing: Mapping[str, Any], sent: Mapping[str, Any]) -> str:
    """Why the claim found under a name is not the one `sent` ("" when it is: gpufed's, a
    pod's own or shared as sent, of the same job, for the same devices)."""
    old_meta, new_meta = existing.get("metadata") or {}, sent.get("metadata") or {}
    old_labels, new_labels = old_meta.get("labels") or {}, new_meta.get("labels") or {}
    if CLAIM_LABEL not in old_labels:
        return "it is not gpufed's"
    for key in _IDENTITY_LABELS:
        if old_labels.get(key) != new_labels.get(key):
            return f"its {key} is {old_labels.get(key)!r}, not {new_labels.get(key)!r}"
    old_notes, new_notes = old_meta.get("annotations") or {}, new_meta.get("annotations") or {}
    for key in _IDENTITY_ANNOTATIONS:
        if old_notes.get(key) != new_notes.get(key):
            return f"its {key} is {old_notes.get(key)!r}, not {new_notes.get(key)!r}"
    return ""


def is_held(claim: Mapping[str, Any]) -> bool:
    """Whether a pod owns the claim or has it reserved."""
    meta = claim.get("metadata") or {}
    return bool(meta.get("ownerReferences") or (claim.get("status") or {}).get("reservedFor"))


def allocated(claim: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The devices an allocated claim holds: (driver, pool, device)."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    return [
        (str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")))
        for r in results
    ]


def sick_devices(
    claim: Mapping[str, Any], condition_types: Iterable[str]
) -> dict[tuple[str, str, str], str]:
    """The devices a claim's `status.devices` says are unhealthy: (driver, pool, device) ->
    why, for each with a condition of `condition_types` that is True (what a DRA driver may
    report of an allocated device)."""
    kinds = frozenset(condition_types)
    out = {}
    for entry in (claim.get("status") or {}).get("devices") or []:
        for condition in entry.get("conditions") or []:
            if condition.get("type") in kinds and condition.get("status") == "True":
                ref = (str(entry.get("driver")), str(entry.get("pool")), str(entry.get("device")))
                out[ref] = f"claim condition {condition['type']}: {condition.get('message', '')}"
    return out
