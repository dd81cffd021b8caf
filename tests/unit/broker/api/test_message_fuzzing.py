"""A fuzzer for what agents send the broker: frames shaped like the real messages, with their
fields mutated (wrong types, huge and negative numbers, deep nesting, broken histograms).
Whatever arrives, decoding either yields a message the broker can use — a summary that the
planner's own checks accept — or raises one of the errors the session turns into a refusal."""

from __future__ import annotations

import json
from typing import Any

import pydantic
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.api import messages
from broker.planning import containment, snapshot
from tests.builders import make_model_summary, make_summary

H100 = "NVIDIA-H100-80GB-HBM3"
REFUSED = (pydantic.ValidationError, ValueError, RecursionError)

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def base_frames() -> list[dict[str, Any]]:
    summary = make_summary(
        "c1", make_model_summary(H100, nodes_by_free=[0] * 8 + [4], racks={"r1": [0] * 8 + [4]})
    )
    return [
        json.loads(messages.encode(m))
        for m in (
            messages.Summary(full=True, summary=summary),
            messages.Heartbeat(seq=3),
            messages.JobUpdate(job_id="j", epoch=1, state="Running"),
            messages.Accepted(job_id="j", epoch=1, pods=[]),
            messages.Rejected(job_id="j", epoch=1, reasons=["full"]),
        )
    ]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += paths(item, (*prefix, index))
    return out


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


@st.composite
def mutated_frames(draw: st.DrawFn) -> str:
    frame = draw(st.sampled_from(base_frames()))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        where = draw(st.sampled_from(paths(frame)[1:]))
        frame = replaced(frame, where, draw(junk))
    return json.dumps(frame)


@settings(max_examples=600, deadline=None)
@given(frame=mutated_frames() | st.text(max_size=200) | junk.map(json.dumps))
def test_a_frame_either_decodes_into_something_safe_or_is_refused(frame: str) -> None:
    try:
        message = messages.decode(frame)
    except REFUSED:
        assert messages.peek_type(frame) in {*messages._TYPES, "unknown"}
        return
    if isinstance(message, messages.Summary):
        for model in message.summary.models:
            capacity = snapshot.ClusterCapacity(
                name="c1",
                healthy=True,
                models={model.model: snapshot.ModelCapacity.from_summary(model)},
            )
            assert containment.check_cluster(capacity) is None
    json.loads(messages.encode(message))  # and it can be written back (logs, the store)


def test_a_frame_nested_too_deeply_is_refused() -> None:
    frame = '{"type": "heartbeat", "seq": ' + "[" * 5000 + "]" * 5000 + "}"
    try:
        messages.decode(frame)
    except REFUSED:
        return
    raise AssertionError("a 5000-deep frame decoded")
