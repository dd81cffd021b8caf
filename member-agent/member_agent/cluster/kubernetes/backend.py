"""The ClusterBackend of a real Kubernetes cluster, through kubernetes-asyncio.

`start` lists Nodes, the Pods of all namespaces and the ResourceQuotas of the namespaces it may
create pods in (all namespaces when unrestricted), then watches them in the background
(`watching.ListWatch`: resume from the last resourceVersion, relist on 410 Gone, reconnect with
exponential backoff and jitter). `state.ClusterState` turns what they report into
the GPU inventory and the events the agent reads; `objects` reads nodes (GPU Feature
Discovery labels, allocatable GPUs and MIG devices, taints, readiness; label keys are
configurable, defaults documented there) and builds the pods; `quotas` reads the GPU
quotas (`gpu_quotas`), which the agent checks before it creates anything.

Restart: gpufed's pods found by the first list are its jobs (`held_jobs`), rebuilt from their
labels and annotations (see `binding`), which the agent adopts before its first hello.

Binding: `spec.nodeName`, not a `kubernetes.io/hostname` node selector. The agent has already
chosen nodes and GPUs for the whole gang at once against its live inventory; `nodeName` hands
each pod straight to the kubelet, bypassing the kube-scheduler: no scheduling-queue latency, no
second opinion that could leave one pod of a gang Pending while the others run, and exactly the
node chosen (what Armada's executor and Volcano's binder effectively do). The kubelet still
admits the pod (resources, node affinity), so a stale view surfaces at once as a Failed pod
(`OutOfnvidia.com/gpu`), and ResourceQuota admission still applies at create time. The price:
no scheduler plugins run (NoSchedule taints, topology spread, preemption), which is why the
inventory keeps tainted nodes out unless the taint is tolerated, and tolerated taints are added
to the pod as tolerations. A hostname selector would keep the kube-scheduler in the loop (its
plugins, its preemption) at the cost of a scheduling round per pod and a gang that may bind
only in part.

Writes (`writing`): every pod create, delete and patch, every node patch and, in
DRA mode, every ResourceClaim request (`claiming`) is sent again on 429 (after its
Retry-After), 5xx, a timeout or a connection failure, with a jittered exponential backoff,
within `retry` (`retrying.RetryPolicy`: a 20 s deadline per request by default, backoff 0.1 s
doubling to 5 s); a create that meets its own pod or claim (an earlier try's answer lost) has
succeeded, a delete that finds nothing is done.

Pods gpufed creates carry the labels `gpufed.io/job`, `gpufed.io/gang`, `gpufed.io/queue`,
`gpufed.io/task`, the W3C `traceparent` annotation, `gpufed.io/gpus` (`0,1,2`): the GPU
indices placement chose, for bookkeeping (the device plugin picks the devices itself; in DRA
mode the pod's claim holds exactly these), and
`gpufed.io/epoch`, `gpufed.io/min-member`, `gpufed.io/gang-size` for a restarted agent.

Preemption: `annotate_pod` merge-patches the notice annotation onto a pod before the agent
deletes it with the grace period; a pod's `gpufed.io/last-checkpoint` is read with it
(`PodRecord.checkpoint`) and a change of it is a PodEvent too.

Events: a PodEvent when one of gpufed's pods changes phase (Pending only with the reason it
does not start, `state.pending_reason`; Unknown is reported as Failed/NodeLost),
with the pod's `status.reason` (Evicted, OutOfnvidia.com/gpu), a container's termination
reason (OOMKilled first, else the first failing one) or NodeLost (the taint manager deleting
it, its node deleted) as the reason; Deleted when it disappears. A node
that is NotReady makes no PodEvent by itself (the kubelet or the taint manager decide the pods'
fate); it leaves the free inventory at once. InventoryChanged when what the summary reads
changed (coalesced: at most one waits unread).

Devices (`devices`): `device-plugin` (the default) reads a node's GPUs from its allocatable
`nvidia.com/gpu` and leaves the choice of devices to the kubelet, as above; sharing pods go only
to nodes advertising the device plugin's shared replicas and request one of those
(`objects`). `dra` reads the GPUs from the ResourceSlices of a DRA driver
(`devices`, `gpu.nvidia.com` by default) and gives every pod a ResourceClaim
allocated to exactly the devices placement chose (`claims`: a claim of its own, or
one claim shared by the sharing pods of a GPU, with the driver's time-slicing or MPS
configuration), created, then the pod bound to it, then the claim owned, allocated and reserved
for the pod as the scheduler would (`claimed`; the calls are `claiming`'s,
which also finds the version of `resource.k8s.io` the server offers: v1 from 1.34, else
v1beta2). Deleting a pod deletes its
claim (a shared one once no pod of gpufed's holds it); the pod's ownership deletes it too.
Between the pod's create and its claim's reservation the kubelet, if it sees the pod, waits:
it starts no container for a claim not reserved for the pod. See docs/kubernetes.md.

GPU health (`health`, `gpuhealth`): a GPU the device plugin drops from allocatable,
that a health taint or label of its node names, or whose DRA device is tainted leaves the
inventory within the watch event that says so, and gpufed's pods on it fail `GPUFailed` (the
gang with them, retried by the broker within its budget). With `--auto-cordon`, a node that has
had `--cordon-after` GPU failures is cordoned: `spec.unschedulable: true` and the annotation
`gpufed.io/cordoned` (why) in one merge patch of the Node; a warning is logged and an Event
recorded on the Node (`events`, as for each pod failed GPUFailed). GPUs unhealthy
in the first lists are not failures (`HealthBook.seeded`): a restarted agent fails the pods
on them but does not count them toward cordoning again.

Configuration: in a pod (`KUBERNETES_SERVICE_HOST` set) the service account is used; outside,
a kubeconfig (`kubeconfig`, default `~/.kube/config`) and its `context`. Namespaces and label
keys not passed in come from the environment, as the Helm chart sets them: `GPUFED_NAMESPACES`
(comma-separated namespaces pods may be created in; unset: any the RBAC allows) and
`GPUFED_LABEL_KEYS` (a JSON object in `LabelKeys.from_mapping`'s camelCase keys).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from kubernetes_asyncio import client, config

from broker.api import status
from kits import tasks
from member_agent.cluster import base, errors, gpuhealth
from member_agent.cluster.kubernetes import (
    claimed,
    claiming,
    devices,
    health,
    objects,
    quotas,
    retrying,
    state,
    watching,
    writing,
)
from member_agent.cluster.kubernetes import events as node_events
from member_agent.inventory import model

logger = logging.getLogger(__name__)

LabelKeys = objects.LabelKeys
DeviceKeys = devices.DeviceKeys
HealthKeys = health.HealthKeys
Devices = Literal["device-plugin", "dra"]
NAMESPACES_ENV = "GPUFED_NAMESPACES"
LABEL_KEYS_ENV = "GPUFED_LABEL_KEYS"
DEFAULT_BACKOFF = watching.Backoff()
USER_AGENT = "gpufed-member-agent"


def namespaces_from_env(environ: Mapping[str, str]) -> list[str] | None:
    """`GPUFED_NAMESPACES` (team-a,team-b) as a list; None when unset."""
    raw = environ.get(NAMESPACES_ENV)
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def label_keys_from_env(environ: Mapping[str, str]) -> LabelKeys:
    """`GPUFED_LABEL_KEYS` (JSON) as LabelKeys; the defaults when unset."""
    raw = environ.get(LABEL_KEYS_ENV)
    if not raw:
        return LabelKeys()
    try:
        values = json.loads(raw)
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
        return LabelKeys.from_mapping(values)
    except ValueError as exc:
        raise errors.PermanentBackendError(f"{LABEL_KEYS_ENV}: {exc}") from exc


class _EventStream:
    """The backend's events, in order. Cancelling a wait (a timeout) loses nothing and does
    not end the stream, unlike an async generator; `close()` ends it."""

    def __init__(
        self, queue: asyncio.Queue[base.BackendEvent | None], cluster_state: state.ClusterState
    ) -> None:
        self._queue = queue
        self._state = cluster_state

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> base.BackendEvent:
        event = await self._queue.get()
        if event is None:
            self._queue.put_nowait(None)  # every reader sees the end
            raise StopAsyncIteration
        if isinstance(event, base.InventoryChanged):
            self._state.change_pending = False
        return event


class KubernetesBackend:
    """ClusterBackend over the Kubernetes API (see the module docstring)."""

    def __init__(
        self,
        cluster: str,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        namespaces: list[str] | None = None,
        label_keys: LabelKeys | None = None,
        api_client: client.ApiClient | None = None,
        backoff: watching.Backoff = DEFAULT_BACKOFF,
        watch_timeout_seconds: int = 300,
        request_timeout_seconds: float = 30.0,
        devices: Devices = "device-plugin",
        device_keys: DeviceKeys | None = None,
        shared_gpu_resource: str | None = None,
        health_keys: HealthKeys | None = None,
        health_settings: gpuhealth.HealthSettings | None = None,
        retry: retrying.RetryPolicy | None = None,
    ) -> None:
        self.cluster = cluster
        self.devices = devices
        self._kubeconfig = kubeconfig
        self._context = context
        if namespaces is None:
            namespaces = namespaces_from_env(os.environ)
        self._namespaces = frozenset(namespaces) if namespaces is not None else None
        self._keys = label_keys if label_keys is not None else label_keys_from_env(os.environ)
        if shared_gpu_resource:
            self._keys = dataclasses.replace(self._keys, shared_gpu_resource=shared_gpu_resource)
        self._api = api_client
        self._owns_api = api_client is None
        self._backoff = backoff
        self._watch_timeout = watch_timeout_seconds
        self._request_timeout = request_timeout_seconds
        self._writer = writing.Writer(
            self._core,
            request_timeout=request_timeout_seconds,
            policy=retry if retry is not None else retrying.RetryPolicy(),
        )
        self._queue: asyncio.Queue[base.BackendEvent | None] = asyncio.Queue()
        health_keys = health_keys or HealthKeys()
        device_keys = dataclasses.replace(
            device_keys or DeviceKeys(),
            health_taints=health_keys.taints,
            health_conditions=health_keys.conditions,
        )
        self._book = _book(devices, device_keys)
        self._health = gpuhealth.HealthBook(
            cluster, health_settings, cordon=self._cordon_soon, seeding=True
        )
        self._events = node_events.NodeEvents(
            self._health,
            api=self._connect,
            request_timeout=request_timeout_seconds,
            pods=lambda name: self._state.record(name),  # noqa: PLW0108 (built next)
        )
        self._state = state.ClusterState(
            cluster,
            self._keys,
            self._events.watching(self._queue.put_nowait),
            device_plugin=self._book is None,
            node_view=self._book_view if self._book is not None else None,
            health_keys=health_keys,
            health_book=self._health,
        )
        self._cordoning: set[asyncio.Task[None]] = set()
        self._claims: claiming.Claims | None = None
        self._claimed: claimed.ClaimedPods | None = None
        self._quotas = quotas.QuotaBook()
        self._watches: list[watching.ListWatch] = []
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def from_config(
        cls,
        cluster: str,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        namespaces: list[str] | None = None,
        label_keys: LabelKeys | None = None,
        **kwargs: Any,
    ) -> KubernetesBackend:
        """A backend with its own API client: in-cluster config when running in a pod (and no
        kubeconfig is given), the kubeconfig and context otherwise."""
        backend = cls(
            cluster,
            kubeconfig=kubeconfig,
            context=context,
            namespaces=namespaces,
            label_keys=label_keys,
            **kwargs,
        )
        await backend._connect()
        return backend

    async def _connect(self) -> client.ApiClient:
        if self._api is not None:
            return self._api
        configuration = client.Configuration()
        in_cluster = os.environ.get("KUBERNETES_SERVICE_HOST")
        try:
            if in_cluster and self._kubeconfig is None and self._context is None:
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                await config.load_kube_config(
                    config_file=self._kubeconfig,
                    context=self._context,
                    client_configuration=configuration,
                    persist_config=False,
                )
        except (config.ConfigException, OSError) as exc:
            raise errors.PermanentBackendError(f"kubernetes configuration: {exc}") from exc
        self._api = client.ApiClient(configuration=configuration)
        self._api.user_agent = USER_AGENT
        self._owns_api = True
        return self._api

    def _book_view(self, node: model.Node) -> model.Node:
        assert self._book is not None
        book = self._book
        return devices.with_devices(node, book.devices(node.name), book.mig_devices(node.name))

    def _core(self) -> client.CoreV1Api:
        if self._api is None:
            raise errors.PermanentBackendError("the backend is not started")
        return client.CoreV1Api(self._api)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """List nodes, pods and ResourceQuotas (errors raise: a wrong config or RBAC fails
        fast), then watch them in the background."""
        api = await self._connect()
        core = self._core()
        dra: list[watching.ListWatch] = []
        if self._book is not None:
            version = await claiming.detect_version(api, timeout=self._request_timeout)
            self._claims = claiming.Claims(
                api,
                version=version,
                keys=self._book.keys,
                request_timeout=self._request_timeout,
                policy=self._writer.policy,
            )
            self._claimed = claimed.ClaimedPods(
                self._claims,
                self._state,
                self._book,
                admit=self._record_of,
                post=self._post_pod,
                delete=functools.partial(self._delete, grace=0),
            )
            dra = self._claims.watches(
                self._state, self._book, backoff=self._backoff, timeout_seconds=self._watch_timeout
            )
            logger.info("cluster %s: DRA mode, resource.k8s.io/%s", self.cluster, version)
        self._watches = [
            watching.ListWatch(
                "nodes",
                core.list_node,
                state.NodeFeed(self._state),
                backoff=self._backoff,
                timeout_seconds=self._watch_timeout,
            ),
            watching.ListWatch(
                "pods",
                core.list_pod_for_all_namespaces,
                state.PodFeed(self._state),
                backoff=self._backoff,
                timeout_seconds=self._watch_timeout,
            ),
            *self._quota_watches(core),
            *dra,
        ]
        # the slices first: nodes and pods are read onto the GPUs they publish
        for watch in sorted(self._watches, key=lambda w: w.kind != "resourceslices"):
            await watch.relist()
        self._health.seeded()  # GPUs unhealthy from now on are failures
        self._tasks = [
            asyncio.create_task(watch.run(), name=f"watch-{watch.kind}") for watch in self._watches
        ]
        logger.info(
            "cluster %s: %d GPU nodes, %d pods held, %d gpufed jobs found",
            self.cluster,
            len(self._state.inventory.nodes),
            len(self._state.inventory.pods),
            len(self._state.held_jobs()),
        )

    def _quota_watches(self, core: client.CoreV1Api) -> list[watching.ListWatch]:
        """One ResourceQuota watch per namespace pods may go to (the chart's Roles allow no
        more); one over all namespaces when any namespace may be used."""
        calls: list[tuple[str, watching.ListCall, str | None]]
        if self._namespaces is None:
            calls = [("resourcequotas", core.list_resource_quota_for_all_namespaces, None)]
        else:
            calls = [
                (
                    f"resourcequotas in {namespace}",
                    functools.partial(core.list_namespaced_resource_quota, namespace),
                    namespace,
                )
                for namespace in sorted(self._namespaces)
            ]
        return [
            watching.ListWatch(
                kind,
                call,
                quotas.QuotaFeed(self._quotas, namespace),
                backoff=self._backoff,
                timeout_seconds=self._watch_timeout,
            )
            for kind, call, namespace in calls
        ]

    async def close(self) -> None:
        for task in [*self._tasks, *self._cordoning]:
            task.cancel()
        for task in [*self._tasks, *self._cordoning]:
            await tasks.stop_task(task)
        self._tasks = []
        await self._events.close()
        self._queue.put_nowait(None)
        if self._api is not None and self._owns_api:
            await self._api.close()
            self._api = None

    @property
    def label_keys(self) -> LabelKeys:
        return self._keys

    @property
    def watches(self) -> list[watching.ListWatch]:
        """The list+watch loops (nodes, pods, then ResourceQuotas; in DRA mode then
        ResourceSlices and ResourceClaims): their resourceVersion and counters."""
        return list(self._watches)

    @property
    def device_keys(self) -> DeviceKeys | None:
        """DRA mode: the driver, its DeviceClass and the attribute names read."""
        return self._book.keys if self._book is not None else None

    @property
    def resource_api_version(self) -> str | None:
        """DRA mode, once started: the `resource.k8s.io` version in use (v1 or v1beta2)."""
        return self._claims.version if self._claims is not None else None

    # -- reading -----------------------------------------------------------------------------

    def inventory(self) -> model.Inventory:
        return self._state.inventory

    def pods_of(self, job_id: str) -> list[status.PodStatus]:
        return self._state.pods_of(job_id)

    def events(self) -> AsyncIterator[base.BackendEvent]:
        return _EventStream(self._queue, self._state)

    def held_jobs(self) -> dict[str, base.HeldJob]:
        return self._state.held_jobs()

    def gpu_quotas(self, namespace: str) -> list[model.GPUQuota]:
        return self._quotas.gpu_quotas(namespace, in_use=self._state.gpus_requested(namespace))

    def gpu_health(self) -> gpuhealth.HealthBook:
        return self._health

    # -- writing -----------------------------------------------------------------------------

    async def create_pod(self, request: base.PodRequest) -> None:
        """Create one pod bound to `request.node`; its GPUs are held in the inventory as soon
        as the API server accepts it."""
        if self._namespaces is not None and request.namespace not in self._namespaces:
            raise errors.PermanentBackendError(
                f"pod {request.name}: namespace {request.namespace} is not one this agent "
                f"may create pods in ({', '.join(sorted(self._namespaces))})"
            )
        if self._claimed is not None:
            await self._claimed.create(request, objects.build_pod(request, self._keys))
            return
        node = self._state.inventory.nodes.get(request.node)
        labels = node.labels if node is not None else {}
        shared = labels.get(model.SHARED_RESOURCE_LABEL, "")
        if labels.get(model.SHARING_LABEL) != model.SHARING_REPLICAS:
            shared = ""
        body = objects.build_pod(request, self._keys, shared_resource=shared)
        record = self._record_of(body)
        await self._post_pod(request, body)
        self._state.add_created(record, at=time.monotonic())

    def _record_of(self, body: dict[str, Any]) -> objects.PodRecord:
        """The pod's record, if it fits its node now (else PermanentBackendError)."""
        record = objects.read_pod(body, shared_resource=self._keys.shared_gpu_resource)
        problem = self._state.check_fits(record)
        if problem:
            raise errors.PermanentBackendError(f"pod {record.name}: {problem}")
        return record

    async def _post_pod(self, request: base.PodRequest, body: dict[str, Any]) -> dict[str, Any]:
        return await self._writer.create_pod(request.namespace, body)

    async def delete_pod(self, namespace: str, name: str, *, grace_seconds: float) -> None:
        """Delete one pod with a grace period; a pod that does not exist is not an error. Its
        GPUs stay held until the watch reports it gone (it runs through its grace period). In
        DRA mode its claim goes too (a shared one when no other pod of gpufed's holds it)."""
        record = self._state.record(name)
        await self._delete(namespace, name, grace=max(0, round(grace_seconds)))
        if self._claimed is not None:
            await self._claimed.release(namespace, name, record)

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Add annotations to one pod (a JSON merge patch of its metadata); a pod that does
        not exist is not an error."""
        body = {"metadata": {"annotations": dict(annotations)}}
        await self._writer.patch_pod(namespace, name, body)

    def _cordon_soon(self, node: str, why: str) -> None:
        """The health book's cordon: the Node patched in the background (from a watch)."""
        task = asyncio.get_running_loop().create_task(self.cordon(node, why), name="cordon")
        self._cordoning.add(task)
        task.add_done_callback(self._cordoning.discard)

    async def cordon(self, node: str, why: str) -> None:
        """Mark a node unschedulable, saying why in its `gpufed.io/cordoned` annotation; a
        failure is logged (the node's GPUs are out of the inventory anyway)."""
        body = {
            "metadata": {"annotations": {gpuhealth.CORDON_ANNOTATION: why}},
            "spec": {"unschedulable": True},
        }
        try:
            patched = await self._writer.patch_node(node, body)
        except errors.BackendError as exc:
            logger.error("cluster %s: cordon node %s failed: %s", self.cluster, node, exc)
            return
        logger.warning("cluster %s: node %s cordoned: %s", self.cluster, node, why)
        if self._events.enabled:
            self._events.cordoned(patched, why)

    async def _delete(self, namespace: str, name: str, *, grace: int) -> None:
        if not await self._writer.delete_pod(namespace, name, grace=grace):
            self._state.forget(namespace, name)


def _book(mode: Devices, keys: DeviceKeys | None) -> devices.DeviceBook | None:
    if mode == "dra":
        return devices.DeviceBook(keys or DeviceKeys())
    if mode != "device-plugin":
        raise errors.PermanentBackendError(f"devices: {mode!r} is not device-plugin or dra")
    return None
