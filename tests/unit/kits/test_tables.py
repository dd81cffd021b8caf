"""Tables given back once far emptier than they were (`kits.tables`)."""

from __future__ import annotations

import sys

import pytest

from kits import tables


@pytest.mark.parametrize("kind", [dict, set])
def test_a_drained_table_is_rebuilt_in_place_with_its_entries(kind: type) -> None:
    table = {f"job-{n}": n for n in range(100_000)} if kind is dict else {n for n in range(100_000)}
    peak = sys.getsizeof(table)
    for n in range(100_000 - 10):
        if kind is dict:
            del table[f"job-{n}"]
        else:
            table.discard(n)
    kept = dict(table) if kind is dict else set(table)
    same = table
    tables.shrink(table)
    assert table is same
    assert table == kept
    assert sys.getsizeof(table) < peak / 100


def test_a_table_near_its_size_or_small_is_left_alone() -> None:
    full = {n: n for n in range(100_000)}
    size = sys.getsizeof(full)
    tables.shrink(full)
    assert sys.getsizeof(full) == size
    small = {n: n for n in range(1000)}
    for n in range(999):
        del small[n]
    size = sys.getsizeof(small)
    tables.shrink(small)
    assert sys.getsizeof(small) == size  # under 64 KiB: not worth a rebuild


def test_deleting_entry_after_entry_rebuilds_a_few_times_only() -> None:
    table = {n: n for n in range(200_000)}
    rebuilt = 0
    for n in range(200_000):
        del table[n]
        before = sys.getsizeof(table)
        tables.shrink(table)
        rebuilt += sys.getsizeof(table) < before
    assert 1 <= rebuilt <= 4  # each rebuild waits for the table to be 8x too big again


def test_a_remembered_table_keeps_one_object_per_kind_and_starts_over_at_its_bound() -> None:
    table: dict[str, list[int]] = {}
    first = tables.remember(table, "a", [1], limit=2)
    assert tables.remember(table, "a", [1], limit=2) is first
    tables.remember(table, "b", [2], limit=2)
    again = tables.remember(table, "c", [3], limit=2)  # full: forgotten wholesale first
    assert table == {"c": again} and tables.remember(table, "a", [1], limit=2) is not first
