"""The Kubernetes backend's ResourceClaim writes (DRA mode) when the API server misbehaves,
against the emulator's injected faults (`Emulator.inject` with a `Fault`): a claim's create
throttled or its answer lost, its reservation failing on the server side, its delete answered
503, a name taken by a claim that is not the gang's. Each is sent again under the backend's
retry policy, as the pod writes are (tests/integration/test_kubernetes_writes.py)."""

from __future__ import annotations

import pytest

from broker.api import messages
from member_agent.binding import binding
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import retrying
from tests.conftest_kube import Kube, KubeAgent, Start, Waits, gpu_job
from tests.kubeemulator import Emulator, Fault, until


async def started(emulator: Emulator, start: Start, waits: Waits) -> k8s.KubernetesBackend:
    await emulator.add_node("n1")
    await emulator.add_slice("n1")
    return await start(devices="dra", retry=retrying.RetryPolicy(sleep=waits))


def assert_held_as_placed(emulator: Emulator, reply: messages.Accepted) -> None:
    """Every pod's own claim is allocated to the GPUs placement chose and reserved for it."""
    assert len(emulator.claims()) == len(reply.pods)
    for placed in reply.pods:
        pod = emulator.pod("default", placed.name)
        claim = emulator.claim("default", f"{placed.name}-gpus")
        assert pod is not None and claim is not None, placed.name
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [r["device"] for r in results] == [f"gpu-{s.index}" for s in placed.gpus]
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]]


async def test_a_claim_create_throttled_is_sent_again_and_the_gang_is_created(
    dra: Kube, start: Start
) -> None:
    """One claim's create is answered 429 Retry-After: 1: it is sent again once the server's
    wait has passed, and the gang is created the first time, nothing deleted."""
    emulator, _ = dra
    waits = Waits()
    agent = KubeAgent(await started(emulator, start, waits))
    throttled = emulator.inject("POST", "resourceclaims", Fault.throttle(retry_after=1), nth=2)
    reply = await agent.offer("j1", gpu_job(gpus=2, replicas=2))
    assert isinstance(reply, messages.Accepted), reply
    assert throttled.hits == 1
    assert len(emulator.requests_of("create", "resourceclaims")) == 3
    assert emulator.requests_of("delete", "resourceclaims") == []
    assert emulator.requests_of("delete", "pods") == []
    assert min(waits.asked) >= 1.0  # Retry-After honoured
    assert_held_as_placed(emulator, reply)


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Fault.commit_then_reset, id="stored, then the connection reset"),
        pytest.param(Fault.commit_then_error(504), id="stored, then 504 Timeout"),
    ],
)
async def test_a_claim_create_whose_answer_is_lost_finds_its_own_claim(
    dra: Kube, start: Start, fault: Fault
) -> None:
    """The create is sent again, meets the claim its first try stored (409 AlreadyExists: the
    same job, the same devices, held by no pod yet) and counts it created: the gang is
    accepted, the claim is allocated and reserved, nothing is deleted."""
    emulator, _ = dra
    agent = KubeAgent(await started(emulator, start, Waits()))
    lost = emulator.inject("POST", "resourceclaims", fault, nth=2)
    reply = await agent.offer("j1", gpu_job(gpus=2, replicas=2))
    assert isinstance(reply, messages.Accepted), reply
    assert lost.hits == 1
    assert len(emulator.requests_of("create", "resourceclaims")) == 3
    assert emulator.requests_of("delete", "resourceclaims") == []
    assert emulator.requests_of("delete", "pods") == []
    assert_held_as_placed(emulator, reply)


async def test_a_claim_name_taken_by_a_claim_not_the_gangs_fails_it_and_leaves_that_claim(
    dra: Kube, start: Start
) -> None:
    """A claim of the pod's claim's name that is not gpufed's (here allocated to another GPU)
    is not the gang's: the gang is rejected, that claim is neither owned nor reserved."""
    emulator, _ = dra
    await emulator.add_allocated_claim("default", "j1-worker-0-gpus", "n1", ["gpu-7"])
    agent = KubeAgent(await started(emulator, start, Waits()))
    reply = await agent.offer("j1", gpu_job(gpus=2))
    assert isinstance(reply, messages.Rejected), reply
    assert "the claim exists: it is not gpufed's" in reply.reasons[0]
    claim = emulator.claim("default", "j1-worker-0-gpus")
    assert claim is not None
    assert "ownerReferences" not in claim["metadata"]
    assert not claim["status"].get("reservedFor")
    assert emulator.pods() == []


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Fault.server_error(503), id="503"),
        pytest.param(Fault.commit_then_reset, id="stored, then the connection reset"),
    ],
)
async def test_a_claim_reservation_that_fails_on_the_server_side_is_made_again(
    dra: Kube, start: Start, fault: Fault
) -> None:
    """The status patch (allocation, reservedFor) fails: it is sent again. One the server
    stored before the answer was lost meets 409 on its resourceVersion and is not sent as it
    was: the claim is read again and the patch computed again (the same)."""
    emulator, _ = dra
    agent = KubeAgent(await started(emulator, start, Waits()))
    failed = emulator.inject("PATCH", "resourceclaims", fault, subresource="status")
    reply = await agent.offer("j1", gpu_job(gpus=2))
    assert isinstance(reply, messages.Accepted), reply
    assert failed.hits == 1
    reads = 1 if fault.commits else 0
    assert len(emulator.requests_of("fetch", "resourceclaims")) == reads
    assert emulator.requests_of("delete", "resourceclaims") == []
    assert_held_as_placed(emulator, reply)


@pytest.mark.parametrize(
    ("fault", "times"),
    [
        pytest.param(Fault.server_error(503), 2, id="503 twice"),
        pytest.param(Fault.throttle(retry_after=1), 1, id="429"),
        pytest.param(Fault.commit_then_error(504), 1, id="deleted, then 504"),
    ],
)
async def test_a_claim_delete_that_fails_on_the_server_side_is_sent_again(
    dra: Kube, start: Start, fault: Fault, times: int
) -> None:
    """The pod is deleted with a grace period (it stays Terminating, its claim with it, as
    the kubelet still uses the devices); the claim's delete fails and is sent again."""
    emulator, _ = dra
    emulator.termination_seconds = 1.0
    backend = await started(emulator, start, Waits())
    reply = await KubeAgent(backend).offer("j1", gpu_job(gpus=2))
    assert isinstance(reply, messages.Accepted), reply
    injection = emulator.inject("DELETE", "resourceclaims", fault, times=times)
    failed = await binding.delete_pods(backend, [("default", "j1-worker-0")], grace_seconds=30)
    assert failed == []
    assert injection.hits == times
    assert len(emulator.requests_of("delete", "resourceclaims")) == times + 1
    await until(lambda: emulator.claims() == [])
    await until(lambda: backend.inventory().nodes["n1"].whole_free == 8)
