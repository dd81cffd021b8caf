"""Which metrics a PromQL expression selects: a small lexer and reader of PromQL, enough to
list each metric selector of an expression with the label names it matches on.

It refuses (`PromQLError`) what it cannot vouch for: an unknown function, a metric name built
from a Grafana variable or chosen by a `__name__` regex, unbalanced brackets. Grafana's
variables (`$__rate_interval`, `${cluster}`, `[[var]]`) are read as values. Used by
tests/integration/test_observability_config.py on the dashboards and rules of deploy/.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

# PromQL's words, as its lexer knows them (Prometheus 3.x; aggregations and keywords in any case)
WORDS = {
    "aggregations": """sum min max avg group stddev stdvar count count_values bottomk topk
        quantile limitk limit_ratio""",
    "functions": """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time
        ceil changes clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week
        day_of_year days_in_month deg delta deriv double_exponential_smoothing end exp floor
        histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev
        histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
        label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
        minute month pi predict_linear present_over_time quantile_over_time rad rate resets round
        scalar sgn sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt start
        stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector year""",
    "label_lists": "by without on ignoring group_left group_right",
    "keywords": "bool offset and or unless atan2 inf nan",
}
AGGREGATIONS, FUNCTIONS, LABEL_LISTS, KEYWORDS = (frozenset(v.split()) for v in WORDS.values())
MATCH_OPS = frozenset({"=", "!=", "=~", "!~"})

TOKEN = re.compile(
    r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<variable>\$+\{[^}]*\}|\$+[A-Za-z_]\w*|\[\[[A-Za-z_]\w*(?::\w+)?\]\])
  | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
                (?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}\[\]@])
    """,
    re.VERBOSE,
)


class PromQLError(ValueError):
    """An expression this reader cannot vouch for."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    start: int
    end: int


@dataclass
class Selector:
    name: str
    labels: set[str] = field(default_factory=set)


def tokenize(expr: str) -> list[Token]:
    tokens, at = [], 0
    while at < len(expr):
        match = TOKEN.match(expr, at)
        if match is None or match.lastgroup is None:
            raise PromQLError(f"unexpected {expr[at : at + 12]!r} at {at}")
        if match.lastgroup != "space":
            tokens.append(Token(match.lastgroup, match.group(), at, match.end()))
        at = match.end()
    for before, after in itertools.pairwise(tokens):
        glued = before.end == after.start and {before.kind, after.kind} == {"ident", "variable"}
        if glued:
            raise PromQLError(f"a metric name built from a variable: {before.text}{after.text}")
    depth = 0
    for token in tokens:
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(token.text, 0)
        if depth < 0:
            raise PromQLError(f"unbalanced {token.text!r} at {token.start}")
    if depth:
        raise PromQLError("unbalanced brackets")
    return tokens


def read_matchers(tokens: list[Token], at: int, into: Selector) -> int:
    """Read `{...}` from `at` (its `{`) into `into`; return the index after its `}`."""
    at += 1
    while tokens[at].text != "}":
        token = tokens[at]
        if token.kind == "variable":  # a Grafana matcher list such as {$__tags}
            at += 1
        elif token.kind == "string" and tokens[at + 1].text in {",", "}"}:
            into.name = into.name or token.text[1:-1]  # Prometheus 3: {"quoted.name"}
            at += 1
        elif token.kind == "ident" and tokens[at + 1].text in MATCH_OPS:
            value = tokens[at + 2]
            if value.kind not in {"string", "variable"}:
                raise PromQLError(f"label {token.text} compared to {value.text!r}")
            if token.text == "__name__":
                if tokens[at + 1].text != "=" or value.kind != "string":
                    raise PromQLError("a metric name chosen by regex or variable: cannot check")
                into.name = value.text[1:-1]
            else:
                into.labels.add(token.text)
            at += 3
        else:
            raise PromQLError(f"unexpected {token.text!r} in a label matcher")
        if tokens[at].text == ",":
            at += 1
    return at + 1


def select_metrics(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression, with the label names each matches on."""
    tokens = tokenize(expr)
    found: list[Selector] = []
    at = 0
    while at < len(tokens):
        token = tokens[at]
        following = tokens[at + 1].text if at + 1 < len(tokens) else ""
        word = token.text.lower()
        if token.kind == "ident" and word in LABEL_LISTS:
            at += 1
            if following == "(":
                while tokens[at].text != ")":
                    at += 1
                    if tokens[at].kind not in {"ident", "string"} and tokens[at].text not in ",)":
                        raise PromQLError(f"{tokens[at].text!r} in the labels of {token.text}")
                at += 1
        elif token.kind == "ident" and word in KEYWORDS:
            at += 1
        elif token.kind == "ident" and following == "(":
            if token.text not in FUNCTIONS and word not in AGGREGATIONS:
                raise PromQLError(f"unknown function {token.text}")
            at += 1
        elif token.kind == "ident" and word in AGGREGATIONS and following in LABEL_LISTS:
            at += 1
        elif token.kind == "ident":
            selector = Selector(token.text)
            at += 1
            if following == "{":
                at = read_matchers(tokens, at, selector)
            found.append(selector)
        elif token.text == "{":
            selector = Selector("")
            at = read_matchers(tokens, at, selector)
            if not selector.name:
                raise PromQLError("a selector without a metric name")
            found.append(selector)
        elif token.text == "[":  # a range or subquery: durations, steps, variables
            while tokens[at].text != "]":
                at += 1
            at += 1
        else:
            at += 1
    return found
