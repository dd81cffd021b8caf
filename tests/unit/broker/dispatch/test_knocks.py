"""When a leader its agents reach only through followers steps aside (`dispatch.knocking.decide`):
a majority of the clusters it counts knock elsewhere, for a while, and not at a term's start."""

from __future__ import annotations

import pytest

from broker.dispatch import knocking

RULE = knocking.Rule(window=6.0, hold=2.0, settle=6.0, hold_off=14.0)
BEGAN = 0.0
LATE = 100.0  # long into the term


@pytest.mark.parametrize(
    ("sessions", "knocks", "now", "cut_since", "expected"),
    [
        pytest.param(
            {"a", "b"}, {}, LATE, None, knocking.Verdict(None, False), id="every agent here"
        ),
        pytest.param(
            set(), {"a": LATE - 1, "b": LATE - 1}, LATE, None,
            knocking.Verdict(LATE, False), id="all knock elsewhere: the cut begins, held first",
        ),
        pytest.param(
            set(), {"a": LATE - 1, "b": LATE - 1}, LATE, LATE - 1.9,
            knocking.Verdict(LATE - 1.9, False), id="not held for 2 s yet",
        ),
        pytest.param(
            set(), {"a": LATE - 1, "b": LATE - 3}, LATE, LATE - 2,
            knocking.Verdict(LATE - 2, True), id="held 2 s: step aside",
        ),
        pytest.param(
            {"a"}, {"b": LATE - 1}, LATE, LATE - 5,
            knocking.Verdict(None, False), id="half knock elsewhere: not a majority",
        ),
        pytest.param(
            {"a"}, {"b": LATE - 1, "c": LATE - 1}, LATE, LATE - 5,
            knocking.Verdict(LATE - 5, True), id="two of three knock elsewhere",
        ),
        pytest.param(
            {"a", "b"}, {"a": LATE - 1, "b": LATE - 1}, LATE, LATE - 5,
            knocking.Verdict(None, False), id="knocks of clusters that have a session here",
        ),
        pytest.param(
            set(), {"a": LATE - 7, "b": LATE - 7}, LATE, LATE - 5,
            knocking.Verdict(None, False), id="knocks older than the window: the cut is over",
        ),
        pytest.param(
            {"c"}, {"a": LATE - 7, "b": LATE - 1}, LATE, LATE - 5,
            knocking.Verdict(None, False), id="one knock outdated: one of two",
        ),
        pytest.param(
            set(), {}, LATE, LATE - 5, knocking.Verdict(None, False), id="no agent at all"
        ),
        pytest.param(
            set(), {"a": 6.0, "b": 6.0}, 7.0, 4.0,
            knocking.Verdict(4.0, False), id="within the settle after the term's start",
        ),
        pytest.param(
            set(), {"a": 7.5, "b": 7.5}, 8.0, 5.0,
            knocking.Verdict(5.0, True), id="settled and held",
        ),
    ],
)  # fmt: skip
def test_a_leader_steps_aside_when_most_of_its_agents_knock_elsewhere_for_a_while(
    sessions: set[str],
    knocks: dict[str, float],
    now: float,
    cut_since: float | None,
    expected: knocking.Verdict,
) -> None:
    verdict = knocking.decide(
        sessions, knocks, now=now, term_began=BEGAN, cut_since=cut_since, rule=RULE
    )
    assert (verdict.cut_since, verdict.step_aside) == (expected.cut_since, expected.step_aside)
    assert bool(verdict.reason) == verdict.step_aside


@pytest.mark.parametrize(
    ("heartbeat", "rule"),
    [
        pytest.param(1.0, knocking.Rule(6.0, 1.0, 6.0, 13.0), id="heartbeat 1 s"),
        pytest.param(5.0, knocking.Rule(22.0, 5.0, 22.0, 49.0), id="default heartbeat 5 s"),
        pytest.param(0.25, knocking.Rule(3.0, 1.0, 3.0, 7.0), id="short heartbeat: 1 s held"),
    ],
)
def test_the_rule_follows_the_heartbeat(heartbeat: float, rule: knocking.Rule) -> None:
    assert knocking.Rule.for_heartbeat(heartbeat) == rule
