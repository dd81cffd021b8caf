"""What the Kubernetes backend knows of its cluster: nodes and pods as the watches report
them, the GPU inventory derived from them, and the events they cause.

The inventory is always derived, never patched blindly: a node change rebuilds that node and
re-applies the pods on it; a relist rebuilds everything from the listed objects (it replaces,
so nothing is counted twice across reconnects). Every pod that is bound and not terminal holds
its requests: gpufed's own pods the GPUs placement chose (the `gpufed.io/gpus` annotation),
other pods the number of GPUs they request, on indices taken from the top (the device plugin,
not gpufed, picks a foreign pod's devices; only the count is real). Pods gpufed created are held
from the moment the create succeeds, before any watch reports them, and the watch's report
then replaces that entry instead of adding to it.

It also counts the GPUs every namespace's live pods request (for ResourceQuotas, see
`quotas`) and groups gpufed's pods by job (`held_jobs`: what a restarted agent
adopts).

DRA mode (`devices`): nodes carry no GPUs of their own (`device_plugin=False`); the
`node_view` hook gives each node the GPUs its ResourceSlices publish, and ResourceClaims that
other schedulers allocated are held like pods (`hold`: a record per claim, never reported).

A Pending pod of gpufed's that says why it does not start (`pending_reason`: an image that
cannot be pulled, PodScheduled=False) is reported with that reason, and again when it changes.

GPU health (`health`): each time a node is built its unhealthy GPUs leave the
inventory and the `gpuhealth.HealthBook` is told; gpufed's pods on a GPU that has just failed,
and a pod the kubelet reports an allocated device of Unhealthy, are reported Failed GPUFailed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from broker.api import status
from member_agent.cluster import base, gpuhealth
from member_agent.cluster.kubernetes import health, objects
from member_agent.cluster.kubernetes import mig as migs
from member_agent.inventory import model

logger = logging.getLogger(__name__)

# whole-GPU slots are shared, never mutated: building pydantic models is the cost of a relist
_WHOLE = tuple(status.GPUSlot(index=i) for i in range(64))
_TERMINAL = (status.PodPhase.SUCCEEDED, status.PodPhase.FAILED, status.PodPhase.DELETED)
# a container the kubelet cannot start: the pod stays Pending, and says why
_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)
PENDING_REASON_CHARS = 200


def pending_reason(state: dict[str, Any]) -> str:
    """Why a Pending pod does not start ("" when it says nothing): a container's waiting
    reason the kubelet gives up on retrying by itself (image pull, container config), else a
    PodScheduled=False condition (Unschedulable), with its message, at most
    PENDING_REASON_CHARS long."""
    found = ""
    for container in [
        *(state.get("initContainerStatuses") or []),
        *(state.get("containerStatuses") or []),
    ]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _WAITING:
            found = f"{waiting['reason']}: {waiting.get('message') or ''}"
            break
    else:
        for cond in state.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                found = f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message') or ''}"
                break
    found = " ".join(found.split()).rstrip(": ")
    if len(found) > PENDING_REASON_CHARS:
        found = found[: PENDING_REASON_CHARS - 3] + "..."
    return found


def _holding(rec: objects.PodRecord | None) -> tuple[Any, ...]:
    if rec is None or not rec.holds:
        return ()
    mig = (tuple(sorted(rec.mig.items())), tuple(sorted(rec.mig_slots.items())))
    return (rec.node, rec.gpus, rec.cpu_milli, rec.memory_mib, rec.slots, mig)


def _shape(node: model.Node | None) -> model.Node | None:
    """What the summary reads of a node: its labels do not count (GFD rewrites a timestamp
    label every minute)."""
    if node is None:
        return None
    return dataclasses.replace(node, labels={})


class ClusterState:
    """Nodes, pods and the inventory of one cluster. Called from the watch loops and from
    create/delete; single-threaded (one event loop), so no locking."""

    def __init__(
        self,
        cluster: str,
        keys: objects.LabelKeys,
        emit: Callable[[base.BackendEvent], None],
        *,
        device_plugin: bool = True,
        node_view: Callable[[model.Node], model.Node] | None = None,
        health_keys: health.HealthKeys | None = None,
        health_book: gpuhealth.HealthBook | None = None,
    ) -> None:
        self.inventory = model.Inventory(cluster=cluster)
        self._keys = keys
        self._emit = emit
        self._device_plugin = device_plugin
        self._node_view = node_view
        self._health_keys = health_keys or health.HealthKeys()
        self.health = health_book or gpuhealth.HealthBook(cluster)
        self._node_health: dict[str, health.NodeHealth] = {}  # as the Node objects say
        self._held: dict[str, objects.PodRecord] = {}  # not pods: foreign claims (DRA)
        self._nodes: dict[str, model.Node] = {}  # as parsed, everything free
        self._pods: dict[str, objects.PodRecord] = {}  # by key, as the API reports them
        self._created: dict[str, tuple[objects.PodRecord, float]] = {}  # created, not seen yet
        self._by_node: dict[str, set[str]] = defaultdict(set)  # keys of holding pods
        self._by_job: dict[str, set[str]] = defaultdict(set)
        self._reported: dict[str, objects.PodRecord] = {}  # gpufed's pods: last phase sent
        # GPUs requested by non-terminal pods (bound or not), by namespace then pod key
        self._gpu_use: dict[str, dict[str, int]] = defaultdict(dict)
        self.change_pending = False

    # -- nodes -------------------------------------------------------------------------------

    def replace_nodes(self, items: list[dict[str, Any]], *, started: float) -> None:
        del started
        parsed = [self._read_node(item) for item in items]
        nodes = {node.name: node for node in parsed if node is not None}
        listed = {str((item.get("metadata") or {}).get("name", "")) for item in items}
        lost = set(self._nodes) - listed  # gone from the cluster, not just out of GPUs
        self._nodes = nodes
        self._rebuild()
        for name in sorted(lost):
            self._report_node_lost(name)
            self._forget_health(name)
        self._changed("nodes listed")

    def apply_node(self, kind: str, raw: dict[str, Any]) -> None:
        name = str((raw.get("metadata") or {}).get("name", ""))
        old_health = self._node_health.get(name)
        node = None if kind == "DELETED" else self._read_node(raw)
        old = self._nodes.get(name)
        if node == old and self._node_health.get(name) == old_health:
            return  # a heartbeat or a change gpufed does not read
        if node is None:
            del self._nodes[name]
        else:
            self._nodes[name] = node
        self._rebuild_node(name)
        if kind == "DELETED":
            self._report_node_lost(name)
            self._forget_health(name)
        if _shape(node) != _shape(old) or self._node_health.get(name) != old_health:
            self._changed(f"node {name} changed")

    def _read_node(self, raw: dict[str, Any]) -> model.Node | None:
        """The node as the inventory reads it; what it says of its GPUs' health is kept."""
        read = health.read_node(raw, self._keys, self._health_keys, plugin=self._device_plugin)
        name = str((raw.get("metadata") or {}).get("name", ""))
        self._node_health.pop(name, None)
        if not read[1].healthy:
            self._node_health[name] = read[1]
        return read[0]

    def _forget_health(self, name: str) -> None:
        self._node_health.pop(name, None)
        self.health.forget(name)

    def _read_pod(self, raw: dict[str, Any]) -> objects.PodRecord:
        rec = objects.read_pod(raw, shared_resource=self._keys.shared_gpu_resource)
        live = rec.phase in (status.PodPhase.PENDING, status.PodPhase.RUNNING)
        if rec.ours and live and health.pod_gpu_unhealthy(raw.get("status") or {}):
            return dataclasses.replace(
                rec, phase=status.PodPhase.FAILED, reason=gpuhealth.GPU_FAILED
            )
        if rec.ours and rec.phase == status.PodPhase.PENDING and not rec.reason:
            waiting = pending_reason(raw.get("status") or {})
            if waiting:
                return dataclasses.replace(rec, reason=waiting)
        return rec

    def nodes_changed(self, names: Iterable[str], *, reason: str) -> None:
        """What these nodes have changed outside their Node objects (their devices): build
        them again."""
        for name in sorted(set(names)):
            self._rebuild_node(name)
        self._changed(reason)

    # -- holdings that are not pods (DRA: claims other schedulers allocated) ----------------

    def hold(self, key: str, rec: objects.PodRecord | None) -> None:
        """Hold what `rec` holds under `key`, in place of what was held under it (None: give
        it back)."""
        old = self._held.pop(key, None)
        if old is not None:
            self._drop(old)
        if rec is not None:
            self._held[key] = rec
            self._track(rec)
            self._place(rec)
        if _holding(old) != _holding(rec):
            self._changed(f"{key} changed")

    def holders(self, node: str) -> list[objects.PodRecord]:
        """What holds GPUs on a node now: pods and claims."""
        return [rec for rec in map(self.record, sorted(self._by_node.get(node, ()))) if rec]

    def claim_users(self, namespace: str, claim: str) -> list[str]:
        """gpufed's pods holding their GPUs through a claim (DRA mode)."""
        return sorted(
            rec.name
            for rec in self._records()
            if rec.claim == claim and rec.namespace == namespace and rec.holds
        )

    # -- pods --------------------------------------------------------------------------------

    def replace_pods(self, items: list[dict[str, Any]], *, started: float) -> None:
        pods = {rec.key: rec for rec in map(self._read_pod, items)}
        # a pod created after the list was asked for may be missing from it: keep it
        self._created = {
            key: entry
            for key, entry in self._created.items()
            if key not in pods and entry[1] >= started
        }
        self._pods = pods
        gone = [rec for key, rec in self._reported.items() if key not in pods]
        self._gpu_use.clear()
        for rec in self._records():
            self._count(rec)
        self._rebuild()
        for rec in gone:
            if rec.key not in self._created:
                self._report_deleted(rec)
        for rec in pods.values():
            if rec.ours:
                self._report(rec)
        self._changed("pods listed")

    def apply_pod(self, kind: str, raw: dict[str, Any]) -> None:
        rec = self._read_pod(raw)
        key = rec.key
        created = self._created.pop(key, None)
        old = self._pods.get(key) or (created[0] if created else None)
        if kind == "DELETED":
            self._pods.pop(key, None)
            self._uncount(old or rec)
            self._drop(old or rec)
            if rec.ours:
                self._report_deleted(old or rec)
            if _holding(old):
                self._changed(f"pod {key} deleted")
            return
        self._pods[key] = rec
        self._count(rec)
        if rec.reason == gpuhealth.GPU_FAILED and (old is None or old.reason != rec.reason):
            self.health.pods_failed()  # the kubelet said its device is unhealthy
        if _holding(old) != _holding(rec):
            if old is not None:
                self._untrack(old)
            self._track(rec)
            self._place(rec)
            self._changed(f"pod {key} changed")
        elif old is None:
            self._track(rec)
        if rec.ours:
            self._report(rec)

    def add_created(self, rec: objects.PodRecord, *, at: float) -> None:
        """A pod this backend just created: hold its GPUs until the watch reports it."""
        if rec.key in self._pods:
            return  # the watch was faster than the create's response
        self._created[rec.key] = (rec, at)
        self._count(rec)
        self._track(rec)
        self._place(rec)
        self._reported.setdefault(rec.key, rec)

    def forget(self, namespace: str, name: str) -> None:
        """The API says the pod does not exist: stop holding it (if it is gpufed's)."""
        for key in (name, f"{namespace}/{name}"):
            rec = self.record(key)
            if rec is None or rec.namespace != namespace:
                continue
            self._created.pop(key, None)
            self._pods.pop(key, None)
            self._uncount(rec)
            self._drop(rec)
            if rec.ours:
                self._report_deleted(rec)
            self._changed(f"pod {key} is gone")

    def record(self, key: str) -> objects.PodRecord | None:
        rec = self._pods.get(key)
        if rec is not None:
            return rec
        created = self._created.get(key)
        return created[0] if created else self._held.get(key)

    def check_fits(self, rec: objects.PodRecord) -> str:
        """Why a pod to create does not fit its node now ("" when it does)."""
        if self.record(rec.key) is not None:
            return ""  # the API decides (409); it already holds what it needs
        node = self.inventory.nodes.get(rec.node)
        if node is None:
            return f"node {rec.node} is not in the GPU inventory"
        if not node.ready:
            return f"node {rec.node} is NotReady"
        if not node.schedulable:
            return f"node {rec.node} is cordoned or tainted"
        problem = migs.fit_problem(node, rec.name, rec.mig)
        if problem:
            return problem
        sick = sorted({s.index for s in rec.slots} & node.unhealthy)
        if sick:
            return f"GPU {', '.join(map(str, sick))} of node {rec.node} is unhealthy"
        slots = self._slots_for(node, rec)
        if len(slots) < rec.gpus:
            return f"node {rec.node} has {len(slots)} GPUs free for {rec.name}, needs {rec.gpus}"
        sharing = node.labels.get(model.SHARING_LABEL)
        partial = bool(rec.slots) and rec.slots[0].milli < model.GPU_MILLI
        resource = node.labels.get(model.SHARED_RESOURCE_LABEL, "shared replicas")
        if sharing == model.SHARING_NONE and partial:
            return (
                f"node {rec.node} advertises no {resource}: a pod of {rec.slots[0].milli} "
                "milli would be handed a whole GPU"
            )
        if sharing == model.SHARING_REPLICAS and rec.gpus and not partial and not rec.shared:
            return f"node {rec.node} offers its GPUs only as {resource} replicas"
        if sharing == model.SHARING_REPLICAS:
            return self._check_replicas(node)
        return ""

    def _check_replicas(self, node: model.Node) -> str:
        """Why the device plugin has no shared replica left on the node for one more sharing
        pod ("" when it has): its replicas per GPU bound the pods, whatever their milli."""
        unit = objects.replica_milli(node, self._keys)
        if unit >= model.GPU_MILLI:
            return ""
        replicas = node.gpu_count * (model.GPU_MILLI // unit)
        used = sum(
            rec.gpus
            for rec in self.holders(node.name)
            if rec.shared or (rec.slots and rec.slots[0].milli < model.GPU_MILLI)
        )
        if used < replicas:
            return ""
        resource = node.labels.get(model.SHARED_RESOURCE_LABEL, "shared replicas")
        return f"node {node.name}: all {replicas} {resource} replicas are in use"

    def pods_of(self, job_id: str) -> list[status.PodStatus]:
        out = []
        for key in sorted(self._by_job.get(job_id, ())):
            rec = self.record(key)
            if rec is None:
                continue
            held = self.inventory.pods.get(key)
            gpus = list(rec.slots) or (list(held[0].gpus) if held else [])
            out.append(
                status.PodStatus(
                    name=rec.name,
                    task=rec.task,
                    node=rec.node,
                    gpus=gpus,
                    phase=rec.phase,
                    reason=rec.reason,
                )
            )
        return out

    def held_jobs(self) -> dict[str, base.HeldJob]:
        """gpufed's jobs with pods known now, each rebuilt from its pods' labels and
        annotations."""
        out = {}
        for job_id, keys in self._by_job.items():
            records = [rec for rec in map(self.record, sorted(keys)) if rec is not None]
            if not records:
                continue
            first = records[0]
            out[job_id] = base.held_job(
                job_id,
                first.namespace,
                first.job_meta,
                self.pods_of(job_id),
                gpus=sum(rec.gpus for rec in records),
                queue=first.queue,
            )
        return out

    def gpus_requested(self, namespace: str) -> int:
        """GPUs the namespace's non-terminal pods request (what a GPU ResourceQuota counts)."""
        return sum(self._gpu_use.get(namespace, {}).values())

    # -- bookkeeping -------------------------------------------------------------------------

    def _count(self, rec: objects.PodRecord) -> None:
        if rec.quota_gpus > 0 and rec.phase not in _TERMINAL:
            self._gpu_use[rec.namespace][rec.key] = rec.quota_gpus
        else:
            self._uncount(rec)

    def _uncount(self, rec: objects.PodRecord) -> None:
        used = self._gpu_use.get(rec.namespace)
        if used is not None:
            used.pop(rec.key, None)

    def _records(self) -> Iterable[objects.PodRecord]:
        yield from self._pods.values()
        for rec, _ in self._created.values():
            yield rec
        yield from self._held.values()

    def _track(self, rec: objects.PodRecord) -> None:
        if rec.holds:
            self._by_node[rec.node].add(rec.key)
        if rec.ours:
            self._by_job[rec.job_id].add(rec.key)

    def _untrack(self, rec: objects.PodRecord) -> None:
        self._by_node.get(rec.node, set()).discard(rec.key)
        self._by_job.get(rec.job_id, set()).discard(rec.key)

    def _drop(self, rec: objects.PodRecord) -> None:
        self._untrack(rec)
        self.inventory.release(rec.key)

    def _place(self, rec: objects.PodRecord) -> None:
        """Hold what the pod requests on its node (what it held before is released first)."""
        self.inventory.release(rec.key)
        node = self.inventory.nodes.get(rec.node)
        if node is None or not rec.holds:
            return
        slots = self._slots_for(node, rec)
        if len(slots) < rec.gpus and not rec.shared:
            logger.warning(
                "pod %s asks %d GPUs of %s, %d free in the inventory: counting what is free",
                rec.key,
                rec.gpus,
                rec.node,
                len(slots),
            )
        # model_construct: these values are ours and already valid (validation is most of the cost)
        placement = status.PodPlacement.model_construct(
            name=rec.key, task=rec.task, node=rec.node, gpus=slots
        )
        self.inventory.apply(
            placement,
            cpu_milli=rec.cpu_milli,
            memory_mib=rec.memory_mib,
            held=True,
            mig=migs.slots_for(node, rec.mig, rec.mig_slots) if rec.mig else None,
        )

    def _slots_for(self, node: model.Node, rec: objects.PodRecord) -> list[status.GPUSlot]:
        if rec.gpus <= 0:
            return []
        free = node.gpu_free
        chosen = {slot.index for slot in rec.slots}
        if (
            rec.slots
            and len(chosen) == len(rec.slots)
            and all(
                s.index < len(free) and (free[s.index] >= s.milli or s.index in node.unhealthy)
                for s in rec.slots
            )
        ):
            return list(rec.slots)
        if rec.shared and not rec.slots:  # a foreign pod's device-plugin replicas
            return objects.replica_slots(free, objects.replica_milli(node, self._keys), rec.gpus)
        milli = rec.slots[0].milli if rec.slots else model.GPU_MILLI
        if rec.gpus == 1 and milli < model.GPU_MILLI:
            shared = [i for i, f in enumerate(free) if f >= milli]
            return [status.GPUSlot.model_construct(index=shared[0], milli=milli)] if shared else []
        whole = [i for i in reversed(range(len(free))) if free[i] == model.GPU_MILLI]
        return [
            _WHOLE[i] if i < len(_WHOLE) else status.GPUSlot(index=i)
            for i in sorted(whole[: rec.gpus])
        ]

    def _rebuild(self) -> None:
        """The whole inventory again, from the nodes and pods known now."""
        self.inventory.clear()
        self._by_node.clear()
        self._by_job.clear()
        for node in self._nodes.values():
            self.inventory.add(self._fresh(node))
        records = sorted(self._records(), key=lambda rec: not rec.ours)  # ours keep their GPUs
        for rec in records:
            self._track(rec)
            self._place(rec)
        self._apply_health(*self._nodes)

    def _rebuild_node(self, name: str) -> None:
        keys = list(self._by_node.get(name, ()))
        for key in keys:
            self.inventory.release(key)
        self.inventory.remove(name)
        if name in self._nodes:
            self.inventory.add(self._fresh(self._nodes[name]))
        records = [rec for rec in map(self.record, keys) if rec is not None]
        for rec in sorted(records, key=lambda rec: not rec.ours):
            self._place(rec)
        self._apply_health(name)

    def _apply_health(self, *names: str) -> None:
        """Take the nodes' unhealthy GPUs out of the inventory; gpufed's pods on those that
        have just failed fail GPUFailed."""
        for name in names:
            node = self.inventory.nodes.get(name)
            if node is None:
                continue
            found = self._node_health.get(name, health.NodeHealth())
            if found.healthy and not node.unhealthy and name not in self.health.unhealthy:
                continue  # the common case, at every relist: nothing to do
            ours = {
                rec.key: {slot.index for slot in self.inventory.pods[rec.key][0].gpus}
                for rec in self.holders(name)
                if rec.ours and rec.key in self.inventory.pods
            }
            held = set().union(*ours.values())
            chosen = health.choose_unhealthy(found, node.gpu_free, ours=held, named=node.unhealthy)
            if chosen or node.unhealthy:
                self.inventory.set_unhealthy(name, chosen)
            failed = self.health.observe(name, chosen, reason="; ".join(found.reasons))
            for key in sorted(key for key, indices in ours.items() if indices & failed):
                rec = self.record(key)
                if rec is not None and rec.phase not in _TERMINAL:
                    self.health.pods_failed()
                    failure = dataclasses.replace(
                        rec, phase=status.PodPhase.FAILED, reason=gpuhealth.GPU_FAILED
                    )
                    self._report(failure)

    def _fresh(self, node: model.Node) -> model.Node:
        """The inventory's node: everything free, with the devices DRA publishes for it."""
        fresh = objects.fresh_copy(node)
        return self._node_view(fresh) if self._node_view is not None else fresh

    # -- events ------------------------------------------------------------------------------

    def _changed(self, reason: str) -> None:
        if not self.change_pending:  # one InventoryChanged waits in the queue at most
            self.change_pending = True
            self._emit(base.InventoryChanged(reason=reason))

    def _report(self, rec: objects.PodRecord) -> None:
        last = self._reported.get(rec.key)
        self._reported[rec.key] = rec
        if last is None and rec.phase == status.PodPhase.PENDING and not rec.reason:
            return
        if last is not None and (last.phase, last.reason, last.checkpoint) == (
            rec.phase,
            rec.reason,
            rec.checkpoint,
        ):
            return
        self._emit(
            base.PodEvent(
                job_id=rec.job_id,
                name=rec.name,
                phase=rec.phase,
                node=rec.node,
                reason=rec.reason,
                checkpoint=rec.checkpoint,
            )
        )

    def _report_deleted(self, rec: objects.PodRecord) -> None:
        last = self._reported.pop(rec.key, None) or rec
        self._emit(
            base.PodEvent(
                job_id=last.job_id,
                name=last.name,
                phase=status.PodPhase.DELETED,
                node=last.node,
                reason=last.reason or "Deleted",
            )
        )

    def _report_node_lost(self, name: str) -> None:
        for key in sorted(self._by_node.get(name, ())):
            rec = self.record(key)
            if rec is None or not rec.ours or rec.phase in _TERMINAL:
                continue
            self._report(
                dataclasses.replace(rec, phase=status.PodPhase.FAILED, reason=objects.NODE_LOST)
            )


class NodeFeed:
    """The nodes watch's sink (`watching.Sink`)."""

    def __init__(self, cluster_state: ClusterState) -> None:
        self._state = cluster_state

    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        self._state.replace_nodes(items, started=started)

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self._state.apply_node(kind, obj)


class PodFeed:
    """The pods watch's sink (`watching.Sink`)."""

    def __init__(self, cluster_state: ClusterState) -> None:
        self._state = cluster_state

    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        self._state.replace_pods(items, started=started)

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self._state.apply_pod(kind, obj)
