"""Open the store a URL names: the broker's `--store` setting.

- `sqlite:///relative/path.db`, `sqlite:////absolute/path.db` (SQLAlchemy's convention:
  what follows `sqlite:///` is the path) and `sqlite://:memory:`;
- `etcd://host:port[,host:port...]`: the first endpoint that answers (IPv6 as `[::1]:2379`;
  the port defaults to 2379), over TLS and as an etcd user if `credentials` say so
  (`etcd_credentials`: the broker's `--etcd-*` flags), to every endpoint alike.

And the history store (`open_history`, the broker's history setting): `sqlite:///path` (as
above; `default_history_url` puts it beside an SQLite store) or `postgresql://...` /
`postgres://...` (libpq's URL, read by asyncpg: `postgresql://user:pass@host:5432/db`,
`?host=/run/postgresql` for a socket).
"""

from __future__ import annotations

import os

from broker.state import errors, etcd, etcd_credentials, sqlite, store
from broker.state.history import protocol as history
from broker.state.history import sqlite as sqlite_history

SQLITE_SCHEME = "sqlite://"
ETCD_SCHEME = "etcd://"
ETCD_DEFAULT_PORT = 2379
POSTGRES_SCHEMES = ("postgresql://", "postgres://")
HISTORY_FILE = "history.db"


async def open_store(
    url: str,
    *,
    read_only: bool = False,
    credentials: etcd_credentials.EtcdCredentials = etcd_credentials.NONE,
    max_request_bytes: int = etcd.DEFAULT_MAX_REQUEST_BYTES,
) -> store.DurableStore:
    """The store `url` names, opened; ValueError naming the URL if it names none.

    `read_only` (the admin commands): an SQLite file is read without being locked, beside a
    running broker, and never created; etcd is opened as always (the caller only reads).
    `credentials` are etcd's (TLS, user); SQLite has none. `max_request_bytes` is etcd's
    `--max-request-bytes`: its writes stay within it.
    """
    if url.startswith(SQLITE_SCHEME):
        return await sqlite.SqliteStore.open(parse_sqlite_path(url), read_only=read_only)
    if url.startswith(ETCD_SCHEME):
        return await etcd.EtcdStore.connect(
            parse_etcd_endpoints(url), credentials=credentials, max_request_bytes=max_request_bytes
        )
    raise ValueError(
        f"unsupported store URL {url!r}: use sqlite:///path, sqlite://:memory: or etcd://host:port"
    )


def parse_sqlite_path(url: str) -> str:
    rest = url.removeprefix(SQLITE_SCHEME)
    if rest in (":memory:", "/:memory:"):
        return ":memory:"
    if not rest.startswith("/") or rest == "/":
        raise ValueError(f"store URL {url!r}: expected sqlite:///path/to/file.db")
    return rest.removeprefix("/")


def parse_etcd_endpoints(url: str) -> list[tuple[str, int]]:
    rest = url.removeprefix(ETCD_SCHEME).rstrip("/")
    endpoints = []
    for item in rest.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = port, str(ETCD_DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"store URL {url!r}: bad etcd endpoint {item!r}, expected host:port")
        endpoints.append((host, int(port)))
    return endpoints


async def open_history(url: str) -> history.HistoryStore:
    """The history store `url` names, opened (its schema created if absent); ValueError naming
    the URL if it names none, `broker.state.errors` types (chained) if it cannot be opened."""
    if url.startswith(SQLITE_SCHEME):
        return await sqlite_history.SqliteHistory.open(parse_sqlite_path(url))
    if url.startswith(POSTGRES_SCHEMES):
        try:
            from broker.state.history import postgres
        except ImportError as exc:  # asyncpg is a dependency; a trimmed install may lack it
            raise errors.StoreError(f"postgresql history: asyncpg is missing ({exc})") from exc
        return await postgres.PostgresHistory.connect(url)
    raise ValueError(
        f"unsupported history URL {url!r}: use sqlite:///path or postgresql://user@host/db"
    )


def default_history_url(store_url: str) -> str | None:
    """Where the history goes when no URL is given: `history.db` beside an SQLite store's
    file (`<name>-history.db` if the store itself is `history.db`; `sqlite://:memory:`
    beside an in-memory one); None for etcd (replicated brokers share a history: give them
    a PostgreSQL URL)."""
    if not store_url.startswith(SQLITE_SCHEME):
        return None
    path = parse_sqlite_path(store_url)
    if path == ":memory:":
        return "sqlite://:memory:"
    folder, name = os.path.split(path)
    history_name = (
        HISTORY_FILE if name != HISTORY_FILE else f"{name.removesuffix('.db')}-history.db"
    )
    return f"{SQLITE_SCHEME}/{os.path.join(folder, history_name)}"
