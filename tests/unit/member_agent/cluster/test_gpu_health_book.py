"""The health book over time: only failures within `cordon_window` count toward cordoning,
and what a backend reads before `seeded()` (how the cluster was when the agent started) fails
the pods on unhealthy GPUs without counting the GPUs as failures. The Events the Kubernetes
backend writes about them, as the API server would take them."""

from __future__ import annotations

import datetime

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from member_agent.cluster import gpuhealth
from member_agent.cluster.kubernetes import events
from tests.kubeevents import api_server_problems


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def book_of(
    *, after: int = 2, window: float = 600.0, seeding: bool = False
) -> tuple[gpuhealth.HealthBook, list[tuple[str, str]], Clock]:
    cordoned: list[tuple[str, str]] = []
    clock = Clock()
    book = gpuhealth.HealthBook(
        "c1",
        gpuhealth.HealthSettings(auto_cordon=True, cordon_after=after, cordon_window=window),
        cordon=lambda node, why: cordoned.append((node, why)),
        seeding=seeding,
        clock=clock,
    )
    return book, cordoned, clock


# -- the window -------------------------------------------------------------------------------


def test_failures_older_than_the_window_do_not_count_toward_cordoning() -> None:
    book, cordoned, clock = book_of(after=2, window=600)
    book.observe("n1", {3})
    clock.now += 601  # the first failure is out of the window when the second comes
    book.observe("n1", {3, 5})
    assert (cordoned, book.recent_failures("n1"), book.gpu_failures) == ([], 1, 2)
    clock.now += 599  # the second is still in it
    book.observe("n1", {3, 5, 6})
    assert cordoned == [("n1", "GPUFailed: 2 GPU failures on this node within 10m")]


def test_a_gpu_failing_again_after_it_healed_is_another_failure_in_the_window() -> None:
    book, cordoned, clock = book_of(after=2, window=3600)
    assert book.observe("n1", {0}) == {0}
    clock.now += 60
    assert book.observe("n1", set()) == frozenset()  # healthy again
    clock.now += 60
    assert book.observe("n1", {0}) == {0}
    assert cordoned == [("n1", "GPUFailed: 2 GPU failures on this node within 1h")]


def test_each_node_has_its_own_window() -> None:
    book, cordoned, clock = book_of(after=2, window=60)
    book.observe("n1", {0})
    book.observe("n2", {0})
    clock.now += 30
    book.observe("n2", {0, 1})
    assert [node for node, _ in cordoned] == ["n2"]
    clock.now += 31
    assert (book.recent_failures("n1"), book.recent_failures("n2")) == (0, 1)


@pytest.mark.parametrize(
    ("window", "said"),
    [
        pytest.param(90.0, "90s", id="seconds"),
        pytest.param(1800.0, "30m", id="minutes"),
        pytest.param(5400.0, "1h30m", id="hours and minutes"),
        pytest.param(86400.0, "24h", id="a day"),
        pytest.param(0.5, "0.5s", id="under a second"),
    ],
)
def test_the_cordon_says_the_window(window: float, said: str) -> None:
    book, cordoned, _ = book_of(after=1, window=window)
    book.observe("n1", {0})
    assert cordoned == [("n1", f"GPUFailed: 1 GPU failures on this node within {said}")]


@pytest.mark.parametrize("window", [0.0, -1.0, float("nan")])
def test_a_window_must_be_above_zero(window: float) -> None:
    with pytest.raises(ValueError, match="cordon_window"):
        gpuhealth.HealthSettings(cordon_window=window)


# -- seeding: how the cluster was when the agent started ---------------------------------------


def test_gpus_unhealthy_at_start_fail_their_pods_but_are_no_failures() -> None:
    book, cordoned, _ = book_of(after=1, seeding=True)
    # the nodes are listed (no pods yet), then the pods: each time every unhealthy GPU is
    # returned, so that a pod of gpufed's found on one fails, whenever it is listed
    assert book.observe("n1", {3, 5}, reason="taint nvidia.com/gpu-xid=gpu-3.gpu-5") == {3, 5}
    assert book.observe("n1", {3, 5}) == {3, 5}
    book.seeded()
    assert (book.gpu_failures, book.seeded_gpus, book.recent_failures("n1")) == (0, 2, 0)
    assert (cordoned, book.unhealthy_gpus()) == ([], {"n1": 2})
    assert book.summary().unhealthy_gpus == 2  # still out of service, still reported
    # after the start, the same GPUs are nothing new; another one failing is a failure
    assert book.observe("n1", {3, 5}) == frozenset()
    assert book.observe("n1", {3, 5, 6}) == {6}
    assert (book.gpu_failures, cordoned) == (1, [("n1", cordoned[0][1])])
    assert cordoned[0][1] == "GPUFailed: 1 GPU failures on this node within 10m"


def test_a_book_that_does_not_seed_counts_from_the_first_observation() -> None:
    book, cordoned, _ = book_of(after=2)  # the simulated backend: its cluster starts with it
    assert book.observe("n1", {3, 5}) == {3, 5}
    assert (book.gpu_failures, [n for n, _ in cordoned]) == (2, ["n1"])


# -- the Events a Kubernetes backend writes ------------------------------------------------


NOW = datetime.datetime(2026, 3, 1, 12, 30, 5, 123456, tzinfo=datetime.UTC)
NODE = {"metadata": {"name": "gpu-node-7", "uid": "0d7e2b3c-5a41-4c1e-9d7a-1f2e3d4c5b6a"}}


def test_a_cordon_event_is_one_the_api_server_takes() -> None:
    body = events.node_event(
        NODE,
        reason=events.CORDONED,
        action="Cordon",
        note="cordoned by gpufed: GPUFailed: 2 GPU failures on this node within 1h",
        instance=events.reporting_instance("agent-7f9c"),
        now=NOW,
    )
    kubernetes_validate.validate(body, "1.34", strict=True)
    assert api_server_problems(body) == []
    assert body["metadata"] == {"name": "gpu-node-7.1898b77dfd948c00", "namespace": "default"}
    assert body["eventTime"] == "2026-03-01T12:30:05.123456Z"
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", **NODE["metadata"]}
    assert body["reportingController"] == "gpufed.io/member-agent"
    assert body["reportingInstance"] == "gpufed.io/member-agent-agent-7f9c"
    assert (body["type"], body["reason"], body["action"]) == (
        "Warning",
        "GPUFailuresCordoned",
        "Cordon",
    )


def test_an_event_stays_within_the_api_servers_limits() -> None:
    long_name = ("n" * 62 + ".") * 4  # 252 characters: a node name as long as they get
    body = events.node_event(
        {"metadata": {"name": long_name.rstrip(".")}},  # no uid: the name serves, as kubelet's
        reason=events.GPU_FAILED,
        action="FailGang",
        note="é" * 2000,
        instance=events.reporting_instance("h" * 300),
        now=NOW,
        related={"apiVersion": "v1", "kind": "Pod", "namespace": "team-a", "name": "j1-w-0"},
    )
    kubernetes_validate.validate(body, "1.34", strict=True)
    assert api_server_problems(body) == []
    assert body["regarding"]["uid"] == long_name.rstrip(".")
    assert body["note"].endswith("…") and len(body["note"].encode()) <= 1024
