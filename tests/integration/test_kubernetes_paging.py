"""The backend's paged lists against the emulator: a `continue` token that expires between two
pages (410 Gone, as the API server answers once etcd compacted the list's revision)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.cluster.kubernetes import watching
from tests.conftest_kube import FAST, Kube
from tests.kubeemulator import Fault


class Recorded:
    """A list+watch sink that keeps what it was given."""

    def __init__(self) -> None:
        self.replaced: list[list[str]] = []

    def replace(self, items: list[dict[str, Any]], *, started: float) -> None:
        del started
        self.replaced.append([item["metadata"]["name"] for item in items])

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        del kind, obj


async def test_a_paged_list_whose_continue_expires_lists_again(kube: Kube) -> None:
    emulator, api = kube
    for i in range(5):
        await emulator.add_pod("team-a", f"p{i}")
    sink = Recorded()
    core = client.CoreV1Api(api)
    pods = watching.ListWatch(
        "pods", core.list_pod_for_all_namespaces, sink, backoff=FAST, page_size=2
    )
    expired = emulator.inject("GET", "pods", Fault.expired_continue, nth=2)
    await pods.relist()
    assert expired.hits == 1
    assert sink.replaced == [[f"p{i}" for i in range(5)]]  # whole, once, nothing twice
    assert pods.resource_version == str(emulator.version)
    # pages 1, 2, then 3 expired (the 2nd continue); then pages 1, 2, 3 again
    lists = emulator.requests_of("list", "pods")
    assert [bool(r.params.get("continue")) for r in lists] == [False, True, True] * 2


async def test_a_list_whose_continue_keeps_expiring_fails(kube: Kube) -> None:
    emulator, api = kube
    for i in range(3):
        await emulator.add_pod("team-a", f"p{i}")
    sink = Recorded()
    core = client.CoreV1Api(api)
    pods = watching.ListWatch(
        "pods", core.list_pod_for_all_namespaces, sink, backoff=FAST, page_size=2
    )
    emulator.inject("GET", "pods", Fault.expired_continue, times=watching.RELIST_ATTEMPTS)
    with pytest.raises(k8s_errors.WatchExpired):
        await pods.relist()
    assert sink.replaced == []
