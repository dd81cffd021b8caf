"""Retrying one request to the API server (`retrying.call`): the waits, the deadline, and the
Kubernetes errors it reads (`kubernetes.errors`: Retry-After, what is temporary)."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from member_agent.cluster import errors
from member_agent.cluster.kubernetes import errors as k8s_errors
from member_agent.cluster.kubernetes import retrying, watching


class FakeTime:
    """A clock that moves only when the policy sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def policy(time: FakeTime, **kwargs: float) -> retrying.RetryPolicy:
    backoff = watching.Backoff(initial=0.1, maximum=5.0, factor=2.0, jitter=0.5)
    return retrying.RetryPolicy(
        sleep=time.sleep, clock=time.clock, rng=random.Random(7), backoff=backoff, **kwargs
    )


class Server:
    """Fails the first tries as told, then answers "done"; records each try's timeout."""

    def __init__(self, *failures: errors.BackendError, took: float = 0.0, time: FakeTime) -> None:
        self.failures = list(failures)
        self.timeouts: list[float] = []
        self.took = took
        self.time = time

    async def __call__(self, timeout: float) -> str:
        self.timeouts.append(timeout)
        self.time.now += self.took
        if self.failures:
            raise self.failures.pop(0)
        return "done"


def throttled(after: float | None = None) -> errors.TemporaryBackendError:
    return errors.TemporaryBackendError("HTTP 429", retry_after=after)


async def test_retry_after_is_waited_for_at_least_and_spread_by_the_jitter() -> None:
    time = FakeTime()
    server = Server(throttled(1.0), throttled(2.0), throttled(0.0), time=time)
    assert await retrying.call(policy(time), "create", server, timeout=30) == "done"
    first, second, third = time.slept
    assert 1.0 <= first <= 1.5 and 2.0 <= second <= 3.0
    assert 0.2 <= third <= 0.4  # a Retry-After of 0 still backs off (the third try's delay)
    assert len(server.timeouts) == 4


async def test_without_retry_after_the_backoff_grows_and_is_capped() -> None:
    time = FakeTime()
    server = Server(*(throttled() for _ in range(8)), time=time)
    await retrying.call(policy(time, deadline=60), "delete", server, timeout=30)
    assert [round(s, 2) for s in time.slept[:3]] == pytest.approx([0.1, 0.2, 0.4], rel=0.5)
    assert all(s <= 5.0 for s in time.slept)
    assert time.slept[-1] >= 2.5  # reached the cap, less at most half of it


async def test_a_wait_the_deadline_has_no_room_for_gives_up_with_the_last_error() -> None:
    time = FakeTime()
    last = throttled(30.0)
    server = Server(throttled(1.0), last, time=time)
    with pytest.raises(errors.TemporaryBackendError) as caught:
        await retrying.call(policy(time, deadline=20), "create", server, timeout=30)
    assert caught.value is last
    assert len(time.slept) == 1 and len(server.timeouts) == 2


async def test_each_try_gets_what_is_left_of_the_deadline_at_most() -> None:
    time = FakeTime()
    server = Server(throttled(), throttled(), took=6.0, time=time)
    await retrying.call(policy(time, deadline=15), "create", server, timeout=10)
    assert server.timeouts[0] == 10
    assert server.timeouts[2] == pytest.approx(15 - 12 - sum(time.slept))


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(errors.PermanentBackendError("HTTP 400"), id="permanent"),
        pytest.param(errors.RefusedError("HTTP 403", detail="denied"), id="refused"),
        pytest.param(k8s_errors.Conflict("HTTP 409"), id="conflict"),
    ],
)
async def test_a_permanent_error_is_not_tried_again(error: errors.BackendError) -> None:
    time = FakeTime()
    server = Server(error, time=time)
    with pytest.raises(type(error)):
        await retrying.call(policy(time), "create", server, timeout=30)
    assert len(server.timeouts) == 1 and time.slept == []


async def test_no_retry_is_one_try_with_the_whole_timeout() -> None:
    time = FakeTime()
    server = Server(throttled(0.0), time=time)
    with pytest.raises(errors.TemporaryBackendError):
        await retrying.call(retrying.NO_RETRY, "create", server, timeout=30)
    assert server.timeouts == [30]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param("3", 3.0, id="seconds"),
        pytest.param("0", 0.0, id="at once"),
        pytest.param(
            format_datetime(datetime.fromtimestamp(1012, UTC), usegmt=True), 12.0, id="date"
        ),
        pytest.param("soon", None, id="unreadable"),
        pytest.param(None, None, id="absent"),
    ],
)
def test_retry_after_is_read_as_seconds_or_a_date(
    header: str | None, expected: float | None
) -> None:
    headers = {"Retry-After": header} if header is not None else {}
    assert k8s_errors.retry_after(headers, now=1000.0) == expected


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        pytest.param(429, errors.TemporaryBackendError, id="429 throttled"),
        pytest.param(503, errors.TemporaryBackendError, id="503"),
        pytest.param(409, k8s_errors.Conflict, id="409 already exists"),
        pytest.param(403, errors.RefusedError, id="403 forbidden or denied"),
        pytest.param(422, errors.RefusedError, id="422 invalid"),
        pytest.param(400, errors.PermanentBackendError, id="400"),
    ],
)
def test_the_status_gives_the_kind_of_error(code: int, kind: type[errors.BackendError]) -> None:
    error = k8s_errors.error_for_status(
        code, "what the server said", what="create pod a/b", headers={"Retry-After": "2"}
    )
    assert type(error) is kind
    if isinstance(error, errors.TemporaryBackendError):
        assert error.retry_after == 2.0
    if isinstance(error, errors.RefusedError):
        assert error.detail == "what the server said"
