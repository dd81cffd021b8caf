"""A broker the local supervisor starts runs on jemalloc where the system has it
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


async def test_the_local_broker_runs_on_jemalloc_when_the_system_has_it(
    fleet: processes.LocalFleet,
) -> None:
    library = allocator.find_jemalloc()
    if library is None:
        if os.environ.get("GPUFED_REQUIRE_JEMALLOC") == "1":
            pytest.fail("jemalloc is required here (GPUFED_REQUIRE_JEMALLOC=1) and not found")
        pytest.skip("no jemalloc on this system (apt-get install libjemalloc2)")
    fleet.write_tokens(tenants=["team-a"], clusters=[])
    broker = await fleet.start_broker()
    assert library in mapped_libraries(broker.process.pid)
    environ = Path(f"/proc/{broker.process.pid}/environ").read_bytes().split(b"\0")
    assert b"MALLOC_CONF=" + allocator.JEMALLOC_CONF.encode() in environ
    assert b"PYTHONMALLOC=malloc" in environ
