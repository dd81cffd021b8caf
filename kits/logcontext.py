"""The context a log line is logged in: fields bound for a block (`job_id`, `cluster`,
`cycle`), kept in a contextvar so they follow the asyncio task and the tasks it starts.

    with logcontext.bind(cycle=number):
        ...  # every line logged here, and in tasks started here, carries `cycle`

Whoever logs binds (the broker's cycle, an agent's session); the JSON formatter
(`gpufed.logs`) reads `CONTEXT` into each line. Here, not beside the formatter, because the
broker and the agent import nothing of the CLI.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

CONTEXT: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("gpufed_log_context")


@contextmanager
def bind(**fields: object) -> Iterator[None]:
    """Add `fields` to every line logged inside the block, in this task and those it starts."""
    token = CONTEXT.set({**CONTEXT.get({}), **{key: str(value) for key, value in fields.items()}})
    try:
        yield
    finally:
        CONTEXT.reset(token)


def bound() -> dict[str, str]:
    """The fields bound where this is called."""
    return CONTEXT.get({})
