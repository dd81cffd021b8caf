"""The broker's queues configuration: the one source of truth for quotas. Not pure (store).

Built by `broker.app` at start from the queues file (`--queues config/queues.yaml`; a file
that cannot work stops the broker, naming the field), then overlaid with the queues stored
by `PUT /v1/queues/{name}` (`/gpufed/queues/<name>` in the store: a queue PUT through the API
wins over the file's entry of the same name, and survives restarts). `follow` watches that
prefix so every replica sees every PUT. The scheduling shell reads `config` each cycle; the
submit handler calls `check_job`.

Jobs and queues: without any declared queue (no file, nothing PUT) every queue name is an
*open* queue — no guarantee, no limit, weight 1, cohort `default` — and nothing is preempted
or reserved, as before tenancy existed. Once queues are declared, a job must name a declared
queue of its own tenant (else 422 / 403 on `spec.queue`); a job stored earlier whose queue
has gone is scheduled as in an open queue (it may only borrow).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pydantic
import yaml

from broker.api import errors, jobs, queues
from broker.state import errors as store_errors
from broker.state import store

logger = logging.getLogger(__name__)

QUEUES = "/gpufed/queues/"


class QueuesFileError(ValueError):
    """The queues file is unreadable or describes queues that cannot work."""


class UnknownQueueError(errors.Invalid):
    """A job names a queue that is not declared."""

    title = "Invalid job"


class ForeignQueueError(errors.Forbidden):
    """A job names a queue of another tenant."""


class UnknownPriorityClassError(errors.Invalid):
    """A job names a priority class that is not declared."""

    title = "Invalid job"


def _refusal(kind: type[errors.GpufedError], field: str, message: str) -> errors.GpufedError:
    return kind(f"{field}: {message}", field=field)


def read_file(path: Path) -> queues.QueuesConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise QueuesFileError(f"{path}: cannot read the queues file: {exc}") from exc
    try:
        return queues.QueuesConfig.model_validate(data or {})
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise QueuesFileError(f"{path}: {where}: {first['msg']}") from exc


class QueueRegistry:
    def __init__(self, config: queues.QueuesConfig | None = None) -> None:
        self.base = config or queues.QueuesConfig()
        self.config = self.base
        self.revision = 0
        self.backing: store.Store | None = None

    @classmethod
    def from_file(cls, path: Path | None) -> QueueRegistry:
        return cls(read_file(path) if path is not None else None)

    @property
    def declared(self) -> bool:
        """True once any queue is declared: jobs must then name one."""
        return bool(self.config.queues)

    # ---- jobs ---------------------------------------------------------------------------

    def check_job(self, tenant: str, job: jobs.GPUJob) -> None:
        """Raise Invalid or Forbidden (naming the field) if `tenant` may not submit `job`."""
        spec = job.spec
        if (
            spec.priority_class is not None
            and self.config.priority_class(spec.priority_class) is None
        ):
            known = ", ".join(c.name for c in self.config.priority_classes) or "none declared"
            raise _refusal(
                UnknownPriorityClassError,
                "spec.priorityClass",
                f"no priority class {spec.priority_class!r} ({known})",
            )
        if not self.declared:
            return
        queue = self.config.queue(spec.queue)
        if queue is None:
            mine = sorted(q.name for q in self.config.queues if q.tenant == tenant)
            raise _refusal(
                UnknownQueueError,
                "spec.queue",
                f"no queue {spec.queue!r}; queues of tenant {tenant}: {', '.join(mine) or 'none'}",
            )
        if queue.tenant != tenant:
            raise _refusal(
                ForeignQueueError,
                "spec.queue",
                f"queue {spec.queue!r} belongs to tenant {queue.tenant}",
            )

    # ---- the store ----------------------------------------------------------------------

    async def load(self, backing: store.Store) -> int:
        """Overlay the queues stored through the API; returns the revision read at."""
        self.backing = backing
        entries, revision = await backing.list(QUEUES)
        config = self.base
        for entry in entries:
            config = self._with_stored(config, entry.key, entry.value)
        self.config = config
        self.revision = revision
        return revision

    def _with_stored(
        self, config: queues.QueuesConfig, key: str, value: bytes
    ) -> queues.QueuesConfig:
        try:
            return config.with_queue(queues.Queue.model_validate_json(value))
        except pydantic.ValidationError as exc:
            logger.warning("stored queue %s ignored: %s", key, exc.errors()[:1])
            return config

    async def put(self, queue: queues.Queue) -> queues.QueuesConfig:
        """Validate `queue` against the rest of the configuration, store it, apply it.

        Raises pydantic.ValidationError (the field named) for a queue that cannot work.
        """
        if self.backing is None:
            raise errors.Unavailable("the queues are not loaded from the store yet")
        config = self.config.with_queue(queue)
        revision = await self.backing.put(
            f"{QUEUES}{queue.name}", queue.model_dump_json(by_alias=True).encode()
        )
        self.config = config
        self.revision = max(self.revision, revision)
        return config

    def _apply(self, event: store.WatchEvent) -> None:
        name = event.key.removeprefix(QUEUES)
        if event.type == store.EventType.PUT:
            self.config = self._with_stored(self.config, event.key, event.value)
        else:
            kept = [q for q in self.config.queues if q.name != name]
            from_file = self.base.queue(name)
            queues = kept + ([from_file] if from_file is not None else [])
            self.config = self.config.model_copy(update={"queues": queues})
        self.revision = max(self.revision, event.revision)

    async def follow(self, backing: store.Store) -> None:
        """Apply queue changes made by any replica, until cancelled."""
        while True:
            try:
                async for event in backing.watch(QUEUES, start_revision=self.revision + 1):
                    self._apply(event)
                await asyncio.sleep(1.0)  # the watch ended (store closing): try again later
            except store_errors.CompactedError:
                await self.load(backing)
            except store_errors.StoreError as exc:
                logger.warning("watching queues failed, retrying: %s", exc)
                await asyncio.sleep(1.0)
