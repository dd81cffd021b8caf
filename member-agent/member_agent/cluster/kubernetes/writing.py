"""The Kubernetes backend's writes: pods created, deleted and annotated, nodes patched, each
sent again while it fails in a way another try may not (`retrying`: 429 with its Retry-After,
5xx, timeouts, connection failures), within the request's deadline.

Every write can be sent twice, because a try whose answer was lost may have been applied:

- a create answered 409 AlreadyExists reads the pod of that name: when its `gpufed.io/job`
  label, `gpufed.io/attempt` and `gpufed.io/epoch` annotations and node are the ones sent, it
  is the pod an earlier try created, and the create has succeeded (the pod read is returned);
  a pod of another job, attempt, epoch or node is `k8s_errors.Conflict`, and is left
  alone; one of ours being deleted (`deletionTimestamp`) is tried again until it is gone
  (`create_once`, which `claiming` uses for ResourceClaims too);
- a delete answered 404 is done (`delete_pod` says whether the pod was there);
- a merge patch of annotations or of a node's fields writes the same thing again.

`send` and `send_unread` make one raw request (`_preload_content=False`, JSON read back), for
these writes and for `claiming`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import client

from member_agent.cluster import base, errors
from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.cluster.kubernetes import objects, retrying

RawCall = Callable[..., Awaitable[Any]]  # a generated API call made with _preload_content=False
MERGE_PATCH = "application/merge-patch+json"
_IDENTITY = (base.ATTEMPT_ANNOTATION, base.EPOCH_ANNOTATION)


def identity_problem(existing: dict[str, Any], sent: dict[str, Any]) -> str:
    """Why the pod found under a name is not the one `sent` ("" when it is: same job,
    attempt, epoch and node)."""
    old_meta, new_meta = existing.get("metadata") or {}, sent.get("metadata") or {}
    old_job = (old_meta.get("labels") or {}).get(objects.JOB_LABEL)
    new_job = (new_meta.get("labels") or {}).get(objects.JOB_LABEL)
    if old_job != new_job:
        return f"it belongs to {f'job {old_job}' if old_job else 'no job of gpufed'}"
    old_notes, new_notes = old_meta.get("annotations") or {}, new_meta.get("annotations") or {}
    for key in _IDENTITY:
        if old_notes.get(key) != new_notes.get(key):
            return f"its {key} is {old_notes.get(key)!r}, not {new_notes.get(key)!r}"
    old_node = (existing.get("spec") or {}).get("nodeName")
    new_node = (sent.get("spec") or {}).get("nodeName")
    if old_node != new_node:
        return f"it is on node {old_node or '(none)'}, not {new_node}"
    return ""


async def send(
    call: RawCall, *args: Any, what: str, timeout: float, none_on: int | None = None, **kwargs: Any
) -> Any:
    """One raw request: the JSON the server answers with, None when it answers `none_on` (404
    for a read, 409 for a patch of a stale resourceVersion); a failure as the boundary's error."""
    async with k8s_errors.translating(what):
        response = await call(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        async with response:
            if response.status == none_on:
                return None
            return await k8s_errors.read_json(response, what=what)


async def send_unread(call: RawCall, *args: Any, what: str, timeout: float, **kwargs: Any) -> bool:
    """One raw request whose answer is not read; False when the object is missing (404)."""
    async with k8s_errors.translating(what):
        response = await call(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        async with response:
            if response.status == k8s_errors.NOT_FOUND:
                return False
            await k8s_errors.check_response(response, what=what)
    return True


async def create_once(
    create: Callable[[], Awaitable[dict[str, Any]]],
    read: Callable[[], Awaitable[dict[str, Any] | None]],
    problem: Callable[[dict[str, Any]], str],
    *,
    what: str,
    noun: str,
) -> dict[str, Any]:
    """One try of a create an earlier try may have applied: the object created, or on 409 the
    object of that name when it is ours (`problem` of it is ""); another's is `Conflict`, left
    alone, and a name free again or ours being deleted a TemporaryBackendError (tried again)."""
    try:
        return await create()
    except k8s_errors.Conflict as exc:
        existing = await read()
        if existing is None:  # deleted meanwhile: the name is free again
            raise errors.TemporaryBackendError(f"{what}: {exc}") from exc
        found = problem(existing)
        if found:
            raise k8s_errors.Conflict(f"{what}: the {noun} exists: {found}") from exc
        if (existing.get("metadata") or {}).get("deletionTimestamp"):
            raise errors.TemporaryBackendError(
                f"{what}: an earlier {noun} of that name is being deleted"
            ) from exc
        return existing


class Writer:
    """Pod and node writes through one CoreV1Api, retried by one policy."""

    def __init__(
        self,
        core: Callable[[], client.CoreV1Api],
        *,
        request_timeout: float,
        policy: retrying.RetryPolicy,
    ) -> None:
        self._core = core
        self._timeout = request_timeout
        self.policy = policy

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the pod `body`; returns it as the server has it (see the module for a
        pod that exists already)."""
        name = str((body.get("metadata") or {}).get("name", ""))
        what = f"create pod {namespace}/{name}"
        core = self._core()

        async def attempt(timeout: float) -> dict[str, Any]:
            return await create_once(
                lambda: send(
                    core.create_namespaced_pod, namespace, body, what=what, timeout=timeout
                ),
                lambda: send(
                    core.read_namespaced_pod,
                    name,
                    namespace,
                    what=f"read pod {namespace}/{name}",
                    timeout=timeout,
                    none_on=k8s_errors.NOT_FOUND,
                ),
                lambda existing: identity_problem(existing, body),
                what=what,
                noun="pod",
            )

        return await retrying.call(self.policy, what, attempt, timeout=self._timeout)

    async def delete_pod(self, namespace: str, name: str, *, grace: int) -> bool:
        """Delete a pod with a grace period; False when there was none (404: done)."""
        what = f"delete pod {namespace}/{name}"
        options = client.V1DeleteOptions(
            grace_period_seconds=grace, propagation_policy="Background"
        )
        delete: RawCall = self._core().delete_namespaced_pod

        async def attempt(timeout: float) -> bool:
            return await send_unread(
                delete,
                name,
                namespace,
                grace_period_seconds=grace,
                body=options,
                what=what,
                timeout=timeout,
            )

        return await retrying.call(self.policy, what, attempt, timeout=self._timeout)

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> bool:
        """Merge-patch a pod; False when there is none (404)."""
        what = f"patch pod {namespace}/{name}"
        call: RawCall = self._core().patch_namespaced_pod

        async def attempt(timeout: float) -> bool:
            return await send_unread(
                call, name, namespace, patch, _content_type=MERGE_PATCH, what=what, timeout=timeout
            )

        return await retrying.call(self.policy, what, attempt, timeout=self._timeout)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch a node; returns it as patched."""
        what = f"patch node {name}"
        call: RawCall = self._core().patch_node

        async def attempt(timeout: float) -> dict[str, Any]:
            patched: dict[str, Any] = await send(
                call, name, patch, _content_type=MERGE_PATCH, what=what, timeout=timeout
            )
            return patched

        return await retrying.call(self.policy, what, attempt, timeout=self._timeout)
