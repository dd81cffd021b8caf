"""dcgm-exporter's page read into GPU readings, joined to the pods that hold those GPUs.

Decides which queue each GPU's utilisation and memory count for. `scraping.DCGMScraper` calls
`parse_page` on every page it fetches; `exporting.collect` calls `holdings_of` and `join` at
each scrape of the agent's `/metrics`. Pure: no await, no clock, no I/O.

dcgm-exporter prints one sample per GPU and field, labelled `gpu` (the index on its node),
`UUID`, `Hostname` (the node's name when the exporter runs with `NODE_NAME` set, else the
exporter pod's own name) and, with its Kubernetes pod mapping on (`--kubernetes`),
`namespace`, `pod` and `container` of the pod the kubelet gave the GPU to
(`exported_namespace`, `exported_pod` once a Prometheus without `honor_labels` renamed them,
as when the page is Prometheus's `/federate`). The fields read: `DCGM_FI_DEV_GPU_UTIL` (percent
busy), `DCGM_FI_DEV_FB_USED` and `DCGM_FI_DEV_FB_FREE` (framebuffer, MiB). MIG instances
(`GPU_I_ID`) report no `DCGM_FI_DEV_GPU_UTIL` and are not read.

The join, per gpufed pod: the readings that name the pod (pod mapping: where the kubelet really
put it, which in device-plugin mode may be other GPUs than the ones gpufed chose), else the
readings of the GPUs placement chose, by node and index (exact in DRA mode and on the simulated
backend), unless a reading gives that GPU to another of gpufed's pods. A pod sharing a GPU
counts its share of it (500 milli: half the GPU, half its busy time and memory).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import parser

from member_agent.jobs import table

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FIELDS = (GPU_UTIL, FB_USED, FB_FREE)
IDLE_PERCENT = 5.0  # a GPU less busy than this is idle
MIB = 1 << 20
GPU_MILLI = 1000


class PageError(ValueError):
    """The page is not dcgm-exporter's: not the Prometheus text format, or no GPU in it."""


@dataclass(slots=True)
class GPUReading:
    """One GPU as one page showed it (one per pod mapped to it, with pod mapping on)."""

    hostname: str
    index: int
    uuid: str = ""
    namespace: str = ""
    pod: str = ""
    util_percent: float = 0.0
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None


@dataclass(slots=True)
class Holding:
    """One GPU (or a share of one) a gpufed pod holds, as the agent's job table says. (Not
    frozen: a large cluster has tens of thousands, made at every scrape, and a frozen
    dataclass is several times slower to make. Nothing changes them.)"""

    queue: str
    namespace: str
    pod: str
    node: str
    index: int
    share: float = 1.0  # of the GPU: milli / 1000


@dataclass
class QueueUse:
    """A queue's GPUs on this cluster, allocated and used, in GPUs (a share counts its part)."""

    allocated: float = 0.0  # held by the queue's live pods
    measured: float = 0.0  # of those, with a reading
    busy: float = 0.0  # the sum of share × utilisation (1.0: one GPU 100% busy)
    idle: float = 0.0  # measured and under IDLE_PERCENT busy
    memory_used_bytes: float = 0.0
    memory_bytes: float = 0.0  # used + free, of the GPUs whose memory was read

    def add(self, share: float, reading: GPUReading) -> None:
        self.measured += share
        self.busy += share * reading.util_percent / 100.0
        if reading.util_percent < IDLE_PERCENT:
            self.idle += share
        if reading.fb_used_mib is not None and reading.fb_free_mib is not None:
            self.memory_used_bytes += share * reading.fb_used_mib * MIB
            self.memory_bytes += share * (reading.fb_used_mib + reading.fb_free_mib) * MIB


_Key = tuple[str, int, str, str]  # hostname, index, namespace, pod


def parse_page(text: str) -> list[GPUReading]:
    """The GPUs of one dcgm-exporter page (a `/federate` page too), each with its utilisation
    and, where printed, its framebuffer. Only the samples of FIELDS are parsed (by
    prometheus_client's parser); the other families are not read, however they are printed.
    Raises PageError when those samples are not the text format or show no GPU's
    utilisation."""
    fields: dict[_Key, dict[str, float]] = {}
    uuids: dict[_Key, str] = {}
    # only the three fields' samples go to the parser: a page has dozens of families (and a
    # federated one thousands of GPUs), which it would parse at a few thousand lines a second
    wanted = "".join(f"{line}\n" for line in text.splitlines() if line.startswith(FIELDS))
    try:
        families = list(parser.text_string_to_metric_families(wanted))
    except (ValueError, IndexError, KeyError, TypeError) as exc:  # what the parser raises
        raise PageError(f"not the Prometheus text format: {exc}") from exc
    for family in families:
        for sample in family.samples:
            if sample.name not in FIELDS:
                continue
            key = _key_of(sample.labels)
            value = float(sample.value)
            if key is None or math.isnan(value):
                continue
            fields.setdefault(key, {})[sample.name] = value
            uuids[key] = sample.labels.get("UUID") or sample.labels.get("uuid") or ""
    readings = [
        GPUReading(
            hostname=key[0],
            index=key[1],
            uuid=uuids[key],
            namespace=key[2],
            pod=key[3],
            util_percent=min(max(values[GPU_UTIL], 0.0), 100.0),
            fb_used_mib=values.get(FB_USED),
            fb_free_mib=values.get(FB_FREE),
        )
        for key, values in fields.items()
        if GPU_UTIL in values
    ]
    if not readings:
        raise PageError(f"no {GPU_UTIL} sample with a gpu label: not dcgm-exporter's page")
    return sorted(readings, key=lambda r: (r.hostname, r.index, r.namespace, r.pod))


def _key_of(labels: Mapping[str, str]) -> _Key | None:
    """Where a sample is: its node (or exporter) and GPU index, and the pod mapped to it."""
    if labels.get("GPU_I_ID"):  # a MIG instance
        return None
    index = labels.get("gpu", "").strip()
    if not index.isdigit():
        return None
    # a Prometheus that scraped the exporter without honor_labels keeps the exporter's
    # pod and namespace labels as exported_*; its own name the exporter pod
    if "exported_pod" in labels:
        namespace, pod = labels.get("exported_namespace", ""), labels["exported_pod"]
    else:
        namespace, pod = labels.get("namespace", ""), labels.get("pod", "")
    return labels.get("Hostname", ""), int(index), namespace if pod else "", pod


def holdings_of(jobs: Iterable[table.TrackedJob]) -> list[Holding]:
    """The GPUs the live pods (Pending or Running, bound to a node) of the jobs hold."""
    return [
        Holding(
            queue=record.queue,
            namespace=record.namespace,
            pod=pod.name,
            node=pod.node,
            index=slot.index,
            share=min(slot.milli, GPU_MILLI) / GPU_MILLI,
        )
        for record in jobs
        for pod in record.live_pods()
        if pod.node
        for slot in pod.gpus
    ]


def join(readings: Iterable[GPUReading], holdings: Iterable[Holding]) -> dict[str, QueueUse]:
    """Each queue's GPUs allocated and used: every holding is allocated; it is measured by
    the readings that name its pod, else by the reading of its node and index unless that
    GPU's readings name another of gpufed's pods (see the module's docstring). A pod no
    holding has (another workload's, or the exporter's own, which a Prometheus adds to a
    federated page when pod mapping is off) claims no GPU."""
    pods: dict[tuple[str, str], list[Holding]] = {}
    for holding in holdings:
        pods.setdefault((holding.namespace, holding.pod), []).append(holding)
    by_pod: dict[tuple[str, str], dict[tuple[str, int], GPUReading]] = {}
    by_gpu: dict[tuple[str, int], GPUReading] = {}
    claimed: set[tuple[str, int]] = set()  # GPUs a reading gives to one of gpufed's pods
    for reading in readings:
        gpu = (reading.hostname, reading.index)
        by_gpu.setdefault(gpu, reading)
        owner = (reading.namespace, reading.pod)
        if reading.pod and owner in pods:
            by_pod.setdefault(owner, {}).setdefault(gpu, reading)
            claimed.add(gpu)
    uses: dict[str, QueueUse] = {}
    for pod, held in pods.items():
        use = uses.setdefault(held[0].queue, QueueUse())
        use.allocated += sum(h.share for h in held)
        mapped = by_pod.get(pod)
        if mapped:
            ordered = sorted(mapped.items())
            for holding, (_, reading) in zip(sorted(held, key=_slot), ordered, strict=False):
                use.add(holding.share, reading)
            continue
        for holding in held:
            gpu = (holding.node, holding.index)
            found = by_gpu.get(gpu)
            if found is not None and gpu not in claimed:
                use.add(holding.share, found)
    return uses


def _slot(holding: Holding) -> tuple[str, int]:
    return holding.node, holding.index
