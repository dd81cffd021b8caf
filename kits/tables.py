"""Bounded tables: hash tables given back once far emptier than they were, and tables of one
object per kind that never grow past a count.

CPython never shrinks a dict or a set when entries are deleted, so a table that once held a
great many entries keeps its size for the few left. `shrink`, called where entries leave,
rebuilds a table in place (same object, so every holder keeps it) once it is at least `SLACK`
times the size a table of its entries needs and over `SMALLEST` bytes: a rebuild costs its
live entries once and comes only after many more deletions than that, so an entry's share
stays constant. `remember` keeps one object per kind (shapes, templates read alike) in a
table bounded by a count, forgotten wholesale when full.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")

SMALLEST = 64 * 1024  # bytes: tables below this are never rebuilt
SLACK = 8  # rebuilt once this many times larger than needed
BYTES_PER_ENTRY = 64  # a generous bound of a fresh dict's (about 56) or set's (about 27)


def shrink(table: dict[Any, Any] | set[Any]) -> None:
    """Rebuild `table` in place if it is oversized for its entries (see the docstring)."""
    size = sys.getsizeof(table)
    if size <= SMALLEST or size <= SLACK * BYTES_PER_ENTRY * (len(table) + 16):
        return
    kept = list(table.items()) if isinstance(table, dict) else list(table)
    table.clear()
    table.update(kept)  # a dict takes back its pairs, a set its members


def remember(table: dict[K, V], key: K, value: V, *, limit: int) -> V:
    """`table[key]` if it is there, else `value`, put there: a table of one object per kind
    (shapes, templates read alike), forgotten wholesale past `limit` kinds (a bound, never a
    leak: the objects live on with whatever holds them)."""
    found = table.get(key)
    if found is not None:
        return found
    if len(table) >= limit:
        table.clear()
    table[key] = value
    return value
