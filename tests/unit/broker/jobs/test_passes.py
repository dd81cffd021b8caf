"""A leader's periodic task lives through failing passes, backing off, and ends only with its
term (`broker.jobs.passes`)."""

from __future__ import annotations

import pytest

from broker.jobs import passes
from broker.state import errors


class Stop(Exception):
    """Ends the loop from the fake sleep once the script has run."""


async def test_failing_passes_are_counted_backed_off_and_survived() -> None:
    script: list[BaseException | float] = [
        errors.TemporaryStoreError("etcd away"),
        RuntimeError("a bug in one pass"),
        0.25,
        errors.StoreError("again"),
        0.5,
    ]
    pauses: list[float] = []
    errors_counted: list[None] = []

    async def step() -> float:
        item = script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if not script:
            raise Stop

    with pytest.raises(Stop):
        await passes.run_passes(
            step, what="testing", on_error=lambda: errors_counted.append(None), sleep=sleep
        )
    # backoff doubles while passes fail (0.5, 1.0), the pass's own pause once one works
    assert pauses == [0.5, 1.0, 0.25, 0.5, 0.5]
    assert len(errors_counted) == 3


async def test_the_end_of_the_term_ends_the_task() -> None:
    async def step() -> float:
        raise errors.NotLeaderError("term 3 is over")

    async def sleep(seconds: float) -> None:
        raise AssertionError("no pause after the term ended")

    with pytest.raises(errors.NotLeaderError):
        await passes.run_passes(step, what="testing", on_error=lambda: None, sleep=sleep)
