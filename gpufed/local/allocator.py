"""Which memory allocator a local broker or agent runs on: jemalloc where the system has it.

The broker frees most of what a burst of jobs allocated once they retire to history, but
the C library's allocator gives little of it back: glibc's heap keeps every 4 KiB page that
still holds one live object, and the few thousand objects that outlive a burst (caches,
index tables, a page of history being served) are spread across all of it. After a soak
(`python -m e2e.bench_soak`) the broker's heap is mostly free pages that `malloc_trim`
(`kits.garbage`) cannot return, and its resident memory stays well above its start.
jemalloc keeps objects of one size class together and returns dirty pages on a timer, so
far more of that memory goes back, at the same pods/s.

The agent too: with its finished pods deleted (`--finished-pods-ttl`) its live allocations
fall after a soak, but on Python's own allocator its resident memory stays at its peak; on
jemalloc it gives much of it back, at the same CPU per job. e2e/README.md gives the figures.

`service_env` is the environment the local supervisor (`processes.LocalFleet`, so `gpufed
local`, the demo and the benchmarks) gives the broker and each agent: Python's allocations
through the C allocator (`PYTHONMALLOC=malloc`, which the collector's trim needs), and
jemalloc preloaded when the loader can find it (Debian's `libjemalloc2`), with its
background thread purging pages dirty for 5 s. An `LD_PRELOAD` already set, or
`GPUFED_JEMALLOC=0`, leaves the allocator alone; without jemalloc they run on glibc.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Callable, Mapping

JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:0"


def find_jemalloc() -> str | None:
    """The jemalloc library's name as the dynamic loader finds it (`libjemalloc.so.2`), or None."""
    return ctypes.util.find_library("jemalloc")


def service_env(
    environ: Mapping[str, str], *, find: Callable[[], str | None] = find_jemalloc
) -> dict[str, str]:
    """The variables to add to `environ` for a broker or agent process (see the module's
    docstring)."""
    env = {"PYTHONMALLOC": environ.get("PYTHONMALLOC", "malloc")}
    if environ.get("LD_PRELOAD") or environ.get("GPUFED_JEMALLOC", "1") in ("0", "false", "no"):
        return env
    library = find()
    if library is not None:
        env["LD_PRELOAD"] = library
        env["MALLOC_CONF"] = environ.get("MALLOC_CONF", JEMALLOC_CONF)
    return env
