"""A value computed once per live object, forgotten with the object. Pure, no I/O.

For objects not changed once made (a job's spec after submit, shared by every draft of its
record): what is read off one (its gang, its stored JSON) can be read once, not at every
commit and every cycle. Keyed by identity, held through a weak reference: an object that
goes away takes its values with it. Whoever reads makes its own `PerObject` and keeps it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from kits import tables

T = TypeVar("T")
V = TypeVar("V")


class _Ref(weakref.ref[T]):
    """A weak reference that knows its key (no closure per entry: one is held per live
    object)."""

    __slots__ = ("key",)
    key: int


class PerObject(Generic[T, V]):
    """`get(obj, compute)`: `compute(obj)` the first time, the same value after, while `obj`
    lives; `peek` and `put` for a value the caller checks itself. For objects that are not
    changed once made (the caller's promise)."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[_Ref[T], V]] = {}

    def get(self, obj: T, compute: Callable[[T], V]) -> V:
        known = self._values.get(id(obj))
        if known is not None and known[0]() is obj:
            return known[1]
        value = compute(obj)
        self.put(obj, value)
        return value

    def peek(self, obj: T) -> V | None:
        known = self._values.get(id(obj))
        return known[1] if known is not None and known[0]() is obj else None

    def put(self, obj: T, value: V) -> None:
        key = id(obj)
        known = self._values.get(key)
        if known is not None and known[0]() is obj:
            self._values[key] = (known[0], value)
            return
        ref = _Ref(obj, self._drop)
        ref.key = key
        self._values[key] = (ref, value)

    def _drop(self, ref: _Ref[T]) -> None:
        known = self._values.get(ref.key)
        if known is not None and known[0] is ref:  # not a newer object's entry
            del self._values[ref.key]
            tables.shrink(self._values)

    def __len__(self) -> int:
        return len(self._values)
