"""Label selectors read as Kubernetes reads `?labelSelector=`, and matched on job labels."""

from __future__ import annotations

import pytest

from broker.api import errors, selectors

Operator = selectors.Operator


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("", ""),
        ("team=x", "team=x"),
        ("team==x", "team=x"),
        ("team!=x", "team!=x"),
        (" tier in ( gold , silver ) ", "tier in (gold,silver)"),
        ("tier notin(gold)", "tier!=gold"),
        ("canary", "canary"),
        ("!canary", "!canary"),
        ("tier=", "tier="),
        ("example.com/team=x,!canary,tier", "example.com/team=x,!canary,tier"),
    ],
)
def test_selectors_read_as_kubernetes_writes_them(text: str, canonical: str) -> None:
    parsed = selectors.parse(text)

    assert selectors.describe(parsed) == canonical
    assert selectors.parse(selectors.describe(parsed)) == parsed


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("team=x,", "missing after the last ','"),
        (",team=x", "expected a label key"),
        ("!", "expected a label key"),
        ("team x", "expected '='"),
        ("team=x y", "expected ','"),
        ("tier in ()", "at least one value"),
        ("tier in gold", "parenthesised list"),
        ("gpus>2", "numeric comparisons"),
        ("Team Name=x", "expected '='"),
        ("-bad=x", "not a label key"),
        ("team=not a value!", "expected ','"),
        ("team=" + "v" * 64, "not a label value"),
        ("a=b," * 40 + "a=b", "at most 32 requirements"),
        ("a" * 5000, "at most 4096 characters"),
    ],
)
def test_a_selector_that_does_not_read_is_malformed_naming_the_field(
    text: str, problem: str
) -> None:
    with pytest.raises(errors.Malformed, match=problem) as refused:
        selectors.parse(text)

    assert refused.value.field == "labelSelector"


@pytest.mark.parametrize(
    ("text", "labels", "matches"),
    [
        ("team=x", {"team": "x"}, True),
        ("team=x", {"team": "y"}, False),
        ("team=x", {}, False),
        ("team!=x", {}, True),
        ("team!=x", {"team": "x"}, False),
        ("tier in (gold,silver)", {"tier": "silver"}, True),
        ("tier notin (gold,silver)", {"tier": "bronze"}, True),
        ("tier notin (gold,silver)", {}, True),
        ("canary", {"canary": ""}, True),
        ("!canary", {"canary": ""}, False),
        ("tier=", {"tier": ""}, True),
        ("team=x,!canary", {"team": "x", "canary": "true"}, False),
        ("", {"anything": "at all"}, True),
    ],
)
def test_a_selector_matches_every_requirement(
    text: str, labels: dict[str, str], matches: bool
) -> None:
    assert selectors.matches(selectors.parse(text), labels) is matches
