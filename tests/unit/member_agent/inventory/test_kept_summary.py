"""The summary the agent keeps between reports (`inventory.tallies.KeptSummary`) counts again
only the nodes the inventory says changed. After any sequence of changes made through the
inventory — pods placed and released (whole, shared, MIG), GPUs made unhealthy, nodes made
NotReady or cordoned (and touched), added, replaced, removed, the inventory cleared — it
must read as a fresh `summarise` of the same inventory."""

from __future__ import annotations

import random

from broker.api import status
from member_agent.inventory import model, summary, tallies

GPU = model.GPU_MILLI
MIG = "1g.10gb"


def new_node(rng: random.Random, name: str) -> model.Node:
    gpus = rng.choice([4, 8])
    return model.Node(
        name=name,
        model=rng.choice(["H100", "A100", "A100", ""]),
        gpu_count=gpus if rng.random() > 0.05 else 0,
        gpu_memory_mib=rng.choice([40960, 81920]),
        cpu_milli=rng.choice([32000, 64000]),
        memory_mib=rng.choice([256000, 512000]),
        rack=rng.choice(["", "r1", "r2", "r3"]),
        nvlink_domain=rng.choice(["", "", "nvl-a"]),
        nvlink_island=rng.choice([0, 2, 4, 8]),
        mig={MIG: 7} if rng.random() < 0.15 else {},
    )


class Driver:
    """Random changes to an inventory, each through its methods."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.inv = model.Inventory(cluster="c")
        self.serial = 0
        for _ in range(self.rng.randint(3, 30)):
            self.add()

    def add(self) -> None:
        self.serial += 1
        names = list(self.inv.nodes)
        # now and then a node of the same name again (a node object replaced)
        name = self.rng.choice(names) if names and self.rng.random() < 0.2 else f"n{self.serial}"
        self.inv.add(new_node(self.rng, name))

    def place(self) -> None:
        node = self.rng.choice(list(self.inv.nodes.values()))
        self.serial += 1
        if node.mig and self.rng.random() < 0.5:
            free = node.mig_free.get(MIG, ())
            if free:
                pod = status.PodPlacement(name=f"p{self.serial}", task="t", node=node.name)
                self.inv.apply(pod, mig={MIG: [free[0]]})
            return
        milli = self.rng.choice([GPU, GPU, 250, 500])
        slots = [
            status.GPUSlot(index=i, milli=milli)
            for i, free in enumerate(node.gpu_free)
            if free >= milli and i not in node.unhealthy
        ][: self.rng.randint(1, 4)]
        cpu = self.rng.choice([0, 1000, 4000])
        if slots and node.cpu_free >= cpu:
            pod = status.PodPlacement(name=f"p{self.serial}", task="t", node=node.name, gpus=slots)
            self.inv.apply(pod, cpu_milli=cpu, memory_mib=cpu * 4)

    def step(self) -> None:
        rng, inv = self.rng, self.inv
        nodes = list(inv.nodes.values())
        roll = rng.random()
        if not nodes or roll < 0.05:
            self.add()
        elif roll < 0.45:
            self.place()
        elif roll < 0.75 and (inv.pods or inv.mig_pods):
            inv.release(rng.choice([*inv.pods, *inv.mig_pods]))
        elif roll < 0.82:
            node = rng.choice(nodes)
            inv.set_unhealthy(node.name, {i for i in range(node.gpu_count) if rng.random() < 0.2})
        elif roll < 0.9:
            node = rng.choice(nodes)
            if rng.random() < 0.5:
                node.ready = not node.ready
            else:
                node.schedulable = not node.schedulable
            inv.touch(node.name)
        elif roll < 0.97:
            inv.remove(rng.choice(nodes).name)
        elif roll < 0.985:
            inv.clear()
            self.add()
        else:
            self.add()


def test_the_kept_summary_reads_as_a_fresh_one_after_every_change() -> None:
    for seed in range(40):
        driver = Driver(seed)
        kept = tallies.KeptSummary(check_every=0)  # no whole count to hide a wrong one
        for _ in range(150):
            for _ in range(driver.rng.randint(1, 5)):  # a report covers several changes
                driver.step()
            got = kept(driver.inv, seq=4)
            fresh = summary.summarise(driver.inv, seq=4)
            assert tallies.same(got, fresh), (seed, got, fresh)
        assert kept.drifts == 0


def test_a_change_not_told_is_found_by_the_whole_count_and_mended() -> None:
    driver = Driver(3)
    kept = tallies.KeptSummary(check_every=3)
    kept(driver.inv)  # call 1: counted whole
    node = next(n for n in driver.inv.nodes.values() if n.gpu_count)
    node.ready = not node.ready  # and no touch: the kept counts are wrong now
    assert not tallies.same(kept(driver.inv), summary.summarise(driver.inv))  # call 2
    mended = kept(driver.inv)  # call 3 counts whole as well
    assert kept.drifts == 1 and tallies.same(mended, summary.summarise(driver.inv))
    driver.step()
    assert tallies.same(kept(driver.inv), summary.summarise(driver.inv))  # whole again


def test_a_new_inventory_is_counted_whole() -> None:
    first, second = Driver(1), Driver(2)
    kept = tallies.KeptSummary(check_every=0)
    kept(first.inv)
    assert tallies.same(kept(second.inv), summary.summarise(second.inv))
