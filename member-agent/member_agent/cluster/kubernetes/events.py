"""Kubernetes Events on a Node about its GPUs, recorded as a controller records them, so that
`kubectl describe node` and `kubectl events` show what gpufed did there and why.

Written with `--auto-cordon` (the chart grants `create` on `events.k8s.io` events with it):

- **the agent cordoned the node**: reason `GPUFailuresCordoned`, action `Cordon`, the note
  says why (`GPUFailed: 2 GPU failures on this node within 1h`) and which GPUs are unhealthy;
- **a pod of gpufed's on it failed GPUFailed** (whichever way the cluster said so): reason
  `GPUFailed`, action `FailGang`, the note names the pod, its job, the node's unhealthy GPUs
  and why; `related` is the pod.

Each is an `events.k8s.io/v1` Event of type Warning, as client-go's events recorder (the
kube-scheduler's) writes one: in the `default` namespace (a Node has none), named
`<node>.<nanoseconds, hex>`, `regarding` the Node with its uid (the one kubectl's node
describer looks up; the kubelet's own Events use the node's name as uid, which it looks up
too: used here when the Node could not be read), `eventTime`, `reportingController:
gpufed.io/member-agent`, `reportingInstance` that and the host name, the `note` cut to the API
server's 1 KiB. No series, no aggregation: failures are rare, and every one is worth a line.

An Event is written in the background and once; one that fails (RBAC, a timeout, the API
server down) is logged and counted (`HealthBook.event_written`, `/metrics`
`gpufed_agent_node_events_total{result="failed"}`), and nothing waits for it: not the cordon,
not the gang's failure.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kubernetes_asyncio import client

from broker.api import status
from kits import tasks
from member_agent.cluster import base, errors, gpuhealth
from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.cluster.kubernetes import objects

logger = logging.getLogger(__name__)

REPORTING_CONTROLLER = "gpufed.io/member-agent"
NAMESPACE = "default"  # where Events about cluster-scoped objects go
CORDONED = "GPUFailuresCordoned"
GPU_FAILED = gpuhealth.GPU_FAILED
API_VERSION = "events.k8s.io/v1"
_NOTE_BYTES = 1024  # the API server's limit on a note
_FIELD_LIMIT = 128  # reportingInstance, action, reason
_NAME_LIMIT = 253
RawCall = Callable[..., Awaitable[Any]]


def reporting_instance(host: str | None = None) -> str:
    """`gpufed.io/member-agent-<host>`, as client-go names its recorder's instance."""
    return f"{REPORTING_CONTROLLER}-{host or socket.gethostname()}"[:_FIELD_LIMIT]


def node_event(
    node: Mapping[str, Any],
    *,
    reason: str,
    action: str,
    note: str,
    instance: str,
    now: datetime.datetime,
    related: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """An events.k8s.io/v1 Event of type Warning regarding a Node (its name and uid from
    `node`'s metadata; the name as uid when there is none, as the kubelet does)."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name") or "")
    stamp = now.astimezone(datetime.UTC)
    nanos = int(stamp.timestamp()) * 1_000_000_000 + stamp.microsecond * 1000
    suffix = f".{nanos:x}"
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "Event",
        "metadata": {
            "name": name[: _NAME_LIMIT - len(suffix)].rstrip(".-") + suffix,
            "namespace": NAMESPACE,
        },
        "eventTime": stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:_FIELD_LIMIT],
        "action": action[:_FIELD_LIMIT],
        "reason": reason[:_FIELD_LIMIT],
        "type": "Warning",
        "note": _cut(note),
        "regarding": {
            "apiVersion": "v1",
            "kind": "Node",
            "name": name,
            "uid": str(meta.get("uid") or name),
        },
    }
    if related:
        body["related"] = dict(related)
    return body


def is_gpu_failure(event: base.BackendEvent) -> bool:
    """A pod of gpufed's reported Failed GPUFailed (its gang fails with it)."""
    return (
        isinstance(event, base.PodEvent)
        and event.phase == status.PodPhase.FAILED
        and event.reason == GPU_FAILED
        and bool(event.node)
    )


class NodeEvents:
    """Writes the module's Events for a Kubernetes backend, in the background."""

    def __init__(
        self,
        book: gpuhealth.HealthBook,
        *,
        api: Callable[[], Awaitable[client.ApiClient]],
        request_timeout: float,
        pods: Callable[[str], objects.PodRecord | None] = lambda name: None,
        instance: str | None = None,
        now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self._book = book
        self._api = api
        self._timeout = request_timeout
        self._pods = pods  # gpufed's pods by name (for the namespace of an Event's `related`)
        self._instance = instance or reporting_instance()
        self._now = now
        self._writing: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._book.settings.auto_cordon

    def watching(
        self, emit: Callable[[base.BackendEvent], None]
    ) -> Callable[[base.BackendEvent], None]:
        """`emit`, and an Event on the node of each pod of gpufed's that fails GPUFailed."""

        def emit_and_record(event: base.BackendEvent) -> None:
            emit(event)
            if self.enabled and isinstance(event, base.PodEvent) and is_gpu_failure(event):
                self._gpu_failed(event)

        return emit_and_record

    def cordoned(self, node: Mapping[str, Any], why: str) -> None:
        """The node (as the cordon's patch returned it) was cordoned."""
        name = str((node.get("metadata") or {}).get("name") or "")
        note = f"cordoned by gpufed: {why}{self._gpus(name)}; uncordon it after the repair"
        body = self._body(node, reason=CORDONED, action="Cordon", note=note)
        self._spawn(self._write(body), node=name)

    async def close(self) -> None:
        for task in list(self._writing):
            task.cancel()
        for task in list(self._writing):
            await tasks.stop_task(task)

    def _spawn(self, work: Awaitable[None], *, node: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(f"event-{node}")
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    def _gpu_failed(self, event: base.PodEvent) -> None:
        note = (
            f"pod {event.name} of job {event.job_id} failed {GPU_FAILED}{self._gpus(event.node)}:"
            " gpufed fails its gang; the broker retries it within its failure policy"
        )
        related = {"apiVersion": "v1", "kind": "Pod", "name": event.name}
        pod = self._pods(event.name)  # now: the agent deletes it next
        if pod is not None:
            related["namespace"] = pod.namespace
        self._spawn(self._write_on(event.node, note=note, related=related), node=event.node)

    async def _write_on(self, name: str, *, note: str, related: Mapping[str, Any]) -> None:
        node = await self._read_node(name)
        kwargs = {"reason": GPU_FAILED, "action": "FailGang", "note": note, "related": related}
        await self._write(self._body(node, **kwargs))

    def _gpus(self, node: str) -> str:
        found = self._book.unhealthy.get(node)
        if not found:
            return ""
        why = self._book.reasons.get(node)
        return f"; unhealthy GPUs {','.join(map(str, sorted(found)))}" + (
            f" ({why})" if why else ""
        )

    def _body(self, node: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        return node_event(node, instance=self._instance, now=self._now(), **kwargs)

    async def _read_node(self, name: str) -> Mapping[str, Any]:
        """The Node (for its uid); only its name when it cannot be read."""
        what = f"read node {name}"
        try:
            api = await self._api()
            read: RawCall = client.CoreV1Api(api).read_node
            async with k8s_errors.translating(what):
                response = await read(name, _preload_content=False, _request_timeout=self._timeout)
                async with response:
                    found: dict[str, Any] = await k8s_errors.read_json(response, what=what)
                    return found
        except errors.BackendError as exc:
            logger.info("%s for its Event: %s (its name serves as uid)", what, exc)
            return {"metadata": {"name": name}}

    async def _write(self, body: Mapping[str, Any]) -> None:
        name = body["regarding"]["name"]
        what = f"create Event {body['reason']} on node {name}"
        try:
            api = await self._api()
            create: RawCall = client.EventsV1Api(api).create_namespaced_event
            async with k8s_errors.translating(what):
                response = await create(
                    NAMESPACE, body, _preload_content=False, _request_timeout=self._timeout
                )
                async with response:
                    await k8s_errors.check_response(response, what=what)
        except errors.BackendError as exc:
            self._book.event_written(ok=False)
            logger.warning("cluster %s: %s failed: %s", self._book.cluster, what, exc)
            return
        self._book.event_written(ok=True)
        logger.info("cluster %s: %s: %s", self._book.cluster, what, body["note"])


def _cut(note: str) -> str:
    """The note within the API server's 1 KiB (whole characters, `…` where it was cut)."""
    raw = note.encode()
    if len(raw) <= _NOTE_BYTES:
        return note
    return raw[: _NOTE_BYTES - 3].decode(errors="ignore") + "…"
