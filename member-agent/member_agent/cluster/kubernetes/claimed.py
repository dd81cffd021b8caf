"""gpufed's pods in DRA mode: each created with the ResourceClaim that holds its GPUs, and its
claim deleted with it. The Kubernetes backend's `create_pod` and `delete_pod` hand their DRA
half to `ClaimedPods`; the bodies are `claims`', the calls `claiming`'s.

A pod's creation, in order: its claim (created unallocated; one a sharing pod's GPU has already
is joined), the pod bound to its node and naming the claim, then the claim owned by the pod,
allocated and reserved for it. A failed step deletes what the steps before it created, so the
binding's all-or-nothing rollback (`binding.create_gang`) has only the pods it saw created to
delete. A sharing pod may join its GPU's claim only from its own namespace (a claim serves one)
and with the same sharing (`timeslice` or `mps`): otherwise the pod is refused, nothing made.

A pod's deletion deletes its own claim at once (the finalizer keeps it while the kubelet still
uses the devices; the pod's ownership would delete it too). A shared claim is left to the
garbage collector, which deletes it once every pod owning it is gone: deleted at once, it would
be marked (deletionTimestamp) while its last pod terminates through its grace period, and a
sharing pod placed on that GPU meanwhile could not join it, nor get the device through a claim
of its own. Only a pod whose creation failed deletes a shared claim no other pod of gpufed's
holds (it may own none). One create or release of a shared claim runs at a time, so a pod
joining a claim and the last one leaving it never cross.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from member_agent.cluster import base, errors
from member_agent.cluster.kubernetes import claiming, claims, devices, objects, state

logger = logging.getLogger(__name__)

Admit = Callable[[dict[str, Any]], objects.PodRecord]  # the pod's record, if it fits now
PostPod = Callable[[base.PodRequest, dict[str, Any]], Awaitable[dict[str, Any]]]
DeletePod = Callable[[str, str], Awaitable[None]]  # namespace, name: at once


class ClaimedPods:
    def __init__(
        self,
        writer: claiming.Claims,
        cluster_state: state.ClusterState,
        book: devices.DeviceBook,
        *,
        admit: Admit,
        post: PostPod,
        delete: DeletePod,
    ) -> None:
        self._writer = writer
        self._state = cluster_state
        self._book = book
        self._admit = admit
        self._post = post
        self._delete = delete
        self._locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._released: set[tuple[str, str]] = set()  # deleted pods the watch still shows

    async def create(self, request: base.PodRequest, body: dict[str, Any]) -> None:
        """Create the pod (`body`, as the device plugin would have it) and its claim."""
        if not request.gpus and not request.mig:  # a CPU-only pod of a gang: no claim
            record = self._admit(body)
            await self._post(request, body)
            self._state.add_created(record, at=time.monotonic())
            return
        try:
            plan = claims.plan_claim(
                request,
                self._book.devices(request.node),
                self._book.mig_devices(request.node),
            )
        except claims.ClaimProblem as exc:
            raise errors.PermanentBackendError(f"pod {request.name}: {exc}") from exc
        pod = claims.claim_pod(body, plan)
        record = self._admit(pod)
        problem = self._check_shared(plan)
        if problem:
            raise errors.PermanentBackendError(f"pod {request.name}: {problem}")
        lock = self._locks[(plan.namespace, plan.name)] if plan.shared else None
        async with lock or contextlib.nullcontext():
            created = await self._writer.create(plan)
            try:
                posted = await self._post(request, pod)
            except BaseException:
                if created is not None:
                    await _quietly(self._writer.delete(plan.namespace, plan.name))
                raise
            self._state.add_created(record, at=time.monotonic())
            try:
                uid = str((posted.get("metadata") or {}).get("uid") or "")
                await self._writer.reserve(plan, uid=uid, claim=created)
            except BaseException:
                await _quietly(self._delete(request.namespace, request.name))
                await _quietly(self._release(request.namespace, request.name, record))
                raise

    async def release(self, namespace: str, pod: str, record: objects.PodRecord | None) -> None:
        """A pod was deleted: delete its own claim; a shared one goes with its last owner."""
        claim = _claim_of(namespace, pod, record)
        if claims.is_pod_claim(pod, claim):
            await self._writer.delete(namespace, claim)

    async def _release(self, namespace: str, pod: str, record: objects.PodRecord | None) -> None:
        claim = _claim_of(namespace, pod, record)
        if claims.is_pod_claim(pod, claim):
            await self._writer.delete(namespace, claim)
            return
        self._released.add((namespace, pod))
        users = [
            user
            for user in self._state.claim_users(namespace, claim)
            if (namespace, user) not in self._released
        ]
        if not users:
            await self._writer.delete(namespace, claim)
        self._released = {k for k in self._released if self._state.record(k[1]) is not None}

    def _check_shared(self, plan: claims.ClaimPlan) -> str:
        """Why a sharing pod cannot join the claim of its GPU ("" when it can): pods of
        another namespace or another sharing setting hold it through a claim of their own."""
        if not plan.shared:
            return ""
        index = plan.devices[0].index
        for rec in self._state.holders(plan.node):
            same = rec.claim == plan.name and rec.namespace == plan.namespace
            if not rec.claim or same or rec.name == plan.pod:
                continue
            if not any(slot.index == index for slot in rec.slots):
                continue
            if rec.namespace != plan.namespace:
                return (
                    f"GPU {index} of {plan.node} is shared by pods of namespace "
                    f"{rec.namespace}; a ResourceClaim serves one namespace"
                )
            return (
                f"GPU {index} of {plan.node} is shared with {rec.sharing or 'another'} "
                f"sharing; the pod asks {plan.sharing}"
            )
        return ""


def _claim_of(namespace: str, pod: str, record: objects.PodRecord | None) -> str:
    """The claim a pod's record names; a pod's own claim when it is not known."""
    if record is not None and record.namespace == namespace and record.claim:
        return record.claim
    return claims.pod_claim_name(pod)


async def _quietly(step: Awaitable[None]) -> None:
    """A clean-up step after a failure: its own failure is logged, not raised."""
    try:
        await step
    except errors.BackendError as exc:
        logger.warning("clean-up failed: %s", exc)
