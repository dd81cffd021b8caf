"""One trace per job, across processes: a real broker and agent export over OTLP/HTTP to an
in-process receiver that parses the real protobuf requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from e2e.helpers import wait_for
from gpufed import client
from gpufed.local import processes
from tests import kubeemulator
from tests.builders import make_job
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.e2e

H100 = "NVIDIA-H100-80GB-HBM3"
BROKER_SPANS = {"job", "job.submit", "job.queue", "job.schedule", "job.dispatch"}
AGENT_SPANS = {"agent.place", "agent.bind", "job.running"}


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    server = OtlpReceiver()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def wait_spans(
    receiver: OtlpReceiver, trace_id: str, names: set[str], *, timeout: float = 20.0
) -> list[ReceivedSpan]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if names <= {s.name for s in spans}:
            return spans
        await asyncio.sleep(0.1)
    got = sorted({s.name for s in receiver.trace(trace_id)})
    raise AssertionError(f"trace {trace_id}: missing {sorted(names - set(got))}, got {got}")


def exporting(receiver: OtlpReceiver, **sampler: str) -> dict[str, str]:
    """The OTEL_* variables of a process that exports to `receiver` (and samples by
    `sampler`: OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG)."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        **sampler,
    }


@contextlib.asynccontextmanager
async def kubernetes_fleet(
    fleet: processes.LocalFleet, *, nodes: int
) -> AsyncIterator[tuple[client.BrokerClient, kubeemulator.Emulator]]:
    """A broker, and an agent on an emulated Kubernetes cluster of `nodes` H100 nodes (so the
    pods it creates can be read back), ready; team-a's client and the emulator. The fleet
    stops on the way out: its agent's watches end before the emulator does, and each process
    exports the spans it holds as it stops."""
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    async with kubeemulator.with_kubeconfig(fleet.workdir, "h100") as (emulator, kubeconfig):
        for n in range(nodes):
            await emulator.add_node(f"h100-node-{n}", gpus=8, product=H100)
        try:
            await fleet.start_agent(
                "h100", None, "--kubeconfig", str(kubeconfig), backend="kubernetes"
            )
            await fleet.wait_clusters_ready(["h100"])
            async with fleet.client("team-a") as api:
                yield api, emulator
        finally:
            await fleet.stop()


async def run_to_success(
    api: client.BrokerClient, emulator: kubeemulator.Emulator, job_doc: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Submit a job of 2 pods and take its pods through Running to Succeeded: the submit's
    answer, and the pods the agent created."""
    submitted = await api.submit(json.dumps(job_doc))
    job_id = submitted["id"]
    await wait_for(api, job_id, "Dispatched")
    pods = []
    for _ in range(200):
        pods = [
            p for p in emulator.pods() if p["metadata"]["labels"].get("gpufed.io/job") == job_id
        ]
        if len(pods) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(pods) == 2
    for phase in ("Running", "Succeeded"):
        for pod in pods:
            meta = pod["metadata"]
            await emulator.set_pod_phase(meta["namespace"], meta["name"], phase)
        await wait_for(api, job_id, phase)
    return submitted, pods


async def test_one_trace_from_submit_to_finish_across_broker_and_agent(
    fleet: processes.LocalFleet, receiver: OtlpReceiver
) -> None:
    fleet.env = exporting(receiver)
    async with kubernetes_fleet(fleet, nodes=3) as (api, emulator):
        job_doc = make_job("traced", gpus=8).model(H100).gang(2).document()
        submitted, pods = await run_to_success(api, emulator, job_doc)
        job_id, trace_id = submitted["id"], submitted["traceId"]
        job = await api.get(job_id)
        # a batch's jobs: a trace each, not the batch request's trace for all of them
        too_big = make_job("batched", gpus=8).model(H100).gang(9).document()  # waits
        batch = await api.submit_batch([{"job": too_big}, {"job": too_big}])
        batched = batch["items"]
        assert [item["status"] for item in batched] == [202, 202], batch
        for item in batched:
            await api.cancel(item["id"])
            await wait_for(api, item["id"], "Cancelled")

    # the pods carry the job's trace context: their traceparent is a span of this trace
    for pod in pods:
        traceparent = pod["metadata"]["annotations"]["traceparent"]
        assert traceparent.split("-")[1] == trace_id

    spans = await wait_spans(receiver, trace_id, BROKER_SPANS | AGENT_SPANS)
    by_name = {s.name: s for s in spans}
    services = {s.service for s in spans}
    assert {"gpufed-broker", "gpufed-agent"} <= services
    assert by_name["agent.place"].resource.get("gpufed.cluster") == "h100"

    root = by_name["job"]
    assert job["traceparent"].split("-")[2] == root.span_id
    for name in ("job.submit", "job.queue", "job.schedule", "job.dispatch"):
        assert by_name[name].parent_span_id == root.span_id, name
    dispatch = by_name["job.dispatch"]
    for pod in pods:  # written by the agent from the offer: the dispatch span's context
        assert pod["metadata"]["annotations"]["traceparent"].split("-")[2] == dispatch.span_id
    for name in AGENT_SPANS:
        assert by_name[name].parent_span_id == dispatch.span_id, name
        assert by_name[name].service == "gpufed-agent"
    # the HTTP request span (aiohttp instrumentation) is the job span's parent
    http = [s for s in spans if s.span_id == root.parent_span_id]
    assert http and http[0].service == "gpufed-broker"
    # the job span covers submit to finish
    assert root.start_ns <= by_name["job.submit"].start_ns
    assert root.end_ns >= by_name["job.running"].end_ns
    assert root.attributes["gpufed.state"] == "Succeeded"
    assert "Running" in root.events and "Succeeded" in root.events

    traces = {item["traceId"] for item in batched}
    assert len(traces) == 2 and trace_id not in traces
    roots = [
        next(s for s in await wait_spans(receiver, t, {"job", "job.submit"}) if s.name == "job")
        for t in traces
    ]
    # each linked to the batch request's span, which is in neither job's trace
    links = {link for r in roots for link in r.links}
    assert len(links) == 1 and all(r.parent_span_id == "" for r in roots)
    batch_http = [s for s in receiver.spans if s.span_id in links]
    assert batch_http and batch_http[0].trace_id not in traces


@pytest.mark.parametrize(
    ("sampler", "ratio", "recorded"),
    [
        pytest.param("traceidratio", "0", False, id="ratio 0: nothing exported, ids still flow"),
        pytest.param("traceidratio", "1", True, id="ratio 1: every span exported"),
        pytest.param(
            "parentbased_traceidratio",
            "0",
            False,
            id="parent-based, ratio 0: the job's later spans and the agent's follow submit's",
        ),
    ],
)
async def test_the_standard_sampler_settings_choose_which_traces_are_exported(
    fleet: processes.LocalFleet, receiver: OtlpReceiver, sampler: str, ratio: str, recorded: bool
) -> None:
    """Broker and agent sampled by the standard OTEL_* variables, as the charts set them: a
    trace is exported whole or not at all, and a job not sampled still has its trace id and
    traceparent, in the API and on its pods."""
    fleet.env = exporting(receiver, OTEL_TRACES_SAMPLER=sampler, OTEL_TRACES_SAMPLER_ARG=ratio)
    async with kubernetes_fleet(fleet, nodes=2) as (api, emulator):
        job_doc = make_job("sampled", gpus=8).model(H100).gang(2).document()
        submitted, pods = await run_to_success(api, emulator, job_doc)
        job = await api.get(submitted["id"])

    trace_id = submitted["traceId"]
    _, job_trace, _, flags = job["traceparent"].split("-")
    assert (job_trace, flags) == (trace_id, "01" if recorded else "00")
    for pod in pods:  # the offer's trace context reached the agent, and the pod
        assert pod["metadata"]["annotations"]["traceparent"].split("-")[1] == trace_id
    if recorded:
        await wait_spans(receiver, trace_id, BROKER_SPANS | AGENT_SPANS)
    else:
        await asyncio.sleep(0.5)  # a request still on its way
        assert receiver.spans == []
