"""Open the store a URL names: the broker's `--store` setting.

- `sqlite:///relative/path.db`, `sqlite:////absolute/path.db` (SQLAlchemy's convention:
  what follows `sqlite:///` is the path) and `sqlite://:memory:`;
- `etcd://host:port[,host:port...]`: the first endpoint that answers (IPv6 as `[::1]:2379`;
  the port defaults to 2379).
"""

from __future__ import annotations

from broker.state import etcd, sqlite, store

SQLITE_SCHEME = "sqlite://"
ETCD_SCHEME = "etcd://"
ETCD_DEFAULT_PORT = 2379


async def open_store(url: str, *, read_only: bool = False) -> store.DurableStore:
    """The store `url` names, opened; ValueError naming the URL if it names none.

    `read_only` (the admin commands): an SQLite file is read without being locked, beside a
    running broker, and never created; etcd is opened as always (the caller only reads).
    """
    if url.startswith(SQLITE_SCHEME):
        return await sqlite.SqliteStore.open(parse_sqlite_path(url), read_only=read_only)
    if url.startswith(ETCD_SCHEME):
        return await etcd.EtcdStore.connect(parse_etcd_endpoints(url))
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
