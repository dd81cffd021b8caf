"""The pods of an array's job get GPUFED_ARRAY_INDEX (`api.arrays`), and no other job's do."""

from __future__ import annotations

from pathlib import Path

from broker.api import arrays, gangs, jobs
from member_agent.binding import binding
from member_agent.cluster import base
from member_agent.placement import gang
from tests import agentbuilders


def requests_of(tmp_path: Path, job: jobs.GPUJob) -> list[base.PodRequest]:
    backend = agentbuilders.small_backend(tmp_path)
    placement = gang.place_gang(backend.inventory(), gangs.gang_request("j1", job))
    assert isinstance(placement, gang.GangPlacement)
    return binding.build_requests("j1", job, placement, epoch=1)


def env_of(request: base.PodRequest) -> list[dict[str, str]]:
    return [c.get("env", []) for c in request.template["spec"]["containers"]]


def test_every_container_of_every_pod_gets_its_index(tmp_path: Path) -> None:
    document = agentbuilders.make_job(gpus=4, replicas=2, duration=1).model_dump(by_alias=True)
    document["metadata"]["labels"] = {arrays.ARRAY_LABEL: "sweep", arrays.INDEX_LABEL: "7"}
    # a value the template gave is replaced, other variables kept
    container = document["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "GPUFED_ARRAY_INDEX", "value": "x"}, {"name": "A", "value": "1"}]
    member = jobs.GPUJob.model_validate(document)
    requests = requests_of(tmp_path, member)
    assert len(requests) == 2
    for request in requests:
        assert env_of(request) == [
            [{"name": "A", "value": "1"}, {"name": "GPUFED_ARRAY_INDEX", "value": "7"}]
        ]


def test_a_job_of_no_array_gets_no_index(tmp_path: Path) -> None:
    job = agentbuilders.make_job(gpus=4, replicas=2, duration=1)
    assert all(env_of(r) == [[]] for r in requests_of(tmp_path, job))
