"""packing: a held model's attributes in its class's one table of keys, its empty lists and
dicts the one read-only empty of their kind; the same model to read, write, copy and dump."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
from pydantic import BaseModel, Field

from broker.state import records
from kits import packing


class Held(BaseModel):
    name: str
    queue: str = "default"
    priority: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    pods: list[str] = Field(default_factory=list)
    a: int = 1
    b: int = 2
    c: int = 3
    d: int = 4
    e: int = 5
    f: int = 6


class Late(BaseModel):
    name: str
    queue: str = "default"


packing.prime(Held)
LATE = [Late(name=str(n)) for n in range(100)]  # made before its class is primed
packing.prime(Late)


def packed(**values: object) -> Held:
    model = Held.model_validate(values)
    packing.pack(model)
    return model


def test_a_packed_model_holds_its_values_in_less_and_reads_and_dumps_the_same() -> None:
    own = Held(name="a", labels={"team": "x"}, pods=["p"], priority=3)
    model = packed(name="a", labels={"team": "x"}, pods=["p"], priority=3)
    assert sys.getsizeof(model.__dict__) < sys.getsizeof(own.__dict__) / 2
    assert model == own and model.__dict__ == own.__dict__
    assert list(model.__dict__) == list(own.__dict__)  # the same order
    assert model.model_dump_json() == own.model_dump_json()
    assert model.model_dump_json(exclude_defaults=True) == own.model_dump_json(
        exclude_defaults=True
    )


def test_packed_models_change_apart() -> None:
    first, second = packed(name="a"), packed(name="b")
    second.priority = 7
    copied = first.model_copy(update={"queue": "q"})
    assert (first.priority, first.queue) == (0, "default")
    assert (second.priority, copied.queue, copied.name) == (7, "q", "a")


def test_a_class_primed_too_late_is_left_as_it_is() -> None:
    assert packing.keyed(Held) and not packing.keyed(Late)
    model = Late(name="x")
    values = model.__dict__
    packing.pack(model)
    assert model.__dict__ is values


def test_empty_lists_and_dicts_are_one_read_only_empty_and_copies_are_plain() -> None:
    first, second = packed(name="a"), packed(name="b")
    assert first.pods is second.pods is packing.EMPTY_LIST
    assert first.labels is second.labels is packing.EMPTY_DICT
    assert packed(name="c", pods=["p"]).pods == ["p"]  # a list with items is its own
    with pytest.raises(TypeError):
        first.pods.append("p")
    with pytest.raises(TypeError):
        first.labels["team"] = "x"
    assert second.pods == [] and second.labels == {}
    for plain in (
        copy.copy(first.pods),
        copy.deepcopy(first.pods),
        first.model_copy(deep=True).pods,
        pickle.loads(pickle.dumps(first)).pods,
        list(first.pods),
    ):
        plain.append("p")
        assert plain == ["p"]
    deep = first.model_copy(deep=True)
    deep.labels["team"] = "x"
    assert deep.labels == {"team": "x"} and first.labels == {}


def test_the_models_a_book_holds_are_primed_in_time() -> None:
    """The store's records module readies them when imported: were it later, a broker that
    had made a few dozen of them first would hold every job in dictionaries of its own."""
    assert all(packing.keyed(cls) for cls in records.HELD_MODELS)
