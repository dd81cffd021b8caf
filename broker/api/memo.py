"""A value computed once per live object, forgotten with the object. Pure, no I/O.

A job's spec never changes after submit, and one spec object is shared by every draft of its
record (`jobs.book.draft_of`): what is read off it (its gang's shapes, its stored JSON) can be
read once, not at every commit and every cycle. Keyed by identity, held through a weak
reference: a spec that goes out of the book takes its values with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V")


class PerObject(Generic[T, V]):
    """`get(obj, compute)`: `compute(obj)` the first time, the same value after, while `obj`
    lives. For objects that are not changed once made (the caller's promise)."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref[T], V]] = {}

    def get(self, obj: T, compute: Callable[[T], V]) -> V:
        key = id(obj)
        known = self._values.get(key)
        if known is not None and known[0]() is obj:
            return known[1]
        value = compute(obj)
        self._values[key] = (weakref.ref(obj, self._dropper(key)), value)
        return value

    def _dropper(self, key: int) -> Callable[[weakref.ref[T]], None]:
        def drop(_: weakref.ref[T]) -> None:
            self._drop(key)

        return drop

    def _drop(self, key: int) -> None:
        known = self._values.get(key)
        if known is not None and known[0]() is None:
            del self._values[key]

    def __len__(self) -> int:
        return len(self._values)
