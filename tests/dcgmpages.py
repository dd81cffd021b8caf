"""dcgm-exporter's `/metrics` page as it prints it, for the utilisation tests.

The families of its default counters (`etc/default-counters.csv`) in its order, with its HELP
texts and labels: `gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname`,
`DCGM_FI_DRIVER_VERSION`, and `container`, `namespace`, `pod` (empty without pod mapping, the
pod the kubelet gave the GPU to with it). `mig=True` adds a MIG instance's framebuffer rows
(`GPU_I_ID`, `GPU_I_PROFILE`), which carry no utilisation.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

H100 = "NVIDIA H100 80GB HBM3"
L4 = "NVIDIA L4"
DRIVER = "550.54.15"


@dataclass(frozen=True)
class GPU:
    hostname: str
    index: int
    util: float = 0.0
    fb_used: int = 0  # MiB
    fb_total: int = 81559  # MiB
    model: str = H100
    namespace: str = ""
    pod: str = ""
    container: str = ""

    @property
    def uuid(self) -> str:
        digits = f"{zlib.crc32(f'{self.hostname}/{self.index}'.encode()):012x}"
        return f"GPU-9c1a7b3e-5d2f-4e6a-8b1c-{digits}"

    def labels(self) -> str:
        return (
            f'gpu="{self.index}",UUID="{self.uuid}",pci_bus_id="00000000:{0x18 + self.index:02X}'
            f':00.0",device="nvidia{self.index}",modelName="{self.model}",'
            f'Hostname="{self.hostname}",DCGM_FI_DRIVER_VERSION="{DRIVER}",'
            f'container="{self.container}",namespace="{self.namespace}",pod="{self.pod}"'
        )


# (name, type, help, value of a GPU)
FAMILIES = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda g: 1980),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", lambda g: 2619),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", lambda g: 41),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: 36),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda g: 70.5 + 6 * g.util),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        lambda g: 8012345678,
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", lambda g: 0),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda g: g.util),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", lambda g: g.util / 2),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", lambda g: 0),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", lambda g: 0),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", lambda g: 0),
    (
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Framebuffer memory free (in MiB).",
        lambda g: g.fb_total - g.fb_used,
    ),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", lambda g: g.fb_used),
    (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        lambda g: round(g.util / 100, 6),
    ),
]


def render(gpus: Iterable[GPU], *, mig: bool = False) -> str:
    """The page of an exporter (or several, federated) showing `gpus`."""
    shown = list(gpus)
    lines = []
    for name, kind, help_text, value in FAMILIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{gpu.labels()}}} {number(value(gpu))}" for gpu in shown]
        if mig and name in ("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED") and shown:
            first = shown[0]
            mig_labels = first.labels() + ',GPU_I_PROFILE="1g.10gb",GPU_I_ID="7"'
            lines.append(f"{name}{{{mig_labels}}} 9856")
    return "\n".join(lines) + "\n"


def number(value: float) -> str:
    """As the exporter prints it: integers without a fraction."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
