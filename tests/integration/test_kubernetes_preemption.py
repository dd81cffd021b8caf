"""Graceful preemption on the Kubernetes backend, against the kmock emulator: the notice is
patched onto the pod before the DELETE that carries the grace period, the pod's GPUs stay
held until the API server lets it go, and a workload's `gpufed.io/last-checkpoint` on its
pod becomes a pod event. The backend runs as the agent's ServiceAccount with the RBAC the chart
renders (tests/kubeauthz.py), and a pod deleted with a grace period stays Terminating for a
while, as the kubelet stops it."""

from __future__ import annotations

from member_agent.cluster import base
from tests.conftest_kube import Kube, Start
from tests.kubeemulator import next_event, pod_request, until

NOTICE = {base.PREEMPTION_NOTICE_ANNOTATION: "2026-01-01T00:00:30.000Z"}


async def test_the_notice_is_patched_on_before_the_pod_is_deleted_with_its_grace(
    kube: Kube, start: Start
) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0, 1]))
    await backend.annotate_pod("team-a", "job-a-worker-0", NOTICE)
    pod = emulator.pod("team-a", "job-a-worker-0")
    assert pod is not None
    assert (
        pod["metadata"]["annotations"][base.PREEMPTION_NOTICE_ANNOTATION]
        == NOTICE[base.PREEMPTION_NOTICE_ANNOTATION]
    )
    assert base.TRACEPARENT_ANNOTATION in pod["metadata"]["annotations"]  # merged, not replaced
    [patch] = emulator.requests_of("update", "pods")  # kmock's name for a PATCH
    assert patch.method.name == "PATCH"
    assert patch.headers.get("Content-Type") == "application/merge-patch+json"
    await backend.delete_pod("team-a", "job-a-worker-0", grace_seconds=45)
    [delete] = emulator.requests_of("delete", "pods")
    assert emulator._requests.index(patch) < emulator._requests.index(delete)
    assert delete.params.get("gracePeriodSeconds") == "45"
    assert delete.data["gracePeriodSeconds"] == 45


async def test_annotating_a_pod_that_is_gone_is_not_an_error(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    await backend.annotate_pod("team-a", "no-such-pod", NOTICE)


async def test_a_checkpoint_written_on_a_pod_is_a_pod_event(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await emulator.add_node("n1", gpus=8)
    backend = await start()
    stream = backend.events()
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0]))
    await emulator.set_pod_phase("team-a", "job-a-worker-0", "Running")
    running = await next_event(stream, lambda e: isinstance(e, base.PodEvent))
    assert isinstance(running, base.PodEvent) and running.checkpoint == ""
    stamp = "2026-01-01T00:10:00Z"
    await backend.annotate_pod("team-a", "job-a-worker-0", {base.LAST_CHECKPOINT_ANNOTATION: stamp})
    event = await next_event(stream, lambda e: isinstance(e, base.PodEvent) and bool(e.checkpoint))
    assert isinstance(event, base.PodEvent)
    assert (event.name, event.checkpoint) == ("job-a-worker-0", stamp)
    await until(lambda: backend.pods_of("job-a") != [])


async def test_the_notice_is_delivered_under_the_charts_role_and_the_gpus_held_while_terminating(
    kube: Kube, start: Start
) -> None:
    """The agent limited to the chart's namespaces (a Role in each, not the ClusterRole of
    allNamespaces): the notice's patch is allowed, and the pod, deleted with its grace period,
    holds its GPUs while Terminating and frees them once it is gone."""
    emulator, _ = kube
    emulator.termination_seconds = 0.5
    await emulator.add_node("n1", gpus=8)
    backend = await start(namespaces=["team-a"])
    await backend.create_pod(pod_request("job-a-worker-0", "n1", [0, 1]))
    await backend.annotate_pod("team-a", "job-a-worker-0", NOTICE)
    pod = emulator.pod("team-a", "job-a-worker-0")
    assert pod is not None
    assert base.PREEMPTION_NOTICE_ANNOTATION in pod["metadata"]["annotations"]
    await backend.delete_pod("team-a", "job-a-worker-0", grace_seconds=30)
    [terminating] = emulator.terminating()
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 30
    await until(lambda: backend.watches[1].resource_version == str(emulator.version))
    assert backend.inventory().nodes["n1"].whole_free == 6  # still stopping on its GPUs
    await until(lambda: emulator.pod("team-a", "job-a-worker-0") is None)
    await until(lambda: backend.inventory().nodes["n1"].whole_free == 8)
    assert emulator.forbidden == []
