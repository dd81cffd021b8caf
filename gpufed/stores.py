"""`gpufed broker backup` and `gpufed broker quarantine`: admin commands on the broker's store.

They read the store directly (`--store`, the broker's own setting), not through the broker's
HTTP API: they work whether the broker runs or not (an SQLite file is read without being
locked, beside the running broker), and they need the access an operator of the store has
(the file, or etcd's endpoints, with the broker's --etcd-* flags for TLS and an etcd user),
not a token. Failures are one line on stderr, exit code 1.

- `backup OUT`: a consistent copy of an SQLite store (`broker.state.sqlite_backup`, sqlite's
  online backup), also while the broker writes; an etcd store is backed up with
  `etcdctl snapshot save` (etcd's own consistent snapshot) and refused here.
- `quarantine`: the records set aside because they do not parse (`broker.state.quarantine`):
  key, size, when, error.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from typing import Any

from broker.state import errors, etcd_credentials, opening, quarantine, sqlite_backup
from gpufed import tables


def _fail(command: str, message: object) -> int:
    print(f"gpufed broker {command}: {message}", file=sys.stderr)
    return 1


def backup_command(store_url: str, out: str) -> int:
    if store_url.startswith(opening.ETCD_SCHEME):
        return _fail(
            "backup",
            "an etcd store is backed up with `etcdctl snapshot save FILE` (docs/operations.md)",
        )
    try:
        path = opening.parse_sqlite_path(store_url)
        if path == ":memory:":
            return _fail("backup", "an in-memory store has nothing to back up")
        copied = sqlite_backup.backup(path, out)
    except (ValueError, errors.StoreError) as exc:
        return _fail("backup", exc)
    print(
        f"backed up {path} to {copied.path}: revision {copied.revision}, {copied.keys} keys,"
        f" {copied.size / 2**20:.1f} MiB"
    )
    return 0


async def _read_quarantine(
    store_url: str, credentials: etcd_credentials.EtcdCredentials
) -> list[quarantine.Quarantined]:
    backing = await opening.open_store(store_url, read_only=True, credentials=credentials)
    try:
        return await quarantine.list_quarantined(backing)
    finally:
        await backing.close()


def quarantine_command(
    store_url: str, *, output: str = "table", etcd_flags: Mapping[str, Any] | None = None
) -> int:
    """`etcd_flags`: `etcd_credentials.load_credentials`'s keyword arguments (--etcd-*)."""
    try:
        credentials = etcd_credentials.load_credentials(**(etcd_flags or {}))
        if credentials != etcd_credentials.NONE and not store_url.startswith(opening.ETCD_SCHEME):
            return _fail("quarantine", "the --etcd-* flags are for an etcd store")
        items = asyncio.run(_read_quarantine(store_url, credentials))
    except (ValueError, errors.StoreError) as exc:
        return _fail("quarantine", exc)
    if output == "json":
        listing = [
            {
                "key": item.key,
                "storedUnder": item.stored_under,
                "size": item.size,
                "revision": item.revision,
                "at": item.at.isoformat(),
                "error": item.error,
            }
            for item in items
        ]
        print(json.dumps(listing, indent=2))
        return 0
    rows = [[item.key, item.size, item.at.isoformat()[:19], item.error] for item in items]
    print(tables.render(["KEY", "SIZE", "SET ASIDE", "ERROR"], rows))
    if not items:
        print("no record is in quarantine")
    return 0
