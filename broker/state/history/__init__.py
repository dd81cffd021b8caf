"""The history of finished jobs: a store of its own, fit for millions of records.

The hot store (etcd or SQLite, `broker.state.store`) holds live jobs and recently finished
ones; older finished jobs move here and are pruned after a retention window
(docs/design/history.md).

- `query.py` — what a list asks for (`JobQuery`: tenant, queue, state, cluster, a label
  selector, a finished-time window, a text in the name or id), the order (newest first, or
  oldest) and the opaque continue token
  (`Cursor`: the last sort key, so pages are stable while jobs are added);
- `protocol.py` — the `HistoryStore` protocol and the row a record is stored as;
- `sql.py` — the schema and the page query, one builder for both SQL dialects;
- `sqlite.py` — `SqliteHistory`, the embedded default (its own file beside the broker's);
- `postgres.py` — `PostgresHistory` (asyncpg), for replicated brokers;
- `listing.py` — one page over the live jobs and the history together (`GET /v1/jobs`).

Both stores pass one conformance suite (`tests/integration/test_history_conformance.py`);
`broker.state.opening.open_history` opens the one a URL names.
"""
