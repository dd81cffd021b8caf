"""The Kubernetes backend against kmock's emulator over real HTTP, with kubernetes-asyncio."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import exceptions as k8s_exceptions

from broker.api import status
from member_agent.cluster import base, errors
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.cluster.kubernetes import objects, retrying
from member_agent.inventory import summary
from tests.conftest_kube import FAST, Kube, Start
from tests.kubeemulator import GPU, H100, next_event, pod_request, until

Phase = status.PodPhase


def free(backend: k8s.KubernetesBackend, node: str) -> int:
    return backend.inventory().nodes[node].whole_free


# -- nodes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        pytest.param(
            {"gpus": 8},
            {
                "model": H100,
                "gpu_count": 8,
                "gpu_memory_mib": 81559,
                "cpu_milli": 128_000,
                "memory_mib": 1_048_576,
                "available": True,
            },
            id="8x H100 with GFD labels",
        ),
        pytest.param(
            {
                "labels": {
                    "gpufed.io/rack": "r7",
                    "nvidia.com/gpu.clique": "uuid.3",
                    "gpufed.io/nvlink-island": "8",
                }
            },
            {"rack": "r7", "nvlink_domain": "uuid.3", "nvlink_island": 8},
            id="rack, NVLink domain and island from labels",
        ),
        pytest.param(
            {
                "gpus": 0,
                "allocatable": {"nvidia.com/mig-1g.10gb": "7", "nvidia.com/mig-3g.40gb": "2"},
            },
            {"gpu_count": 0, "mig": {"1g.10gb": 7, "3g.40gb": 2}},
            id="MIG devices read from allocatable",
        ),
        pytest.param({"unschedulable": True}, {"available": False}, id="cordoned"),
        pytest.param({"ready": False}, {"ready": False, "available": False}, id="NotReady"),
        pytest.param(
            {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]},
            {"schedulable": False},
            id="NoSchedule taint",
        ),
        pytest.param(
            {"taints": [{"key": "maintenance", "effect": "PreferNoSchedule"}]},
            {"schedulable": True},
            id="PreferNoSchedule taint ignored",
        ),
        pytest.param(
            {"taints": [{"key": GPU, "value": "present", "effect": "NoSchedule"}]},
            {"schedulable": True},
            id="nvidia.com/gpu taint tolerated",
        ),
        pytest.param(
            {"gpus": 0, "product": "", "cpu": "64"},
            {"gpu_count": 0, "model": "", "cpu_milli": 64_000},
            id="CPU-only node",
        ),
    ],
)
async def test_nodes_are_read_into_the_inventory(
    kube: Kube, start: Start, node: dict[str, Any], expected: dict[str, Any]
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", **node)
    backend = await start()
    got = backend.inventory().nodes["n1"]
    for attr, value in expected.items():
        actual = objects.mig_slices(got) if attr == "mig" else getattr(got, attr)
        assert actual == value, attr


async def test_label_keys_are_configurable(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", labels={"example.com/rack": "r1", "gpufed.io/rack": "ignored"})
    keys = objects.LabelKeys.from_mapping({"rack": "example.com/rack", "toleratedTaints": []})
    backend = await start(label_keys=keys)
    assert backend.inventory().nodes["n1"].rack == "r1"
    with pytest.raises(ValueError, match="unknown keys"):
        objects.LabelKeys.from_mapping({"rak": "x"})


async def test_gpu_nodes_appear_in_the_summary(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8, labels={"gpufed.io/rack": "r1"})
    await emulator.add_node("n2", gpus=8, labels={"gpufed.io/rack": "r2"})
    await emulator.add_node("n3", gpus=4, ready=False)
    backend = await start()
    model = summary.summarise(backend.inventory()).model(H100)
    assert model is not None
    assert (model.nodes, model.total_gpus, model.free_gpus, model.unavailable_gpus) == (
        3,
        20,
        16,
        4,
    )
    assert sorted(model.racks) == ["r1", "r2"]


@pytest.mark.parametrize(
    ("action", "available"),
    [
        pytest.param(
            {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
            False,
            id="goes NotReady",
        ),
        pytest.param({"spec": {"unschedulable": True}}, False, id="cordoned"),
        pytest.param({"metadata": {"labels": {"unrelated": "x"}}}, True, id="unrelated change"),
    ],
)
async def test_a_node_that_goes_away_leaves_the_free_inventory_at_once(
    kube: Kube, start: Start, action: dict[str, Any], available: bool
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.add_node("n2", gpus=8)
    backend = await start()
    stream = backend.events()
    await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))  # the lists
    await emulator.patch_node("n1", action)
    await emulator.set_node_ready("n2", True)  # a change that arrives after n1's
    await until(lambda: backend.watches[0].resource_version == str(emulator.version))
    model = summary.summarise(backend.inventory()).model(H100)
    assert model is not None
    assert backend.inventory().nodes["n1"].available is available
    assert model.free_gpus == (16 if available else 8)
    if available:  # nothing gpufed reads changed: no summary to send
        with pytest.raises(TimeoutError):
            await next_event(stream, lambda e: True, timeout=0.2)
    else:
        event = await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))
        assert "n1" in event.reason


# -- foreign pods --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "free_after"),
    [
        pytest.param({"node": "n1", "gpus": 3}, 5, id="running foreign pod holds its GPUs"),
        pytest.param({"node": "", "gpus": 3, "phase": "Pending"}, 8, id="unbound pod holds none"),
        pytest.param(
            {"node": "n1", "gpus": 3, "phase": "Succeeded"}, 8, id="finished pod holds none"
        ),
        pytest.param({"node": "n1", "gpus": 0}, 8, id="CPU pod holds no GPU"),
    ],
)
async def test_foreign_pods_count_as_used(
    kube: Kube, start: Start, pod: dict[str, Any], free_after: int
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.add_pod("other-team", "before", **pod)
    backend = await start()
    assert free(backend, "n1") == free_after
    # the same pod arriving through the watch counts the same, once
    await emulator.add_pod("other-team", "after", **pod)
    await until(lambda: backend.watches[1].resource_version == str(emulator.version))
    assert free(backend, "n1") == 8 - 2 * (8 - free_after)


async def test_a_foreign_pod_coming_and_going_changes_the_summary(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    stream = backend.events()
    await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))
    await emulator.add_pod("other-team", "p", node="n1", gpus=6)
    await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))
    model = summary.summarise(backend.inventory()).model(H100)
    assert model is not None and model.free_gpus == 2
    await emulator.delete_pod("other-team", "p")
    await next_event(stream, lambda e: isinstance(e, base.InventoryChanged))
    assert free(backend, "n1") == 8


# -- gpufed's pods -------------------------------------------------------------------------


async def test_a_gangs_pods_are_created_on_the_chosen_nodes(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.add_node("n2", gpus=8)
    backend = await start()
    gang = [
        pod_request("job-a-worker-0", "n1", [0, 1, 2, 3]),
        pod_request("job-a-worker-1", "n1", [4, 5, 6, 7]),
        pod_request("job-a-worker-2", "n2", [0, 1]),
    ]
    for request in gang:
        await backend.create_pod(request)
    for request in gang:
        pod = emulator.pod("team-a", request.name)
        assert pod is not None
        assert pod["spec"]["nodeName"] == request.node
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["labels"] == {
            "team": "vision",
            "gpufed.io/job": "job-a",
            "gpufed.io/gang": "job-a",
            "gpufed.io/queue": "research",
            "gpufed.io/task": "worker",
        }
        annotations = pod["metadata"]["annotations"]
        assert annotations["traceparent"] == request.annotations["traceparent"]
        assert annotations["gpufed.io/gpus"] == ",".join(str(s.index) for s in request.gpus)
        assert annotations["note"] == "kept"
        assert {"key": GPU, "operator": "Exists"} in pod["spec"]["tolerations"]
    await until(lambda: backend.watches[1].resource_version == str(emulator.version))
    assert (free(backend, "n1"), free(backend, "n2")) == (0, 6)
    pods = backend.pods_of("job-a")
    assert [(p.name, p.node, [g.index for g in p.gpus]) for p in pods] == [
        ("job-a-worker-0", "n1", [0, 1, 2, 3]),
        ("job-a-worker-1", "n1", [4, 5, 6, 7]),
        ("job-a-worker-2", "n2", [0, 1]),
    ]


async def test_created_pods_hold_their_gpus_before_the_watch_sees_them(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    emulator.fail("watch", "pods", times=10_000)  # the pods watch cannot come back...
    emulator.break_watches()
    await until(lambda: emulator.watch_count("pods") == 0)
    for i in range(4):
        await backend.create_pod(pod_request(f"job-a-worker-{i}", "n1", [2 * i, 2 * i + 1]))
    assert free(backend, "n1") == 0
    with pytest.raises(errors.PermanentBackendError, match="0 GPUs free"):
        await backend.create_pod(pod_request("job-b-worker-0", "n1", [0], job_id="job-b"))
    assert len(emulator.requests_of("create", "pods")) == 4  # refused without asking the API
    emulator.clear_failures()  # ...until now: it resumes and reports the four pods
    await until(lambda: backend.watches[1].resource_version == str(emulator.version))
    assert free(backend, "n1") == 0
    assert len(backend.inventory().pods) == 4
    await backend.delete_pod("team-a", "job-a-worker-0", grace_seconds=0)
    await until(lambda: free(backend, "n1") == 2)


@pytest.mark.parametrize(
    ("status_code", "error"),
    [
        pytest.param(500, errors.TemporaryBackendError, id="500 is temporary"),
        pytest.param(429, errors.TemporaryBackendError, id="429 throttled is temporary"),
        pytest.param(403, errors.PermanentBackendError, id="403 quota is permanent"),
        pytest.param(422, errors.PermanentBackendError, id="422 invalid is permanent"),
    ],
)
async def test_a_create_failing_mid_gang_leaves_no_pod_after_rollback(
    kube: Kube, start: Start, status_code: int, error: type[errors.BackendError]
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start(retry=retrying.NO_RETRY)  # one try: the error as mapped
    emulator.fail("create", "pods", nth=3, status=status_code)
    gang = [pod_request(f"job-a-worker-{i}", "n1", [i]) for i in range(4)]
    created = []
    with pytest.raises(error, match=f"HTTP {status_code}") as caught:
        for request in gang:
            await backend.create_pod(request)
            created.append(request)
    assert isinstance(caught.value.__cause__ or caught.value, Exception)
    assert len(created) == 2
    for request in created:  # what the binding does on failure
        await backend.delete_pod(request.namespace, request.name, grace_seconds=0)
    assert [p["metadata"]["name"] for p in emulator.pods()] == []
    await until(lambda: free(backend, "n1") == 8)
    assert backend.pods_of("job-a") == []


async def test_only_the_allowed_namespaces_get_pods(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start(namespaces=["team-b"])
    with pytest.raises(errors.PermanentBackendError, match="namespace team-a"):
        await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))
    assert emulator.requests_of("create", "pods") == []


async def test_delete_sends_the_grace_period_and_a_missing_pod_is_fine(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))
    await backend.delete_pod("team-a", "job-a-worker-0", grace_seconds=30)
    await backend.delete_pod("team-a", "job-a-worker-0", grace_seconds=30)  # 404 now
    sent = emulator.requests_of("delete", "pods")
    assert [r.params.get("gracePeriodSeconds") for r in sent] == ["30", "30"]
    assert sent[0].data["gracePeriodSeconds"] == 30
    await until(lambda: free(backend, "n1") == 8)


@pytest.mark.parametrize(
    ("phase", "kwargs", "expected"),
    [
        pytest.param("Running", {}, (Phase.RUNNING, ""), id="Running"),
        pytest.param("Succeeded", {}, (Phase.SUCCEEDED, ""), id="Succeeded"),
        pytest.param(
            "Failed",
            {"container_reason": "OOMKilled", "exit_code": 137},
            (Phase.FAILED, "OOMKilled"),
            id="Failed OOMKilled",
        ),
        pytest.param("Failed", {"reason": "Evicted"}, (Phase.FAILED, "Evicted"), id="Evicted"),
        pytest.param("Failed", {}, (Phase.FAILED, "Error"), id="Failed with an exit code"),
        pytest.param("Unknown", {}, (Phase.FAILED, "NodeLost"), id="Unknown: node lost"),
    ],
)
async def test_pod_phase_changes_become_pod_events(
    kube: Kube, start: Start, phase: str, kwargs: dict[str, Any], expected: tuple[Phase, str]
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    stream = backend.events()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0, 1]))
    await emulator.set_pod_phase("team-a", "job-a-worker-0", phase, **kwargs)
    event = await next_event(stream, lambda e: isinstance(e, base.PodEvent))
    assert isinstance(event, base.PodEvent)
    assert (event.job_id, event.name, event.node) == ("job-a", "job-a-worker-0", "n1")
    assert (event.phase, event.reason) == expected
    [pod] = backend.pods_of("job-a")
    assert (pod.phase, pod.reason) == expected
    terminal = expected[0] in (Phase.SUCCEEDED, Phase.FAILED) and phase != "Unknown"
    assert free(backend, "n1") == (8 if terminal else 6)
    await emulator.delete_pod("team-a", "job-a-worker-0")
    gone = await next_event(stream, lambda e: isinstance(e, base.PodEvent))
    assert isinstance(gone, base.PodEvent)
    assert gone.phase == Phase.DELETED
    assert backend.pods_of("job-a") == []


async def test_a_deleted_node_fails_its_gpufed_pods_as_node_lost(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    stream = backend.events()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))
    await emulator.set_pod_phase("team-a", "job-a-worker-0", "Running")
    await next_event(stream, lambda e: isinstance(e, base.PodEvent))
    await emulator.delete_node("n1")
    event = await next_event(stream, lambda e: isinstance(e, base.PodEvent))
    assert isinstance(event, base.PodEvent)
    assert (event.phase, event.reason) == (Phase.FAILED, "NodeLost")
    assert "n1" not in backend.inventory().nodes


# -- watches that break --------------------------------------------------------------------


async def test_a_broken_watch_resumes_from_its_resource_version(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.add_pod("other-team", "old", node="n1", gpus=2)
    backend = await start()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))
    pods = backend.watches[1]
    await until(lambda: pods.resource_version == str(emulator.version))
    seen = pods.resource_version
    emulator.fail("watch", "pods", times=10_000)
    emulator.break_watches()
    await until(lambda: emulator.watch_count("pods") == 0)
    await emulator.delete_pod("other-team", "old")  # while nobody watches
    await emulator.add_pod("other-team", "new", node="n1", gpus=3)
    emulator.clear_failures()
    await until(lambda: pods.resource_version == str(emulator.version))
    resumed = [r.params.get("resourceVersion") for r in emulator.requests_of("watch", "pods")]
    assert resumed[-1] == seen
    assert pods.relists == 1
    assert free(backend, "n1") == 8 - 1 - 3


async def test_410_gone_lists_again_and_the_list_replaces(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    await emulator.add_node("n2", gpus=8)
    await emulator.add_pod("other-team", "old", node="n1", gpus=2)
    backend = await start()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))
    stream = backend.events()
    emulator.fail("watch", "pods", times=10_000)
    emulator.fail("watch", "nodes", times=10_000)
    emulator.break_watches()
    await until(lambda: emulator.watch_count("pods") + emulator.watch_count("nodes") == 0)
    await emulator.delete_pod("other-team", "old")
    await emulator.add_pod("other-team", "new", node="n1", gpus=3)
    await emulator.set_pod_phase("team-a", "job-a-worker-0", "Running")
    await emulator.delete_node("n2")
    emulator.compact()  # the history is gone: resuming gets 410
    emulator.clear_failures()
    event = await next_event(stream, lambda e: isinstance(e, base.PodEvent))
    nodes_and_pods = backend.watches[:2]
    await until(lambda: all(w.relists == 2 for w in nodes_and_pods))
    assert isinstance(event, base.PodEvent) and event.phase == Phase.RUNNING
    assert sorted(backend.inventory().nodes) == ["n1"]
    assert free(backend, "n1") == 8 - 1 - 3
    assert sorted(backend.inventory().pods) == ["job-a-worker-0", "other-team/new"]
    await emulator.add_pod("other-team", "later", node="n1", gpus=1)  # watched, not listed
    await until(lambda: free(backend, "n1") == 8 - 1 - 3 - 1)
    assert [w.relists for w in nodes_and_pods] == [2, 2]


async def test_a_watch_that_keeps_expiring_backs_off_instead_of_spinning(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    emulator.fail("watch", "pods", status=410, times=10_000)
    emulator.break_watches()
    await asyncio.sleep(0.3)
    pods = backend.watches[1]
    assert 2 <= pods.relists < 20  # a hot loop would list hundreds of times
    emulator.clear_failures()
    await emulator.add_pod("other-team", "p", node="n1", gpus=2)
    await until(lambda: free(backend, "n1") == 6)


# -- configuration and errors --------------------------------------------------------------


async def test_from_config_reads_a_kubeconfig_and_its_context(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    emulator, api = kube
    await emulator.add_node("n1", gpus=8)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "emu", "cluster": {"server": api.configuration.host}},
            {"name": "elsewhere", "cluster": {"server": "http://127.0.0.1:9"}},
        ],
        "users": [{"name": "me", "user": {"token": "t0ken"}}],
        "contexts": [
            {"name": "emu", "context": {"cluster": "emu", "user": "me"}},
            {"name": "other", "context": {"cluster": "elsewhere", "user": "me"}},
        ],
        "current-context": "other",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    backend = await k8s.KubernetesBackend.from_config(
        "c1", kubeconfig=str(path), context="emu", backoff=FAST
    )
    try:
        await backend.start()
        assert list(backend.inventory().nodes) == ["n1"]
        assert emulator.requests_of("list", "nodes")[-1].headers["Authorization"] == "Bearer t0ken"
    finally:
        await backend.close()


async def test_from_config_in_a_pod_uses_the_service_account(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token"):
        pytest.skip("running in a pod: the service account would really be used")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(errors.PermanentBackendError, match="token file"):
        await k8s.KubernetesBackend.from_config("c1")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, (None, "gpufed.io/rack"), id="unset: any namespace, default keys"),
        pytest.param(
            {"GPUFED_NAMESPACES": "team-a, team-b", "GPUFED_LABEL_KEYS": '{"rack": "x.io/rack"}'},
            (["team-a", "team-b"], "x.io/rack"),
            id="as the Helm chart sets them",
        ),
        pytest.param({"GPUFED_LABEL_KEYS": '{"rak": "x"}'}, "unknown keys", id="a typo"),
        pytest.param({"GPUFED_LABEL_KEYS": "rack=x"}, "GPUFED_LABEL_KEYS", id="not JSON"),
    ],
)
async def test_namespaces_and_label_keys_come_from_the_environment(
    kube: Kube,
    start: Start,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    expected: tuple[list[str] | None, str] | str,
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    for name in ("GPUFED_NAMESPACES", "GPUFED_LABEL_KEYS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(expected, str):
        with pytest.raises(errors.PermanentBackendError, match=expected):
            await start()
        return
    namespaces, rack = expected
    backend = await start()
    assert backend.label_keys.rack == rack
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))  # in team-a
    elsewhere = pod_request("job-b-worker-0", "n1", [1], job_id="job-b", namespace="team-c")
    if namespaces is None:
        await backend.create_pod(elsewhere)
    else:
        with pytest.raises(errors.PermanentBackendError, match="not one this agent"):
            await backend.create_pod(elsewhere)


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        pytest.param(
            k8s_exceptions.ApiException(status=503), errors.TemporaryBackendError, id="503"
        ),
        pytest.param(
            k8s_exceptions.ApiException(status=429), errors.TemporaryBackendError, id="429"
        ),
        pytest.param(
            k8s_exceptions.ApiException(status=409), errors.PermanentBackendError, id="409"
        ),
        pytest.param(k8s_exceptions.ApiException(status=410), k8s_errors.WatchExpired, id="410"),
        pytest.param(TimeoutError(), errors.TemporaryBackendError, id="timeout"),
        pytest.param(ConnectionRefusedError(), errors.TemporaryBackendError, id="refused"),
    ],
)
async def test_library_errors_become_backend_errors(
    raised: Exception, expected: type[errors.BackendError]
) -> None:
    with pytest.raises(expected) as caught:
        async with k8s_errors.translating("create pod x"):
            raise raised
    assert caught.value.__cause__ is raised
