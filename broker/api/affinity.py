"""Which nodes a pod may run on: `nodeSelector` and required node affinity, read as Kubernetes
reads them and matched by both schedulers. Pure.

`read_pod_spec` turns a pod spec's `nodeSelector` and
`affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution` into one `NodeSelector`:
its terms are ORed, the requirements inside a term ANDed, and every `nodeSelector` entry is
ANDed into every term (a pod must satisfy both). Called by `jobs.shape_of`, so the selector
travels in the `PodShape` to the broker's planner and to the agent's placement:

- the agent matches it exactly on a node's labels and name (`NodeSelector.matches`), with the
  semantics of Kubernetes (`In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`, `Lt`; `matchFields`
  on `metadata.name`);
- the broker knows only the GPU models of a cluster (the `nvidia.com/gpu.product` values), so
  it asks `NodeSelector.admits_model`: could a node of this model match, taking every
  requirement on another label as satisfiable? It excludes no cluster for a label it cannot
  see; the agent then decides exactly.

The reading also lists what Kubernetes would refuse the pod for (`Reading.problems`: an
unknown operator, `In`/`NotIn` without values, values on `Exists`/`DoesNotExist`, `Gt`/`Lt`
without exactly one integer, a key that is not a label key, no term at all), and one thing it
would accept but that can never run: terms that are all empty. A submit refuses the job on
the first problem (422 naming the field). A job stored before these checks is still read: the
term holding a bad requirement matches no node, as Kubernetes' own matcher treats a term it
cannot parse, so the job waits with a reason instead of breaking anything.

Preferred node affinity (`preferredDuringSchedulingIgnoredDuringExecution`) is checked like
Kubernetes checks it and otherwise ignored: a preference never rules a node out, and gpufed's
scoring does not weigh it. Pod affinity and anti-affinity are not evaluated: their required
terms are refused (a rule gpufed would silently break), their preferred terms ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
NODE_NAME_FIELD = "metadata.name"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
INT64 = 2**63

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_INTEGER = re.compile(r"^[+-]?[0-9]{1,19}$")


class Operator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


OPERATORS = ", ".join(op.value for op in Operator)
_OPERATOR_NAMES = frozenset(op.value for op in Operator)


@dataclass(frozen=True, slots=True)
class Requirement:
    """One `matchExpressions` (or `matchFields`, `field=True`) entry, or a `nodeSelector` pair
    (an `In` of one value)."""

    key: str
    operator: Operator
    values: frozenset[str] = frozenset()
    number: int = 0  # the value of Gt and Lt
    field: bool = False  # `key` is a node field (metadata.name), not a label

    def matches(self, labels: Mapping[str, str], name: str = "") -> bool:
        value = name if self.field else labels.get(self.key)
        operator = self.operator
        if operator is Operator.IN:
            return value is not None and value in self.values
        if operator is Operator.NOT_IN:
            return value is None or value not in self.values
        if operator is Operator.EXISTS:
            return value is not None
        if operator is Operator.DOES_NOT_EXIST:
            return value is None
        number = parse_integer(value)
        if number is None:
            return False  # Kubernetes: a label that is not an integer neither Gt nor Lt
        return number > self.number if operator is Operator.GT else number < self.number

    @property
    def on_product(self) -> bool:
        """Whether this is about the GPU model label."""
        return not self.field and self.key == GPU_PRODUCT_LABEL

    def may_match_model(self, model: str) -> bool:
        """Whether a GPU node of `model` could satisfy this: exact on the product label, true
        for any other label or field (unknown to the broker)."""
        if not self.on_product:
            return True
        return self.matches({GPU_PRODUCT_LABEL: model} if model else {})

    def describe(self) -> str:
        key = f"field {self.key}" if self.field else self.key
        if self.operator in (Operator.EXISTS, Operator.DOES_NOT_EXIST):
            return f"{key} {self.operator}"
        if self.operator in (Operator.GT, Operator.LT):
            return f"{key} {self.operator} {self.number}"
        return f"{key} {self.operator} [{', '.join(sorted(self.values))}]"


Term = tuple[Requirement, ...]


@dataclass(frozen=True, slots=True)
class NodeSelector:
    """The nodes a pod may use: any term whose every requirement holds. No term: no node."""

    terms: tuple[Term, ...]

    def matches(self, labels: Mapping[str, str], name: str = "") -> bool:
        for term in self.terms:  # loops, not any(all(...)): this runs once per candidate node
            for requirement in term:
                if not requirement.matches(labels, name):
                    break
            else:
                return True
        return False

    def admits_model(self, model: str) -> bool:
        """Whether some node of GPU model `model` could match (permissive beyond the model)."""
        return any(all(r.may_match_model(model) for r in term) for term in self.terms)

    def models(self) -> tuple[str, ...]:
        """The product label values every match must have, when each term pins them with `In`
        (sorted); () when some term allows a model it does not name."""
        allowed: set[str] = set()
        for term in self.terms:
            pinned: frozenset[str] | None = None
            for requirement in term:
                if requirement.operator is Operator.IN and requirement.on_product:
                    values = requirement.values
                    pinned = values if pinned is None else pinned & values
            if pinned is None:
                return ()
            allowed.update(m for m in pinned if all(r.may_match_model(m) for r in term))
        return tuple(sorted(allowed))

    def only_models(self) -> bool:
        """True when the selector says nothing but "the product label is one of `models()`"."""
        return bool(self.models()) and all(
            r.on_product and r.operator is Operator.IN for term in self.terms for r in term
        )

    def describe(self) -> str:
        if not self.terms:
            return "no node (no term can match)"
        return " or ".join(" and ".join(r.describe() for r in term) for term in self.terms)


@dataclass(frozen=True)
class Problem:
    """What Kubernetes would refuse in the pod spec: `path` relative to the pod spec."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class Reading:
    selector: NodeSelector | None  # None: every node
    problems: tuple[Problem, ...]


def parse_integer(value: str | None) -> int | None:
    """A label value as Kubernetes' Gt/Lt read it (a 64-bit decimal integer), else None."""
    if value is None or not _INTEGER.match(value):
        return None
    number = int(value)
    return number if -INT64 <= number < INT64 else None


def label_key_problem(key: object) -> str | None:
    """Why `key` is not a Kubernetes label (or annotation) key, or None when it is one."""
    if not isinstance(key, str):
        return "must be a string"
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"{key!r} is not a label key: its prefix is not a DNS subdomain (at most 253)"
    if len(name) > 63 or not _NAME_PART.match(name):
        return (
            f"{key!r} is not a label key (at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit, after an optional DNS prefix and '/')"
        )
    return None


def label_value_problem(value: object) -> str | None:
    """Why `value` is not a Kubernetes label value, or None when it is one."""
    if not isinstance(value, str):
        return "must be a string"
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return (
            f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit, or empty)"
        )
    return None


def labels_problem(labels: Mapping[Any, Any]) -> tuple[Any, Any, str] | None:
    """The first entry of `labels` that is not a Kubernetes label, as (key, value, why), or
    None when every one is."""
    for key, value in labels.items():
        problem = label_key_problem(key) or label_value_problem(value)
        if problem is not None:
            return key, value, problem
    return None


class _Reader:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def complain(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def requirement(self, raw: object, path: str, *, field: bool) -> Requirement | None:
        """One requirement, or None (and a problem) when Kubernetes would refuse it."""
        if not isinstance(raw, Mapping):
            self.complain(path, "must be an object with key, operator and values")
            return None
        unknown = sorted(str(k) for k in raw if k not in ("key", "operator", "values"))
        if unknown:
            self.complain(f"{path}.{unknown[0]}", "unknown field")
            return None
        key, operator, values = raw.get("key"), raw.get("operator"), raw.get("values")
        if field:
            if key != NODE_NAME_FIELD:
                message = f"{key!r} is not {NODE_NAME_FIELD}, the one node field"
                self.complain(f"{path}.key", message)
                return None
        else:
            problem = label_key_problem(key)
            if problem is not None:
                self.complain(f"{path}.key", problem)
                return None
        key = str(key)
        if not isinstance(operator, str) or operator not in _OPERATOR_NAMES:
            self.complain(f"{path}.operator", f"{operator!r} is not supported: one of {OPERATORS}")
            return None
        op = Operator(operator)
        if values is None:
            values = []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            self.complain(f"{path}.values", "must be a list of strings")
            return None
        if field and (op not in (Operator.IN, Operator.NOT_IN) or len(values) != 1):
            self.complain(
                f"{path}.operator" if len(values) == 1 else f"{path}.values",
                "a node field selector takes In or NotIn and exactly one value",
            )
            return None
        if op in (Operator.IN, Operator.NOT_IN):
            if not values:
                self.complain(f"{path}.values", f"must be specified when operator is {op}")
                return None
            return Requirement(key, op, frozenset(values), field=field)
        if op in (Operator.EXISTS, Operator.DOES_NOT_EXIST):
            if values:
                self.complain(f"{path}.values", f"may not be specified when operator is {op}")
                return None
            return Requirement(key, op)
        if len(values) != 1:
            self.complain(f"{path}.values", f"{op} takes exactly one value, an integer")
            return None
        number = parse_integer(values[0])
        if number is None:
            self.complain(f"{path}.values[0]", f"{op} compares integers, {values[0]!r} is not one")
            return None
        return Requirement(key, op, number=number)

    def term(self, raw: object, path: str) -> Term | None:
        """A term's requirements, or None when the term can never match (bad or empty)."""
        if not isinstance(raw, Mapping):
            self.complain(path, "must be an object with matchExpressions or matchFields")
            return None
        unknown = sorted(str(k) for k in raw if k not in ("matchExpressions", "matchFields"))
        if unknown:
            self.complain(f"{path}.{unknown[0]}", "unknown field")
            return None
        requirements: list[Requirement] = []
        valid = True
        for name, field in (("matchExpressions", False), ("matchFields", True)):
            items = raw.get(name)
            if items is None:
                continue
            if not isinstance(items, list):
                self.complain(f"{path}.{name}", "must be a list")
                valid = False
                continue
            for index, item in enumerate(items):
                found = self.requirement(item, f"{path}.{name}[{index}]", field=field)
                if found is None:
                    valid = False
                else:
                    requirements.append(found)
        if not valid or not requirements:
            return None  # Kubernetes: an empty term, or one it cannot parse, matches no node
        return tuple(requirements)

    def required(self, raw: object, path: str) -> tuple[Term, ...]:
        if not isinstance(raw, Mapping):
            self.complain(path, "must be an object with nodeSelectorTerms")
            return ()
        unknown = sorted(str(k) for k in raw if k != "nodeSelectorTerms")
        if unknown:
            self.complain(f"{path}.{unknown[0]}", "unknown field")
        raw_terms = raw.get("nodeSelectorTerms")
        if not isinstance(raw_terms, list) or not raw_terms:
            self.complain(f"{path}.nodeSelectorTerms", "must have at least one node selector term")
            return ()
        terms = []
        for index, item in enumerate(raw_terms):
            found = self.term(item, f"{path}.nodeSelectorTerms[{index}]")
            if found is not None:
                terms.append(found)
        if not terms and not self.problems:
            self.complain(
                f"{path}.nodeSelectorTerms",
                "every term is empty: no node can match (give matchExpressions or matchFields)",
            )
        return tuple(terms)

    def preferred(self, raw: object, path: str) -> None:
        """Checked like Kubernetes checks it; a preference never narrows the nodes."""
        if not isinstance(raw, list):
            self.complain(path, "must be a list of {weight, preference}")
            return
        for index, item in enumerate(raw):
            where = f"{path}[{index}]"
            if not isinstance(item, Mapping):
                self.complain(where, "must be an object with weight and preference")
                continue
            unknown = sorted(str(k) for k in item if k not in ("weight", "preference"))
            if unknown:
                self.complain(f"{where}.{unknown[0]}", "unknown field")
            weight = item.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
                self.complain(f"{where}.weight", "must be a whole number from 1 to 100")
            self.term(item.get("preference"), f"{where}.preference")

    def node_affinity(self, raw: object, path: str) -> tuple[Term, ...] | None:
        """The required terms (None: no requirement)."""
        if not isinstance(raw, Mapping):
            self.complain(path, "must be an object")
            return ()
        unknown = sorted(str(k) for k in raw if k not in (REQUIRED, PREFERRED))
        if unknown:
            self.complain(f"{path}.{unknown[0]}", "unknown field")
        if raw.get(PREFERRED) is not None:
            self.preferred(raw[PREFERRED], f"{path}.{PREFERRED}")
        if raw.get(REQUIRED) is None:
            return None
        return self.required(raw[REQUIRED], f"{path}.{REQUIRED}")

    def pod_affinity(self, raw: object, path: str) -> None:
        if not isinstance(raw, Mapping):
            self.complain(path, "must be an object")
            return
        if raw.get(REQUIRED):
            self.complain(
                f"{path}.{REQUIRED}",
                "is not supported: gpufed places pods itself and does not evaluate pod "
                "(anti-)affinity; use topology (rack, nvlink) for where a gang's pods go",
            )


def read_pod_spec(node_selector: Mapping[str, Any], affinity: object) -> Reading:
    """The selector of a pod spec's `nodeSelector` and `affinity`, and what Kubernetes would
    refuse in them (paths relative to the pod spec)."""
    reader = _Reader()
    pairs: list[Requirement] = []
    for key, value in sorted(node_selector.items()):
        problem = label_key_problem(key)
        if problem is None:
            problem = label_value_problem(value)
        if problem is not None:
            reader.complain(f"nodeSelector[{key}]", problem)
        # kept even then (a stored job): it matches the label literally, as it always did
        pairs.append(Requirement(str(key), Operator.IN, frozenset({str(value)})))
    required: tuple[Term, ...] | None = None
    if affinity is not None:
        if not isinstance(affinity, Mapping):
            reader.complain("affinity", "must be an object")
            required = ()
        else:
            if affinity.get("nodeAffinity") is not None:
                required = reader.node_affinity(affinity["nodeAffinity"], "affinity.nodeAffinity")
            for kind in ("podAffinity", "podAntiAffinity"):
                if affinity.get(kind) is not None:
                    reader.pod_affinity(affinity[kind], f"affinity.{kind}")
    problems = tuple(reader.problems)
    if required is None:
        if not pairs:
            return Reading(None, problems)
        return Reading(NodeSelector((tuple(pairs),)), problems)
    return Reading(NodeSelector(tuple(tuple(pairs) + term for term in required)), problems)
