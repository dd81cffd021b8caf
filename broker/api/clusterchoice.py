"""Which member clusters a job may run on and which it would rather: `spec.clusters`, matched
on the labels each agent reports for its cluster (`gpufed agent --cluster-label`). Pure.

- `selector` (`matchLabels`, `matchExpressions` with Kubernetes' operators `In`, `NotIn`,
  `Exists`, `DoesNotExist`, all ANDed, as a Kubernetes `LabelSelector`): the clusters the job
  may use at all; the others are excluded (`why`: "excluded by spec.clusters"). Absent or
  empty: every cluster.
- `preferred` (`{weight, selector}` items, weights 1 to 100): the weights of the items a
  cluster matches add to its score; among the clusters where the job fits, the highest score
  wins, before the planner's own tie-breaks (tightest fit, busiest cluster, name).
- `order` (cluster names): ordered spill-over. Among the clusters where the job fits, the
  first in `order` wins, whatever the score; clusters it does not name come after, by score.
  `order` does not exclude a cluster: a `selector` does.

Two readings, as for the rest of `GPUJob` (`jobs`, `policies`): a submit holds every rule and
names the field (`spec.clusters.selector.matchExpressions[0].operator`); a stored record is
read leniently (an operator this version does not know matches no cluster, a weight out of
range is clamped), so a job accepted by another version always loads and waits with a
reason. The planner reads `Choice`, a frozen value (`choice_of`), never the model: the
selection (`Choice.allows`) and the score (`Choice.rank`) are pure functions the broker's
planner and the simulator share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from broker.api import affinity, policies

MAX_REQUIREMENTS = 32
MAX_VALUES = 64
MAX_PREFERRED = 16
MAX_ORDER = 64
MAX_WEIGHT = 100
SELECTOR_OPERATORS = (
    affinity.Operator.IN,
    affinity.Operator.NOT_IN,
    affinity.Operator.EXISTS,
    affinity.Operator.DOES_NOT_EXIST,
)
_OPERATOR_NAMES = frozenset(op.value for op in SELECTOR_OPERATORS)
_NEEDS_VALUES = frozenset({affinity.Operator.IN.value, affinity.Operator.NOT_IN.value})
# what a stored requirement this version cannot read becomes: it matches no cluster
_NOTHING = affinity.Requirement("(a requirement it cannot read)", affinity.Operator.IN, frozenset())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SelectorRequirement(_Strict):
    """One `matchExpressions` entry, as in a Kubernetes LabelSelector."""

    key: str = Field(max_length=317, description="a cluster label key")
    operator: str = Field(description="In, NotIn, Exists or DoesNotExist")
    values: list[str] = Field(
        default_factory=list,
        validate_default=True,  # In without values is refused at submit
        max_length=MAX_VALUES,
        description="In and NotIn: at least one value; Exists and DoesNotExist: none",
    )

    @field_validator("key")
    @classmethod
    def _key(cls, value: str, info: ValidationInfo) -> str:
        problem = affinity.label_key_problem(value) if policies.at_submit(info) else None
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("operator")
    @classmethod
    def _operator(cls, value: str, info: ValidationInfo) -> str:
        if policies.at_submit(info) and value not in _OPERATOR_NAMES:
            raise ValueError(
                f"{value!r} is not an operator of a label selector: In, NotIn, Exists or "
                "DoesNotExist"
            )
        return value

    @field_validator("values")
    @classmethod
    def _values(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if not policies.at_submit(info):
            return value
        operator = info.data.get("operator")
        if operator in _NEEDS_VALUES and not value:
            raise ValueError(f"{operator} needs at least one value")
        if operator in _OPERATOR_NAMES and operator not in _NEEDS_VALUES and value:
            raise ValueError(f"{operator} takes no values")
        for index, item in enumerate(value):
            problem = affinity.label_value_problem(item)
            if problem is not None:
                raise ValueError(f"[{index}]: {problem}")
        return value

    def requirement(self) -> affinity.Requirement:
        """The requirement as the matcher reads it; one that matches no cluster when the
        operator is unknown (a stored record) or values are missing."""
        if self.operator not in _OPERATOR_NAMES:
            return _NOTHING
        operator = affinity.Operator(self.operator)
        if operator.value in _NEEDS_VALUES:
            if not self.values:
                return _NOTHING
            return affinity.Requirement(self.key, operator, frozenset(self.values))
        return affinity.Requirement(self.key, operator)


class LabelSelector(_Strict):
    """A Kubernetes LabelSelector over cluster labels: every entry must hold."""

    match_labels: dict[str, str] = Field(
        default_factory=dict,
        alias="matchLabels",
        max_length=MAX_REQUIREMENTS,
        description="labels the cluster must have, with these values",
    )
    match_expressions: list[SelectorRequirement] = Field(
        default_factory=list,
        alias="matchExpressions",
        max_length=MAX_REQUIREMENTS,
        description="requirements on the cluster's labels (In, NotIn, Exists, DoesNotExist)",
    )

    @field_validator("match_labels")
    @classmethod
    def _labels(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if policies.at_submit(info) and (found := affinity.labels_problem(value)) is not None:
            raise ValueError(found[2])
        return value

    def requirements(self) -> tuple[affinity.Requirement, ...]:
        pairs = tuple(
            affinity.Requirement(key, affinity.Operator.IN, frozenset({value}))
            for key, value in sorted(self.match_labels.items())
        )
        return pairs + tuple(item.requirement() for item in self.match_expressions)


class PreferredClusters(_Strict):
    weight: Annotated[
        int,
        Field(ge=1, le=MAX_WEIGHT, description="added to the score of a cluster it selects"),
    ]
    selector: LabelSelector

    @field_validator("weight", mode="before")
    @classmethod
    def _weight(cls, value: object, info: ValidationInfo) -> object:
        return policies.lenient_int(value, info, low=1, high=MAX_WEIGHT, default=1)


class ClusterChoice(_Strict):
    """`spec.clusters`: which member clusters the job may use, and in what preference."""

    selector: LabelSelector | None = Field(
        None,
        description="the clusters the job may run on, by their labels; absent: every cluster",
    )
    preferred: list[PreferredClusters] = Field(
        default_factory=list,
        max_length=MAX_PREFERRED,
        description="weights added to the score of the clusters each selector matches; the "
        "highest score among the clusters where the job fits wins",
    )
    order: list[str] = Field(
        default_factory=list,
        max_length=MAX_ORDER,
        description="cluster names, for ordered spill-over: the first where the job fits "
        "wins over any score; clusters not named come after, by score",
    )

    @field_validator("order")
    @classmethod
    def _order(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if not policies.at_submit(info):
            return value
        for index, name in enumerate(value):
            if not _is_cluster_name(name):
                raise ValueError(f"[{index}]: {name!r} is not a cluster name (a DNS label)")
        if len(set(value)) != len(value):
            raise ValueError("cluster names must be unique")
        return value


def _is_cluster_name(name: str) -> bool:
    return 0 < len(name) <= 63 and affinity.label_value_problem(name) is None and name.islower()


@dataclass(frozen=True)
class Choice:
    """`spec.clusters` as the planner reads it: hashable, so alike jobs share verdicts."""

    selector: tuple[affinity.Requirement, ...] = ()
    preferred: tuple[tuple[int, tuple[affinity.Requirement, ...]], ...] = ()
    order: tuple[str, ...] = ()

    def allows(self, labels: Mapping[str, str]) -> bool:
        """Whether a cluster with `labels` is one the job may run on."""
        return all(requirement.matches(labels) for requirement in self.selector)

    def score(self, labels: Mapping[str, str]) -> int:
        """The weights of the `preferred` items a cluster with `labels` matches."""
        return sum(
            weight
            for weight, selector in self.preferred
            if all(requirement.matches(labels) for requirement in selector)
        )

    def rank(self, name: str, labels: Mapping[str, str]) -> tuple[int, int]:
        """Lower is better: its place in `order` (after every named cluster when not
        named), then its score, negated."""
        try:
            position = self.order.index(name)
        except ValueError:
            position = len(self.order)
        return (position, -self.score(labels))

    def describe_exclusion(self, labels: Mapping[str, str]) -> str:
        """Why a cluster with `labels` is excluded, for `why`."""
        failed = [r.describe() for r in self.selector if not r.matches(labels)]
        shown = ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"
        return (
            f"excluded by spec.clusters: the selector's {'; '.join(failed)} does not hold "
            f"for its labels ({shown})"
        )


def choice_of(clusters: ClusterChoice | None) -> Choice | None:
    """The planner's `Choice` of a job's `spec.clusters`; None when it says nothing."""
    if clusters is None:
        return None
    selector = clusters.selector.requirements() if clusters.selector is not None else ()
    preferred = tuple((p.weight, p.selector.requirements()) for p in clusters.preferred)
    if not selector and not preferred and not clusters.order:
        return None
    return Choice(selector, preferred, tuple(clusters.order))


def allows(choice: Choice | None, labels: Mapping[str, str]) -> bool:
    """Whether a job of `choice` may run on a cluster with `labels` (None: anywhere)."""
    return choice is None or choice.allows(labels)
