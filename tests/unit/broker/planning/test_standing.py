"""A cluster that keeps failing to start what it accepts is scored down for a while: when the
strikes add up (`standing.strike`), and what the planner does with a cluster scored down."""

from __future__ import annotations

import pytest

from broker.planning import planning, snapshot, standing
from tests.builders import make_job, make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
POLICY = standing.StrikePolicy(limit=3, window=100.0, cooldown=50.0)


def strikes(*times: float, start: standing.Standing | None = None) -> standing.Standing:
    """The standing after a strike at each of `times`."""
    out = start or standing.Standing()
    for at in times:
        out = standing.strike(out, now=at, policy=POLICY)
    return out


@pytest.mark.parametrize(
    ("times", "now", "scored_down", "until"),
    [
        pytest.param((10.0,), 11.0, False, None, id="one strike is not enough"),
        pytest.param((10.0, 20.0), 21.0, False, None, id="two strikes are not enough"),
        pytest.param((10.0, 20.0, 30.0), 31.0, True, 80.0, id="three within the window"),
        pytest.param((10.0, 20.0, 30.0), 79.9, True, 80.0, id="still in its cooldown"),
        pytest.param((10.0, 20.0, 30.0), 80.0, False, 80.0, id="the cooldown is over"),
        pytest.param(
            (10.0, 20.0, 115.0), 116.0, False, None, id="a strike older than the window is gone"
        ),
        pytest.param(
            (10.0, 20.0, 30.0, 40.0, 50.0), 60.0, True, 80.0, id="strikes in a cooldown keep it"
        ),
        pytest.param(
            (10.0, 20.0, 30.0, 40.0, 50.0, 90.0),
            91.0,
            True,
            140.0,
            id="strikes in a cooldown count for the next one",
        ),
        pytest.param(
            (10.0, 20.0, 30.0, 90.0), 91.0, False, None, id="its strikes were spent by the cooldown"
        ),
    ],
)
def test_strikes_score_a_cluster_down(
    times: tuple[float, ...], now: float, scored_down: bool, until: float | None
) -> None:
    after = strikes(*times)
    assert after.scored_down(now=now) is scored_down
    assert after.scored_down_until == until


def summaries(tight: str, roomy: str) -> snapshot.FleetSnapshot:
    """`tight` has one node with 1 free H100 (the tightest fit of a 1-GPU job), `roomy` one
    with 2 free."""
    return snapshot.FleetSnapshot.build(
        [
            snapshot.ClusterCapacity.from_summary(
                make_summary(tight, make_model_summary(H100, nodes_by_free=[0, 1] + [0] * 7)),
                healthy=True,
            ),
            snapshot.ClusterCapacity.from_summary(
                make_summary(roomy, make_model_summary(H100, nodes_by_free=[0, 0, 1] + [0] * 6)),
                healthy=True,
            ),
        ]
    )


def pending(job_id: str) -> snapshot.PendingJob:
    return make_job(gpus=1).pending(job_id)


@pytest.mark.parametrize(
    ("down", "expected"),
    [
        pytest.param((), ["tight"], id="none scored down: the tightest fit"),
        pytest.param(("tight",), ["roomy"], id="the tightest fit scored down: the other"),
        pytest.param(("roomy",), ["tight"], id="the other scored down: the tightest fit"),
        pytest.param(("tight", "roomy"), ["tight"], id="both scored down: the tightest fit"),
    ],
)
def test_a_cluster_scored_down_is_chosen_after_the_others(
    down: tuple[str, ...], expected: list[str]
) -> None:
    fleet = summaries("tight", "roomy")
    for name in down:
        fleet.clusters[name].scored_down = True
    plan = planning.plan_cycle(fleet, [pending("j1")])
    assert [a.cluster for a in plan.assignments] == expected


def test_a_cluster_scored_down_still_takes_what_fits_nowhere_else() -> None:
    fleet = summaries("tight", "roomy")
    fleet.clusters["tight"].scored_down = True
    plan = planning.plan_cycle(fleet, [pending(f"j{i}") for i in range(3)])
    assert sorted(a.cluster for a in plan.assignments) == ["roomy", "roomy", "tight"]
