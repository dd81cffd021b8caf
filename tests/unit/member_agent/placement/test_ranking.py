"""ranking.Rankings answers what gang.choose_node's scan answers, node for node, while the
cluster changes under it: pods placed and released, GPUs failing, nodes going NotReady."""

from __future__ import annotations

import random

import pytest

from broker.api import affinity, status
from member_agent.inventory import fragmentation, model
from member_agent.placement import filtering, gang, indexing, policies, ranking, scoring
from tests import agentbuilders as b

WORKLOAD = fragmentation.default_workload()

SCORERS = {
    "default": lambda: policies.make_default(WORKLOAD),
    "fgd-float": lambda: scoring.FGD(WORKLOAD, truncate=False),
    "bestfit": scoring.BestFit,
    "binpack": scoring.Binpack,
    "spread": scoring.Spread,
    "firstfit": scoring.Scorer,
}

DEMANDS = [
    filtering.Demand(gpus=1, gpu_milli=1000, cpu_milli=1000, memory_mib=1000),
    filtering.Demand(gpus=2, gpu_milli=1000, cpu_milli=8000, memory_mib=64_000),
    filtering.Demand(gpus=4, gpu_milli=1000, cpu_milli=4000, memory_mib=4000, nvlink=True),
    filtering.Demand(gpus=8, gpu_milli=1000, cpu_milli=1000, memory_mib=1000),
    filtering.Demand(gpus=1, gpu_milli=500, cpu_milli=500, memory_mib=500),
    filtering.Demand(gpus=1, gpu_milli=300, cpu_milli=500, memory_mib=500),
    filtering.Demand(gpus=0, gpu_milli=0, cpu_milli=16_000, memory_mib=1000),
    filtering.Demand(gpus=1, gpu_milli=1000, cpu_milli=1000, memory_mib=1000, models=("A100",)),
    filtering.Demand(
        gpus=1,
        gpu_milli=1000,
        cpu_milli=1000,
        memory_mib=1000,
        selector=affinity.read_pod_spec({"pool": "blue"}, None).selector,
    ),
]


def _cluster(rng: random.Random, count: int) -> model.Inventory:
    nodes = []
    for i in range(count):
        gpus = rng.choice([4, 8, 8])
        used = {g: rng.choice([0, 0, 0, 300, 500, 1000]) for g in range(gpus)}
        nodes.append(
            b.node(
                f"n{i:03d}",
                gpus=gpus,
                model_name=rng.choice(["H100", "H100", "A100"]),
                used={g: milli for g, milli in used.items() if milli},
                cpu_free=rng.choice([-1, 2000, 30_000]),
                island=rng.choice([0, 4]),
                ready=rng.random() > 0.05,
                labels={"pool": rng.choice(["blue", "green"])},
            )
        )
    return b.inventory(*nodes)


def _scan(index: indexing.FreeIndex, demand: filtering.Demand, scorer: scoring.Scorer) -> str:
    entry = gang.choose_node(index, demand, scorer, scratch={})
    return entry.name if entry is not None else ""


def _ranked(rankings: ranking.Rankings, demand: filtering.Demand) -> str:
    entry = rankings.choose(demand, {})
    return entry.name if entry is not None else ""


@pytest.mark.parametrize("policy", sorted(SCORERS))
@pytest.mark.parametrize("seed", range(4))
def test_the_order_answers_what_the_scan_answers(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    inv = _cluster(rng, 60)
    scorer = SCORERS[policy]()
    index = indexing.FreeIndex.build(inv)
    rankings = ranking.Rankings(index, scorer)
    placed: list[str] = []
    checked = 0
    for step in range(400):
        demand = rng.choice(DEMANDS)
        expected = _scan(index, demand, scorer)
        assert _ranked(rankings, demand) == expected, (step, demand)
        checked += bool(expected)
        changed: str | None = None
        roll = rng.random()
        if expected and roll < 0.6:  # place the pod where both chose
            entry = index.entries[expected]
            pod = status.PodPlacement(
                name=f"p{step}",
                task="t",
                node=expected,
                gpus=[
                    status.GPUSlot(index=i, milli=milli) for i, milli in scorer.slots(entry, demand)
                ],
            )
            inv.apply(pod, cpu_milli=demand.cpu_milli, memory_mib=demand.memory_mib)
            placed.append(pod.name)
            changed = expected
        elif placed and roll < 0.85:  # a pod ends
            name = placed.pop(rng.randrange(len(placed)))
            changed = inv.pods[name][0].node
            inv.release(name)
        elif roll < 0.95:  # a GPU fails, or comes back
            changed = rng.choice(list(inv.nodes))
            bad = [rng.randrange(inv.nodes[changed].gpu_count)] if rng.random() < 0.5 else []
            inv.set_unhealthy(changed, bad)
        else:  # a node goes NotReady, or comes back
            changed = rng.choice(list(inv.nodes))
            inv.nodes[changed].ready = not inv.nodes[changed].ready
        index.refresh(inv.nodes[changed])
        rankings.refresh(index.entries[changed])
    assert checked > 100  # most steps had a node to choose: the comparison meant something


def test_scratch_copies_are_weighed_as_the_scan_weighs_them() -> None:
    """Inside one gang, a node already holding a pod of it is judged as the gang left it."""
    inv = b.inventory(b.node("a", gpus=8, used={0: 1000}), b.node("b", gpus=8))
    index = indexing.FreeIndex.build(inv, order=list(inv.nodes))
    scorer = policies.make_default(WORKLOAD)
    rankings = ranking.Rankings(index, scorer)
    demand = DEMANDS[0]
    scratch = {"b": index.entries["b"].copy()}
    scratch["b"].take([(0, 1000), (1, 1000), (2, 1000)], cpu_milli=0, memory_mib=0)
    expected = gang.choose_node(index, demand, scorer, scratch=scratch)
    assert expected is not None
    got = rankings.choose(demand, scratch)
    assert got is not None and got.name == expected.name
    assert got is scratch.get(got.name, index.entries[got.name])  # the copy, if it is one


def test_orders_are_kept_for_the_demands_used_last() -> None:
    inv = _cluster(random.Random(7), 20)
    index = indexing.FreeIndex.build(inv)
    rankings = ranking.Rankings(index, scoring.BestFit())
    for cpu in range(ranking.MAX_DEMANDS + 5):
        rankings.choose(filtering.Demand(gpus=1, gpu_milli=1000, cpu_milli=cpu, memory_mib=0), {})
    assert len(rankings) == ranking.MAX_DEMANDS


def test_randomised_scorers_and_mig_pods_are_left_to_the_scan() -> None:
    demand = DEMANDS[0]
    assert ranking.Rankings.applies(policies.make_default(WORKLOAD), demand)
    assert not ranking.Rankings.applies(scoring.Random(1), demand)
    mig = filtering.Demand(
        gpus=0, gpu_milli=0, cpu_milli=0, memory_mib=0, mig_profile="1g.10gb", mig_slices=1
    )
    assert not ranking.Rankings.applies(policies.make_default(WORKLOAD), mig)
