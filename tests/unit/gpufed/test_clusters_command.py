"""`gpufed clusters`: a model's MIG devices per profile in their own column, free/total, and
`-` for a model without (or from a broker before MIG)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from gpufed import fleetcommands

A100 = "NVIDIA-A100-SXM4-80GB"


class FakeBroker:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items

    async def clusters(self) -> list[dict[str, Any]]:
        return self.items


def totals(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "total": 16, "free": 8, "allocated": 8, "unavailable": 0, **extra}


async def test_the_clusters_table_shows_free_and_total_mig_devices_per_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mig = [
        {"profile": "1g.10gb", "total": 14, "free": 11},
        {"profile": "3g.40gb", "total": 2, "free": 0},
    ]
    items = [
        {
            "name": "east",
            "health": "Ready",
            "running_jobs": 1,
            "models": [totals(A100, mig=mig), totals("Tesla-T4")],  # an older broker: no mig
        }
    ]
    args = argparse.Namespace(output="table")
    assert await fleetcommands.clusters(args, FakeBroker(items)) == 0  # type: ignore[arg-type]
    header, _, a100, t4 = capsys.readouterr().out.splitlines()[:4]
    assert "MIG FREE/TOTAL" in header
    assert "1g.10gb=11/14,3g.40gb=0/2" in a100.split()
    assert t4.split()[-2:] == ["-", "-"]  # no MIG, no labels
