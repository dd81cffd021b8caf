"""Per-namespace GPU limits: the limits file and the cluster's ResourceQuotas, stricter wins."""

from __future__ import annotations

import pytest

from member_agent.inventory import model
from member_agent.placement import limits

REQ = "requests.nvidia.com/gpu"
LIM = "limits.nvidia.com/gpu"


def quota(hard: int, used: int, *, name: str = "gpus", resource: str = REQ) -> model.GPUQuota:
    return model.GPUQuota("team-a", name, resource, hard=hard, used=used)


@pytest.mark.parametrize(
    ("file_limit", "in_use", "found", "asked", "expected"),
    [
        pytest.param(None, 0, [], 64, None, id="no limit at all"),
        pytest.param(None, 0, [quota(16, 8)], 8, None, id="fits the quota exactly"),
        pytest.param(
            None,
            0,
            [quota(16, 10)],
            8,
            (
                "quota",
                "namespace team-a: ResourceQuota gpus allows 16 requests.nvidia.com/gpu, "
                "10 used, 6 left, the job asks for 8",
            ),
            id="over the quota",
        ),
        pytest.param(
            32,
            4,
            [quota(16, 12)],
            8,
            ("quota", "ResourceQuota gpus allows 16"),
            id="quota stricter than the file",
        ),
        pytest.param(
            6,
            4,
            [quota(16, 4)],
            8,
            ("limit", "namespace team-a: GPU limit 6 on this cluster, 4 in use"),
            id="file stricter than the quota",
        ),
        pytest.param(
            64,
            0,
            [quota(32, 0, name="big"), quota(8, 2, name="small", resource=LIM)],
            8,
            ("quota", "ResourceQuota small allows 8 limits.nvidia.com/gpu, 2 used, 6 left"),
            id="the strictest of two quotas",
        ),
        pytest.param(
            None,
            0,
            [quota(4, 9)],
            1,
            ("quota", "9 used, 0 left"),
            id="a quota already exceeded",
        ),
    ],
)
def test_the_stricter_of_the_file_and_the_quotas_wins(
    file_limit: int | None,
    in_use: int,
    found: list[model.GPUQuota],
    asked: int,
    expected: tuple[str, str] | None,
) -> None:
    agent_limits = limits.AgentLimits(
        namespace_gpus={"team-a": file_limit} if file_limit is not None else {}
    )
    over = limits.check_gpus(agent_limits, "team-a", in_use=in_use, asked=asked, quotas=found)
    if expected is None:
        assert over is None
        return
    assert over is not None
    assert over.source == expected[0]
    assert expected[1] in over.reason
