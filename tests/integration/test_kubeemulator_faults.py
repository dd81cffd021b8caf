"""The emulator's injected faults, as kubernetes-asyncio sees them (tests of the test ground)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import exceptions as k8s_exceptions

from tests.conftest_kube import Kube
from tests.kubeemulator import Fault, pod_body


async def test_a_write_that_commits_then_resets_is_stored_and_the_client_sees_a_reset(
    kube: Kube,
) -> None:
    emulator, api = kube
    core = client.CoreV1Api(api)
    body: Any = pod_body("team-a", "p1")
    injection = emulator.inject("POST", "pods", Fault.commit_then_reset, namespace="team-a")
    with pytest.raises(aiohttp.ClientError):
        await core.create_namespaced_pod("team-a", body)
    assert emulator.pod("team-a", "p1") is not None
    assert injection.hits == 1
    # the retry meets the stored pod, as a real API server answers it
    with pytest.raises(k8s_exceptions.ApiException) as caught:
        await core.create_namespaced_pod("team-a", body)
    assert caught.value.status == 409
    assert json.loads(caught.value.body or "{}")["reason"] == "AlreadyExists"


async def test_a_write_that_commits_then_times_out_is_stored(kube: Kube) -> None:
    emulator, api = kube
    emulator.inject("POST", "pods", Fault.commit_then_error(504))
    body: Any = pod_body("ns", "p1")
    with pytest.raises(k8s_exceptions.ApiException) as caught:
        await client.CoreV1Api(api).create_namespaced_pod("ns", body)
    assert caught.value.status == 504
    assert emulator.pod("ns", "p1") is not None


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        pytest.param(Fault.throttle(retry_after=3), 429, id="throttled"),
        pytest.param(Fault.server_error(503), 503, id="unavailable"),
        pytest.param(Fault.conflict, 409, id="conflict"),
    ],
)
async def test_a_refused_write_stores_nothing(kube: Kube, fault: Fault, status: int) -> None:
    emulator, api = kube
    core = client.CoreV1Api(api)
    await emulator.add_pod("ns", "p1")
    emulator.inject("PATCH", "pods", fault, name="p1", nth=2)
    await core.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(k8s_exceptions.ApiException) as caught:
        await core.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"a": "2"}}})
    assert caught.value.status == status
    if status == 429:
        assert caught.value.headers is not None
        assert caught.value.headers["Retry-After"] == "3"
    pod = emulator.pod("ns", "p1")
    assert pod is not None and pod["metadata"]["labels"] == {"a": "1"}
    # only `times` requests meet it
    await core.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"a": "3"}}})


async def test_a_paged_list_and_its_expired_continue(kube: Kube) -> None:
    emulator, api = kube
    core = client.CoreV1Api(api)
    for i in range(5):
        await emulator.add_pod("ns", f"p{i}")
    emulator.inject("GET", "pods", Fault.expired_continue, nth=2)
    first = await core.list_pod_for_all_namespaces(limit=2)
    second = await core.list_pod_for_all_namespaces(limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in first.items + second.items] == ["p0", "p1", "p2", "p3"]
    assert second.metadata.resource_version == first.metadata.resource_version
    with pytest.raises(k8s_exceptions.ApiException) as caught:
        await core.list_pod_for_all_namespaces(limit=2, _continue=second.metadata._continue)
    assert caught.value.status == 410
