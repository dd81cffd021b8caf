"""DRA mode's pure readers and writers: ResourceSlice devices, the API version chosen, claim
names. The end-to-end behaviour is in tests/integration/test_kubernetes_dra.py."""

from __future__ import annotations

from typing import Any

import pytest

from member_agent.cluster.kubernetes import claims, devices
from member_agent.inventory import model
from tests import kubeemulator

KEYS = devices.DeviceKeys()


def one_device(**fields: Any) -> dict[str, Any]:
    body = kubeemulator.slice_body("n1", gpus=1)
    device: dict[str, Any] = body["spec"]["devices"][0]
    device.update(fields)
    return device


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        pytest.param(one_device(), (0, "NVIDIA H100 80GB HBM3", 81559), id="as NVIDIA publishes"),
        pytest.param(
            one_device(name="gpu-3"), (3, "NVIDIA H100 80GB HBM3", 81559), id="index from name"
        ),
        pytest.param(
            one_device(name="gpu-0-mig-19-0-1", attributes={"productName": {"string": "x"}}),
            None,
            id="a MIG name carries no GPU index",
        ),
        pytest.param(
            {
                "name": "dev",
                "basic": {
                    "attributes": {
                        "gpu.nvidia.com/index": {"int": 5},
                        "gpu.nvidia.com/productName": {"string": "NVIDIA L4"},
                    },
                    "capacity": {"memory": {"value": "22Gi"}},
                },
            },
            (5, "NVIDIA L4", 22528),
            id="v1beta1's basic wrapper, qualified names",
        ),
        pytest.param(
            one_device(taints=[{"key": "k", "effect": "NoExecute"}]),
            (0, "NVIDIA H100 80GB HBM3", 81559),
            id="tainted: read, as an unhealthy GPU",
        ),
        pytest.param(
            one_device(taints=[{"key": "k", "effect": "None"}]),
            (0, "NVIDIA H100 80GB HBM3", 81559),
            id="a taint with effect None keeps it",
        ),
    ],
)
def test_a_slices_devices_are_read(
    device: dict[str, Any], expected: tuple[int, str, int] | None
) -> None:
    found = devices.read_device(device, KEYS, pool="n1", node="n1")
    got = None if found is None else (found.index, found.product, found.memory_mib)
    assert got == expected


@pytest.mark.parametrize(
    ("taints", "unhealthy"),
    [
        pytest.param([], "", id="no taint"),
        pytest.param(
            [{"key": "k", "effect": "NoExecute"}], "device taint k", id="NoExecute, any key"
        ),
        pytest.param(
            [{"key": "gpu.nvidia.com/xid", "value": "48", "effect": "None"}],
            "device taint gpu.nvidia.com/xid=48",
            id="NVIDIA's DRA driver's XID taint, effect None",
        ),
        pytest.param(
            [{"key": "example.com/info", "effect": "None"}], "", id="an informational taint"
        ),
    ],
)
def test_a_tainted_device_is_an_unhealthy_gpu(taints: list[Any], unhealthy: str) -> None:
    found = devices.read_device(one_device(taints=taints), KEYS, pool="n1", node="n1")
    assert found is not None and found.unhealthy == unhealthy
    node = devices.with_devices(model.Node(name="n1", model="", gpu_count=0), {0: found})
    assert node.unhealthy == (frozenset({0}) if unhealthy else frozenset())
    assert node.gpu_free == [0 if unhealthy else 1000]


def test_slices_that_publish_no_nodes_gpus_are_not_read() -> None:
    network = kubeemulator.slice_body("n1")
    del network["spec"]["nodeName"]
    network["spec"]["allNodes"] = True
    assert devices.read_slice(network, KEYS) is None
    other = kubeemulator.slice_body("n1", driver="net.example.com")
    assert devices.read_slice(other, KEYS) is None


def test_a_pools_newest_generation_counts_and_only_its_nodes_change() -> None:
    book = devices.DeviceBook(KEYS)
    assert book.replace([kubeemulator.slice_body(n) for n in ("n1", "n2")]) == {"n1", "n2"}
    newer = kubeemulator.slice_body("n1", gpus=2, generation=2, name="n1-g2")
    assert book.apply("ADDED", newer) == {"n1"}
    assert sorted(book.devices("n1")) == [0, 1]
    assert book.find("gpu.nvidia.com", "n1", "gpu-5") is None
    assert book.apply("DELETED", newer) == {"n1"}  # generation 1 is all there is again
    assert len(book.devices("n1")) == 8
    assert book.apply("MODIFIED", kubeemulator.slice_body("n2")) == set()  # nothing changed


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [
        pytest.param(["v1beta1", "v1beta2", "v1"], "v1", id="1.34"),
        pytest.param(["v1beta1", "v1beta2"], "v1beta2", id="1.33"),
        pytest.param(["v1beta1"], None, id="1.32"),
    ],
)
def test_the_version_is_v1_else_v1beta2(versions: list[str], chosen: str | None) -> None:
    group = {"versions": [{"version": v} for v in versions]}
    if chosen is None:
        with pytest.raises(claims.ClaimProblem, match="needs v1"):
            claims.choose_version(group)
    else:
        assert claims.choose_version(group) == chosen


def test_a_shared_claims_name_is_a_valid_object_name_for_any_node() -> None:
    assert claims.shared_name("n1", 3, "mps") == "gpufed-n1-gpu3-mps"
    long = claims.shared_name("a" * 250, 3, "timeslice")
    assert len(long) <= 253 and long.endswith("-gpu3-timeslice")
    assert long != claims.shared_name("a" * 249 + "b", 3, "timeslice")
