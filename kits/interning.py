"""One object per kind, for the validated jobs a holder keeps. Pure, no I/O.

Jobs of one sweep (10,000 jobs of one template) read alike: the same pod template, the
same pod shape, the same tasks. A holder (the broker's job book, an agent's session) makes
one `Interners` and hands it to what validates its jobs, so they share one object of each
kind instead of holding copies. Each table is bounded by a count and forgotten wholesale when
full: a bound, never a leak (the objects live on with the jobs that hold them), and a kind
forgotten only costs a copy.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel

from kits import packing, tables

MAX_KINDS = 4096


class Settled(Protocol):
    """A template as a validated job holds it: its JSON, and whether a submit's rules
    checked it."""

    @property
    def json(self) -> str: ...

    @property
    def checked(self) -> bool: ...


T = TypeVar("T", bound=Settled)
S = TypeVar("S", bound=Hashable)
G = TypeVar("G", bound=Hashable)


class Interners(Generic[T, S, G]):
    """Templates (`T`, by their JSON), shapes (`S`) and gangs' tasks (`G`), one object of
    each kind."""

    def __init__(self, *, limit: int = MAX_KINDS) -> None:
        self._limit = limit
        self._templates: dict[str, T] = {}
        self._shapes: dict[S, S] = {}
        self._tasks: dict[G, G] = {}
        self._fields: dict[type[BaseModel], set[str]] = {}
        self._names: dict[str, str] = {}

    def template(self, text: str) -> T | None:
        """The template kept for this JSON, if any."""
        return self._templates.get(text)

    def keep(self, template: T) -> T:
        """The template to hold for `template`'s JSON: the one kept, unless `template` was
        checked by a submit's rules and it was not (then `template`, kept from now on)."""
        known = self._templates.get(template.json)
        if known is not None and (known.checked or not template.checked):
            return known
        if known is None and len(self._templates) >= self._limit:
            self._templates.clear()
        self._templates[template.json] = template
        return template

    def shape(self, shape: S) -> S:
        return tables.remember(self._shapes, shape, shape, limit=self._limit)

    def tasks(self, tasks: G) -> G:
        return tables.remember(self._tasks, tasks, tasks, limit=self._limit)

    def name(self, text: str) -> str:
        """One string object for every equal `text` (a queue's, a namespace's name)."""
        return tables.remember(self._names, text, text, limit=self._limit)

    def fields(self, model: BaseModel) -> None:
        """Let `model` hold its class's one set of every field name as the set of fields it
        was given (pydantic keeps a set of its own in every instance). With every name in
        it, an assignment adds nothing to it, so no model changes another's; a copy
        (`model_copy`) takes a set of its own. What changes: `exclude_unset` leaves nothing
        out of such a model, so it is for models never dumped that way (a held job's)."""
        cls = type(model)
        names = self._fields.get(cls)
        if names is None:
            names = self._fields[cls] = set(cls.model_fields)
        object.__setattr__(model, "__pydantic_fields_set__", names)

    def pack(self, model: BaseModel) -> None:
        """Let `model` keep its attributes in its class's one table of keys
        (`packing.pack`: the same keys, values and order)."""
        packing.pack(model)
