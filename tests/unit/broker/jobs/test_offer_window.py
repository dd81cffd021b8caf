"""Each agent's offer window (`jobs.fleet`): additive increase, multiplicative decrease.
Offers timing out halve it, once per round of offers sent before the cut, never below the
floor; each offer answered grows it back by 0.1, up to --max-offers-in-flight; the cycle's
snapshot gives the cluster what is left of it as `offer_slots`."""

from __future__ import annotations

from broker.jobs import fleet
from broker.planning import fitting
from tests.builders import make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"


def made(limit: int | None = 100) -> tuple[fleet.Fleet, fleet.Cluster]:
    clusters = fleet.Fleet(max_offers_in_flight=limit)
    cluster = fleet.Cluster(name="a", link=object(), last_seen=1.0)  # type: ignore[arg-type]
    cluster.summary = make_summary("a", make_model_summary(H100, nodes_by_free=[0] * 8 + [4]))
    clusters.clusters["a"] = cluster
    return clusters, cluster


def test_a_window_starts_at_the_maximum_and_halves_once_per_round_of_timeouts() -> None:
    clusters, cluster = made(100)
    assert clusters.offer_window(cluster) == 100
    clusters.offers_timed_out(cluster, sent_at=5.0, now=10.0)
    assert clusters.offer_window(cluster) == 50
    # more of the offers sent before the cut time out: the same round, no second cut
    clusters.offers_timed_out(cluster, sent_at=9.0, now=11.0)
    assert clusters.offer_window(cluster) == 50
    # offers sent after the cut time out too: halved again
    clusters.offers_timed_out(cluster, sent_at=10.5, now=12.0)
    assert clusters.offer_window(cluster) == 25


def test_a_window_is_never_halved_below_the_floor() -> None:
    clusters, cluster = made(100)
    for n in range(10):
        clusters.offers_timed_out(cluster, sent_at=float(2 * n + 1), now=float(2 * n + 2))
    assert clusters.offer_window(cluster) == fleet.WINDOW_FLOOR
    small, tiny = made(4)
    small.offers_timed_out(tiny, sent_at=1.0, now=2.0)
    assert small.offer_window(tiny) == 4  # a maximum under the floor is its own floor


def test_answers_grow_the_window_back_to_the_maximum() -> None:
    clusters, cluster = made(100)
    clusters.offers_timed_out(cluster, sent_at=1.0, now=2.0)
    clusters.offers_answered(cluster, 100)  # 100 answers: 10 offers more
    assert clusters.offer_window(cluster) == 60
    clusters.offers_answered(cluster, 10_000)
    assert clusters.offer_window(cluster) == 100 and cluster.offer_window is None


def test_without_a_maximum_there_is_no_window() -> None:
    clusters, cluster = made(None)
    clusters.offers_timed_out(cluster, sent_at=1.0, now=2.0)
    clusters.offers_answered(cluster)
    assert clusters.offer_window(cluster) is None
    (capacity,) = clusters.snapshot(now=1.0).clusters.values()
    assert capacity.offer_slots is None


def test_the_snapshot_gives_what_is_left_of_the_window_as_offer_slots() -> None:
    clusters, cluster = made(100)
    clusters.offers_timed_out(cluster, sent_at=1.0, now=2.0)  # 50
    fit = fitting.Fit(cluster="a", takes=(), leftover=0)
    for n in range(7):
        cluster.inflight[f"j{n}"] = fleet.InFlight(fit=fit, sent_at=3.0)
    assert cluster.accept("j0")  # answered: out of the window
    (capacity,) = clusters.snapshot(now=1.0).clusters.values()
    assert capacity.offer_slots == 50 - 6


def test_an_answer_read_frees_its_slot_before_it_is_applied() -> None:
    clusters, cluster = made(10)
    fit = fitting.Fit(cluster="a", takes=(), leftover=0)
    for n in range(4):
        cluster.inflight[f"j{n}"] = fleet.InFlight(fit=fit, sent_at=3.0, attempt=2)
    assert clusters.offer_slots(cluster) == 6
    assert not cluster.inflight.hear("j0", 1)  # an answer to an earlier attempt
    assert not cluster.inflight.hear("nobody", 2)
    assert cluster.inflight.hear("j0", 2)
    assert not cluster.inflight.hear("j0", 2)  # read twice: one slot
    assert clusters.offer_slots(cluster) == 7
    # applied later: accepted (still deducted from capacity until the next summary), the
    # slot counted once; or rejected (the offer leaves)
    assert cluster.accept("j0") and clusters.offer_slots(cluster) == 7
    assert cluster.inflight.hear("j1", 2)
    cluster.inflight.pop("j1")
    assert clusters.offer_slots(cluster) == 8
    assert cluster.inflight.unanswered == 2 and len(cluster.inflight) == 3  # j0 accepted
    # accepted without being heard first (a test, an older path): counted as before
    assert cluster.accept("j2") and cluster.inflight.unanswered == 1
    cluster.inflight.clear()
    assert cluster.inflight.unanswered == 0 and cluster.inflight.answered == 0
