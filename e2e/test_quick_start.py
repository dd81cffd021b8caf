"""The README's first job, run as a newcomer runs it: its three shell blocks, as written (only
the port changed, and `<id>` the id the submit printed), with the real `gpufed` on PATH, in a
directory holding a copy of `config/`. And what an agent does with a token the broker refuses
(exit 3, with the reason), a token file that is not there, and a broker that is not up yet."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gpufed import client
from gpufed.local import processes

pytestmark = pytest.mark.e2e

README = processes.REPO / "README.md"


def quick_start_blocks() -> list[list[str]]:
    """The commands of the first three `sh` blocks under "## Using it", a command a line
    (continuations joined, comments dropped)."""
    text = README.read_text()
    section = text[text.index("## Using it") :]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)[:3]
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
        commands.append([re.sub(r"\s+", " ", line) for line in lines if line])
    return commands


def shim(bin_dir: Path) -> dict[str, str]:
    """An environment whose `gpufed` is this checkout's, whatever the venv's scripts."""
    bin_dir.mkdir()
    script = bin_dir / "gpufed"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gpufed.cli "$@"\n')
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFED_")}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}


@contextlib.asynccontextmanager
async def background(
    command: str, *, cwd: Path, env: dict[str, str], log: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A command of its own terminal: running until the test ends (SIGTERM, then SIGKILL)."""
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_shell(
            f"exec {command}", cwd=cwd, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT
        )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def shell(command: str, *, cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_shell(
        command, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def wait_until(
    check: Callable[[], Awaitable[bool]], *, what: str, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not {what} after {timeout}s")


async def test_the_readme_quick_start_runs_as_written_with_queues(tmp_path: Path) -> None:
    broker_block, agent_block, user_block = quick_start_blocks()
    assert any("--queues config/queues.yaml" in c for c in broker_block)  # the case at issue
    port = str(processes.free_port())
    work = tmp_path / "checkout"
    shutil.copytree(processes.config_dir(), work / "config")
    env = shim(tmp_path / "bin")

    def local(command: str) -> str:
        return command.replace("8080", port)

    [broker_command] = broker_block
    async with background(
        local(broker_command), cwd=work, env=env, log=tmp_path / "broker.log"
    ) as broker:

        async def broker_ready() -> bool:
            assert broker.returncode is None, (tmp_path / "broker.log").read_text()
            answer = await client.replica_status(f"http://127.0.0.1:{port}")
            return isinstance(answer, dict) and bool(answer.get("synced"))

        await wait_until(broker_ready, what="the broker ready")
        *setup, agent_command = agent_block
        for command in setup:  # echo dev-agent-h100 > h100.token
            code, _, err = await shell(local(command), cwd=work, env=env)
            assert code == 0, (command, err)
        assert agent_command.startswith("gpufed agent")
        async with background(
            local(agent_command), cwd=work, env=env, log=tmp_path / "agent.log"
        ) as agent:

            async def h100_ready() -> bool:
                assert agent.returncode is None, (tmp_path / "agent.log").read_text()
                async with client.BrokerClient(f"http://127.0.0.1:{port}", "dev-admin") as api:
                    found = {c["name"]: c["health"] for c in await api.clusters()}
                return found.get("h100") == "Ready"

            await wait_until(h100_ready, what="cluster h100 Ready")
            outputs = await run_user_block(user_block, local=local, cwd=work, env=env)

    submitted = next(out for command, out in outputs if command.startswith("gpufed submit"))
    assert re.match(r"llama-pretrain-\S+ Queued \(trace [0-9a-f]{32}\)", submitted), submitted
    watched = next(out for command, out in outputs if command.startswith("gpufed get -w"))
    states = [line.split()[1] for line in watched.splitlines()[1:]]
    assert states == ["Queued", "Dispatched", "Running", "Succeeded"], watched
    assert "Running on h100" in watched
    queues = next(out for command, out in outputs if command == "gpufed queues")
    listed = {line.split()[0] for line in queues.splitlines()[2:] if not line.startswith("warn")}
    assert listed == {"training", "dev"}, queues  # team-a's own, not team-b's research


async def run_user_block(
    block: list[str], *, local: Callable[[str], str], cwd: Path, env: dict[str, str]
) -> list[tuple[str, str]]:
    """Each command in order, as typed: `export` sets the environment, `<id>` is the id the
    submit printed. Every command must succeed."""
    env = dict(env)
    job_id = None
    outputs = []
    for typed in block:
        if typed.startswith("export "):
            for assignment in shlex.split(typed)[1:]:
                name, _, value = assignment.partition("=")
                env[name] = local(value)
            continue
        command = typed
        if "<id>" in typed:
            assert job_id is not None, "the block names the job before submitting it"
            command = typed.replace("llama-pretrain-<id>", job_id)
        code, out, err = await shell(local(command), cwd=cwd, env=env)
        assert code == 0, (command, out, err)
        assert "Traceback" not in err, err
        if command.startswith("gpufed submit"):
            job_id = out.split()[0]
        outputs.append((command, out))
    return outputs


async def wait_exit(service: processes.Service, *, timeout: float = 20.0) -> int:
    try:
        return await asyncio.wait_for(service.process.wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"{service.name} still running:\n{service.tail()}") from None


async def test_an_agent_with_another_clusters_token_exits_3_saying_so(
    fleet: processes.LocalFleet,
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=["h100", "a100"])
    await fleet.start_broker()
    # the a100 agent's token, given to the h100 agent: the broker closes the session with 4003
    (fleet.workdir / "h100.token").write_text(fleet.tokens["agent:a100"] + "\n")
    agent = await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    assert await wait_exit(agent) == 3
    last = agent.tail(1)
    assert last.startswith("gpufed agent: the broker refused cluster h100: "), agent.tail()
    assert "4003" in last and "hello" in last


async def test_an_agent_whose_token_file_is_missing_exits_3_naming_it(
    fleet: processes.LocalFleet,
) -> None:
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    await fleet.start_broker()
    (fleet.workdir / "h100.token").unlink()
    agent = await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    assert await wait_exit(agent) == 3
    path = fleet.workdir / "h100.token"
    assert agent.tail(1) == (
        f"gpufed agent: cannot read the token file {path}: No such file or directory"
    )


async def test_an_agent_started_before_its_broker_waits_for_it(
    fleet: processes.LocalFleet,
) -> None:
    """Not an auth failure: a broker that is not up yet is retried, not given up on."""
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    fleet.port = processes.free_port()
    agent = await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await asyncio.sleep(2.0)
    assert agent.alive, agent.tail()
    await fleet.start_broker()
    await fleet.wait_clusters_ready(["h100"])
