"""A consistent copy of an SQLite store while a broker writes to it (`gpufed store backup
OUT`): sqlite's online backup of one read transaction, checked, marked closed, and moved
into place whole or not at all."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from dataclasses import dataclass

from broker.state import errors, sqlite


@dataclass(frozen=True)
class Backup:
    """What `backup` copied."""

    path: str
    revision: int
    keys: int
    size: int  # bytes


def backup(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Backup:
    """Copy the store at `source` to `target` with sqlite's online backup, also while a broker
    writes to it: the copy is one consistent revision (read in one read transaction), checked,
    marked closed (restoring it warns of nothing), and appears at `target` whole or not at all.

    Blocking (call it from a thread, or from the CLI); StoreError naming the file if the
    source cannot be read or the copy does not check.
    """
    source, target = os.fspath(source), os.fspath(target)
    if not os.path.isfile(source):
        raise errors.StoreError(f"sqlite store {source}: no such file")
    if os.path.exists(target) and os.path.samefile(source, target):
        raise errors.StoreError(f"cannot back up {source} onto itself")
    if not os.path.isdir(os.path.dirname(os.path.abspath(target))):
        raise errors.StoreError(f"backup of {source} to {target}: no such folder")
    partial = f"{target}.partial"
    for leftover in (partial, f"{partial}-wal", f"{partial}-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)
    try:
        reader = sqlite.connect_reader(source)
        try:
            copy = sqlite3.connect(partial, isolation_level=None)
            try:
                reader.backup(copy)  # every page in one step: one read transaction
                sqlite.check_integrity(copy, source)
                copy.execute("UPDATE meta SET value = 0 WHERE name = 'open'")
                meta = dict(copy.execute("SELECT name, value FROM meta").fetchall())
                (keys,) = copy.execute("SELECT count(*) FROM kv").fetchone()
            finally:
                copy.close()  # the only connection: the copy's -wal goes into the file
        finally:
            reader.close()
        with open(partial, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(partial, target)
    except sqlite3.Error as exc:
        raise sqlite.store_error(source, exc) from exc
    except OSError as exc:
        raise errors.StoreError(f"backup of {source} to {target}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    directory = os.open(os.path.dirname(os.path.abspath(target)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return Backup(target, int(meta["revision"]), int(keys), os.path.getsize(target))
