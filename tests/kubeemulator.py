"""kmock's KubernetesEmulator, adapted to what the agent's Kubernetes backend relies on. Tests only.

The gaps of kmock 0.8 (see DEPENDENCIES.md) closed here, in a subclass:

- kubernetes-asyncio sends `watch=True`; kmock only knows `watch=true` and would answer a list;
- every change gets a resourceVersion from one counter, new objects a uid and a
  creationTimestamp, new pods `status.phase: Pending`, lists the current resourceVersion (and
  work for kinds with no object yet);
- a watch honours `resourceVersion`: it replays the events after it (from a history) rather
  than every object as ADDED, and answers 410 Gone (an ERROR event) when `compact()` has
  dropped that version;
- `break_watches()` ends every open watch stream, as a proxy or an API server restart would;
- `fail(...)` makes the n-th matching request fail before it changes anything;
- `inject(...)` makes matching requests meet a `Fault` the way a real API server, etcd or the
  network between them does: a write that commits and then fails (a reset connection, a 504),
  429 with `Retry-After`, 5xx, 409 Conflict, 410 on an expired `continue`;
- `accounts` maps bearer tokens to the RBAC of a ServiceAccount (tests/kubeauthz.py: the
  member-agent chart's, as rendered): a request with such a token that its rules do not allow is
  403 Forbidden; requests without one (the helpers', the test's own client) are an admin's;
- a create of an object that exists is 409 `AlreadyExists` (kmock says "Object Already
  Exists"), naming the object in `details` as the API server does;
- `v1/resourcequotas` is declared from the start (the backend lists them in every allowed
  namespace, and a kind nobody declared is 404 on kmock, never on a real API server), and so
  is `events.k8s.io/v1/events` (the agent records Events on Nodes; `events()` reads them).

Dynamic Resource Allocation (`declare_dra`): `resource.k8s.io` is served in the versions asked
for (v1 as 1.34, v1beta2 as 1.33), its APIGroup also at `/apis/resource.k8s.io/` (the path
kubernetes-asyncio asks; kmock answers it as a list). ResourceClaims are stored as the API
server stores them: a create's `status` is dropped, a patch of the claim changes everything but
its status and one of `/status` only its status; a patch carrying a `metadata.resourceVersion`
that is not the stored one is 409 Conflict; an allocation, once written, cannot be changed, and
`reservedFor` needs one. kube-controller-manager's resourceclaim controller is modelled after
every change to a pod or a claim: it drops from `reservedFor` the pods that are gone or done
(Succeeded, Failed); a claim the scheduler allocated (it has the finalizer
`resource.kubernetes.io/delete-protection`) whose last reservation was so dropped, or that is
being deleted and reserved for no pod, is deallocated (`status.allocation` cleared, the
finalizer removed); a claim being deleted goes once it has no finalizer left. The garbage
collector deletes a claim all of whose owners are gone. `slice_body` writes a ResourceSlice as
NVIDIA's k8s-dra-driver-gpu publishes a node's GPUs.

Graceful deletion: a pod bound to a node and not done is, when deleted with a grace period (the
request's, else its `terminationGracePeriodSeconds`, else 30 s), marked (`deletionTimestamp`,
`deletionGracePeriodSeconds`: Terminating) and goes `termination_seconds` later (or at the end
of its grace period, if shorter), as the kubelet stops it; a delete with grace 0 ends it at
once. OwnerReferencesPermissionEnforcement (on by default in OpenShift; `enforce_owner_refs`):
an account that sets `blockOwnerDeletion` on an owner reference needs `update` on the owner's
`finalizers` subresource, else 403.

Label and field selectors stay ignored (the backend uses none), and `/version/` stays 404 (the
backend never asks for it). The helpers (`add_node`, `add_pod`, `set_pod_phase`,
`set_node_ready`, `set_quota`, ...) go over HTTP through the same handler, so they cause the
same watch events the API server would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import aiohttp.web
import attrs
import kmock
import pytest
import yaml
from kubernetes_asyncio import client

from broker.api import status
from member_agent.cluster import base
from tests import helmrender, kubeauthz

GPU = "nvidia.com/gpu"
H100 = "NVIDIA-H100-80GB-HBM3"
_BREAK = object()
PODS = kmock.resource("v1/pods")
QUOTAS = "v1/resourcequotas"
EVENTS = "events.k8s.io/v1/events"
RESOURCE_GROUP = "resource.k8s.io"
DRA_DRIVER = "gpu.nvidia.com"
H100_PRODUCT = "NVIDIA H100 80GB HBM3"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"


@dataclass
class _Failure:
    action: str
    plural: str
    countdown: int  # matching requests to let through first
    times: int
    status: int


@dataclass(frozen=True)
class Fault:
    """What an injected request meets (`Emulator.inject`):

    - `Fault.commit_then_reset`: the write is stored (and watchers see it), then the connection
      is dropped without an answer: the client sees a reset (a timed-out write looks the same);
    - `Fault.commit_then_error(504)`: the write is stored, then the answer is that Status (the
      API server's "Timeout: request did not complete within requested timeout" is a 504);
    - `Fault.throttle(retry_after=1)`: 429 TooManyRequests with `Retry-After`, nothing stored;
    - `Fault.server_error(503)`: that 5xx, nothing stored;
    - `Fault.conflict`: 409 Conflict ("the object has been modified"), nothing stored;
    - `Fault.expired_continue`: 410 Expired, for a list carrying a `continue` token only (other
      requests pass and do not count).
    """

    kind: str  # "reset" | "error"
    status: int = 0
    reason: str = ""
    message: str = ""
    commits: bool = False
    retry_after: int | None = None
    paged_only: bool = False

    commit_then_reset: ClassVar[Fault]
    conflict: ClassVar[Fault]
    expired_continue: ClassVar[Fault]

    @staticmethod
    def commit_then_error(status: int = 504) -> Fault:
        message = "Timeout: request did not complete within requested timeout"
        reason = "Timeout" if status == 504 else "InternalError"
        return Fault("error", status, reason, message, commits=True)

    @staticmethod
    def throttle(retry_after: int = 1) -> Fault:
        message = "Too many requests, please try again later."
        return Fault("error", 429, "TooManyRequests", message, retry_after=retry_after)

    @staticmethod
    def server_error(status: int = 500) -> Fault:
        reason = {503: "ServiceUnavailable", 504: "Timeout"}.get(status, "InternalError")
        return Fault("error", status, reason, f"injected {status}")

    def answer(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The Status response of this fault, as the API server writes it."""
        details: dict[str, Any] = {}
        if request.name:
            details["name"] = request.name
        if request.resource is not None:
            details["kind"] = request.resource.plural
        if self.retry_after is not None:
            details["retryAfterSeconds"] = self.retry_after
        body = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": details,
            "code": self.status,
        }
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return aiohttp.web.json_response(body, status=self.status, headers=headers)


Fault.commit_then_reset = Fault("reset", commits=True)
Fault.conflict = Fault(
    "error",
    409,
    "Conflict",
    "Operation cannot be fulfilled: the object has been modified; "
    "please apply your changes to the latest version and try again",
)
Fault.expired_continue = Fault(
    "error",
    410,
    "Expired",
    "The provided continue parameter is too old to display a consistent list result. "
    "You can start a new list without the continue parameter.",
    paged_only=True,
)


@dataclass
class _Injection:
    method: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    watch: bool | None
    countdown: int  # matching requests to let through first
    times: int
    fault: Fault
    hits: int = 0

    def matches(self, request: kmock.Request) -> bool:
        if self.times <= 0 or request.resource is None:
            return False
        if request.method.value.upper() != self.method or request.resource.plural != self.plural:
            return False
        if self.namespace is not None and request.namespace != self.namespace:
            return False
        if self.name is not None and request.name != self.name:
            return False
        if self.subresource is not None and request.subresource != self.subresource:
            return False
        if self.watch is not None and (request.action == kmock.action.WATCH) != self.watch:
            return False
        return not self.fault.paged_only or bool(request.params.get("continue"))


class _Recorder:
    """Stands in for kmock's per-resource event bus: kmock calls `put` under its lock."""

    def __init__(self, emulator: Emulator, resource: Any) -> None:
        self._emulator = emulator
        self._resource = resource

    async def put(self, *events: dict[str, Any]) -> None:
        for event in events:
            self._emulator._record(self._resource, event)


class _Recorders(dict[Any, _Recorder]):
    def __init__(self, emulator: Emulator) -> None:
        super().__init__()
        self._emulator = emulator

    def __missing__(self, resource: Any) -> _Recorder:
        recorder = self[resource] = _Recorder(self._emulator, resource)
        return recorder


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _history: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: list[tuple[Any, str | None, asyncio.Queue[Any]]] = attrs.field(
        factory=list, init=False
    )
    _failures: list[_Failure] = attrs.field(factory=list, init=False)
    _injections: list[_Injection] = attrs.field(factory=list, init=False)
    # bearer token -> its RBAC (or what makes it, on the token's first request)
    accounts: dict[str, kubeauthz.Authorizer | Callable[[], kubeauthz.Authorizer]] = attrs.field(
        factory=dict, init=False
    )
    dra_versions: tuple[str, ...] = attrs.field(default=(), init=False)
    # how long a Terminating pod stays (the kubelet stopping it), at most its grace period
    termination_seconds: float = attrs.field(default=0.05, init=False)
    enforce_owner_refs: bool = attrs.field(default=True, init=False)
    forbidden: list[str] = attrs.field(factory=list, init=False)  # requests answered 403
    _terminations: dict[Any, asyncio.Task[None]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _Recorders(self)  # type: ignore[assignment]
        self.resources[QUOTAS] = kmock.ResourceInfo(kind="ResourceQuota", namespaced=True)
        self.resources[EVENTS] = kmock.ResourceInfo(kind="Event", namespaced=True)

    # -- the adapted server ------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> Any:
        group = _group_path(request)
        if group is not None:
            return self._serve_api_group(group)
        forbidden = self._authorize(request)
        if forbidden is not None:
            return forbidden
        if request.resource is not None and request.resource.plural == "resourceclaims":
            self._store_claim(request)
        if (
            request.method == kmock.method.GET
            and request.action != kmock.action.WATCH
            and str(request.params.get("watch", "")).lower() in ("true", "1")
        ):
            watch = attrs.evolve(request, action=kmock.action.WATCH)
            # kmock matches reactions by the identity of the recorded request: swap it
            index = next(i for i, seen in enumerate(self._requests) if seen is request)
            self._requests[index] = request = watch
        if request.resource is not None and request.action is not None:
            self._maybe_fail(request)
        fault = self._take_fault(request)
        if fault is not None and not fault.commits:
            return fault.answer(request)
        response = await self._serve(request)
        if fault is not None and fault.kind == "reset":
            raw = request._raw_request
            if raw is not None and raw.transport is not None:
                raw.transport.abort()
        elif fault is not None:
            return fault.answer(request)
        return response

    async def __aexit__(self, *exc_info: Any) -> None:
        for task in self._terminations.values():
            task.cancel()
        for task in list(self._terminations.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().__aexit__(*exc_info)

    async def _serve(self, request: kmock.Request) -> Any:
        if (
            request.action == kmock.action.DELETE
            and request.resource is not None
            and request.resource.plural == "pods"
            and request.name
        ):
            answer = await self._delete_pod(request)
            if answer is not None:
                return answer
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            meta.setdefault("creationTimestamp", stamp)
            if request.resource is not None and request.resource.plural == "pods":
                request.data.setdefault("status", {}).setdefault("phase", "Pending")
        try:
            response = await super()._handle(request)
        except kmock.KubernetesError as exc:
            if exc.status != 409 or request.action != kmock.action.CREATE:
                raise
            # kmock's "Object Already Exists", as the API server says it
            meta = (request.data.get("metadata") or {}) if isinstance(request.data, dict) else {}
            plural = request.resource.plural if request.resource is not None else ""
            raise kmock.KubernetesError(
                status=409,
                reason="AlreadyExists",
                message=f'{plural} "{meta.get("name")}" already exists',
                details={"name": meta.get("name"), "kind": plural},
            ) from exc
        changed = request.resource.plural if request.resource is not None else ""
        writes = (kmock.action.DELETE, kmock.action.UPDATE)
        if request.action in writes and changed in ("pods", "resourceclaims"):
            await self._control_claims()
        return response

    # -- pods: graceful deletion ---------------------------------------------------------------

    async def _delete_pod(self, request: kmock.Request) -> Any:
        """A graceful delete (see the module); None: kmock deletes it at once (or says 404)."""
        key: Any = (request.resource, request.namespace, request.name)
        grace = _grace_of(request)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                return None
            obj = self.objects[key]
            raw = obj.raw
            spec = raw.get("spec") or {}
            if grace is None:
                grace = int(spec.get("terminationGracePeriodSeconds", 30))
            done = (raw.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            terminating = bool((raw.get("metadata") or {}).get("deletionTimestamp"))
            if grace <= 0 or self.termination_seconds <= 0 or not spec.get("nodeName") or done:
                if not terminating:
                    return None
                self._end_pod(key)  # kmock would leave a marked object be
                answer = aiohttp.web.json_response(dict(obj.last.raw))
            elif terminating:
                return aiohttp.web.json_response(dict(raw))
            else:
                now = datetime.datetime.now(datetime.UTC)
                stamp = (now + datetime.timedelta(seconds=grace)).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta = {"deletionTimestamp": stamp, "deletionGracePeriodSeconds": grace}
                obj.patch({"metadata": meta})
                self._record(key[0], {"type": "MODIFIED", "object": obj.raw})
                delay = min(float(grace), self.termination_seconds)
                self._terminations[key] = asyncio.create_task(self._terminate(key, delay))
                return aiohttp.web.json_response(dict(obj.raw))
        await self._control_claims()
        return answer

    async def _terminate(self, key: Any, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._lock:
            self._terminations.pop(key, None)
            if key in self.objects and not self.objects[key].deleted:
                self._end_pod(key)
        await self._control_claims()

    def _end_pod(self, key: Any) -> None:
        """The kubelet is done with a Terminating pod: it goes (under the lock)."""
        task = self._terminations.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        obj = self.objects[key]
        raw = obj.raw
        obj.delete()
        self._record(key[0], {"type": "DELETED", "object": raw})

    def terminating(self) -> list[dict[str, Any]]:
        """The pods marked for deletion that are still there."""
        return [p for p in self.pods() if (p.get("metadata") or {}).get("deletionTimestamp")]

    # -- resource.k8s.io, as the API server serves it -------------------------------------------

    def declare_dra(self, versions: tuple[str, ...] = ("v1",)) -> None:
        """Serve ResourceSlices and ResourceClaims in these versions (the first preferred)."""
        self.dra_versions = versions
        for version in versions:
            prefix = f"{RESOURCE_GROUP}/{version}"
            self.resources[f"{prefix}/resourceslices"] = kmock.ResourceInfo(
                kind="ResourceSlice", namespaced=False
            )
            self.resources[f"{prefix}/resourceclaims"] = kmock.ResourceInfo(
                kind="ResourceClaim", namespaced=True, subresources={"status"}
            )

    def _serve_api_group(self, group: str) -> Any:
        versions = list(self.dra_versions) if group == RESOURCE_GROUP else []
        if not versions:
            body = {"kind": "Status", "code": 404, "reason": "NotFound", "message": "not found"}
            return aiohttp.web.json_response(body, status=404)
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return aiohttp.web.json_response(
            {
                "apiVersion": "v1",
                "kind": "APIGroup",
                "name": group,
                "versions": listed,
                "preferredVersion": listed[0],
            }
        )

    def _store_claim(self, request: kmock.Request) -> None:
        """What the API server keeps of a write to a ResourceClaim (see the module)."""
        data = request.data
        if not isinstance(data, dict):
            return
        if request.action == kmock.action.CREATE:
            data.pop("status", None)
            return
        if request.action != kmock.action.UPDATE or request.resource is None or not request.name:
            return
        key = (request.resource, request.namespace, request.name)
        stored = (
            self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
        )
        meta = data.get("metadata") or {}
        expected = meta.pop("resourceVersion", None)
        if expected is not None and expected != (stored.get("metadata") or {}).get(
            "resourceVersion"
        ):
            raise kmock.KubernetesError(
                status=409, reason="Conflict", message="the object has been modified"
            )
        if request.subresource == "status":
            for field in list(data):
                if field != "status":
                    del data[field]
            now = stored.get("status") or {}
            new = data.get("status") or {}
            if (
                now.get("allocation")
                and "allocation" in new
                and new["allocation"] != now["allocation"]
            ):
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message="status.allocation: may not be changed"
                )
            if new.get("reservedFor") and not (new.get("allocation") or now.get("allocation")):
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message="status.reservedFor: needs an allocation"
                )
        else:
            data.pop("status", None)

    async def _control_claims(self) -> None:
        """kube-controller-manager's resourceclaim controller and garbage collector, one pass
        over every claim (see the module)."""
        async with self._lock:
            pods = {
                (ns, name): obj.raw
                for (resource, ns, name), obj in self.objects.items()
                if resource.plural == "pods" and not obj.deleted
            }
            uids = {str((raw.get("metadata") or {}).get("uid")) for raw in pods.values()}
            for key, obj in list(self.objects.items()):
                if key[0].plural != "resourceclaims" or obj.deleted:
                    continue
                self._control_claim(key, obj, pods, uids)

    def _control_claim(
        self, key: Any, obj: Any, pods: Mapping[tuple[str | None, str], Any], uids: set[str]
    ) -> None:
        resource, ns, _ = key
        raw = obj.raw
        meta = raw.get("metadata") or {}
        current = raw.get("status") or {}
        reserved = current.get("reservedFor") or []
        valid = [r for r in reserved if _in_use(pods.get((ns, r.get("name"))), r)]
        finalizers = list(meta.get("finalizers") or [])
        status: dict[str, Any] = {}
        if len(valid) != len(reserved):
            status["reservedFor"] = valid or None
        # deallocated on the change from "was used" to "is not used", or once being deleted
        released = bool(reserved) and not valid
        if (released or meta.get("deletionTimestamp")) and not valid:
            if current.get("allocation") and DELETE_PROTECTION in finalizers:
                status["allocation"] = None
            if DELETE_PROTECTION in finalizers:
                finalizers.remove(DELETE_PROTECTION)
        if status or finalizers != list(meta.get("finalizers") or []):
            patch: dict[str, Any] = {"metadata": {"finalizers": finalizers or None}}
            if status:
                patch["status"] = status
            obj.patch(patch)
            self._record(resource, {"type": "MODIFIED", "object": obj.raw})
        owners = [str(o.get("uid")) for o in meta.get("ownerReferences") or []]
        gone = bool(owners) and not any(uid in uids for uid in owners)
        deleting = bool(meta.get("deletionTimestamp"))
        if gone and not deleting and finalizers:
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            obj.patch({"metadata": {"deletionTimestamp": stamp}})
            self._record(resource, {"type": "MODIFIED", "object": obj.raw})
        elif (gone or deleting) and not finalizers:
            last = obj.raw
            obj.delete()
            self._record(resource, {"type": "DELETED", "object": last})

    def _maybe_fail(self, request: kmock.Request) -> None:
        assert request.action is not None and request.resource is not None
        for failure in self._failures:
            if failure.times <= 0:
                continue
            if request.action.name.lower() != failure.action:
                continue
            if request.resource.plural != failure.plural:
                continue
            if failure.countdown > 0:
                failure.countdown -= 1
                continue
            failure.times -= 1
            raise kmock.KubernetesError(
                status=failure.status, reason="Injected", message=f"injected {failure.status}"
            )

    def _authorize(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        """The 403 of a request whose token's RBAC does not allow it (None: allowed)."""
        headers = {k.lower(): v for k, v in request.headers.items()}
        token = str(headers.get("authorization") or "").removeprefix("Bearer ").strip()
        account = self.accounts.get(token)
        if account is None:
            return None
        if not isinstance(account, kubeauthz.Authorizer):
            account = self.accounts[token] = account()
        forbidden = account.check(request)
        if forbidden is None and self.enforce_owner_refs:
            forbidden = self._check_owner_refs(account, request)
        if forbidden is not None:
            self.forbidden.append(f"{request.method.value} {request.url.path}")
        return forbidden

    def _check_owner_refs(
        self, account: kubeauthz.Authorizer, request: kmock.Request
    ) -> aiohttp.web.StreamResponse | None:
        """OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on a reference
        needs `update` on the owner's finalizers (only references it newly sets)."""
        if request.resource is None or not isinstance(request.data, dict):
            return None
        if request.action not in (kmock.action.CREATE, kmock.action.UPDATE):
            return None
        refs = (request.data.get("metadata") or {}).get("ownerReferences") or []
        key: Any = (request.resource, request.namespace, request.name)
        stored = (
            self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
        )
        before = {
            str(o.get("uid"))
            for o in (stored.get("metadata") or {}).get("ownerReferences") or []
            if o.get("blockOwnerDeletion")
        }
        for ref in refs:
            if not ref.get("blockOwnerDeletion") or str(ref.get("uid")) in before:
                continue
            group = str(ref.get("apiVersion", "")).rpartition("/")[0]
            plural = f"{str(ref.get('kind', '')).lower()}s"
            if account.allows(group, f"{plural}/finalizers", "update", request.namespace):
                continue
            return kubeauthz.forbidden(
                request,
                "cannot set blockOwnerDeletion if an ownerReference refers to a resource you "
                f'can\'t set finalizers on: User "{account.user}" cannot update resource '
                f'"{plural}/finalizers" in API group "{group}" in the namespace '
                f'"{request.namespace}"',
            )
        return None

    def _take_fault(self, request: kmock.Request) -> Fault | None:
        for injection in self._injections:
            if not injection.matches(request):
                continue
            if injection.countdown > 0:
                injection.countdown -= 1
                continue
            injection.times -= 1
            injection.hits += 1
            return injection.fault
        return None

    def _record(self, resource: Any, event: dict[str, Any]) -> None:
        """One change (under kmock's lock): give it a resourceVersion, keep it, fan it out."""
        self._version += 1
        event = copy.deepcopy(event)
        meta = event["object"].setdefault("metadata", {})
        meta["resourceVersion"] = str(self._version)
        key = (resource, meta.get("namespace"), meta.get("name"))
        if event["type"] != "DELETED" and key in self.objects and not self.objects[key].deleted:
            stored = self.objects[key]
            stored["metadata"] = {**stored.raw.get("metadata", {}), **meta}
        self._history.append((self._version, resource, event))
        for watched, namespace, queue in self._watchers:
            if watched == resource and namespace in (None, meta.get("namespace")):
                queue.put_nowait(event)

    def _matching(self, request: kmock.Request) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (resource, namespace, _), obj in self.objects.items()
            if resource == request.resource
            and not obj.deleted
            and (request.namespace is None or namespace == request.namespace)
        ]

    async def _serve_list(self, request: kmock.Request) -> Any:
        """A list, in pages when asked (`limit`, `continue`): the pages after the first are read
        from the objects as they are then, not from a snapshot, and carry the first page's
        resourceVersion."""
        async with self._lock:
            items = self._matching(request)
            version = self._version
        token = str(request.params.get("continue") or "")
        after: tuple[str, str] | None = None
        if token:
            decoded = json.loads(base64.urlsafe_b64decode(token))
            version, after = int(decoded["rv"]), (decoded["ns"], decoded["name"])
        limit = int(request.params.get("limit") or 0)
        meta: dict[str, Any] = {"resourceVersion": str(version)}
        if token or limit:
            items.sort(key=_list_key)
            if after is not None:
                items = [item for item in items if _list_key(item) > after]
            if limit and len(items) > limit:
                last = _list_key(items[limit - 1])
                meta["remainingItemCount"] = len(items) - limit
                meta["continue"] = base64.urlsafe_b64encode(
                    json.dumps({"rv": version, "ns": last[0], "name": last[1]}).encode()
                ).decode()
                items = items[:limit]
        return {"kind": "List", "metadata": meta, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now
        since = str(request.params.get("resourceVersion") or "0")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        entry = (request.resource, request.namespace, queue)
        async with self._lock:
            if since != "0" and int(since) < self._compacted:
                gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
                backlog = [{"type": "ERROR", "object": gone}]
            elif since != "0":
                backlog = [
                    event
                    for version, resource, event in self._history
                    if version > int(since)
                    and resource == request.resource
                    and request.namespace in (None, event["object"]["metadata"].get("namespace"))
                ]
            else:
                backlog = [{"type": "ADDED", "object": raw} for raw in self._matching(request)]
            self._watchers.append(entry)
        try:
            for event in backlog:
                yield event
                if event["type"] == "ERROR":
                    return
            while (event := await queue.get()) is not _BREAK:
                yield event
        finally:
            self._watchers.remove(entry)

    # -- controls for tests ------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def compact(self) -> None:
        """Forget the history: a watch resuming from a version older than the current one gets
        410 Gone (a list's version, the current one, can still be watched from)."""
        self._compacted = self._version
        self._history.clear()

    def break_watches(self) -> int:
        """End every open watch stream; returns how many there were."""
        for _, _, queue in self._watchers:
            queue.put_nowait(_BREAK)
        return len(self._watchers)

    def watch_count(self, plural: str) -> int:
        return sum(1 for resource, _, _ in self._watchers if resource.plural == plural)

    def fail(
        self, action: str, plural: str, *, nth: int = 1, times: int = 1, status: int = 500
    ) -> None:
        """Fail the `nth` (1-based, counted from now) `action` request on `plural`, and the
        `times - 1` after it, with `status`, before anything changes."""
        self._failures.append(_Failure(action.lower(), plural, nth - 1, times, status))

    def clear_failures(self) -> None:
        self._failures.clear()
        self._injections.clear()

    def inject(
        self,
        method: str,
        resource: str,
        fault: Fault,
        *,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
        watch: bool | None = None,
        nth: int = 1,
        times: int = 1,
    ) -> _Injection:
        """Make the `nth` (1-based, counted from now) request of the HTTP `method` on the
        resource `resource` (its plural), and the `times - 1` after it, meet `fault`. Narrow it
        with `namespace`, `name`, `subresource`, `watch` (GETs: True only watches, False only
        lists and reads). Returns the injection: its `hits` counts the faults served.

            emulator.inject("POST", "pods", Fault.commit_then_reset)
            emulator.inject("PATCH", "pods", Fault.throttle(retry_after=1), times=2)
            emulator.inject("DELETE", "pods", Fault.server_error(503), namespace="team-a")
            emulator.inject("PATCH", "resourceclaims", Fault.conflict, subresource="status")
            emulator.inject("GET", "pods", Fault.expired_continue)  # a paged list's 2nd page
        """
        injection = _Injection(
            method.upper(), resource, namespace, name, subresource, watch, nth - 1, times, fault
        )
        self._injections.append(injection)
        return injection

    def requests_of(self, action: str, plural: str) -> list[kmock.Request]:
        return [
            r
            for r in self._requests
            if r.action is not None
            and r.action.name.lower() == action.lower()
            and r.resource is not None
            and r.resource.plural == plural
        ]

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        key = (PODS, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return dict(self.objects[key].raw)

    def node(self, name: str) -> dict[str, Any]:
        """A Node as stored (KeyError if there is none)."""
        found = [
            obj.raw
            for (resource, _, n), obj in self.objects.items()
            if resource.plural == "nodes" and n == name and not obj.deleted
        ]
        if not found:
            raise KeyError(name)
        return dict(found[0])

    def pods(self) -> list[dict[str, Any]]:
        return [
            obj.raw
            for (resource, _, _), obj in self.objects.items()
            if resource.plural == "pods" and not obj.deleted
        ]

    def events(self) -> list[dict[str, Any]]:
        """The events.k8s.io Events there are, as stored."""
        return [
            obj.raw
            for (resource, _, _), obj in self.objects.items()
            if resource.group == "events.k8s.io" and resource.plural == "events" and not obj.deleted
        ]

    def claims(self) -> list[dict[str, Any]]:
        """The ResourceClaims there are (of every version), as stored."""
        return [
            obj.raw
            for (resource, _, _), obj in self.objects.items()
            if resource.plural == "resourceclaims" and not obj.deleted
        ]

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = [
            c
            for c in self.claims()
            if c["metadata"]["namespace"] == namespace and c["metadata"]["name"] == name
        ]
        return found[0] if found else None

    async def add_slice(self, node: str, **kwargs: Any) -> dict[str, Any]:
        version = kwargs.pop("version", self.dra_versions[0])
        body = slice_body(node, version=version, **kwargs)
        return await self._send("POST", f"/apis/{RESOURCE_GROUP}/{version}/resourceslices", body)

    async def delete_slice(self, name: str) -> dict[str, Any]:
        version = self.dra_versions[0]
        return await self._send("DELETE", f"/apis/{RESOURCE_GROUP}/{version}/resourceslices/{name}")

    async def add_allocated_claim(
        self, namespace: str, name: str, node: str, devices: list[str], *, driver: str = DRA_DRIVER
    ) -> dict[str, Any]:
        """A claim the kube-scheduler allocated for someone else's pod."""
        version = self.dra_versions[0]
        path = f"/apis/{RESOURCE_GROUP}/{version}/namespaces/{namespace}/resourceclaims"
        body = {
            "apiVersion": f"{RESOURCE_GROUP}/{version}",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {"deviceClassName": driver, "count": len(devices)},
                        }
                    ]
                }
            },
        }
        await self._send("POST", path, body)
        results = [{"request": "gpu", "driver": driver, "pool": node, "device": d} for d in devices]
        status = {"status": {"allocation": {"devices": {"results": results}}}}
        return await self._send("PATCH", f"{path}/{name}/status", status)

    async def _send(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        async with self.request(method, path, json=body) as response:
            data: dict[str, Any] = await response.json()
            if response.status >= 400:
                raise RuntimeError(f"{method} {path}: {response.status} {data.get('message')}")
            return data

    async def add_node(self, name: str, **kwargs: Any) -> dict[str, Any]:
        return await self._send("POST", "/api/v1/nodes", node_body(name, **kwargs))

    async def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return await self._send("PATCH", f"/api/v1/nodes/{name}", patch)

    async def delete_node(self, name: str) -> dict[str, Any]:
        return await self._send("DELETE", f"/api/v1/nodes/{name}")

    async def set_node_ready(self, name: str, ready: bool) -> None:
        await self.patch_node(name, {"status": {"conditions": [_ready(ready)]}})

    async def add_pod(self, namespace: str, name: str, **kwargs: Any) -> dict[str, Any]:
        body = pod_body(namespace, name, **kwargs)
        return await self._send("POST", f"/api/v1/namespaces/{namespace}/pods", body)

    async def delete_pod(self, namespace: str, name: str, *, grace: int = 0) -> dict[str, Any]:
        """Delete a pod: at once (`kubectl delete --grace-period=0 --force`), or with a grace
        period (Terminating for a while, see the module)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds={grace}"
        return await self._send("DELETE", path)

    async def set_quota(
        self,
        namespace: str,
        name: str,
        hard: Mapping[str, str],
        *,
        used: Mapping[str, str] | None = None,
        scopes: list[str] | None = None,
    ) -> dict[str, Any]:
        """Create a ResourceQuota, or change its `hard` and `status.used` (kmock has no quota
        controller: `used` is what the test says)."""
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"hard": dict(hard), **({"scopes": scopes} if scopes else {})},
            "status": {"hard": dict(hard), "used": dict(used or {})},
        }
        path = f"/api/v1/namespaces/{namespace}/resourcequotas"
        if any(
            resource.plural == "resourcequotas" and ns == namespace and n == name and not o.deleted
            for (resource, ns, n), o in self.objects.items()
        ):
            return await self._send(
                "PATCH", f"{path}/{name}", {k: body[k] for k in ("spec", "status")}
            )
        return await self._send("POST", path, body)

    async def delete_quota(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._send("DELETE", f"/api/v1/namespaces/{namespace}/resourcequotas/{name}")

    async def set_pod_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        *,
        reason: str | None = None,
        container_reason: str | None = None,
        exit_code: int = 1,
    ) -> None:
        """What the kubelet would report: the phase, a pod-level reason (Evicted), or the
        container's termination reason (OOMKilled)."""
        state: dict[str, Any] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        if phase in ("Succeeded", "Failed"):
            code = 0 if phase == "Succeeded" else exit_code
            term = {
                "exitCode": code,
                "reason": container_reason or ("Completed" if code == 0 else "Error"),
            }
            state = {"terminated": term}
        status: dict[str, Any] = {
            "phase": phase,
            "containerStatuses": [{"name": "main", "ready": phase == "Running", "state": state}],
        }
        if reason:
            status["reason"] = reason
        await self._send("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", {"status": status})


def _grace_of(request: kmock.Request) -> int | None:
    """The grace period a delete asks (query parameter or DeleteOptions body), if any."""
    raw = request.params.get("gracePeriodSeconds")
    if raw is None and isinstance(request.data, dict):
        raw = request.data.get("gracePeriodSeconds")
    return None if raw is None else int(raw)


def _in_use(pod: Mapping[str, Any] | None, ref: Mapping[str, Any]) -> bool:
    """Whether a claim's `reservedFor` entry still names a pod that may use the devices."""
    if pod is None:
        return False
    uid = (pod.get("metadata") or {}).get("uid")
    if ref.get("uid") and uid and ref["uid"] != uid:
        return False  # another pod of that name
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _list_key(item: Mapping[str, Any]) -> tuple[str, str]:
    meta = item.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def _group_path(request: kmock.Request) -> str | None:
    """The group of an APIGroup request with the trailing slash (`/apis/resource.k8s.io/`)."""
    path = request.url.path
    parts = path.split("/")
    if request.method != kmock.method.GET or len(parts) != 4 or parts[1] != "apis":
        return None
    return parts[2] if parts[3] == "" and parts[2] else None


def slice_body(
    node: str,
    *,
    gpus: int = 8,
    product: str = H100_PRODUCT,
    memory: str = "81559Mi",
    driver: str = DRA_DRIVER,
    version: str = "v1",
    generation: int = 1,
    indices: list[int] | None = None,
    publish_index: bool = False,
    clique: str | None = None,
    mig: int = 0,
    name: str | None = None,
    tainted: tuple[int, ...] = (),
    mig_profile: str = "1g.10gb",
    mig_parent: int | None = None,
) -> dict[str, Any]:
    """A node's ResourceSlice as NVIDIA's k8s-dra-driver-gpu publishes it: one device per GPU
    named `gpu-<minor>`, its type, UUID, product, versions and PCI bus, its memory a capacity
    (`publish_index`: also the `index` attribute older drivers published; `mig`: MIG devices
    too, which are not whole GPUs, of `mig_profile` on GPU `mig_parent`: by default the one
    after the whole GPUs, which is then not published whole; their `parentUUID` its UUID)."""
    devices = []
    for i in indices if indices is not None else range(gpus):
        attributes: dict[str, Any] = {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{i}')}"},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "570.124.6"},
            "cudaDriverVersion": {"version": "12.8.0"},
            "pcieBusID": {"string": f"0000:{0x18 + i:02x}:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{i // 4:02x}"},
        }
        if publish_index:
            attributes["index"] = {"int": i}
            attributes["minor"] = {"int": i}
        if clique is not None:
            attributes["cliqueID"] = {"string": clique}
        device: dict[str, Any] = {
            "name": f"gpu-{i}",
            "attributes": attributes,
            "capacity": {"memory": {"value": memory}},
        }
        if i in tainted:
            device["taints"] = [
                {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
            ]
        devices.append(device)
    parent = gpus if mig_parent is None else mig_parent
    for m in range(mig):
        devices.append(
            {
                "name": f"gpu-{parent}-mig-19-{m}-1",
                "attributes": {
                    "type": {"string": "mig"},
                    "uuid": {"string": f"MIG-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/mig{m}')}"},
                    "parentUUID": {
                        "string": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{parent}')}"
                    },
                    "profile": {"string": mig_profile},
                    "productName": {"string": product},
                },
                "capacity": {"memory": {"value": "9984Mi"}},
            }
        )
    return {
        "apiVersion": f"{RESOURCE_GROUP}/{version}",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{node}-{driver}-x7k2p"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _ready(ready: bool) -> dict[str, str]:
    return {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "NodeStatusUnknown",
    }


def node_body(
    name: str,
    *,
    gpus: int = 8,
    product: str = H100,
    memory_mib: int = 81559,
    labels: Mapping[str, str] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    allocatable: Mapping[str, str] | None = None,
    cpu: str = "128",
    memory: str = "1Ti",
) -> dict[str, Any]:
    """A GPU node as GPU Feature Discovery and the NVIDIA device plugin leave it."""
    alloc = {"cpu": cpu, "memory": memory, "pods": "110", GPU: str(gpus), **(allocatable or {})}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.memory": str(memory_mib),
                "nvidia.com/gpu.count": str(gpus),
                **(labels or {}),
            },
        },
        "spec": {"unschedulable": unschedulable, "taints": list(taints or [])},
        "status": {"allocatable": alloc, "capacity": dict(alloc), "conditions": [_ready(ready)]},
    }


def pod_body(
    namespace: str,
    name: str,
    *,
    node: str = "",
    gpus: int = 0,
    cpu: str = "1",
    memory: str = "1Gi",
    labels: Mapping[str, str] | None = None,
    phase: str | None = "Running",
) -> dict[str, Any]:
    """A pod someone else runs (a foreign pod, unless its labels say gpufed's)."""
    limits = {GPU: str(gpus)} if gpus else {}
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits},
                }
            ]
        },
    }
    if node:
        body["spec"]["nodeName"] = node
    if phase:
        body["status"] = {"phase": phase}
    return body


# -- helpers for the backend's tests ---------------------------------------------------------


async def until(predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "the condition did not become true in time"
        await asyncio.sleep(0.005)


async def next_event(
    stream: AsyncIterator[base.BackendEvent],
    match: Callable[[base.BackendEvent], bool],
    *,
    timeout: float = 5.0,
) -> base.BackendEvent:
    async def find() -> base.BackendEvent:
        async for event in stream:
            if match(event):
                return event
        raise AssertionError("the event stream ended")

    return await asyncio.wait_for(find(), timeout)


def pod_request(name: str, node: str, gpus: list[int], **kwargs: Any) -> base.PodRequest:
    template = {
        "metadata": {"labels": {"team": "vision"}, "annotations": {"note": "kept"}},
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "image": "trainer:1",
                    "resources": {"limits": {GPU: len(gpus)}, "requests": {"cpu": "4"}},
                }
            ]
        },
    }
    job = kwargs.pop("job_id", "job-a")
    return base.PodRequest(
        namespace=kwargs.pop("namespace", "team-a"),
        name=name,
        job_id=job,
        task="worker",
        queue="research",
        node=node,
        gpus=tuple(status.GPUSlot(index=i) for i in gpus),
        cpu_milli=4000,
        memory_mib=0,
        template=template,
        annotations={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        **kwargs,
    )


@contextlib.asynccontextmanager
async def with_kubeconfig(
    directory: Path, name: str, *, namespaces: list[str] | None = None
) -> AsyncIterator[tuple[Emulator, Path]]:
    """An emulator on a loopback port, and a kubeconfig for it (context `name`) in `directory`:
    for agent processes (`gpufed agent --backend kubernetes --kubeconfig ...`). The kubeconfig's
    token is the agent's ServiceAccount's, with the RBAC the member-agent chart renders for
    `namespaces` (None: `allNamespaces`, what an agent started without `--namespace` needs), in
    DRA mode when the emulator serves resource.k8s.io by the agent's first request; a request it
    refuses fails the test. Skipped without Go to render the chart."""
    if helmrender.MISSING:
        pytest.skip(helmrender.MISSING)
    async with Emulator() as emulator, kmock.Server(emulator) as server:

        def chart_rbac() -> kubeauthz.Authorizer:
            devices = "dra" if emulator.dra_versions else "device-plugin"
            values = kubeauthz.agent_values(namespaces=namespaces, devices=devices)
            return kubeauthz.chart_authorizer(values)

        emulator.accounts[kubeauthz.AGENT_TOKEN] = chart_rbac
        emulator.resources["v1/nodes"] = kmock.ResourceInfo(kind="Node", namespaced=False)
        emulator.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", namespaced=True)
        kubeconfig = directory / f"{name}.kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": name,
                    "clusters": [
                        {"name": name, "cluster": {"server": str(server.url).rstrip("/")}}
                    ],
                    "users": [{"name": name, "user": {"token": kubeauthz.AGENT_TOKEN}}],
                    "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
                }
            )
        )
        yield emulator, kubeconfig
        assert not emulator.forbidden, f"refused by the chart's RBAC: {emulator.forbidden}"


@contextlib.asynccontextmanager
async def running() -> AsyncIterator[tuple[Emulator, client.ApiClient]]:
    """An emulator on a loopback port, and a kubernetes-asyncio client pointed at it."""
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        emulator.resources["v1/nodes"] = kmock.ResourceInfo(kind="Node", namespaced=False)
        emulator.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", namespaced=True)
        configuration = client.Configuration(host=str(server.url).rstrip("/"))
        api = client.ApiClient(configuration=configuration)
        try:
            yield emulator, api
        finally:
            await api.close()
