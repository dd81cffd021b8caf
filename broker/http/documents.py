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
    where `document` is in the body (a batch's `items[3].job`), its depth counted from it."""
    stack: list[tuple[Any, str, int]] = [(document, path, 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise errors.Malformed(
                f"{path or 'body'}: nested more than {MAX_DEPTH} levels deep",
                field=path or None,
                title="Body too deep",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                name = key if isinstance(key, str) else str(key)
                _check_text(name, f"{path}.{name}" if path else name)
                stack.append((item, f"{path}.{name}" if path else name, depth + 1))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                stack.append((item, f"{path}[{index}]", depth + 1))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if len(str(abs(value))) > MAX_INT_DIGITS:
                raise errors.Malformed(
                    f"{path}: an integer of more than {MAX_INT_DIGITS} digits",
                    field=path or None,
                    title="Number too large",
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise errors.Malformed(
                    f"{path}: not a finite number", field=path or None, title="Bad number"
                )
        else:  # YAML dates, bytes, sets: not JSON, not ours
            raise errors.Malformed(
                f"{path}: a {type(value).__name__} is not a JSON value",
                field=path or None,
                title="Bad value",
            )


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
