"""summarise counts each node with list methods (`summary._whole_and_shared`) rather than a
loop per GPU: over random nodes — used, shared, unhealthy, islands of 2, 4 and 8, racks,
multi-node NVLink domains, not ready — it must read as the per-GPU definition does."""

from __future__ import annotations

import random

from member_agent.inventory import model, summary

GPU = model.GPU_MILLI


def reference(inv: model.Inventory) -> dict[str, tuple[object, ...]]:
    """Per model: the counts the summary carries, GPU by GPU as the docstring defines them."""
    out: dict[str, tuple[object, ...]] = {}
    for name in sorted({n.model for n in inv}):
        nodes = [n for n in inv if n.model == name]
        ready = [n for n in nodes if n.ready and n.schedulable]
        width = max(n.gpu_count for n in nodes) + 1
        by_free = [0] * max(9, width)
        racks: dict[str, list[int]] = {}
        blocks = [0]
        domains: dict[str, int] = {}
        for node in ready:
            whole = sum(1 for m in node.gpu_free if m >= GPU)
            by_free[whole] += 1
            if node.rack:
                racks.setdefault(node.rack, [0] * 9)[whole] += 1
            islands: dict[int, int] = {}
            for index, milli in enumerate(node.gpu_free):
                if milli >= GPU:
                    islands[node.island_of(index)] = islands.get(node.island_of(index), 0) + 1
            blocks.append(max(islands.values(), default=0))
            if node.nvlink_domain:
                domains[node.nvlink_domain] = domains.get(node.nvlink_domain, 0) + whole
        out[name] = (
            sum(n.gpu_count for n in nodes if not (n.ready and n.schedulable))
            + sum(n.unhealthy_gpus for n in ready),
            sum(sum(1 for m in n.gpu_free if m >= GPU) for n in ready),
            sum(sum(m for m in n.gpu_free if m < GPU) for n in ready),
            by_free[:width],
            {rack: hist[:width] for rack, hist in sorted(racks.items())},
            max([*blocks, *domains.values()]),
            max([0, *(n.cpu_free for n in ready)]),
        )
    return out


def random_inventory(rng: random.Random) -> model.Inventory:
    inv = model.Inventory(cluster="c")
    for index in range(rng.randint(1, 40)):
        gpus = rng.choice([2, 4, 8])
        node = model.Node(
            name=f"n{index}",
            model=rng.choice(["H100", "A100"]),
            gpu_count=gpus,
            cpu_milli=rng.choice([8000, 64000]),
            rack=rng.choice(["", "r1", "r2"]),
            nvlink_domain=rng.choice(["", "", "nvl-1"]),
            nvlink_island=rng.choice([0, 1, 2, 4, 8]),
            ready=rng.random() > 0.1,
            schedulable=rng.random() > 0.1,
            unhealthy=frozenset(i for i in range(gpus) if rng.random() < 0.05),
        )
        node.gpu_free = [
            0 if i in node.unhealthy else rng.choice([0, 250, 500, GPU, GPU, GPU])
            for i in range(gpus)
        ]
        node.cpu_free = rng.randint(0, node.cpu_milli)
        inv.add(node)
    return inv


def test_the_summary_counts_as_gpu_by_gpu() -> None:
    rng = random.Random(12)
    for _ in range(300):
        inv = random_inventory(rng)
        got = {
            m.model: (
                m.unavailable_gpus,
                m.free_gpus,
                m.shared_free_milli,
                m.nodes_by_free,
                m.racks,
                m.largest_free_nvlink_block,
                m.max_free_cpu_milli,
            )
            for m in summary.summarise(inv).models
        }
        assert got == reference(inv)


def test_a_gpu_reported_over_full_is_counted_whole_not_shared() -> None:
    inv = model.Inventory(cluster="c")
    inv.add(model.Node(name="n", model="H100", gpu_count=4, gpu_free=[GPU + 5, GPU, 300, 0]))
    (h100,) = summary.summarise(inv).models
    assert (h100.free_gpus, h100.shared_free_milli) == (2, 300)
