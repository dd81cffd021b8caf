"""An accept must say where the gang runs: it names the gang's pods (at least its
minMember), or the broker takes it for a rejection (`messages.accept_problem`)."""

from __future__ import annotations

import pytest

from broker.api import messages, status
from tests.builders import JobBuilder, make_job


def accept(*names: str) -> messages.Accepted:
    pods = [status.PodPlacement(name=name, task="worker", node="n0") for name in names]
    return messages.Accepted(job_id="j1", epoch=1, pods=pods)


@pytest.mark.parametrize(
    ("job", "named", "problem"),
    [
        pytest.param(make_job(gpus=1), ("p0",), None, id="the one pod named"),
        pytest.param(
            make_job(gpus=1),
            (),
            "accepted without naming every pod (0 of 1 named)",
            id="no pod named",
        ),
        pytest.param(make_job(gpus=8).gang(4), ("p0", "p1", "p2", "p3"), None, id="gang of 4"),
        pytest.param(
            make_job(gpus=8).gang(4),
            ("p0", "p1", "p2"),
            "accepted without naming every pod (3 of 4 named)",
            id="a pod of the gang missing",
        ),
        pytest.param(
            make_job(gpus=8).gang(4),
            ("p0", "p0", "p1", "p1"),
            "accepted without naming every pod (2 of 4 named)",
            id="a pod named twice counts once",
        ),
        pytest.param(
            make_job(gpus=8).gang(4).min_member(2),
            ("p0", "p1"),
            None,
            id="minMember placed: the rest may be left out",
        ),
        pytest.param(
            make_job(gpus=8).gang(4).min_member(2),
            ("p0",),
            "accepted without naming the gang's minMember 2 (1 of 2 named)",
            id="fewer than minMember",
        ),
        pytest.param(
            make_job(gpus=1).task("ps", gpus=0, replicas=2),
            ("p0", "p1", "p2"),
            None,
            id="every task's pods",
        ),
    ],
)
def test_an_accept_names_the_gang(job: JobBuilder, named: tuple[str, ...], problem: str) -> None:
    assert messages.accept_problem(accept(*named), job.build()) == problem
