"""Election replicas on a real etcd for the leadership tests: each on a store connection of
its own, its campaign running as a task until `stop`."""

from __future__ import annotations

import asyncio
import contextlib

from broker.state import electing, etcd, opening


async def replica(url: str, name: str, *, ttl: int) -> tuple[electing.Election, asyncio.Task[None]]:
    """An Election named `name` (advertising http://<name>) on its own connection to `url`,
    campaigning."""
    backing = await etcd.EtcdStore.connect(opening.parse_etcd_endpoints(url))
    election = electing.Election(backing, replica=name, url=f"http://{name}", ttl=ttl)
    return election, asyncio.create_task(election.run())


async def stop(election: electing.Election, task: asyncio.Task[None]) -> None:
    """End the replica's campaign and close its store."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await election.backing.close()
