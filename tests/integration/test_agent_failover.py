"""The real agent (run_agent, simulated backend) with several broker URLs and a partition:
failover to the next URL, following the leader a follower names (HTTP 409 not-leader), a
refused token at start, final reports that survive a move between replicas, and the agent
fencing itself when it cannot hear its broker (a TCP proxy the test cuts)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from broker.api import messages, status
from gpufed.local import processes
from member_agent import app
from member_agent.cluster.simulated import backend as simulated
from member_agent.session import brokers
from tests import agentbuilders, fakebroker, tcpproxy

State = status.JobState


class Refusing:
    """A broker replica that refuses every session as the contract says: 409 not-leader (with
    the leader's URL or null, and Retry-After: 1), or 401."""

    def __init__(self, *, status: int = 409, leader: str | None = None) -> None:
        self.status = status
        self.leader = leader
        self.attempts = 0
        self.refused_at = 0.0  # monotonic, the latest refusal
        self.times: list[float] = []  # monotonic, every refusal
        self.app = web.Application()
        self.app.router.add_get("/v1/agents/connect", self.connect)

    async def connect(self, request: web.Request) -> web.Response:
        self.attempts += 1
        self.refused_at = time.monotonic()
        self.times.append(self.refused_at)
        if self.status == 409:
            body = {
                "type": brokers.NOT_LEADER,
                "title": "Not the leader",
                "status": 409,
                "detail": "this replica follows; agents connect to the leader",
                "leader": self.leader,
            }
            headers = {"Retry-After": "1"}
        else:
            body = {"type": "about:blank", "title": "Unauthenticated", "status": self.status}
            body["detail"] = "unknown token"
            headers = {}
        return web.Response(
            status=self.status,
            text=json.dumps(body),
            content_type="application/problem+json",
            headers=headers,
        )


@contextlib.asynccontextmanager
async def serving(application: web.Application) -> AsyncIterator[TestServer]:
    server = TestServer(application)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def url_of(server: TestServer) -> str:
    return str(server.make_url("/")).rstrip("/")


@contextlib.asynccontextmanager
async def running_agent(
    tmp_path: Path, broker_url: str, *, max_backoff: float = 0.2
) -> AsyncIterator[fakebroker.Agent]:
    token_file = tmp_path / "token"
    token_file.write_text(fakebroker.TOKEN + "\n")
    nodes = agentbuilders.write_cluster(tmp_path)
    settings = app.AgentSettings(
        broker_url=broker_url,
        cluster="small",
        token_file=token_file,
        nodes_file=nodes,
        backoff=app.BackoffSettings(
            initial_seconds=0.05, max_seconds=max_backoff, auth_retry_seconds=0.3
        ),
        summary_interval_seconds=0.02,
        failure_grace_seconds=0,
    )
    backend = simulated.SimulatedBackend("small", simulated.load_pools(nodes), start_delay=0.05)
    agent = fakebroker.Agent(settings, backend, token_file)
    agent.start()
    try:
        yield agent
    finally:
        await agent.stop()
        await backend.close()


def offer(broker: fakebroker.FakeBroker, job_id: str, **job: object) -> messages.Offer:
    return agentbuilders.make_offer(job_id, agentbuilders.make_job(**job), epoch=broker.epoch)  # type: ignore[arg-type]


async def test_a_dead_first_broker_url_is_passed_over_for_the_next(tmp_path: Path) -> None:
    fake = fakebroker.FakeBroker()
    dead = f"http://127.0.0.1:{processes.free_port()}"  # nothing listens there
    async with serving(fake.app) as server, running_agent(tmp_path, f"{dead},{url_of(server)}"):
        hello = await fake.wait_for_hellos(1, timeout=3)
        assert hello.cluster == "small"


async def test_a_follower_sends_the_agent_to_the_leader_it_names_at_once(tmp_path: Path) -> None:
    leader = fakebroker.FakeBroker()
    async with serving(leader.app) as leading:
        follower = Refusing(leader=url_of(leading))  # the leader is not in the agent's list
        async with (
            serving(follower.app) as following,
            running_agent(tmp_path, url_of(following)),
        ):
            await leader.wait_for_hellos(1, timeout=3)
            took = time.monotonic() - follower.refused_at
            assert follower.attempts == 1
            # not the follower's Retry-After (1 s): straight to the leader
            assert took < 0.6, f"{took:.2f} s: the agent waited instead of following"
            # the leader's session drops: the agent reconnects to it, not to the follower
            assert leader.ws is not None
            await leader.ws.close()
            await leader.wait_for_hellos(2, timeout=3)
            assert follower.attempts == 1


async def test_a_follower_that_knows_no_leader_sends_the_agent_down_the_list(
    tmp_path: Path,
) -> None:
    fake = fakebroker.FakeBroker()
    follower = Refusing(leader=None)
    async with (
        serving(follower.app) as following,
        serving(fake.app) as server,
        running_agent(tmp_path, f"{url_of(following)},{url_of(server)}"),
    ):
        await fake.wait_for_hellos(1, timeout=3)
        assert follower.attempts == 1


async def test_while_replicas_refuse_the_agent_asks_at_their_retry_after_not_slower(
    tmp_path: Path,
) -> None:
    """After a leader's kill -9 the followers name it until its lease expires: the agent
    follows it (nothing answers), goes down the list, is refused again... With a 5 s backoff
    ceiling it would soon wait up to 5 s and miss the new leader by as much; a replica's
    Retry-After (1 s) caps the wait instead."""
    dead = f"http://127.0.0.1:{processes.free_port()}"  # the killed leader
    first, second = Refusing(leader=dead), Refusing(leader=dead)
    async with (
        serving(first.app) as one,
        serving(second.app) as two,
        running_agent(tmp_path, f"{url_of(one)},{url_of(two)}", max_backoff=5.0),
    ):
        await asyncio.sleep(6.0)
    times = sorted(first.times + second.times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) >= 5, times
    assert max(gaps) <= 1.5, [round(g, 2) for g in gaps]


async def test_a_token_refused_before_any_session_stops_the_agent_with_the_reason(
    tmp_path: Path,
) -> None:
    refusing = Refusing(status=401)
    async with serving(refusing.app) as server, running_agent(tmp_path, url_of(server)) as agent:
        assert agent.task is not None
        with pytest.raises(brokers.AuthError, match="HTTP 401 unknown token"):
            async with asyncio.timeout(3):
                await agent.task
        agent.task = None
        assert refusing.attempts == 1  # no failover to try: the token is wrong everywhere


async def test_the_cli_exits_non_zero_saying_why_the_token_was_refused(tmp_path: Path) -> None:
    refusing = Refusing(status=401)
    (tmp_path / "small.token").write_text("wrong\n")
    nodes = agentbuilders.write_cluster(tmp_path)
    async with serving(refusing.app) as server:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpufed.cli", "agent", "--broker", url_of(server),
            "--cluster", "small", "--token-file", str(tmp_path / "small.token"),
            "--nodes", str(nodes), "--log-level", "CRITICAL",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(20):
            _, err = await process.communicate()
    assert process.returncode == 3
    assert err.decode().strip().splitlines()[-1] == (
        "gpufed agent: the broker refused cluster small: HTTP 401 unknown token"
    )


async def test_final_reports_and_running_jobs_survive_a_move_to_another_replica(
    tmp_path: Path,
) -> None:
    first, second = fakebroker.FakeBroker(), fakebroker.FakeBroker()
    second.epoch = 90
    async with (
        serving(first.app) as one,
        serving(second.app) as two,
        running_agent(tmp_path, f"{url_of(one)},{url_of(two)}"),
    ):
        await first.wait_for_hellos(1)
        await first.send(offer(first, "long", gpus=8, model=agentbuilders.H100, duration=600))
        await first.send(offer(first, "short", gpus=1, duration=0.1))
        done = await first.expect(messages.JobUpdate, lambda u: u.state.terminal)
        assert (done.job_id, done.state, done.seq) == ("short", State.SUCCEEDED, 1)
        # the first replica goes before acknowledging it: the agent moves to the second
        first.down = True
        assert first.ws is not None
        await first.ws.close()
        hello = await second.wait_for_hellos(1, timeout=5)
        held = {j.job_id: j.state for j in hello.jobs}
        assert held == {"long": State.RUNNING, "short": State.SUCCEEDED}
        again = await second.expect(messages.JobUpdate, lambda u: u.state.terminal)
        assert (again.job_id, again.state, again.seq) == ("short", State.SUCCEEDED, 1)
        await second.send(messages.Ack(epoch=second.epoch, seqs=[1]))
        await second.send(offer(second, "marker", gpus=1))  # read after the ack
        await second.expect(messages.Accepted, lambda a: a.job_id == "marker")
        assert second.ws is not None
        await second.ws.close()
        hello = await second.wait_for_hellos(2)
        assert {j.job_id for j in hello.jobs} == {"long", "marker"}


async def test_a_partitioned_agent_fences_itself_before_the_brokers_grace(
    tmp_path: Path,
) -> None:
    fake = fakebroker.FakeBroker(heartbeat=0.5)
    fake.lost_after = 4.0  # the agent fences after 4.0 - (2 x 0.5 + 1) = 2 s without word
    async with serving(fake.app) as server:
        proxy = await tcpproxy.TcpProxy(server.port or 0).start()
        try:
            async with running_agent(tmp_path, proxy.url) as agent:
                await fake.wait_for_hellos(1)
                await fake.send(offer(fake, "req", gpus=8, model=agentbuilders.H100, duration=600))
                await fake.send(
                    offer(
                        fake,
                        "waits",
                        gpus=2,
                        model=agentbuilders.L4,
                        duration=600,
                        cluster_lost="wait",
                    )
                )
                for job_id in ("req", "waits"):
                    await fake.expect(
                        messages.JobUpdate,
                        lambda u, j=job_id: (u.job_id, u.state) == (j, State.RUNNING),
                    )
                proxy.cut()
                cut = time.monotonic()
                await asyncio.sleep(1.0)  # renewed at most 0.5 s before the cut
                assert len(agent.backend.pods_of("req")) == 1, "fenced before its lease lapsed"
                while agent.backend.pods_of("req") and time.monotonic() - cut < 5:
                    await asyncio.sleep(0.02)
                fenced = time.monotonic() - cut
                assert agent.backend.pods_of("req") == []
                assert fenced < fake.lost_after - 0.5, f"fenced {fenced:.2f} s after the cut"
                [pod] = agent.backend.pods_of("waits")
                assert pod.phase == status.PodPhase.RUNNING

                proxy.heal()
                hello = await fake.wait_for_hellos(2, timeout=5)
                held = {j.job_id: (j.state, j.reason) for j in hello.jobs}
                assert held == {
                    "req": (State.CANCELLED, "ClusterLost"),
                    "waits": (State.RUNNING, None),
                }
                report = await fake.expect(
                    messages.JobUpdate, lambda u: u.job_id == "req" and u.seq is not None
                )
                assert (report.state, report.reason) == (State.CANCELLED, "ClusterLost")
                assert "the agent fenced itself" in report.message
                # renewed: offers are placed again
                await fake.send(offer(fake, "after", gpus=1))
                await fake.expect(messages.Accepted, lambda a: a.job_id == "after")
        finally:
            await proxy.close()
