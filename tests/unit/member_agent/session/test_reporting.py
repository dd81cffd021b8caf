"""Summaries sent up: what they count, deltas against full summaries, coalescing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.api import inventory, messages, status
from member_agent.inventory import model
from member_agent.inventory import summary as summaries
from member_agent.session import connecting, reporting
from tests import agentbuilders


def take(inv: model.Inventory, node: str, *indexes: int, milli: int = 1000, name: str = "") -> None:
    inv.apply(
        status.PodPlacement(
            name=name or f"{node}-{indexes}",
            task="t",
            node=node,
            gpus=[status.GPUSlot(index=i, milli=milli) for i in indexes],
        )
    )


def test_the_summary_counts_free_gpus_per_model(tmp_path: Path) -> None:
    inv = agentbuilders.small_backend(tmp_path).inventory()
    take(inv, "h100-000", 0, 1, 2)  # 5 free, best NVLink island 5
    take(inv, "h100-001", 0, milli=300)  # a shared GPU: 700 milli left on it
    inv.nodes["l4-000"].ready = False
    summary = summaries.summarise(inv)
    h100 = summary.model(agentbuilders.H100)
    assert h100 is not None
    assert (h100.nodes, h100.total_gpus, h100.free_gpus, h100.unavailable_gpus) == (2, 16, 12, 0)
    assert h100.nodes_by_free == [0, 0, 0, 0, 0, 1, 0, 1, 0]
    assert h100.shared_free_milli == 700
    assert h100.largest_free_nvlink_block == 7
    assert h100.racks == {"h100-rack-0": [0, 0, 0, 0, 0, 1, 0, 1, 0]}
    assert h100.max_free_cpu_milli == 200_000
    l4 = summary.model(agentbuilders.L4)
    assert l4 is not None
    assert (l4.free_gpus, l4.unavailable_gpus, l4.nodes_by_free) == (0, 4, [0, 0, 0, 0, 0])


@pytest.mark.parametrize(
    ("island", "domain_nodes", "expected"),
    [
        pytest.param(0, 0, 1, id="no NVLink: one GPU"),
        pytest.param(2, 0, 2, id="NVLink pairs"),
        pytest.param(4, 0, 3, id="two islands of 4, one GPU taken in each"),
        pytest.param(4, 2, 6, id="a domain of two nodes"),
    ],
)
def test_the_largest_free_nvlink_block(island: int, domain_nodes: int, expected: int) -> None:
    inv = model.Inventory(cluster="c")
    for i in range(2):
        inv.add(
            model.Node(
                name=f"n{i}",
                model="m",
                gpu_count=8,
                nvlink_island=island,
                nvlink_domain="d" if domain_nodes else "",
            )
        )
    take(inv, "n0", 0, 4, name="a")
    take(inv, "n1", 0, 1, 2, 3, 4, 5, 6, 7, name="b")
    summary = summaries.summarise(inv).model("m")
    assert summary is not None
    assert summary.largest_free_nvlink_block == expected


def summaries_reporter(
    tmp_path: Path, *, clock: Callable[[], float] = time.monotonic
) -> tuple[reporting.SummaryReporter, model.Inventory]:
    inv = agentbuilders.small_backend(tmp_path).inventory()
    reporter = reporting.SummaryReporter(
        lambda: inv, cluster="small", interval=0.05, summarise=summaries.summarise, clock=clock
    )
    return reporter, inv


def test_a_delta_carries_only_the_changed_model(tmp_path: Path) -> None:
    reporter, inv = summaries_reporter(tmp_path)
    sent: list[messages.Summary] = []
    first = reporter.attach(sent.append)
    assert first.full and first.summary.seq == 1 and len(first.summary.models) == 2
    assert reporter.next_message() is None  # nothing changed
    take(inv, "l4-000", 0)
    delta = reporter.next_message()
    assert delta is not None and not delta.full
    assert [m.model for m in delta.summary.models] == [agentbuilders.L4]
    assert delta.summary.seq == 2
    take(inv, "l4-000", 1)
    take(inv, "h100-000", 1)
    full = reporter.next_message()
    assert full is not None and full.full and full.summary.seq == 3


def test_cluster_labels_go_only_to_a_broker_that_reads_them(tmp_path: Path) -> None:
    inv = agentbuilders.small_backend(tmp_path).inventory()
    labels = {"region": "eu-west", "tier": "spot"}
    reporter = reporting.SummaryReporter(lambda: inv, cluster="small", labels=labels)
    old = reporter.attach(lambda _: None)  # a broker older than protocol 5: no labels
    frame = messages.encode(old)
    assert '"labels"' not in frame  # what an older broker, forbidding unknown fields, reads
    decoded = messages.decode(frame)
    assert isinstance(decoded, messages.Summary) and decoded.summary.labels == {}
    reporter.send_labels = True  # the welcome said v >= LABELS_SINCE
    first = messages.decode(messages.encode(reporter.attach(lambda _: None)))
    assert isinstance(first, messages.Summary) and first.summary.labels == labels
    take(inv, "l4-000", 0)
    delta = reporter.next_message()
    assert delta is not None and not delta.full and delta.summary.labels == labels


def test_a_summary_with_labels_kubernetes_would_refuse_is_refused() -> None:
    with pytest.raises(ValueError, match="labels"):
        inventory.ClusterSummary(cluster="c", labels={"not a key": "x"})
    with pytest.raises(ValueError, match="labels"):
        inventory.ClusterSummary(cluster="c", labels={"region": "no spaces"})


@pytest.mark.looptime
async def test_changes_are_coalesced(tmp_path: Path) -> None:
    reporter, inv = summaries_reporter(tmp_path, clock=asyncio.get_running_loop().time)
    sent: list[messages.Summary] = []
    reporter.attach(sent.append)
    for index in range(4):
        take(inv, "h100-000", index)
        reporter.mark_dirty()
    await asyncio.sleep(0.1)
    assert len(sent) == 1
    h100 = sent[0].summary.model(agentbuilders.H100)
    assert isinstance(h100, inventory.ModelSummary) and h100.free_gpus == 12
    reporter.detach()
    take(inv, "h100-000", 5)
    reporter.mark_dirty()  # no session: nothing to send
    await asyncio.sleep(0.06)
    assert len(sent) == 1


def constant(value: float) -> Callable[[], float]:
    return lambda: value


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [
        pytest.param(0, 0.05, 0.1, id="first retry"),
        pytest.param(3, 0.4, 0.8, id="fourth retry"),
        pytest.param(10, 2.5, 5.0, id="capped"),
        pytest.param(10_000, 2.5, 5.0, id="never overflows"),
    ],
)
def test_backoff_doubles_with_jitter_up_to_the_cap(attempt: int, low: float, high: float) -> None:
    delays = [
        connecting.backoff_delay(attempt, initial=0.1, maximum=5.0, rand=constant(r))
        for r in (0.0, 0.5, 0.999999)
    ]
    assert low == pytest.approx(delays[0])
    assert delays[0] < delays[1] < delays[2] <= high
