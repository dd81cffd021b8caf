"""A held model's attributes in its class's one table of keys. Pure, no I/O.

CPython keeps a plain object's attributes in a dictionary that shares its keys with the other
instances of its class (PEP 412): each object holds only its values. pydantic instead gives
every model a dictionary of its own, built key by key, with a table of keys sized for growth;
for a model of ten or more fields that is most of what the model weighs. A holder of many
models (the broker's book holds every live job) hands each one it keeps to `pack`, which puts
the same keys and values, in the same order, into a dictionary of the shared kind: the model
reads, writes, copies and dumps as before, only where its values are kept changes. An empty
list or dictionary among the values (a queued job's pods, a job's labels) becomes the one
read-only empty of its kind (`EMPTY_LIST`, `EMPTY_DICT`): a held model is never changed in
place (a copy of such an empty is a plain one), and one that would be raises TypeError.

A class's table takes its keys from the first instances given attributes one by one, and
CPython stops adding keys to it after a few dozen instances of the class were made, however
they were made (each new instance is given room for one fewer key still to come, down to
one). So a class is readied (`prime`) before it has many instances: when the module that
holds its models is imported. `pack` leaves the models of a class not readied as they are.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn, get_origin

from pydantic import BaseModel

SETTLE = 64  # blank instances that leave a table no room for keys to come (CPython: ~30)


class _Keyed:
    """A class readied: an empty dictionary of the shared kind with every field (copied for
    each model packed: a copy of one is of the same kind), and the fields that hold a list
    or a dict."""

    __slots__ = ("blank", "containers")

    def __init__(self, blank: dict[str, Any], containers: tuple[str, ...]) -> None:
        self.blank = blank
        self.containers = containers


_KEYED: dict[type[BaseModel], _Keyed] = {}


def prime(*classes: type[BaseModel]) -> None:
    """Put each class's field names in its table of keys, in order, if it still takes them;
    `pack` packs the models of those that did (`keyed`). Then a few dozen blank instances,
    so that instances from now on are given room for their fields and no more."""
    for cls in classes:
        first = cls.__new__(cls)
        for name in cls.model_fields:
            object.__setattr__(first, name, None)
        for _ in range(SETTLE):
            cls.__new__(cls)
        blank = cls.__new__(cls).__dict__  # empty, of the shared kind if the table took them
        for name in cls.model_fields:
            blank[name] = None
        if sys.getsizeof(blank) < sys.getsizeof(dict(blank)):  # the shared kind is smaller
            containers = tuple(
                name
                for name, field in cls.model_fields.items()
                if get_origin(field.annotation) in (list, dict) or field.annotation in (list, dict)
            )
            _KEYED[cls] = _Keyed(blank, containers)


def keyed(cls: type[BaseModel]) -> bool:
    """Whether the models of `cls` are packed (`prime` came in time)."""
    return cls in _KEYED


def pack(model: BaseModel) -> None:
    """Hold `model`'s attributes in a dictionary that shares its class's keys (see the
    module's docstring): the same keys, values and order. Models of a class not `keyed`
    are left as they are, and so is a model without every field in its dictionary."""
    keyed = _KEYED.get(type(model))
    own = model.__dict__
    if keyed is None or len(own) != len(keyed.blank):
        return
    values = keyed.blank.copy()
    values.update(own)
    for name in keyed.containers:
        empty = _EMPTIES.get(type(values[name]))  # a plain list or dict, if it is one
        if empty is not None and not values[name]:
            values[name] = empty
    object.__setattr__(model, "__dict__", values)


def _refuse(self: object, *args: object, **kwargs: object) -> NoReturn:
    raise TypeError("a held model's empty list or dict is shared by many: change a copy")


class _EmptyList(list[Any]):
    """The one empty list of packed models: read-only; a copy of it is a plain list."""

    __slots__ = ()
    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __copy__(self) -> list[Any]:
        return []

    def __deepcopy__(self, memo: dict[int, object]) -> list[Any]:
        return []

    def __reduce_ex__(self, protocol: Any) -> tuple[type[list[Any]], tuple[()]]:
        return list, ()


class _EmptyDict(dict[Any, Any]):
    """The one empty dictionary of packed models: read-only; a copy of it is a plain dict."""

    __slots__ = ()
    clear = pop = popitem = setdefault = update = _refuse
    __setitem__ = __delitem__ = __ior__ = _refuse

    def __copy__(self) -> dict[Any, Any]:
        return {}

    def __deepcopy__(self, memo: dict[int, object]) -> dict[Any, Any]:
        return {}

    def __reduce_ex__(self, protocol: Any) -> tuple[type[dict[Any, Any]], tuple[()]]:
        return dict, ()


EMPTY_LIST: list[Any] = _EmptyList()
EMPTY_DICT: dict[Any, Any] = _EmptyDict()
_EMPTIES: dict[type, Any] = {list: EMPTY_LIST, dict: EMPTY_DICT}
