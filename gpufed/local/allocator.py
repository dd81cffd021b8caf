"""Which memory allocator a local broker or agent runs on: jemalloc where the system has it.

The broker frees most of what a burst of jobs allocated once they retire to history, but
the C library's allocator gives little of it back: glibc's heap keeps every 4 KiB page that
still holds one live object, and the few thousand objects that outlive a burst (caches,
index tables, a page of history being served) are spread across all of it. After a
20,000-job soak (`python -m e2e.bench_soak --jobs 20000 --retain 10s`) the broker held
58 MiB of live allocations in a 337 MiB heap, 279 MiB of it free, and its resident memory
stayed 103-128 MiB above its start (three runs) despite `malloc_trim`
(`kits.garbage`). jemalloc keeps objects of one size class together and returns
dirty pages on a timer: the same soak ended 55 MiB above its start, at the same pods/s.

The agent too: after the same 20,000-job soak, with its finished pods deleted
(`--finished-pods-ttl`), tracemalloc saw its live allocations fall from 60 to 33 MiB but its
resident memory stay at its peak, 43-52 MiB above its start, on Python's own allocator; on
jemalloc it ended 19-23 MiB above (one run, three agents), at the same CPU per job.

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
