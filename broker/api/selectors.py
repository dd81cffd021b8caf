"""Label selectors as Kubernetes writes them in a query (`?labelSelector=`), read into the
requirements of `affinity` and matched on a job's `metadata.labels`. Pure.

The grammar is Kubernetes' (`k8s.io/apimachinery/pkg/labels.Parse`), comma-separated
requirements, all of which must hold:

- `key=value`, `key==value` (an `In` of one value), `key!=value` (`NotIn`: also true of a job
  without the label);
- `key in (a,b)`, `key notin (a,b)`;
- `key` (`Exists`) and `!key` (`DoesNotExist`).

Keys and values are checked as Kubernetes checks labels; the numeric `key>1` / `key<1` forms
are refused (no job label is a number the broker compares). An empty selector selects every
job. A selector that does not parse is `Malformed` naming `labelSelector`: the HTTP layer
answers 400 with no further code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NoReturn

from broker.api import affinity, errors

FIELD = "labelSelector"
MAX_SELECTOR_LENGTH = 4096
MAX_REQUIREMENTS = 32

Operator = affinity.Operator
Requirement = affinity.Requirement
Selector = tuple[affinity.Requirement, ...]

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<set>\((?P<values>[^()]*)\))      # (a, b)
      | (?P<op>==|!=|=|>|<)
      | (?P<bang>!)
      | (?P<comma>,)
      | (?P<word>[^\s,()=!<>]+)
    )""",
    re.VERBOSE,
)


def parse(text: str) -> Selector:
    """The requirements `text` states (ANDed); `Malformed` naming the first problem."""
    if len(text) > MAX_SELECTOR_LENGTH:
        _refuse(f"at most {MAX_SELECTOR_LENGTH} characters")
    tokens = _tokens(text)
    requirements: list[affinity.Requirement] = []
    index = 0
    while index < len(tokens):
        requirement, index = _requirement(tokens, index)
        requirements.append(requirement)
        if index < len(tokens):
            if tokens[index] != ("comma", ","):
                _refuse(f"expected ',' before {tokens[index][1]!r}")
            index += 1
            if index == len(tokens):
                _refuse("a requirement is missing after the last ','")
    if len(requirements) > MAX_REQUIREMENTS:
        _refuse(f"at most {MAX_REQUIREMENTS} requirements")
    return tuple(requirements)


def matches(selector: Sequence[affinity.Requirement], labels: Mapping[str, str]) -> bool:
    """Whether a job with `labels` satisfies every requirement of `selector`."""
    return all(requirement.matches(labels) for requirement in selector)


def describe(selector: Sequence[affinity.Requirement]) -> str:
    """The selector written back in the query syntax, canonical (sorted values)."""
    return ",".join(describe_one(requirement) for requirement in selector)


def describe_one(requirement: affinity.Requirement) -> str:
    """One requirement in the query syntax."""
    key, values = requirement.key, sorted(requirement.values)
    if requirement.operator is Operator.EXISTS:
        return key
    if requirement.operator is Operator.DOES_NOT_EXIST:
        return f"!{key}"
    if len(values) == 1:
        return (
            f"{key}={values[0]}" if requirement.operator is Operator.IN else f"{key}!={values[0]}"
        )
    word = "in" if requirement.operator is Operator.IN else "notin"
    return f"{key} {word} ({','.join(values)})"


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        if text[position:].isspace():
            break
        found = _TOKEN.match(text, position)
        if found is None or found.end() == position:
            _refuse(f"cannot read {text[position:].strip()[:40]!r}")
        kind = found.lastgroup
        if kind == "values":  # the inner group matched last: the set itself
            kind = "set"
        value = found.group("values") if kind == "set" else found.group(kind or "")
        tokens.append((kind or "", value))
        position = found.end()
    return tokens


def _requirement(tokens: list[tuple[str, str]], index: int) -> tuple[affinity.Requirement, int]:
    kind, value = tokens[index]
    if kind == "bang":
        key = _key(tokens, index + 1)
        return affinity.Requirement(key, Operator.DOES_NOT_EXIST), index + 2
    key = _key(tokens, index)
    index += 1
    if index == len(tokens) or tokens[index][0] == "comma":
        return affinity.Requirement(key, Operator.EXISTS), index
    kind, value = tokens[index]
    if kind == "op":
        if value in (">", "<"):
            _refuse(f"{key}{value}…: numeric comparisons are not supported")
        operator = Operator.NOT_IN if value == "!=" else Operator.IN
        after = tokens[index + 1] if index + 1 < len(tokens) else ("comma", "")
        if after[0] == "word":
            return affinity.Requirement(key, operator, frozenset({_value(after[1])})), index + 2
        if after[0] == "comma":  # `key=` : the empty value
            return affinity.Requirement(key, operator, frozenset({""})), index + 1
        _refuse(f"{key}{value}: expected a value, not {after[1]!r}")
    if kind == "word" and value in ("in", "notin"):
        operator = Operator.IN if value == "in" else Operator.NOT_IN
        if index + 1 >= len(tokens) or tokens[index + 1][0] != "set":
            _refuse(f"{key} {value}: expected a parenthesised list of values")
        values = [_value(part.strip()) for part in tokens[index + 1][1].split(",")]
        if values == [""]:
            _refuse(f"{key} {value} (): at least one value")
        return affinity.Requirement(key, operator, frozenset(values)), index + 2
    _refuse(f"after {key!r}: expected '=', '==', '!=', 'in', 'notin' or ',', not {value!r}")


def _key(tokens: list[tuple[str, str]], index: int) -> str:
    if index >= len(tokens) or tokens[index][0] != "word":
        found = tokens[index][1] if index < len(tokens) else "the end"
        _refuse(f"expected a label key, not {found!r}")
    key = tokens[index][1]
    problem = affinity.label_key_problem(key)
    if problem is not None:
        _refuse(problem)
    return key


def _value(value: str) -> str:
    problem = affinity.label_value_problem(value)
    if problem is not None:
        _refuse(problem)
    return value


def _refuse(problem: str) -> NoReturn:
    raise errors.Malformed(f"{FIELD}: {problem}", field=FIELD, title="Bad query")
