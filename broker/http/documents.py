"""Request bodies read safely: JSON or YAML, bounded before any model sees them.

Every body the API takes (a job, a queue) comes through `read_document`: UTF-8 text, parsed
as YAML for YAML content types and as JSON otherwise, then walked once so that what the
models and the store get is bounded — nesting at most `MAX_DEPTH`, integers of at most
`MAX_INT_DIGITS` digits, strings that are valid Unicode (no lone surrogates, which could be
written to neither the store nor a log). Anything else is a 400 naming where it is; never a
500 from deep recursion, a huge integer or an unencodable string.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml

from broker.api import errors

MAX_DEPTH = 32
MAX_INT_DIGITS = 20  # int64 has 19; Kubernetes quantities and counts are far below
YAML_TYPES = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}


def _bounded_int(text: str) -> int:
    digits = text.lstrip("+-")
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse(text: str, *, yaml_body: bool) -> Any:
    if yaml_body:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise errors.Malformed(
                f"the body is not valid YAML{where}", title="Malformed YAML"
            ) from None
    try:
        return json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise errors.Malformed(
            f"the body is not valid JSON: {exc.msg} at line {exc.lineno}", title="Malformed JSON"
        ) from None


def check_tree(document: Any, *, path: str = "") -> None:
    """Raise Malformed naming the first place where `document` is out of bounds; `path`:
    where `document` is in the body (a batch's `items[3].job`), its depth counted from it.
    A place's path is spelled only when something is wrong there (a submit's dozens of keys
    and values cost a path each otherwise)."""
    # (value, its key or index, the entry of its parent, depth): a path is a chain of these
    stack: list[tuple[Any, str | int | None, tuple[Any, ...] | None, int]] = [
        (document, None, None, 0)
    ]
    while stack:
        entry = stack.pop()
        value, _, _, depth = entry
        if depth > MAX_DEPTH:
            where = _path_of(entry, path)
            raise errors.Malformed(
                f"{where or 'body'}: nested more than {MAX_DEPTH} levels deep",
                field=where or None,
                title="Body too deep",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                name = key if isinstance(key, str) else str(key)
                child = (item, name, entry, depth + 1)
                if not name.isascii():
                    _check_text(name, _path_of(child, path))
                stack.append(child)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                stack.append((item, index, entry, depth + 1))
        elif isinstance(value, str):
            if not value.isascii():
                _check_text(value, _path_of(entry, path))
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if value.bit_length() > 60 and len(str(abs(value))) > MAX_INT_DIGITS:
                where = _path_of(entry, path)
                raise errors.Malformed(
                    f"{where}: an integer of more than {MAX_INT_DIGITS} digits",
                    field=where or None,
                    title="Number too large",
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                where = _path_of(entry, path)
                raise errors.Malformed(
                    f"{where}: not a finite number", field=where or None, title="Bad number"
                )
        else:  # YAML dates, bytes, sets: not JSON, not ours
            where = _path_of(entry, path)
            raise errors.Malformed(
                f"{where}: a {type(value).__name__} is not a JSON value",
                field=where or None,
                title="Bad value",
            )


def _path_of(entry: tuple[Any, ...], root: str) -> str:
    """The path of a `check_tree` entry: `spec.tasks[0].name`, from `root` on."""
    steps: list[str | int] = []
    node: tuple[Any, ...] | None = entry
    while node is not None and node[1] is not None:
        steps.append(node[1])
        node = node[2]
    out = root
    for step in reversed(steps):
        out = f"{out}[{step}]" if isinstance(step, int) else _key_path(out, step)
    return out


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.Malformed(
            f"{path or 'body'}: not valid Unicode (a lone surrogate)",
            field=path or None,
            title="Bad string",
        ) from None


def read_document(raw: bytes, *, content_type: str, what: str, checked: bool = True) -> Any:
    """The body as a JSON value, bounded; `what` names it in messages ("a GPUJob").
    `checked=False`: the caller runs `check_tree` on the parts itself (a batch, item by item,
    so that each job is bounded as a single body would be and a fault is its item's)."""
    if not raw.strip():
        raise errors.Malformed(f"the body must be {what} in JSON or YAML", title="Empty body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.Malformed("the body is not UTF-8 text", title="Malformed body") from None
    try:
        document = _parse(text, yaml_body=content_type in YAML_TYPES)
    except RecursionError:
        raise errors.Malformed(
            f"the body is nested more than {MAX_DEPTH} levels deep", title="Body too deep"
        ) from None
    except ValueError:  # an integer too long to read
        raise errors.Malformed(
            f"the body has an integer of more than {MAX_INT_DIGITS} digits",
            title="Number too large",
        ) from None
    if checked:
        check_tree(document)
    return document
