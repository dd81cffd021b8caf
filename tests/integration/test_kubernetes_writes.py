"""The Kubernetes backend's writes when the API server misbehaves, against the emulator's
injected faults (`Emulator.inject` with a `Fault`): a create whose answer is lost, a name
already taken, a throttling storm, a failing delete; and why a Pending pod does not start,
as the agent reports it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from broker.api import messages, status
from member_agent.binding import binding
from member_agent.cluster import base
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.cluster.kubernetes import retrying
from member_agent.jobs import handling
from tests import agentbuilders
from tests.conftest_kube import Kube, Start, Waits, following
from tests.kubeemulator import Emulator, Fault, pod_request, until


class Agent:
    """A job handler on a backend; replies and updates recorded (the backend's events fed to
    it while `following(agent.backend, agent.handler)`)."""

    def __init__(self, backend: k8s.KubernetesBackend) -> None:
        self.backend = backend
        self.sent: list[messages.Message] = []
        self.handler = handling.JobHandler(
            backend, send=self._send, failure_grace_seconds=0, clock=lambda: 1000.0
        )

    def _send(
        self, message: messages.Message, /, *, on_sent: Callable[[], None] | None = None
    ) -> None:
        self.sent.append(message)

    async def offer(self, job_id: str, *, attempt: int = 1, **job: Any) -> messages.Message:
        replies: list[messages.Message] = []
        offer = agentbuilders.make_offer(job_id, agentbuilders.make_job(**job), attempt=attempt)
        await self.handler.handle_offer(offer, session_epoch=1, reply=replies.append)
        return replies[-1]

    def updates(self, job_id: str) -> list[messages.JobUpdate]:
        return [m for m in self.sent if isinstance(m, messages.JobUpdate) and m.job_id == job_id]


async def nodes(emulator: Emulator, count: int) -> None:
    for i in range(count):
        await emulator.add_node(f"n{i}", gpus=8)


def names_of(emulator: Emulator, job_id: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in emulator.pods()
        if (p["metadata"].get("labels") or {}).get("gpufed.io/job") == job_id
    )


def whole_free(backend: k8s.KubernetesBackend) -> int:
    return sum(node.whole_free for node in backend.inventory())


def throttle_every_third(emulator: Emulator, *, requests: int, retry_after: int) -> list[Any]:
    """429 with `Retry-After` for the 3rd, 6th, 9th ... pod create from now, over the next
    `requests`. An injection counts down only the requests no injection before it answered,
    so the k-th, to answer the (3k)-th, lets 2k requests through first."""
    fault = Fault.throttle(retry_after=retry_after)
    return [
        emulator.inject("POST", "pods", fault, nth=2 * k + 1) for k in range(1, requests // 3 + 1)
    ]


# -- a create whose answer is lost ---------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Fault.commit_then_reset, id="stored, then the connection reset"),
        pytest.param(Fault.commit_then_error(504), id="stored, then 504 Timeout"),
    ],
)
async def test_a_create_whose_answer_is_lost_is_recognised_and_the_gang_is_created(
    kube: Kube, start: Start, fault: Fault
) -> None:
    """The create is tried again, meets the pod its first try stored (409 AlreadyExists: the
    same job, attempt, epoch and node) and counts it created: the gang is accepted the first
    time, nothing is deleted."""
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start(retry=retrying.RetryPolicy(sleep=Waits()))
    agent = Agent(backend)
    injection = emulator.inject("POST", "pods", fault, nth=2)
    reply = await agent.offer("j1", gpus=2, replicas=4)
    assert isinstance(reply, messages.Accepted), reply
    assert injection.hits == 1
    assert names_of(emulator, "j1") == [f"j1-worker-{i}" for i in range(4)]
    assert len(emulator.requests_of("create", "pods")) == 5
    assert emulator.requests_of("delete", "pods") == []
    assert agent.handler.offers == {"accepted": 1}


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Fault.commit_then_reset, id="stored, then the connection reset"),
        pytest.param(Fault.commit_then_error(504), id="stored, then 504 Timeout"),
    ],
)
async def test_a_create_whose_answer_is_lost_is_rolled_back_by_name_when_not_retried(
    kube: Kube, start: Start, fault: Fault
) -> None:
    """With one try per request the gang fails; the pod the server stored though the create
    failed is deleted with the others, and the job's next attempt is placed on free GPUs."""
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start(retry=retrying.NO_RETRY)
    agent = Agent(backend)
    emulator.inject("POST", "pods", fault, nth=2)
    reply = await agent.offer("j1", gpus=2, replicas=4)
    assert isinstance(reply, messages.Rejected)
    assert names_of(emulator, "j1") == []
    await until(lambda: whole_free(backend) == 8)
    again = await agent.offer("j1", attempt=2, gpus=2, replicas=4)
    assert isinstance(again, messages.Accepted), again
    assert names_of(emulator, "j1") == [f"j1-worker-{i}-a2" for i in range(4)]


# -- a name already taken --------------------------------------------------------------------


def annotated(request: base.PodRequest, *, attempt: str = "1") -> base.PodRequest:
    """The request with the attempt and epoch annotations `binding.build_requests` sets."""
    annotations = {
        **request.annotations,
        base.ATTEMPT_ANNOTATION: attempt,
        base.EPOCH_ANNOTATION: "3",
    }
    return dataclasses.replace(request, annotations=annotations)


def gang_of(job_id: str, count: int, *, namespaces: tuple[str, ...] = ()) -> list[base.PodRequest]:
    """`count` pods of one GPU each on n0, in `namespaces` (pod i in the i-th; team-a past
    them)."""
    return [
        annotated(
            pod_request(
                f"job-a-worker-{i}",
                "n0",
                [i],
                job_id=job_id,
                namespace=namespaces[i] if i < len(namespaces) else "team-a",
            )
        )
        for i in range(count)
    ]


async def test_a_pod_of_its_own_already_there_counts_as_created(kube: Kube, start: Start) -> None:
    """The pod of that name is the gang's own (same job, attempt, epoch, node: a create whose
    answer an earlier agent lost): AlreadyExists is success, the pod is kept as it is."""
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start()
    gang = gang_of("job-a", 4)
    await backend.create_pod(gang[1])
    uid = emulator.pod("team-a", "job-a-worker-1")["metadata"]["uid"]  # type: ignore[index]
    await binding.create_gang(backend, gang)
    assert names_of(emulator, "job-a") == [f"job-a-worker-{i}" for i in range(4)]
    assert emulator.pod("team-a", "job-a-worker-1")["metadata"]["uid"] == uid  # type: ignore[index]
    assert emulator.requests_of("delete", "pods") == []


@pytest.mark.parametrize(
    ("job_id", "attempt", "said"),
    [
        pytest.param("job-b", "1", "belongs to job job-b", id="another job's pod"),
        pytest.param("job-a", "2", "gpufed.io/attempt is '2'", id="another attempt's pod"),
    ],
)
async def test_a_name_taken_by_another_pod_fails_the_gang_and_that_pod_is_left_alone(
    kube: Kube, start: Start, job_id: str, attempt: str, said: str
) -> None:
    """A create meets a pod that is not the gang's: the gang fails, that pod keeps running,
    and nothing of the gang is left, not even the pod whose create was stored and lost."""
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start(retry=retrying.RetryPolicy(sleep=Waits()))
    squatter = pod_request("job-a-worker-2", "n0", [7], job_id=job_id, namespace="team-b")
    await backend.create_pod(annotated(squatter, attempt=attempt))
    uid = emulator.pod("team-b", "job-a-worker-2")["metadata"]["uid"]  # type: ignore[index]
    lost = emulator.inject("POST", "pods", Fault.commit_then_reset, namespace="team-a")
    gang = gang_of("job-a", 3, namespaces=("team-a", "team-a", "team-b"))
    with pytest.raises(binding.BindingError, match=said) as caught:
        await binding.create_gang(backend, gang)
    assert isinstance(caught.value.__cause__, k8s_errors.Conflict)
    assert lost.hits == 1
    assert emulator.pod("team-b", "job-a-worker-2")["metadata"]["uid"] == uid  # type: ignore[index]
    assert [p["metadata"]["name"] for p in emulator.pods()] == ["job-a-worker-2"]


# -- throttling and server errors ------------------------------------------------------------


async def test_a_gang_of_64_is_placed_through_a_throttling_storm_without_rollback(
    kube: Kube, start: Start
) -> None:
    """Every third create is answered 429 Retry-After: 1 (API Priority and Fairness on a busy
    control plane): each is sent again once the server's wait has passed, and the whole gang
    is created the first time, nothing deleted."""
    emulator, _ = kube
    await nodes(emulator, 8)
    waits = Waits()
    backend = await start(retry=retrying.RetryPolicy(sleep=waits))
    agent = Agent(backend)
    storm = throttle_every_third(emulator, requests=150, retry_after=1)
    reply = await agent.offer("j1", gpus=1, replicas=64)
    assert isinstance(reply, messages.Accepted), reply
    throttled = sum(injection.hits for injection in storm)
    assert throttled >= 64 // 3
    assert len(emulator.requests_of("create", "pods")) == 64 + throttled
    assert len(names_of(emulator, "j1")) == 64
    assert emulator.requests_of("delete", "pods") == []
    assert len(waits.asked) == throttled and min(waits.asked) >= 1.0  # Retry-After honoured


@pytest.mark.parametrize(
    ("fault", "times"),
    [
        pytest.param(Fault.server_error(503), 2, id="503 twice"),
        pytest.param(Fault.server_error(500), 1, id="500"),
        pytest.param(Fault.throttle(retry_after=1), 3, id="429 three times"),
        pytest.param(Fault.commit_then_error(504), 1, id="deleted, then 504"),
    ],
)
async def test_a_delete_that_fails_on_the_server_side_is_sent_again(
    kube: Kube, start: Start, fault: Fault, times: int
) -> None:
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start(retry=retrying.RetryPolicy(sleep=Waits()))
    gang = gang_of("job-a", 2)
    await binding.create_gang(backend, gang)
    emulator.inject("DELETE", "pods", fault, times=times)
    failed = await binding.delete_pods(
        backend, [(r.namespace, r.name) for r in gang], grace_seconds=0, concurrency=1
    )
    assert failed == []
    assert names_of(emulator, "job-a") == []
    await until(lambda: whole_free(backend) == 8)


async def test_an_annotation_throttled_is_sent_again(kube: Kube, start: Start) -> None:
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start(namespaces=["team-a"], retry=retrying.RetryPolicy(sleep=Waits()))
    await backend.create_pod(gang_of("job-a", 1)[0])
    emulator.inject("PATCH", "pods", Fault.throttle(retry_after=1), times=2)
    await backend.annotate_pod("team-a", "job-a-worker-0", {"gpufed.io/preemption-notice": "x"})
    pod = emulator.pod("team-a", "job-a-worker-0")
    assert pod is not None
    assert pod["metadata"]["annotations"]["gpufed.io/preemption-notice"] == "x"


# -- refused at admission ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason"),
    [pytest.param(403, "Forbidden", id="403"), pytest.param(422, "Invalid", id="422")],
)
async def test_an_admission_webhooks_denial_is_the_rejection_reason(
    kube: Kube, start: Start, code: int, reason: str
) -> None:
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start(retry=retrying.RetryPolicy(sleep=Waits()))
    agent = Agent(backend)
    denial = (
        'admission webhook "gpu-policy.example.com" denied the request: '
        "GPU pods need the label cost-center"
    )
    emulator.inject("POST", "pods", Fault("error", code, reason, denial))
    reply = await agent.offer("j1", gpus=2, replicas=2)
    assert isinstance(reply, messages.Rejected)
    (said,) = reply.reasons
    assert said.startswith("creating pods failed: pod default/j1-worker-")
    assert said.endswith(f" refused: {denial}")
    assert len(emulator.requests_of("create", "pods")) == 2  # a refusal is not tried again
    assert names_of(emulator, "j1") == []


# -- why a pod stays Pending -------------------------------------------------------------------


LONG = "0/120 nodes are available: " + ", ".join(
    f"{n} node(s) had untolerated taint {{pool-{n}: x}}" for n in range(1, 30)
)


@pytest.mark.parametrize(
    ("pod_status", "expected"),
    [
        pytest.param(
            {
                "containerStatuses": [
                    {
                        "name": "main",
                        "ready": False,
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": 'Back-off pulling image "x"',
                            }
                        },
                    }
                ]
            },
            'ImagePullBackOff: Back-off pulling image "x"',
            id="the image cannot be pulled",
        ),
        pytest.param(
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient memory.",
                    }
                ]
            },
            "Unschedulable: 0/3 nodes are available: 3 Insufficient memory.",
            id="unschedulable",
        ),
        pytest.param(
            {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": LONG,
                    }
                ]
            },
            f"Unschedulable: {LONG}"[:197] + "...",
            id="a long message is cut short",
        ),
    ],
)
async def test_a_pod_stuck_pending_gives_the_job_its_reason(
    kube: Kube, start: Start, pod_status: dict[str, Any], expected: str
) -> None:
    emulator, _ = kube
    await nodes(emulator, 1)
    backend = await start()
    agent = Agent(backend)
    async with following(agent.backend, agent.handler):
        reply = await agent.offer("j1", gpus=2, replicas=2)
        assert isinstance(reply, messages.Accepted)
        path = "/api/v1/namespaces/default/pods/j1-worker-1"
        async with emulator.request("PATCH", path, json={"status": pod_status}) as response:
            assert response.status == 200
        await until(lambda: bool(agent.updates("j1")))
    (update,) = agent.updates("j1")
    assert (update.state, update.reason) == (status.JobState.DISPATCHED, expected)
    assert len(update.reason) <= 200
    assert [p.reason for p in update.pods] == ["", expected]
