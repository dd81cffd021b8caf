"""How a node's GPUs may be had (`model.SHARING_LABEL`, the Kubernetes backend's device-plugin
mode): sharing pods only on shared replicas, whole-GPU pods only on whole GPUs, both where the
backend says nothing; and when nothing fits for that reason, the reason says so."""

from __future__ import annotations

import pytest

from member_agent.inventory import model
from member_agent.placement import gang
from tests import agentbuilders as b

REPLICAS = {model.SHARING_LABEL: model.SHARING_REPLICAS, model.SHARED_RESOURCE_LABEL: "x.io/s"}
WHOLE = {model.SHARING_LABEL: model.SHARING_NONE, model.SHARED_RESOURCE_LABEL: "x.io/s"}


@pytest.mark.parametrize(
    ("labels", "milli", "placed"),
    [
        pytest.param({}, 500, True, id="no word from the backend: sharing pod fits"),
        pytest.param({}, 1000, True, id="no word from the backend: whole pod fits"),
        pytest.param(REPLICAS, 500, True, id="shared replicas take a sharing pod"),
        pytest.param(REPLICAS, 1000, False, id="shared replicas take no whole pod"),
        pytest.param(WHOLE, 500, False, id="whole GPUs take no sharing pod"),
        pytest.param(WHOLE, 1000, True, id="whole GPUs take a whole pod"),
    ],
)
def test_a_nodes_sharing_decides_which_pods_it_takes(
    labels: dict[str, str], milli: int, placed: bool
) -> None:
    inventory = b.inventory(b.node("n1", gpus=2, labels=labels))
    result = gang.place_gang(inventory, b.gang(b.shape(1, milli=milli)))
    assert isinstance(result, gang.GangPlacement) is placed


@pytest.mark.parametrize(
    ("labels", "milli", "reason"),
    [
        pytest.param(
            WHOLE,
            500,
            "gpu sharing: no ready GPU node advertises x.io/s (the device plugin's shared GPU "
            "replicas): a pod of 500 milli of 1 GPU would be handed a whole GPU",
            id="a sharing pod where no node shares",
        ),
        pytest.param(
            REPLICAS,
            1000,
            "gpu sharing: the ready GPU nodes offer their GPUs only as x.io/s replicas, none "
            "whole for a pod of 1 GPU",
            id="a whole pod where every node shares",
        ),
    ],
)
def test_the_reason_names_the_shared_resource(
    labels: dict[str, str], milli: int, reason: str
) -> None:
    inventory = b.inventory(b.node("n1", labels=labels), b.node("n2", labels=labels))
    result = gang.place_gang(inventory, b.gang(b.shape(1, milli=milli), pods=2))
    assert isinstance(result, gang.NoPlacement)
    assert result.reasons == (reason,)


def test_sharing_pods_go_to_the_sharing_nodes_of_a_mixed_cluster() -> None:
    inventory = b.inventory(b.node("whole", labels=WHOLE), b.node("shared", labels=REPLICAS))
    result = gang.place_gang(inventory, b.gang(b.shape(1, milli=250), pods=6))
    assert isinstance(result, gang.GangPlacement)
    assert {pod.placement.node for pod in result.pods} == {"shared"}
