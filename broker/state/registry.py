"""The broker's queues configuration: the one source of truth for quotas. Not pure (store).

Built by `broker.app` at start from the queues file (`--queues config/queues.yaml`; a file
that cannot work stops the broker, naming the field), then overlaid with the queues stored
by `PUT /v1/queues/{name}` (`/gpufed/queues/<name>` in the store: a queue PUT through the API
wins over the file's entry of the same name, and survives restarts). `follow` watches that
prefix so every replica sees every PUT. The scheduling shell reads `config` each cycle; the
submit handler calls `check_job`.

Jobs and queues depend on the queue mode (`--queue-mode`), said once at start and never
changed by a PUT:

- `open` (the default without a queues file): a job may name any queue. A queue nobody
  declared is an *open* queue — no guarantee, no limit, weight 1, cohort `default`. A declared
  queue (file or PUT) gets its quotas and weight, and belongs to its tenant: another tenant's
  job naming it is refused (403). Declaring one queue locks no other.
- `declared` (the default with a queues file): a job must name a declared queue of its own
  tenant (else 422 / 403 on `spec.queue`).

Switching to `declared` never strands a job silently: a job stored earlier whose queue is not
declared (or has gone) is scheduled as in an open queue (it may only borrow); at start
`report_undeclared` logs those queues with their counts, and `GET /v1/queues` lists each with
a warning.

A tenant-admin's PUT (`put(..., bounded=True)`) must fit its tenant's allotment
(`broker.api.allotments`: declared in the file, else derived from the file's queues of that
tenant), checked against the configuration as it is when the PUT is stored: PUTs are applied
one at a time, so two at once cannot both fit alone and overdraw together. The admin's PUTs
are not bound. Allotments come from the file only: the API cannot raise one.

`delete` removes what the API stored, nothing else: a queue stored only through the API is
gone (the HTTP layer first checks it has no unfinished job); a queue of the file that a PUT
overrode gets the file's definition back; a queue only in the file cannot be deleted through
the API (edit the file and restart).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

import pydantic
import yaml

from broker.api import allotments, errors, images, jobs, queues
from broker.state import errors as store_errors
from broker.state import quarantine, store

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


class BeyondAllotmentError(errors.Forbidden):
    """A tenant-admin's queue would claim more than its tenant's allotment."""

    title = "Beyond the tenant's allotment"


class UntrustedImageError(errors.Invalid):
    """A job names an image its tenant's allotment or its queue does not allow."""

    title = "Image not allowed"


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
    def __init__(
        self,
        config: queues.QueuesConfig | None = None,
        *,
        mode: queues.QueueMode = queues.QueueMode.OPEN,
    ) -> None:
        self.base = config or queues.QueuesConfig()
        self.config = self.base
        self.mode = mode
        self.revision = 0
        self.backing: store.Store | None = None
        self.stored: set[str] = set()  # the queues stored through the API
        self._writing = asyncio.Lock()  # one PUT or DELETE at a time: each sees the last

    @classmethod
    def from_file(cls, path: Path | None, *, mode: queues.QueueMode | None = None) -> QueueRegistry:
        """The registry of a queues file (None: no file). The mode defaults to `declared`
        with a file, `open` without."""
        if mode is None:
            mode = queues.QueueMode.DECLARED if path is not None else queues.QueueMode.OPEN
        return cls(read_file(path) if path is not None else None, mode=mode)

    @property
    def declared(self) -> bool:
        """True in declared mode: jobs must name a declared queue of their tenant."""
        return self.mode == queues.QueueMode.DECLARED

    def source(self, name: str) -> queues.QueueSource | None:
        """Where the declared queue `name` comes from; None: not declared."""
        if self.config.queue(name) is None:
            return None
        in_file = self.base.queue(name) is not None
        if name in self.stored:
            return queues.QueueSource.OVERRIDE if in_file else queues.QueueSource.API
        return queues.QueueSource.FILE if in_file else None

    def undeclared(self, unfinished: Mapping[str, int]) -> dict[str, int]:
        """In declared mode, the queues of `unfinished` (jobs per queue) nobody declared."""
        if not self.declared:
            return {}
        return {
            name: count
            for name, count in sorted(unfinished.items())
            if count and self.config.queue(name) is None
        }

    def report_undeclared(self, unfinished: Mapping[str, int]) -> dict[str, int]:
        """Log the queues `undeclared` finds (at start): their jobs run as in open queues."""
        found = self.undeclared(unfinished)
        if found:
            logger.warning(
                "queue mode declared: %d unfinished jobs name %d undeclared queues (%s); "
                "they are scheduled as in open queues (no guarantee, no limit) — declare "
                "the queues (PUT /v1/queues/NAME) or cancel the jobs",
                sum(found.values()),
                len(found),
                ", ".join(f"{name}: {count}" for name, count in found.items()),
            )
        return found

    def allotment(self, tenant: str) -> tuple[queues.Allotment, bool]:
        """The allotment of `tenant` (what its tenant-admin may claim) and whether the
        queues file declares it (False: derived from the file's queues of the tenant)."""
        return allotments.allotment_of(tenant, self.base)

    def tenants(self) -> list[str]:
        """The tenants with a declared queue or an allotment."""
        named = {q.tenant for q in self.config.queues} | {a.tenant for a in self.base.allotments}
        return sorted(named)

    def check_allotment(self, queue: queues.Queue) -> None:
        """BeyondAllotmentError (naming the field) if `queue` would take its tenant past its
        allotment, beside the tenant's other queues as they are now."""
        allotment, declared = self.allotment(queue.tenant)
        previous = self.config.queue(queue.name)
        config = self.config
        excesses = allotments.check_put(
            allotment,
            queue=queue,
            previous=previous if previous is not None and previous.tenant == queue.tenant else None,
            others=[q for q in config.queues if q.tenant == queue.tenant and q.name != queue.name],
            classes={c.name: c.value for c in config.priority_classes},
            default_class=config.policy.default_priority_class,
        )
        excesses.extend(self._images_beyond(allotment, queue, previous))
        excesses.sort(key=lambda e: e.field)
        if not excesses:
            return
        source = "declared by the fleet admin" if declared else "what the queues file gives it"
        detail = "; ".join(f"{e.field}: {e.message}" for e in excesses)
        raise BeyondAllotmentError(
            f"{detail} (the allotment is {source}; only the fleet admin may claim more)",
            field=excesses[0].field,
        )

    @staticmethod
    def _images_beyond(
        allotment: queues.Allotment, queue: queues.Queue, previous: queues.Queue | None
    ) -> list[allotments.Excess]:
        """The prefixes of `queue.allowedImages` that let through an image the allotment does
        not (and its previous list did not: keeping what it had always fits). Such a prefix
        would change nothing, the allotment's list applies at submit all the same; the PUT is
        refused so that the queue does not seem to allow what its jobs may not run."""
        if allotment.allowed_images is None or queue.allowed_images is None:
            return []
        wider = images.within(queue.allowed_images, allotment.allowed_images)
        if previous is not None and previous.allowed_images is not None:
            wider = images.within(wider, previous.allowed_images)
        if not wider:
            return []
        allowed = ", ".join(allotment.allowed_images) or "none"
        return [
            allotments.Excess(
                "allowedImages",
                f"{', '.join(wider)}: beyond tenant {queue.tenant}'s allotment (allowedImages "
                f"{allowed}); a queue may narrow it, not widen it",
            )
        ]

    def allowed_images(self, tenant: str, queue: str) -> list[str] | None:
        """The image prefixes the jobs of `tenant` in `queue` may run: the allotment's list
        (declared by the fleet admin) narrowed by the queue's (`images.narrow`); None: any."""
        allotment = self.base.allotment(tenant)
        declared = self.config.queue(queue)
        mine = declared if declared is not None and declared.tenant == tenant else None
        return images.narrow(
            allotment.allowed_images if allotment is not None else None,
            mine.allowed_images if mine is not None else None,
        )

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
        queue = self.config.queue(spec.queue)
        if queue is None and not self.declared:
            self._check_images(tenant, job)  # open mode: an undeclared queue is an open queue
            return
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
        self._check_priority(tenant, job)
        self._check_images(tenant, job)

    def _check_images(self, tenant: str, job: jobs.GPUJob) -> None:
        """UntrustedImageError (422, naming the first image's field, every one in `errors`) if
        `job` names an image its tenant's allotment or its queue does not allow."""
        found = images.refusals(job, self.allowed_images(tenant, job.spec.queue))
        if found:
            raise UntrustedImageError(
                "; ".join(f"{r.field}: {r.message}" for r in found),
                field=found[0].field,
                errors=[{"field": r.field, "message": r.message} for r in found],
            )

    def _check_priority(self, tenant: str, job: jobs.GPUJob) -> None:
        """BeyondAllotmentError if `job` asks for a priority above the allotment the fleet
        admin declared for its tenant: the allotment's highest class (else the policy's default
        class; else none, value 0). A job's priority decides whom it may preempt, so a
        submitter may not pick more than the admin gave its tenant. A tenant without a declared
        allotment, or a fleet without priority classes, is not bounded here (as before
        allotments: its jobs may name any declared class)."""
        allotment = self.base.allotment(tenant)  # declared only: none derived per submit
        if allotment is None or not self.config.priority_classes:
            return
        values = {c.name: c.value for c in self.config.priority_classes}
        top = allotment.max_priority_class or self.config.policy.default_priority_class
        ceiling = values.get(top, 0) if top is not None else 0
        spec = job.spec
        if spec.priority_class is not None:
            asked, field = values.get(spec.priority_class, 0), "spec.priorityClass"
            what = f"priority class {spec.priority_class} ({asked})"
        else:
            asked, field, what = spec.priority, "spec.priority", f"priority {spec.priority}"
        if asked > ceiling:
            highest = f"{top} ({ceiling})" if top is not None else "no class (0)"
            raise _refusal(
                BeyondAllotmentError,
                field,
                f"{what} is above tenant {tenant}'s highest, {highest}; only the fleet admin "
                "may allot more",
            )

    # ---- the store ----------------------------------------------------------------------

    async def load(self, backing: store.Store) -> int:
        """Overlay the queues stored through the API; returns the revision read at."""
        self.backing = backing
        entries, revision = await backing.list(QUEUES)
        config = self.base
        self.stored = set()
        for entry in entries:
            try:
                queues.Queue.model_validate_json(entry.value)
            except pydantic.ValidationError as exc:  # does not parse: set aside, not lost
                await quarantine.set_aside(backing, entry, exc)
                continue
            config = self._with_stored(config, entry.key, entry.value)
        self.config = config
        self.revision = revision
        return revision

    def _with_stored(
        self, config: queues.QueuesConfig, key: str, value: bytes
    ) -> queues.QueuesConfig:
        try:
            queue = queues.Queue.model_validate_json(value)
            changed = config.with_queue(queue)
        except pydantic.ValidationError as exc:
            logger.warning("stored queue %s ignored: %s", key, exc.errors()[:1])
            return config
        self.stored.add(queue.name)
        return changed

    async def put(self, queue: queues.Queue, *, bounded: bool = False) -> queues.QueuesConfig:
        """Validate `queue` against the rest of the configuration, store it, apply it.
        `bounded` (a tenant-admin's PUT): it must fit its tenant's allotment too.

        Raises pydantic.ValidationError (the field named) for a queue that cannot work,
        BeyondAllotmentError for one beyond the allotment; either way nothing is stored.
        """
        if self.backing is None:
            raise errors.Unavailable("the queues are not loaded from the store yet")
        async with self._writing:
            if bounded:
                self.check_allotment(queue)
            config = self.config.with_queue(queue)
            # without `allowedImages` when unset: a broker from before the field reads it
            unset = {"allowed_images"} if queue.allowed_images is None else None
            revision = await self.backing.put(
                f"{QUEUES}{queue.name}",
                queue.model_dump_json(by_alias=True, exclude=unset).encode(),
            )
            self.config = config
            self.stored.add(queue.name)
            self.revision = max(self.revision, revision)
            return config

    async def delete(self, name: str) -> queues.QueuesConfig:
        """Delete what the API stored of queue `name`: the queue is gone, or back to the
        file's definition. NotFound if the API stored nothing of that name."""
        if self.backing is None:
            raise errors.Unavailable("the queues are not loaded from the store yet")
        async with self._writing:
            if name not in self.stored:
                raise errors.NotFound(f"no queue {name!r} stored through the API")
            revision = await self.backing.delete(f"{QUEUES}{name}")
            self._forget(name)
            self.revision = max(self.revision, revision)
            return self.config

    def _forget(self, name: str) -> None:
        self.stored.discard(name)
        kept = [q for q in self.config.queues if q.name != name]
        from_file = self.base.queue(name)
        restored = sorted(kept + ([from_file] if from_file is not None else []), key=_by_name)
        self.config = self.config.model_copy(update={"queues": restored})

    def _apply(self, event: store.WatchEvent) -> None:
        if event.type == store.EventType.PUT:
            self.config = self._with_stored(self.config, event.key, event.value)
        else:
            self._forget(event.key.removeprefix(QUEUES))
        self.revision = max(self.revision, event.revision)

    async def follow(self, backing: store.Store) -> None:
        """Apply queue changes made by any replica, until cancelled."""
        while True:
            try:
                async for event in backing.watch(QUEUES, start_revision=self.revision + 1):
                    self._apply(event)
                await asyncio.sleep(1.0)  # the watch ended (store closing): try again later
            except store_errors.CompactedError:
                try:
                    await self.load(backing)
                except Exception as exc:  # the store went away while relisting: later
                    logger.warning("relisting queues failed, retrying: %s", exc)
                    await asyncio.sleep(1.0)
            except Exception as exc:  # never dies of an error: the next watch resumes
                logger.warning("watching queues failed, retrying: %s", exc)
                await asyncio.sleep(1.0)


def _by_name(queue: queues.Queue) -> str:
    return queue.name
