"""Token buckets (broker.http.limits.Buckets) on a clock of the test's: the burst, the
refill, the wait a refusal says, and a table that stays bounded under many keys."""

from __future__ import annotations

import pytest

from broker.http import limits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate() -> None:
    clock = Clock()
    buckets = limits.Buckets(10.0, 5.0, clock=clock)
    assert [buckets.take("t") for _ in range(5)] == [0.0] * 5
    assert buckets.take("t") == pytest.approx(0.1)  # one token back in 1/rate s
    assert buckets.take("other") == 0.0  # each key its own
    clock.now = 0.25
    assert buckets.take("t") == 0.0 and buckets.take("t") == 0.0
    assert buckets.take("t") > 0.0
    clock.now = 100.0  # refills up to the burst, no further
    assert [buckets.take("t") for _ in range(6)].count(0.0) == 5


def test_wait_takes_nothing() -> None:
    clock = Clock()
    buckets = limits.Buckets(1.0, 1.0, clock=clock)
    assert buckets.wait("t") == 0.0
    buckets.take("t")
    assert buckets.wait("t") == pytest.approx(1.0)
    assert buckets.wait("t") == pytest.approx(1.0)
    clock.now = 1.0
    assert buckets.wait("t") == 0.0


def test_many_keys_stay_bounded_and_full_buckets_go_first() -> None:
    clock = Clock()
    buckets = limits.Buckets(1.0, 2.0, max_keys=100, clock=clock)
    buckets.take("busy")
    buckets.take("busy")
    for n in range(1000):
        buckets.take(f"guess-{n}")
        clock.now += 0.002
    assert len(buckets) <= 100
    # kept (refilled over the 2 s) or dropped (back full): never stricter than the rate
    assert buckets.take("busy") == 0.0


@pytest.mark.parametrize(
    ("text", "per_second"),
    [
        pytest.param("50/s", 50.0, id="per second"),
        pytest.param("50", 50.0, id="a plain number"),
        pytest.param("600/m", 10.0, id="per minute"),
        pytest.param("0.5/s", 0.5, id="fractional"),
    ],
)
def test_rates_read(text: str, per_second: float) -> None:
    assert limits.parse_rate(text) == pytest.approx(per_second)


@pytest.mark.parametrize("text", ["0/s", "fast", "-5/s", "5/h"])
def test_bad_rates_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a rate"):
        limits.parse_rate(text)
