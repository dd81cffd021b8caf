"""`gpufed agent --devices`: the flags become the agent's settings and the Kubernetes backend
they build (no cluster is contacted: the backend connects when started)."""

from __future__ import annotations

import pydantic
import pytest

from gpufed import cli, daemons
from member_agent import app
from member_agent.cluster.kubernetes import backend as k8s
from member_agent.cluster.kubernetes import devices

BASE = ["agent", "--broker", "http://b:8080", "--cluster", "c1", "--token-file", "t"]
KUBE = [*BASE, "--backend", "kubernetes", "--kubeconfig", "/nonexistent"]


def backend_of(*flags: str) -> k8s.KubernetesBackend:
    settings = daemons.agent_settings(cli.build_parser().parse_args([*KUBE, *flags]))
    backend = app.make_backend(settings)
    assert isinstance(backend, k8s.KubernetesBackend)
    return backend


def test_the_device_plugin_is_the_default() -> None:
    backend = backend_of()
    assert backend.devices == "device-plugin"
    assert backend.label_keys.shared_gpu_resource == "nvidia.com/gpu.shared"
    assert backend.device_keys is None


def test_dra_mode_with_its_driver_class_and_attribute_names() -> None:
    backend = backend_of(
        "--devices",
        "dra",
        "--dra-driver",
        "gpu.example.com",
        "--dra-attribute",
        "product=model",
        "--dra-attribute",
        "index=slot",
    )
    assert backend.devices == "dra"
    assert backend.device_keys == devices.DeviceKeys(
        driver="gpu.example.com", device_class="gpu.example.com", product="model", index="slot"
    )
    keys = backend_of("--devices", "dra", "--dra-device-class", "big-gpus").device_keys
    assert keys is not None and (keys.driver, keys.device_class) == ("gpu.nvidia.com", "big-gpus")


def test_the_shared_gpu_resource_flag_names_the_device_plugins_replicas() -> None:
    backend = backend_of("--shared-gpu-resource", "example.com/gpu-slice")
    assert backend.label_keys.shared_gpu_resource == "example.com/gpu-slice"


def test_an_unknown_attribute_is_refused_with_the_known_ones() -> None:
    args = cli.build_parser().parse_args([*KUBE, "--dra-attribute", "prodcut=model"])
    with pytest.raises(pydantic.ValidationError, match=r"unknown.*prodcut.*known: index"):
        daemons.agent_settings(args)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([*KUBE, "--dra-attribute", "product"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([*KUBE, "--devices", "cdi"])
