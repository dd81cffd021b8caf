"""A broker and an agent the local supervisor starts run on jemalloc where the system has it
(`gpufed.local.allocator`): the library is mapped into the real process. Without
jemalloc (Debian's `libjemalloc2`) the test skips with one line, except where
`GPUFED_REQUIRE_JEMALLOC=1` (CI: .ci/run installs it), where it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufed.local import allocator, processes


def mapped_libraries(pid: int) -> set[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if line.split()[-1].startswith("/")}


async def test_the_local_broker_and_agents_run_on_jemalloc_when_the_system_has_it(
    fleet: processes.LocalFleet,
) -> None:
    library = allocator.find_jemalloc()
    if library is None:
        if os.environ.get("GPUFED_REQUIRE_JEMALLOC") == "1":
            pytest.fail("jemalloc is required here (GPUFED_REQUIRE_JEMALLOC=1) and not found")
        pytest.skip("no jemalloc on this system (apt-get install libjemalloc2)")
    fleet.write_tokens(tenants=["team-a"], clusters=["h100"])
    broker = await fleet.start_broker()
    agent = await fleet.start_agent("h100", processes.config_dir() / "clusters" / "h100.yaml")
    await fleet.wait_clusters_ready(["h100"])  # the agent's process up, its libraries mapped
    for service in (broker, agent):
        assert library in mapped_libraries(service.process.pid), service.name
        environ = Path(f"/proc/{service.process.pid}/environ").read_bytes().split(b"\0")
        assert b"MALLOC_CONF=" + allocator.JEMALLOC_CONF.encode() in environ
        assert b"PYTHONMALLOC=malloc" in environ
