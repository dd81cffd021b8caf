"""The cluster lease rule both ends follow: the agent fences itself before the broker's grace
ends, and the broker refuses a grace too short for that."""

from __future__ import annotations

import itertools

import pydantic
import pytest

from broker import app
from broker.api import leases, messages


@pytest.mark.parametrize(
    ("requested", "heartbeat", "lost_after", "expected"),
    [
        pytest.param(None, 5.0, 60.0, 45.0, id="defaults: a quarter before the grace ends"),
        pytest.param(None, 0.5, 5.0, 3.0, id="short grace: 2 beats + 1 s before it"),
        pytest.param(None, 1.0, 300.0, 225.0, id="long grace: long outages stop nothing"),
        pytest.param(30.0, 5.0, 60.0, 30.0, id="--fence-after sooner"),
        pytest.param(90.0, 5.0, 60.0, 45.0, id="--fence-after never later"),
        pytest.param(None, 5.0, None, 30.0, id="a broker that does not say its grace"),
        pytest.param(40.0, 5.0, None, 40.0, id="... and --fence-after"),
        pytest.param(1.0, 5.0, 60.0, 15.0, id="never before a silent session is given up"),
    ],
)
def test_the_agent_fences_before_the_brokers_grace_ends(
    requested: float | None, heartbeat: float, lost_after: float | None, expected: float
) -> None:
    assert leases.fence_after(requested, heartbeat=heartbeat, lost_after=lost_after) == expected


def test_every_grace_the_broker_accepts_leaves_the_margin_after_the_fence() -> None:
    for heartbeat, lost_after, requested in itertools.product(
        [0.1, 0.5, 1.0, 5.0, 30.0],
        [1.0, 2.0, 3.5, 5.0, 26.0, 60.0, 600.0],
        [None, 1.0, 30.0, 900.0],
    ):
        if leases.check_lost_after(lost_after, heartbeat=heartbeat) is not None:
            continue
        fence = leases.fence_after(requested, heartbeat=heartbeat, lost_after=lost_after)
        assert fence + leases.margin(heartbeat, lost_after) <= lost_after, (
            heartbeat,
            lost_after,
            requested,
        )
        assert fence >= leases.SILENT_BEATS * heartbeat
        grace = leases.fence_grace(fence, lost_after=lost_after, failure_grace=30.0)
        assert grace >= 0 and fence + grace < lost_after


@pytest.mark.parametrize(
    ("lost_after", "heartbeat", "refused"),
    [
        pytest.param(60.0, 5.0, False, id="defaults"),
        pytest.param(26.0, 5.0, True, id="exactly the minimum: refused"),
        pytest.param(26.5, 5.0, False, id="just above"),
        pytest.param(2.0, 0.5, True, id="2 s at 0.5 s heartbeats"),
        pytest.param(5.0, 0.5, False, id="the e2e settings"),
    ],
)
def test_the_broker_refuses_a_grace_too_short_to_fence_in(
    lost_after: float, heartbeat: float, refused: bool
) -> None:
    problem = leases.check_lost_after(lost_after, heartbeat=heartbeat)
    assert (problem is not None) == refused
    if refused:
        with pytest.raises(pydantic.ValidationError, match=r"--lost-after .* must be above"):
            app.BrokerSettings(lost_after_seconds=lost_after, heartbeat_seconds=heartbeat)
    else:
        app.BrokerSettings(lost_after_seconds=lost_after, heartbeat_seconds=heartbeat)


def test_the_refusal_is_one_line_naming_both_flags() -> None:
    problem = leases.check_lost_after(20.0, heartbeat=5.0)
    assert problem is not None and "\n" not in problem
    assert problem.startswith("--lost-after 20 s must be above 26 s")
    assert "--heartbeat 5 s" in problem


def test_a_fence_gets_half_the_time_left_to_stop_its_pods() -> None:
    assert leases.fence_grace(30.0, lost_after=60.0, failure_grace=30.0) == 15.0
    assert leases.fence_grace(30.0, lost_after=60.0, failure_grace=5.0) == 5.0
    assert leases.fence_grace(3.0, lost_after=5.0, failure_grace=30.0) == 1.0
    assert leases.fence_grace(30.0, lost_after=None, failure_grace=30.0) == 15.0  # 60 assumed
    assert leases.fence_grace(90.0, lost_after=None, failure_grace=30.0) == 0.0


@pytest.mark.parametrize(
    ("agent_version", "said"),
    [
        pytest.param(messages.PROTOCOL_VERSION, 60.0, id="an agent of protocol 3"),
        pytest.param(2, None, id="an older agent, which forbids the field"),
    ],
)
def test_the_welcome_says_the_grace_to_agents_that_read_it(
    agent_version: int, said: float | None
) -> None:
    hello = messages.Hello(cluster="east", v=agent_version)
    welcome = messages.welcome_for(hello, epoch=4, heartbeat_seconds=5.0, lost_after_seconds=60.0)
    assert welcome.lost_after_seconds == said
    frame = messages.encode(welcome)
    assert ("lost_after_seconds" in frame) == (said is not None)
    assert messages.decode(frame) == welcome


@pytest.mark.parametrize(
    ("lease", "heartbeat", "lost_after", "refused"),
    [
        pytest.param(5, 5.0, 60.0, False, id="defaults: agents fence at 45 s, reached at 21 s"),
        pytest.param(5, 1.0, 15.0, False, id="heartbeat 1 s, grace 15 s: fence 11.25 s"),
        pytest.param(10, 1.0, 15.0, True, id="a lease of 10 s with that grace"),
        pytest.param(5, 0.5, 5.0, True, id="lease 5 s, grace 5 s: agents fence at 3 s"),
        pytest.param(5, 0.5, 9.0, False, id="... a grace of 9 s leaves room"),
        pytest.param(60, 5.0, 60.0, True, id="a minute's lease"),
    ],
)
def test_the_broker_refuses_a_leader_lease_that_outlasts_its_agents_fence(
    lease: int, heartbeat: float, lost_after: float, refused: bool
) -> None:
    problem = leases.check_leader_lease(lease, heartbeat=heartbeat, lost_after=lost_after)
    assert (problem is not None) == refused
    settings = {
        "store": "etcd://127.0.0.1:2379",
        "leader_lease_seconds": lease,
        "heartbeat_seconds": heartbeat,
        "lost_after_seconds": lost_after,
    }
    if refused:
        assert problem is not None and "\n" not in problem
        assert problem.startswith(f"--leader-lease-seconds {lease} is too long")
        with pytest.raises(pydantic.ValidationError, match="--leader-lease-seconds"):
            app.BrokerSettings.model_validate(settings)
    else:
        app.BrokerSettings.model_validate(settings)
    # one replica on SQLite has no lease to check
    app.BrokerSettings.model_validate(settings | {"store": "sqlite:///:memory:"})
