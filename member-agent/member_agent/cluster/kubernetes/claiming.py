"""Writing gpufed's ResourceClaims (DRA mode): which `resource.k8s.io` version the server
offers, create, reserve for a pod, delete. The bodies are `claims`'; this sends them
through kubernetes-asyncio's generated `ResourceV1Api` or `ResourceV1beta2Api` (the same calls
in both), raw JSON in and out as elsewhere in the backend.

Reserving a claim for a pod is a read-modify-write, as the scheduler's: the ownership patch
(metadata) then the reservation (status subresource), each a JSON merge patch carrying the
resourceVersion it was computed from, so the API server refuses it (409) when another writer
(the resourceclaim controller dropping a gone pod, a second pod joining a shared claim) came
first; then it is read and computed again, a few times.

Each request is sent again while it fails in a way another try may not (`retrying`, with the
policy the backend's pod writes use: 429 with its Retry-After, 5xx, timeouts, connection
failures), within the request's deadline, and each may be sent twice, because a try whose answer
was lost may have been applied:

- a create answered 409 AlreadyExists reads the claim of that name: gpufed's, a pod's own or
  shared as sent, of the same job and for the same devices (`claims.identity_problem`), it is
  its own. Held by no pod (no owner, not reserved), it is the claim an earlier try created (or a
  failed create left behind) and counts as created; held, it exists already (a shared claim
  other pods hold) and is joined. Being deleted, the create is tried again until it is gone; a
  claim of another job, other devices, or not gpufed's is `k8s_errors.Conflict`, and is
  left alone;
- a delete answered 404 is done;
- a patch answered 409 is not sent again as it was: it carries the resourceVersion it was
  computed from (one an earlier try applied moved it on too), so the claim is read and the
  patch computed again, as for any other writer's change.

`watches` are the list+watch loops DRA mode adds: ResourceSlices (the GPUs, `SliceFeed`) and
the ResourceClaims of all namespaces (`ClaimFeed`: claims other schedulers allocated hold their
devices in the inventory; gpufed's own are held through its pods).
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes_asyncio import client

from broker.api import status
from member_agent.cluster import errors
from member_agent.cluster.kubernetes import (
    claims,
    devices,
    objects,
    retrying,
    state,
    watching,
    writing,
)
from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.inventory import model

logger = logging.getLogger(__name__)

ATTEMPTS = 5


async def detect_version(api: client.ApiClient, *, timeout: float) -> str:
    """`v1` when the server offers it (1.34+), else `v1beta2` (1.33); anything else is a
    PermanentBackendError saying what the server has."""
    what = f"discover {claims.GROUP}"
    get: writing.RawCall = client.ResourceApi(api).get_api_group
    group = await writing.send(get, what=what, timeout=timeout, none_on=k8s_errors.NOT_FOUND)
    if group is None:
        raise errors.PermanentBackendError(
            f"the API server offers no {claims.GROUP} API: DRA mode needs Kubernetes "
            "1.34+ (v1), or 1.33 with DRA turned on (the DynamicResourceAllocation "
            "feature gate, resource.k8s.io/v1beta2), and a DRA driver"
        )
    try:
        return claims.choose_version(group)
    except claims.ClaimProblem as exc:
        raise errors.PermanentBackendError(str(exc)) from exc


class Claims:
    """The ResourceClaim calls of one API version."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        version: str,
        keys: devices.DeviceKeys,
        request_timeout: float,
        policy: retrying.RetryPolicy,
    ) -> None:
        self.version = version
        self.keys = keys
        self._timeout = request_timeout
        self.policy = policy
        self._resource: Any = (
            client.ResourceV1Api(api) if version == "v1" else client.ResourceV1beta2Api(api)
        )

    def watches(
        self,
        cluster_state: state.ClusterState,
        book: devices.DeviceBook,
        *,
        backoff: watching.Backoff,
        timeout_seconds: int,
    ) -> list[watching.ListWatch]:
        foreign = ClaimFeed(cluster_state, book)
        return [
            watching.ListWatch(
                "resourceslices",
                self._resource.list_resource_slice,
                SliceFeed(cluster_state, book, foreign),
                backoff=backoff,
                timeout_seconds=timeout_seconds,
            ),
            watching.ListWatch(
                "resourceclaims",
                self._resource.list_resource_claim_for_all_namespaces,
                foreign,
                backoff=backoff,
                timeout_seconds=timeout_seconds,
            ),
        ]

    async def create(self, plan: claims.ClaimPlan) -> dict[str, Any] | None:
        """Create the plan's claim; returns it as the server has it, or None when it exists
        already held by pods (see the module for a claim that exists)."""
        body = claims.build_claim(plan, version=self.version, keys=self.keys)
        what = f"create resourceclaim {plan.namespace}/{plan.name}"
        create: writing.RawCall = self._resource.create_namespaced_resource_claim

        async def attempt(timeout: float) -> dict[str, Any]:
            return await writing.create_once(
                lambda: writing.send(create, plan.namespace, body, what=what, timeout=timeout),
                lambda: self._read(plan.namespace, plan.name, timeout=timeout),
                lambda existing: claims.identity_problem(existing, body),
                what=what,
                noun="claim",
            )

        claim = await retrying.call(self.policy, what, attempt, timeout=self._timeout)
        return None if claims.is_held(claim) else claim

    async def reserve(
        self, plan: claims.ClaimPlan, *, uid: str, claim: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Own, allocate (if not yet) and reserve the claim for the pod `uid`."""
        what = f"reserve resourceclaim {plan.namespace}/{plan.name} for pod {plan.pod}"
        for attempt in range(1, ATTEMPTS + 1):
            current = claim if claim is not None else await self.read(plan.namespace, plan.name)
            claim = None
            if current is None:
                raise errors.PermanentBackendError(f"{what}: the claim is gone")
            if (current.get("metadata") or {}).get("deletionTimestamp"):
                raise errors.TemporaryBackendError(f"{what}: the claim is being deleted")
            owned = await self._patch(plan, claims.ownership(current, plan, uid=uid), what=what)
            if owned is not None:
                patch = claims.reservation(owned, plan, uid=uid, keys=self.keys)
                reserved = await self._patch(plan, patch, what=what, status=True)
                if reserved is not None:
                    return reserved
            logger.debug("%s: conflict (attempt %d), reading it again", what, attempt)
        raise errors.TemporaryBackendError(f"{what}: {ATTEMPTS} conflicting writes in a row")

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The claim; None when there is none."""
        what = f"read resourceclaim {namespace}/{name}"

        async def attempt(timeout: float) -> dict[str, Any] | None:
            return await self._read(namespace, name, timeout=timeout)

        return await retrying.call(self.policy, what, attempt, timeout=self._timeout)

    async def _read(self, namespace: str, name: str, *, timeout: float) -> dict[str, Any] | None:
        found: dict[str, Any] | None = await writing.send(
            self._resource.read_namespaced_resource_claim,
            name,
            namespace,
            what=f"read resourceclaim {namespace}/{name}",
            timeout=timeout,
            none_on=k8s_errors.NOT_FOUND,
        )
        return found

    async def delete(self, namespace: str, name: str) -> None:
        """Delete a claim; a missing one is not an error (its finalizer keeps it while a
        pod still uses its devices)."""
        what = f"delete resourceclaim {namespace}/{name}"
        delete: writing.RawCall = self._resource.delete_namespaced_resource_claim

        async def attempt(timeout: float) -> None:
            await writing.send_unread(delete, name, namespace, what=what, timeout=timeout)

        await retrying.call(self.policy, what, attempt, timeout=self._timeout)

    async def _patch(
        self, plan: claims.ClaimPlan, body: dict[str, Any], *, what: str, status: bool = False
    ) -> dict[str, Any] | None:
        """One merge patch, sent again on a temporary failure; None on a conflict (the
        resourceVersion moved on: the caller reads the claim again)."""
        resource = self._resource
        call: writing.RawCall = (
            resource.patch_namespaced_resource_claim_status
            if status
            else resource.patch_namespaced_resource_claim
        )

        async def attempt(timeout: float) -> dict[str, Any] | None:
            patched: dict[str, Any] | None = await writing.send(
                call,
                plan.name,
                plan.namespace,
                body,
                _content_type=writing.MERGE_PATCH,
                what=what,
                timeout=timeout,
                none_on=k8s_errors.CONFLICT,
            )
            return patched

        return await retrying.call(self.policy, what, attempt, timeout=self._timeout)


class ClaimFeed:
    """The claims watch's sink: every allocated claim that is not gpufed's holds its devices
    (a record per claim, `state.hold`); gpufed's are held through their pods. Any claim whose
    status says a device is unhealthy (`claims.sick_devices`) makes it an unhealthy GPU."""

    def __init__(self, cluster_state: state.ClusterState, book: devices.DeviceBook) -> None:
        self._state = cluster_state
        self._book = book
        self._raw: dict[str, dict[str, Any]] = {}  # foreign allocated claims, by key
        self._was_sick: set[str] = set()  # claims that said a device is unhealthy

    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        del started
        keys = set(self._raw)
        self._raw = {}
        listed = set()
        for raw in items:
            key = _key(raw)
            listed.add(key)
            self._health(key, raw)
            if not claims.is_ours(raw) and claims.allocated(raw):
                self._raw[key] = raw
        for key in sorted(self._was_sick - listed):
            self._health(key, None)
        for key in sorted(keys | set(self._raw)):
            self._resolve(key)

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        key = _key(obj)
        self._health(key, None if kind == "DELETED" else obj)
        if kind == "DELETED" or claims.is_ours(obj) or not claims.allocated(obj):
            if self._raw.pop(key, None) is not None:
                self._state.hold(key, None)
            return
        self._raw[key] = obj
        self._resolve(key)

    def _health(self, key: str, raw: dict[str, Any] | None) -> None:
        conditions = self._book.keys.health_conditions
        sick = claims.sick_devices(raw, conditions) if raw is not None else {}
        if not sick and key not in self._was_sick:
            return
        if sick:
            self._was_sick.add(key)
        else:
            self._was_sick.discard(key)
        nodes = self._book.set_claim_health(key, sick)
        if nodes:
            self._state.nodes_changed(nodes, reason=f"{key}: a device's health changed")

    def resolve_all(self) -> None:
        """The devices changed: find every claim's devices again."""
        for key in sorted(self._raw):
            self._resolve(key)

    def _resolve(self, key: str) -> None:
        raw = self._raw.get(key)
        self._state.hold(key, None if raw is None else self._record(key, raw))

    def _record(self, key: str, raw: dict[str, Any]) -> objects.PodRecord | None:
        found = [self._book.find(*ref) for ref in claims.allocated(raw)]
        held = [d for d in found if d is not None]
        if not held:
            return None  # another driver's devices, or a slice not seen yet
        meta = raw.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        node = held[0].node
        slots = tuple(
            status.GPUSlot.model_construct(index=d.index, milli=model.GPU_MILLI)
            for d in held
            if d.node == node and not d.profile
        )
        mig_slots: dict[str, tuple[int, ...]] = {}
        for device in held:
            if device.node == node and device.profile:
                mig_slots[device.profile] = (*mig_slots.get(device.profile, ()), device.index)
        return objects.PodRecord(
            namespace=namespace,
            name=key.partition("/")[2],
            node=node,
            gpus=len(slots),
            cpu_milli=0,
            memory_mib=0,
            holds=True,
            slots=slots,
            mig={profile: len(indices) for profile, indices in mig_slots.items()},
            mig_slots=mig_slots,
        )


class SliceFeed:
    """The slices watch's sink: the device book, then the nodes whose GPUs changed and the
    claims whose devices may have."""

    def __init__(
        self, cluster_state: state.ClusterState, book: devices.DeviceBook, foreign: ClaimFeed
    ) -> None:
        self._state = cluster_state
        self._book = book
        self._foreign = foreign

    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        del started
        self._changed(self._book.replace(items))

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self._changed(self._book.apply(kind, obj))

    def _changed(self, nodes: set[str]) -> None:
        if not nodes:
            return
        self._foreign.resolve_all()
        self._state.nodes_changed(nodes, reason=f"devices of {len(nodes)} node(s) changed")


def _key(raw: dict[str, Any]) -> str:
    meta = raw.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/claim:{meta.get('name', '')}"
