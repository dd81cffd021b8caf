"""Broker memory with many clusters' summaries and many jobs, real processes.

    .venv/bin/python -m e2e.bench_memory [--clusters 10] [--nodes 10000] [--jobs 20000]

Starts a broker (SQLite) and `--clusters` simulated agents of `--nodes` nodes each (three GPU
models, racks), submits `--jobs` small jobs, and prints the broker's resident memory (VmRSS,
VmHWM) after the summaries arrived and after the jobs were placed. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import yaml

from e2e import helpers
from gpufed.local import processes

MODELS = [("NVIDIA-H100-80GB-HBM3", 8), ("NVIDIA-A100-SXM4-80GB", 8), ("NVIDIA-L4", 4)]


def rss_mib(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def write_cluster(path: Path, name: str, nodes: int) -> None:
    pools = [
        {
            "name": f"p{i}",
            "count": nodes // len(MODELS),
            "gpu_product": model,
            "gpus_per_node": gpus,
            "gpu_memory_mib": 40960,
            "cpu": 128,
            "memory": "1000Gi",
            "nvlink_island": gpus,
            "racks": 20,
        }
        for i, (model, gpus) in enumerate(MODELS)
    ]
    path.write_text(yaml.safe_dump({"cluster": name, "pools": pools}))


async def main(args: argparse.Namespace, workdir: Path) -> None:
    fleet = processes.LocalFleet(workdir=workdir, heartbeat=5.0, lost_after=600.0)
    names = [f"c{i:03d}" for i in range(args.clusters)]
    try:
        fleet.write_tokens(tenants=["bench"], clusters=names)
        broker = await fleet.start_broker()
        base = rss_mib(broker.process.pid)
        for name in names:
            write_cluster(workdir / f"{name}.yaml", name, args.nodes)
            await fleet.start_agent(name, workdir / f"{name}.yaml")
        await fleet.wait_clusters_ready(names, timeout=600)
        ready = rss_mib(broker.process.pid)
        doc = {
            "apiVersion": "gpufed.io/v1",
            "kind": "GPUJob",
            "metadata": {"name": "m"},
            "spec": {
                "queue": "bench",
                "tasks": [
                    {
                        "name": "w",
                        "replicas": 1,
                        "template": {
                            "metadata": {"annotations": {"gpufed.io/sim-duration": "3600"}},
                            "spec": {
                                "containers": [
                                    {"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}
                                ]
                            },
                        },
                    }
                ],
            },
        }
        started = time.perf_counter()
        async with fleet.client("bench") as api:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for n in range(args.jobs):
                queue.put_nowait(n)

            async def worker() -> None:
                while not queue.empty():
                    queue.get_nowait()
                    await api.submit(json.dumps(doc))

            await asyncio.gather(*[worker() for _ in range(32)])
        await asyncio.sleep(3)
        loaded = rss_mib(broker.process.pid)
        print(
            f"{args.clusters} clusters x {args.nodes} nodes = {args.clusters * args.nodes} "
            f"nodes, {args.jobs} jobs (submitted in {time.perf_counter() - started:.1f}s)"
        )
        print(
            f"broker RSS MiB: empty {base[0]:.0f}; with all summaries {ready[0]:.0f}; "
            f"with the jobs {loaded[0]:.0f} (peak {loaded[1]:.0f})"
        )
    finally:
        await fleet.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=10000)
    parser.add_argument("--jobs", type=int, default=20000)
    arguments = parser.parse_args()
    with helpers.workdir("gpufed-mem-") as workdir:
        asyncio.run(main(arguments, workdir))
