"""GPU utilisation from dcgm-exporter: its page read into readings, and the readings joined to
the pods of the agent's job table, per queue (`member_agent.utilisation.readings`)."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from broker.api import status
from gpufed import cli, daemons
from member_agent.cluster import base
from member_agent.cluster.kubernetes import objects
from member_agent.jobs import adopting, table
from member_agent.utilisation import readings
from tests import agentbuilders, dcgmpages
from tests.dcgmpages import GPU

GiB = 1 << 30
MIB = 1 << 20


def test_a_dcgm_exporter_page_gives_one_reading_per_gpu_with_util_and_framebuffer() -> None:
    page = dcgmpages.render(
        [
            GPU("gpu-node-1", 0, util=87, fb_used=40000, namespace="team-a", pod="train-0"),
            GPU("gpu-node-1", 1, util=0, fb_used=0),
        ],
        mig=True,  # a MIG instance's framebuffer rows: no utilisation, not read
    )

    found = readings.parse_page(page)

    assert found == [
        readings.GPUReading(
            hostname="gpu-node-1",
            index=0,
            uuid=GPU("gpu-node-1", 0).uuid,
            namespace="team-a",
            pod="train-0",
            util_percent=87.0,
            fb_used_mib=40000.0,
            fb_free_mib=41559.0,
        ),
        readings.GPUReading(
            hostname="gpu-node-1",
            index=1,
            uuid=GPU("gpu-node-1", 1).uuid,
            util_percent=0.0,
            fb_used_mib=0.0,
            fb_free_mib=81559.0,
        ),
    ]


def test_a_federated_page_with_renamed_pod_labels_and_timestamps_is_read() -> None:
    # what Prometheus's /federate serves when it scraped the exporter without honor_labels:
    # the exporter's own pod in `pod`, the GPU's pod in `exported_pod`; untyped, timestamped
    page = (
        "# TYPE DCGM_FI_DEV_GPU_UTIL untyped\n"
        'DCGM_FI_DEV_GPU_UTIL{Hostname="n7",UUID="GPU-1",exported_namespace="team-b",'
        'exported_pod="serve-0",gpu="3",instance="10.0.3.7:9400",job="dcgm",'
        'namespace="gpu-operator",pod="nvidia-dcgm-exporter-x2k9q"} 42 1764590000000\n'
        'DCGM_FI_DEV_GPU_UTIL{Hostname="n7",UUID="GPU-2",gpu="4",pod="",utilization="x"} 150\n'
    )

    found = readings.parse_page(page)

    assert [(r.hostname, r.index, r.namespace, r.pod, r.util_percent) for r in found] == [
        ("n7", 3, "team-b", "serve-0", 42.0),
        ("n7", 4, "", "", 100.0),  # clamped to 100%
    ]
    assert found[0].fb_used_mib is None


FULL = dcgmpages.render([GPU("n1", 0, util=50)])
CUT = FULL[: FULL.index("DCGM_FI_DEV_GPU_UTIL{") + 40]


@pytest.mark.parametrize(
    "page",
    [
        pytest.param("<html><body><h1>502 Bad Gateway</h1></body></html>\n", id="an HTML page"),
        pytest.param('{"status": "success", "data": []}\n', id="JSON"),
        pytest.param("", id="empty"),
        pytest.param(
            "# HELP node_load1 1m load average.\n# TYPE node_load1 gauge\nnode_load1 0.42\n",
            id="another exporter's page",
        ),
        pytest.param('DCGM_FI_DEV_GPU_UTIL{gpu="0"} seventy\n', id="a value that is no number"),
        pytest.param(CUT, id="a page cut off mid-line"),
        pytest.param('DCGM_FI_DEV_GPU_UTIL{UUID="GPU-1"} 50\n', id="no gpu label"),
    ],
)
def test_a_page_that_is_not_dcgm_exporters_is_refused(page: str) -> None:
    """(A family it does not read may be anything: only its three fields are parsed.)"""
    with pytest.raises(readings.PageError):
        readings.parse_page(page)


def job(
    queue: str,
    *pods: tuple[str, str, list[tuple[int, int]]],
    phase: status.PodPhase = status.PodPhase.RUNNING,
    namespace: str = "team-a",
) -> table.TrackedJob:
    """A job of `queue` whose pods (name, node, [(index, milli)]) are in `phase`."""
    return table.TrackedJob(
        job_id=f"{queue}-job",
        epoch=1,
        namespace=namespace,
        gpus=sum(len(slots) for _, _, slots in pods),
        min_member=len(pods),
        queue=queue,
        pods={
            name: status.PodStatus(
                name=name,
                task="worker",
                node=node,
                gpus=[status.GPUSlot(index=i, milli=m) for i, m in slots],
                phase=phase,
            )
            for name, node, slots in pods
        },
    )


def test_holdings_are_the_gpus_of_live_pods_bound_to_a_node() -> None:
    jobs = [
        job("train", ("t-0", "n1", [(0, 1000), (1, 1000)])),
        job("serve", ("s-0", "n2", [(3, 500)]), phase=status.PodPhase.PENDING),
        job("done", ("d-0", "n3", [(0, 1000)]), phase=status.PodPhase.SUCCEEDED),
        job("unbound", ("u-0", "", [(0, 1000)]), phase=status.PodPhase.PENDING),
    ]

    held = readings.holdings_of(jobs)

    assert held == [
        readings.Holding("train", "team-a", "t-0", "n1", 0, 1.0),
        readings.Holding("train", "team-a", "t-0", "n1", 1, 1.0),
        readings.Holding("serve", "team-a", "s-0", "n2", 3, 0.5),
    ]


def reading(
    host: str, index: int, util: float, *, pod: str = "", used: int = 0, total: int = 80 * 1024
) -> readings.GPUReading:
    return readings.GPUReading(
        hostname=host,
        index=index,
        namespace="team-a" if pod else "",
        pod=pod,
        util_percent=util,
        fb_used_mib=used,
        fb_free_mib=total - used,
    )


def use(
    allocated: float,
    measured: float = 0.0,
    *,
    busy: float = 0.0,
    idle: float = 0.0,
    used_gib: float = 0.0,
    total_gib: float = 0.0,
) -> readings.QueueUse:
    return readings.QueueUse(allocated, measured, busy, idle, used_gib * GiB, total_gib * GiB)


@pytest.mark.parametrize(
    ("jobs", "found", "expected"),
    [
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000), (1, 1000)]))],
            [reading("n1", 0, 90, used=40 * 1024), reading("n1", 1, 10), reading("n1", 2, 99)],
            {"train": use(2, 2, busy=1.0, used_gib=40, total_gib=160)},
            id="whole GPUs by node and index; a GPU no gpufed pod holds counts for nobody",
        ),
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000)])), job("idle", ("i-0", "n1", [(1, 1000)]))],
            [reading("n1", 0, 100), reading("n1", 1, 4.9)],
            {
                "train": use(1, 1, busy=1.0, total_gib=80),
                "idle": use(1, 1, busy=0.049, idle=1, total_gib=80),
            },
            id="a GPU under 5% busy is idle",
        ),
        pytest.param(
            [
                job("serve", ("s-0", "n1", [(2, 500)])),
                job("batch", ("b-0", "n1", [(2, 500)]), namespace="team-b"),
            ],
            [reading("n1", 2, 60, used=20 * 1024)],
            {
                "serve": use(0.5, 0.5, busy=0.3, used_gib=10, total_gib=40),
                "batch": use(0.5, 0.5, busy=0.3, used_gib=10, total_gib=40),
            },
            id="two pods sharing a GPU each count half of it",
        ),
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000)]))],
            [reading("n1", 0, 0, pod="someone-else"), reading("n1", 3, 75, pod="t-0")],
            {"train": use(1, 1, busy=0.75, total_gib=80)},
            id="pod mapping says which GPU the kubelet gave the pod: it wins over the index",
        ),
        pytest.param(
            [
                job("train", ("t-0", "n1", [(0, 1000)])),
                job("serve", ("s-0", "n1", [(4, 1000)])),
            ],
            [reading("n1", 0, 80, pod="s-0")],
            {"train": use(1), "serve": use(1, 1, busy=0.8, total_gib=80)},
            id="the chosen GPU is another gpufed pod's: the pod is not measured on it",
        ),
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000)]))],
            [reading("n1", 0, 80, pod="nvidia-dcgm-exporter-x2k9q")],
            {"train": use(1, 1, busy=0.8, total_gib=80)},
            id="a pod gpufed does not hold (a federated page's exporter pod) claims no GPU",
        ),
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000), (1, 1000)]))],
            [reading("dcgm-exporter-x2k9q", 5, 30, pod="t-0")],
            {"train": use(2, 1, busy=0.3, total_gib=80)},
            id="Hostname is the exporter pod's name: joined by pod; one GPU of two read",
        ),
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000)]))],
            [],
            {"train": use(1)},
            id="no readings: allocated only",
        ),
        pytest.param(
            [job("train", ("t-0", "n1", [(0, 1000)]))],
            [reading("n2", 0, 100)],
            {"train": use(1)},
            id="a reading of another node's GPU 0 is not the pod's",
        ),
    ],
)
def test_join_counts_each_queues_gpus_allocated_and_used(
    jobs: list[table.TrackedJob],
    found: list[readings.GPUReading],
    expected: dict[str, readings.QueueUse],
) -> None:
    uses = readings.join(found, readings.holdings_of(jobs))

    assert uses.keys() == expected.keys()
    for queue, want in expected.items():
        got = uses[queue]
        assert got.allocated == pytest.approx(want.allocated), queue
        assert got.measured == pytest.approx(want.measured), queue
        assert got.busy == pytest.approx(want.busy), queue
        assert got.idle == pytest.approx(want.idle), queue
        assert got.memory_used_bytes == pytest.approx(want.memory_used_bytes), queue
        assert got.memory_bytes == pytest.approx(want.memory_bytes), queue


def test_a_page_joined_to_the_table_end_to_end() -> None:
    page = dcgmpages.render(
        [
            GPU("l4-07", i, util=u, fb_used=f, fb_total=23034, model=dcgmpages.L4)
            for i, (u, f) in enumerate([(95, 20000), (2, 300), (0, 0), (0, 0)])
        ]
    )
    jobs = [job("train", ("t-0", "l4-07", [(0, 1000), (1, 1000)]))]

    uses = readings.join(readings.parse_page(page), readings.holdings_of(jobs))

    train = uses["train"]
    assert (train.allocated, train.measured, train.idle) == (2.0, 2.0, 1.0)
    assert train.busy == pytest.approx(0.97)
    assert train.memory_used_bytes == 20300 * MIB
    assert train.memory_bytes == 2 * 23034 * MIB


# -- the queue of an adopted job, and the settings -------------------------------------------


async def test_a_restarted_agent_knows_the_queue_of_the_jobs_it_adopts(tmp_path: Path) -> None:
    backend = agentbuilders.small_backend(tmp_path)
    await backend.create_pod(
        base.PodRequest(
            namespace="team-a",
            name="j1-worker-0",
            job_id="j1",
            task="worker",
            queue="train",
            node="h100-000",
            gpus=(status.GPUSlot(index=0), status.GPUSlot(index=1)),
            cpu_milli=1000,
            memory_mib=1024,
            template={},
        )
    )
    try:
        record = adopting.record_of(backend.held_jobs()["j1"], now=0.0)
    finally:
        await backend.close()

    assert record.queue == "train"
    uses = readings.join([reading("h100-000", 1, 40)], readings.holdings_of([record]))
    assert (uses["train"].allocated, uses["train"].busy) == (2.0, 0.4)


def test_the_kubernetes_backend_reads_the_queue_of_gpufeds_pods_from_their_label() -> None:
    pod = {
        "metadata": {
            "namespace": "team-a",
            "name": "j1-worker-0",
            "labels": {"gpufed.io/job": "j1", "gpufed.io/task": "worker", "gpufed.io/queue": "q"},
            "annotations": {"gpufed.io/gpus": "0,1"},
        },
        "spec": {
            "nodeName": "node-7",
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
        },
        "status": {"phase": "Running"},
    }
    foreign = {**pod, "metadata": {**pod["metadata"], "labels": {"gpufed.io/queue": "q"}}}

    assert objects.read_pod(pod).queue == "q"
    assert objects.read_pod(foreign).queue == ""  # not gpufed's pod


AGENT = ["agent", "--broker", "http://b", "--cluster", "c", "--nodes", "n", "--token-file", "t"]


def test_the_dcgm_flags_become_settings() -> None:
    argv = [*AGENT, "--metrics-port", "8081", "--dcgm-interval", "30s"]
    argv += ["--dcgm-url", "http://10.0.3.7:9400/metrics", "--dcgm-url", "https://p:9090/federate"]

    settings = daemons.agent_settings(cli.build_parser().parse_args(argv))

    assert settings.dcgm_urls == ["http://10.0.3.7:9400/metrics", "https://p:9090/federate"]
    assert settings.dcgm_interval_seconds == 30.0
    assert daemons.agent_settings(cli.build_parser().parse_args(AGENT)).dcgm_urls == []


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        pytest.param(["--dcgm-url", "http://e:9400/metrics"], "set metrics_port", id="no /metrics"),
        pytest.param(
            ["--metrics-port", "8081", "--dcgm-url", "e:9400/metrics"],
            "is not an http",
            id="not a URL",
        ),
        pytest.param(
            ["--metrics-port", "8081", "--dcgm-url", "http://e/m", "--dcgm-interval", "0"],
            "dcgm_interval_seconds",
            id="no interval",
        ),
    ],
)
def test_bad_dcgm_settings_are_refused_at_start(flags: list[str], problem: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=problem):
        daemons.agent_settings(cli.build_parser().parse_args([*AGENT, *flags]))
