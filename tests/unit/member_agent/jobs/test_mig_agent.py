"""MIG on the agent: a simulated cluster with MIG nodes takes MIG offers all or nothing, books
and frees the slices, and its summaries carry them only to brokers that read them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker.api import messages, mig
from member_agent.cluster.simulated import backend as simulated
from member_agent.jobs import handling
from member_agent.session import reporting
from tests import agentbuilders

MIG_CLUSTER = f"""
cluster: migs
pools:
  - name: a100
    count: 2
    gpu_product: {agentbuilders.H100}
    gpus_per_node: 2
    cpu: 64
    memory: 256Gi
    mig: {{1g.10gb: 7, 3g.40gb: 2}}
"""


def backend(tmp_path: Path) -> simulated.SimulatedBackend:
    pools = simulated.load_pools(agentbuilders.write_cluster(tmp_path, MIG_CLUSTER))
    return simulated.SimulatedBackend("migs", pools, start_delay=0.01)


def free(sim: simulated.SimulatedBackend, profile: str = "1g.10gb") -> dict[str, int]:
    return {n.name: len(n.mig_free[profile]) for n in sim.inventory()}


def test_a_pool_of_mig_nodes_and_a_bad_profile(tmp_path: Path) -> None:
    sim = backend(tmp_path)
    assert free(sim) == {"a100-000": 7, "a100-001": 7}
    assert all(n.gpu_count == 2 for n in sim.inventory())
    bad = MIG_CLUSTER.replace("1g.10gb: 7", "tiny: 7")
    with pytest.raises(simulated.NodesFileError, match=r"pools\[0\]\.mig.*not a MIG profile"):
        simulated.load_pools(agentbuilders.write_cluster(tmp_path, bad))


async def test_a_mig_gang_that_does_not_fit_is_rejected_with_nothing_created(
    tmp_path: Path,
) -> None:
    sim = backend(tmp_path)
    replies: list[messages.Message] = []
    handler = handling.JobHandler(sim, send=lambda m, **_: None, failure_grace_seconds=0)
    annotations = {mig.MIG_PROFILE_ANNOTATION: "3g.40gb"}
    job = agentbuilders.make_job("m", gpus=2, replicas=3, annotations=annotations)
    await handler.handle_offer(
        agentbuilders.make_offer("j1", job), session_epoch=1, reply=replies.append
    )
    reply = replies[-1]
    assert isinstance(reply, messages.Rejected)
    assert "3 pods × 2 MIG slices of 3g.40gb need 3 nodes" in " ".join(reply.reasons)
    assert free(sim, "3g.40gb") == {"a100-000": 2, "a100-001": 2} and sim.creates == 0
    await handler.close()


async def test_finished_mig_pods_give_their_slices_back(tmp_path: Path) -> None:
    sim = backend(tmp_path)
    replies: list[messages.Message] = []
    handler = handling.JobHandler(sim, send=lambda m, **_: None, failure_grace_seconds=0)
    job = agentbuilders.make_job(
        "m", gpus=5, replicas=2, duration=0.05, annotations={mig.MIG_PROFILE_ANNOTATION: "1g.10gb"}
    )
    await handler.handle_offer(
        agentbuilders.make_offer("j1", job), session_epoch=1, reply=replies.append
    )
    assert isinstance(replies[-1], messages.Accepted), replies[-1]
    assert free(sim) == {"a100-000": 2, "a100-001": 2}  # 5 slices on each node
    assert {n.name: n.whole_free for n in sim.inventory()} == {"a100-000": 2, "a100-001": 2}
    events = sim.events()
    async with asyncio.timeout(5):
        while free(sim) != {"a100-000": 7, "a100-001": 7}:
            handler.handle_event(await anext(events))
    await handler.close()


def test_the_summary_carries_slices_only_to_a_broker_that_reads_them(tmp_path: Path) -> None:
    sim = backend(tmp_path)
    reporter = reporting.SummaryReporter(sim.inventory, cluster="migs")
    old = messages.encode(reporter.attach(lambda _: None))  # a broker of protocol 6
    assert '"mig"' not in old
    reporter.send_mig = True  # the welcome said v >= MIG_SINCE
    decoded = messages.decode(messages.encode(reporter.attach(lambda _: None)))
    assert isinstance(decoded, messages.Summary)
    [found] = decoded.summary.models
    assert found.mig is not None and found.mig["1g.10gb"].free == 14
    assert found.mig["3g.40gb"].nodes_by_free == [0, 0, 2]
