"""Stored records that do not parse, set aside instead of stopping the broker.

A record the broker cannot read (bytes that are not JSON, JSON that no longer fits the model)
would otherwise stop the broker at load. `set_aside` moves it, in one transaction and only if
it is unchanged since read, from its key to the same key under `/gpufed/quarantine/`
(`/gpufed/jobs/x` → `/gpufed/quarantine/jobs/x`), wrapped with the error, the revision it had
and when; the raw bytes are kept whole (base64). Nothing reads it back: an operator lists the
quarantine (`gpufed broker quarantine --store URL`), the broker exports how many records it
holds (`gpufed_store_quarantined_records{kind}`), and a record repaired by hand can be put
back under its key.

Called by `records.JobStore.load` (jobs) and `registry.QueueRegistry.load` (queues).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

import pydantic

from broker.state import errors, store

logger = logging.getLogger(__name__)

ROOT = "/gpufed/"
QUARANTINE = "/gpufed/quarantine/"
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Quarantined:
    """A record set aside: where it was, why, and its bytes as they were stored."""

    key: str  # the key it had, e.g. /gpufed/jobs/x
    error: str
    raw: bytes
    revision: int  # its mod revision when it was set aside
    at: datetime
    stored_under: str  # its key in the quarantine

    @property
    def kind(self) -> str:
        """`jobs`, `queues`: the part of the key after /gpufed/."""
        return kind_of(self.key)

    @property
    def size(self) -> int:
        return len(self.raw)


def kind_of(key: str) -> str:
    return key.removeprefix(ROOT).split("/", 1)[0]


def quarantine_key(key: str) -> str:
    """Where `key` (under /gpufed/) goes when it is set aside."""
    if not key.startswith(ROOT) or key.startswith(QUARANTINE):
        raise ValueError(f"cannot quarantine {key!r}: not a record under {ROOT}")
    return QUARANTINE + key.removeprefix(ROOT)


def describe(exc: Exception) -> str:
    """One line for why a record does not parse: the first pydantic error and how many."""
    if isinstance(exc, pydantic.ValidationError):
        items = exc.errors(include_url=False)
        first = items[0]
        where = ".".join(str(part) for part in first["loc"])
        text = f"{where}: {first['msg']}" if where else str(first["msg"])
        if len(items) > 1:
            text += f" (and {len(items) - 1} more errors)"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:MAX_ERROR_CHARS]


def encode(item: Quarantined) -> bytes:
    return json.dumps(
        {
            "key": item.key,
            "error": item.error,
            "revision": item.revision,
            "at": item.at.isoformat(),
            "raw": base64.b64encode(item.raw).decode(),
        }
    ).encode()


def decode(entry: store.Entry) -> Quarantined:
    try:
        data = json.loads(entry.value)
        return Quarantined(
            key=str(data["key"]),
            error=str(data["error"]),
            raw=base64.b64decode(data["raw"], validate=True),
            revision=int(data["revision"]),
            at=datetime.fromisoformat(data["at"]),
            stored_under=entry.key,
        )
    except (ValueError, TypeError, KeyError, binascii.Error) as exc:
        # written by hand: show it as it is rather than fail the listing
        return Quarantined(
            key=ROOT + entry.key.removeprefix(QUARANTINE),
            error=f"the quarantine entry itself does not decode: {exc}",
            raw=entry.value,
            revision=entry.mod_revision,
            at=datetime.fromtimestamp(0, UTC),
            stored_under=entry.key,
        )


async def set_aside(backing: store.Store, entry: store.Entry, exc: Exception) -> bool:
    """Move `entry` (a record that does not parse) to the quarantine with the error; True if
    moved. False if it changed meanwhile, or the store refused the move (say, a record so
    large that its wrapped copy is over the request limit): it is left where it is, not
    loaded, and the next load tries again. Never raises for the record's sake."""
    item = Quarantined(
        key=entry.key,
        error=describe(exc),
        raw=entry.value,
        revision=entry.mod_revision,
        at=datetime.now(UTC),
        stored_under=quarantine_key(entry.key),
    )
    txn = store.Txn(
        compares=[store.Compare(entry.key, entry.mod_revision)],
        puts=[(item.stored_under, encode(item))],
        deletes=[entry.key],
    )
    try:
        await backing.commit(txn)
    except errors.ConflictError:
        logger.warning("record %s changed while being set aside; left where it is", entry.key)
        return False
    except errors.StoreError as refused:
        logger.error(
            "record %s does not parse (%s) and could not be set aside, left where it is and"
            " not loaded: %s",
            entry.key,
            item.error,
            refused,
        )
        return False
    logger.error(
        "record %s does not parse (%d bytes), set aside as %s: %s",
        entry.key,
        item.size,
        item.stored_under,
        item.error,
    )
    return True


async def list_quarantined(backing: store.Store) -> list[Quarantined]:
    """Every record in the quarantine, by key."""
    entries, _ = await backing.list(QUARANTINE)
    return [decode(entry) for entry in entries]


async def count_quarantined(backing: store.Store) -> Counter[str]:
    """Records in the quarantine per kind (`jobs`, `queues`)."""
    return Counter(item.kind for item in await list_quarantined(backing))


async def report(backing: store.Store) -> Counter[str]:
    """At start: count the quarantine per kind, and say so in the log if it holds anything."""
    counts = await count_quarantined(backing)
    if counts:
        logger.warning(
            "the store holds %d records set aside because they do not parse (%s); list them"
            " with `gpufed broker quarantine --store URL`",
            sum(counts.values()),
            ", ".join(f"{kind}: {count}" for kind, count in sorted(counts.items())),
        )
    return counts
