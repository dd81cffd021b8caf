"""Dashboards and alert rules query only what the code exports.

Every PromQL expression of deploy/ (dashboard targets and variables, data source queries,
recording and alerting rules, the promtool test series) is read with `tests.promql`; each
metric it selects must be a series the broker's `BrokerMetrics` or the agent's collector really
exports (built here, in-process), with labels that family has. Also: the dashboards are valid
JSON with unique panel ids and only provisioned data sources, and the rules carry what an
operator needs. promtool, when installed, checks and unit-tests the rules too.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from broker.telemetry import metrics
from gpufed.local import processes
from member_agent import telemetry
from member_agent.cluster.simulated import backend as simulated
from member_agent.jobs import handling
from member_agent.session import connecting, reporting
from member_agent.utilisation import scraping
from tests import promql

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
RULES = DEPLOY / "prometheus" / "alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yaml"
COMPOSE = DEPLOY / "docker-compose.observability.yaml"

# ---- what the code exports ----------------------------------------------------------------

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
TARGET_LABELS = frozenset({"job", "instance"})  # added by Prometheus to every scraped series
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]

    def series(self) -> dict[str, Family]:
        return {self.name + suffix: self for suffix in SUFFIXES[self.type]}


def build_agent_collector() -> telemetry.AgentCollector:
    pools = simulated.load_pools(processes.config_dir() / "clusters" / "inference.yaml")
    backend = simulated.SimulatedBackend("inference", pools)
    router = connecting.Router()
    handler = handling.JobHandler(backend, send=router.send)
    reporter = reporting.SummaryReporter(backend.inventory, cluster="inference")
    settings = connecting.ConnectSettings(broker_urls=("http://127.0.0.1:9",), cluster="inference")
    connector = connecting.Connector(settings, handler=handler, reporter=reporter, router=router)
    dcgm = scraping.DCGMScraper(["http://127.0.0.1:9/metrics"])  # --dcgm-url: never started
    return telemetry.AgentCollector(
        cluster="inference", handler=handler, connector=connector, reporter=reporter, dcgm=dcgm
    )


def collect_families() -> dict[str, Family]:
    """Every family the broker and the agent register, with its label names."""
    meters = metrics.BrokerMetrics()
    # prometheus_client keeps the label names of a family without children only privately
    declared: dict[str, set[str]] = {}
    for wrapper in vars(meters).values():
        if isinstance(wrapper, MetricWrapperBase):
            declared[next(iter(wrapper.describe())).name] = set(wrapper._labelnames)
    collected = [*meters.registry.collect(), *build_agent_collector().collect()]
    families: dict[str, Family] = {}
    for metric in collected:
        labels = set(declared.get(metric.name, getattr(metric, "_labelnames", ())))
        labels.update(key for sample in metric.samples for key in sample.labels)
        seen = families.get(metric.name)  # both ends export gpufed_agent_session_connected
        if seen is not None:
            assert seen.type == metric.type, f"{metric.name}: a {seen.type} and a {metric.type}"
            labels |= seen.labels
        families[metric.name] = Family(metric.name, metric.type, frozenset(labels - {"le"}))
    return families


# ---- where deploy/ queries metrics ---------------------------------------------------------


@dataclass
class Query:
    where: str
    expr: str
    label: str = ""  # label_values(expr, label): the label the variable lists


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def read_dashboard_queries(path: Path) -> Iterator[Query]:
    board = json.loads(path.read_text())
    for panel in walk_panels(board.get("panels", [])):
        for target in panel.get("targets", []):
            if "expr" in target:
                where = f"{path.name} panel {panel['id']} {panel.get('title')!r} {target['refId']}"
                yield Query(where, target["expr"])
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        text = variable["query"]
        text = text["query"] if isinstance(text, dict) else text
        where = f"{path.name} variable {variable['name']}"
        match = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", text, re.DOTALL)
        if match:
            yield Query(where, match.group(1), label=match.group(2))
        elif match := re.fullmatch(r"\s*query_result\((.+)\)\s*", text, re.DOTALL):
            yield Query(where, match.group(1))
        else:
            yield Query(where, f"unsupported variable query {text}")


def read_rule_queries(path: Path) -> Iterator[Query]:
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            yield Query(f"{path.name} {rule.get('alert') or rule.get('record')}", rule["expr"])


def read_all_queries(dashboards: Path = DASHBOARDS) -> list[Query]:
    queries = [
        q for path in sorted(dashboards.glob("*.json")) for q in read_dashboard_queries(path)
    ]
    queries += read_rule_queries(RULES)
    sources = yaml.safe_load((PROVISIONING / "datasources" / "gpufed.yaml").read_text())
    for source in sources["datasources"]:
        for item in source.get("jsonData", {}).get("tracesToMetrics", {}).get("queries", []):
            queries.append(Query(f"data source {source['uid']} {item['name']!r}", item["query"]))
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for series in test.get("input_series", []):
            queries.append(Query(f"{RULE_TESTS.name} {test['name']!r}", series["series"]))
    return queries


def recorded_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def find_problems(queries: list[Query], families: dict[str, Family]) -> list[str]:
    """Each metric a query selects that is not exported, or matched on a label it lacks."""
    series = {name: fam for family in families.values() for name, fam in family.series().items()}
    recorded = recorded_names()
    problems = []
    for query in queries:
        try:
            selectors = promql.select_metrics(query.expr)
        except promql.PromQLError as exc:
            problems.append(f"{query.where}: {exc}")
            continue
        if not selectors:
            problems.append(f"{query.where}: selects no metric: {query.expr}")
        for number, selector in enumerate(selectors):
            name, labels = (
                selector.name,
                selector.labels | ({query.label} if number == 0 else set()),
            )
            labels.discard("")
            if name in recorded or name in PROMETHEUS_SERIES:
                continue
            family = series.get(name)
            if family is None:
                known = families.get(name)
                hint = f" (a {known.type}: query one of {sorted(known.series())})" if known else ""
                problems.append(f"{query.where}: {name} is not exported{hint}")
                continue
            allowed = (
                family.labels | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
            )
            if labels - allowed:
                problems.append(
                    f"{query.where}: {name} has no label {sorted(labels - allowed)} "
                    f"(it has {sorted(family.labels)})"
                )
    return problems


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        pytest.param("up", {"up": set()}, id="a bare name"),
        pytest.param(
            'histogram_quantile(0.99, sum by (le) (rate(a_bucket{job="x"}[$__rate_interval])))',
            {"a_bucket": {"job"}},
            id="quantile of a histogram with a Grafana interval",
        ),
        pytest.param(
            "sum without (instance) (rate(a_total[5m])) / on (cluster) group_left (model) b",
            {"a_total": set(), "b": set()},
            id="grouping and matching label lists are not metrics",
        ),
        pytest.param(
            'max_over_time(a{x=~"p|q", y!="}{("}[1h:5m] offset 1d) > bool 3 and on () c @ start()',
            {"a": {"x", "y"}, "c": set()},
            id="subquery, offset, bool, @ start() and brackets inside a string",
        ),
        pytest.param(
            'label_replace(a, "dst", "$1", "src", "(.*)") unless count_values("v", b) or 1e3 * -c',
            {"a": set(), "b": set(), "c": set()},
            id="string arguments and numbers",
        ),
        pytest.param(
            "# a comment with rate(fake[5m])\nsum by (state) (job:a:rate5m{$__tags}) * Inf",
            {"job:a:rate5m": set()},
            id="comments, recorded names with colons, Grafana matcher variables",
        ),
        pytest.param(
            '{__name__="a", cluster="h"} + sum(b) by (le)',
            {"a": {"cluster"}, "b": set()},
            id="__name__ matcher and a trailing by",
        ),
    ],
)
def test_select_metrics_reads_the_metric_names_of_promql(
    expr: str, expected: dict[str, set[str]]
) -> None:
    assert {s.name: s.labels for s in promql.select_metrics(expr)} == expected


@pytest.mark.parametrize(
    "expr",
    [
        pytest.param("ratee(a[5m])", id="unknown function"),
        pytest.param("rate(gpufed_${kind}_total[5m])", id="name built from a variable"),
        pytest.param("sum(rate(a[5m])", id="unbalanced"),
        pytest.param('{__name__=~"gpufed_.*"}', id="name by regex"),
        pytest.param("a{cluster}", id="label without a matcher"),
    ],
)
def test_select_metrics_refuses_what_it_cannot_check(expr: str) -> None:
    with pytest.raises(promql.PromQLError):
        promql.select_metrics(expr)


def test_every_metric_queried_by_dashboards_and_rules_is_exported() -> None:
    families = collect_families()
    queries = read_all_queries()
    assert len(queries) > 40, "dashboards and rules were not read"
    assert find_problems(queries, families) == []
    queried = {s.name for q in queries for s in promql.select_metrics(q.expr)}
    for family in ("gpufed_cluster_gpus", "gpufed_agent_session_state", "gpufed_pending_jobs"):
        assert family in queried


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        pytest.param(
            "sum(rate(gpufed_made_up_total[5m]))",
            "gpufed_made_up_total is not exported",
            id="made-up metric",
        ),
        pytest.param(
            'sum(gpufed_cluster_gpus{status="free"})',
            "has no label ['status']",
            id="label the family lacks",
        ),
        pytest.param(
            "rate(gpufed_scheduling_cycle_duration_seconds[5m])",
            "a histogram",
            id="histogram without its suffix",
        ),
        pytest.param(
            "rate(gpufed_placements[5m])", "gpufed_placements_total", id="counter without _total"
        ),
    ],
)
def test_a_copy_of_a_dashboard_with_a_wrong_query_fails_the_check(
    tmp_path: Path, expr: str, problem: str
) -> None:
    for path in DASHBOARDS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    board = json.loads((tmp_path / "gpufed-fleet.json").read_text())
    panel = copy.deepcopy(next(p for p in board["panels"] if p["type"] == "timeseries"))
    panel["id"] = 999
    panel["targets"] = [{"refId": "A", "expr": expr, "datasource": panel["datasource"]}]
    board["panels"].append(panel)
    (tmp_path / "gpufed-fleet.json").write_text(json.dumps(board))

    problems = find_problems(read_all_queries(tmp_path), collect_families())

    assert len(problems) == 1
    assert "gpufed-fleet.json panel 999" in problems[0]
    assert problem in problems[0]


def read_dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def find_datasource_uids(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        source = node.get("datasource")
        if isinstance(source, dict) and source.get("type") != "grafana":
            yield str(source.get("uid"))
        elif isinstance(source, str):
            yield f"a data source by name: {source}"
        for value in node.values():
            yield from find_datasource_uids(value)
    elif isinstance(node, list):
        for item in node:
            yield from find_datasource_uids(item)


def find_overlaps(panels: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Pairs of panels whose grid cells overlap (or that stick out of the 24-column grid)."""
    cells: dict[tuple[int, int], int] = {}
    overlaps = []
    for panel in walk_panels(panels):
        grid = panel["gridPos"]
        if grid["x"] + grid["w"] > 24:
            overlaps.append((panel["id"], panel["id"]))
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                if (x, y) in cells:
                    overlaps.append((cells[(x, y)], panel["id"]))
                cells[(x, y)] = panel["id"]
    return sorted(set(overlaps))


# each dashboard picks its data sources with these variables: imported into a Grafana whose
# Prometheus has another uid (kube-prometheus-stack's is `prometheus`), every panel still works
SOURCE_VARIABLES = {"datasource": "prometheus", "tempo": "tempo"}


def test_dashboards_have_unique_panel_ids_a_tidy_grid_and_data_source_variables() -> None:
    boards = read_dashboards()
    assert {"gpufed-fleet.json", "gpufed-job.json"} <= set(boards)
    sources = yaml.safe_load((PROVISIONING / "datasources" / "gpufed.yaml").read_text())
    provisioned = {s["uid"]: s["type"] for s in sources["datasources"]}
    assert provisioned == {"gpufed-prometheus": "prometheus", "gpufed-tempo": "tempo"}
    assert not any(s.get("isDefault") for s in sources["datasources"]), "a Grafana's default stays"
    for source in sources["datasources"]:
        for key in ("serviceMap", "tracesToMetrics"):
            linked = source.get("jsonData", {}).get(key, {}).get("datasourceUid")
            assert linked is None or linked in provisioned, (source["uid"], key)
    uids = [board["uid"] for board in boards.values()]
    assert len(set(uids)) == len(uids)
    allowed = {"${" + name + "}" for name in SOURCE_VARIABLES}
    for name, board in boards.items():
        ids = [panel["id"] for panel in walk_panels(board["panels"])]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        assert find_overlaps(board["panels"]) == [], name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        for variable, kind in SOURCE_VARIABLES.items():
            assert variables[variable]["type"] == "datasource", (name, variable)
            assert variables[variable]["query"] == kind, (name, variable)
        assert set(find_datasource_uids(board)) <= allowed, f"{name}: a data source by uid"
        for uid in provisioned:
            assert uid not in json.dumps(board), f"{name} names the data source {uid}"
        linked = re.findall(r"/d/([\w-]+)", json.dumps(board))
        assert set(linked) <= set(uids), f"{name}: links to a dashboard that is not here"


def test_each_query_uses_the_data_source_variable_of_its_kind() -> None:
    variable_of = {kind: name for name, kind in SOURCE_VARIABLES.items()}
    for board in read_dashboards().values():
        for panel in walk_panels(board["panels"]):
            for target in panel.get("targets", []):
                source = target["datasource"]
                assert source["uid"] == "${" + variable_of[source["type"]] + "}", panel["id"]


PICKERS = ("cluster", "model", "queue")  # the fleet dashboard's variables


def test_fleet_panels_honour_the_cluster_model_and_queue_pickers() -> None:
    """A panel over a family that has a picker's label filters on it: a queue picked shows
    that queue, never every queue summed."""
    families = collect_families()
    series = {n: fam for family in families.values() for n, fam in family.series().items()}
    board = read_dashboards()["gpufed-fleet.json"]
    missing = []
    for panel in walk_panels(board["panels"]):
        for target in panel.get("targets", []):
            for selector in promql.select_metrics(target["expr"]):
                family = series.get(selector.name)
                if family is None:
                    continue
                for picker in PICKERS:
                    if f"(all {picker}s)" in panel["title"]:
                        continue  # a figure of the whole cluster, and its title says so
                    if picker in family.labels and f'{picker}=~"${picker}"' not in target["expr"]:
                        missing.append(f"panel {panel['id']} {selector.name}: no ${picker}")
    assert missing == []


def read_ratio_queries() -> Iterator[Query]:
    """The dashboard targets and recording rules that divide (alerts compare, and a NaN
    compares false)."""
    for path in sorted(DASHBOARDS.glob("*.json")):
        yield from (q for q in read_dashboard_queries(path) if " / " in q.expr)
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule and " / " in rule["expr"]:
                yield Query(rule["record"], rule["expr"])


def test_ratios_divide_only_by_a_positive_denominator() -> None:
    """`x / (y > 0)`: no value where nothing was measured, instead of NaN or +Inf."""
    unguarded = [
        f"{q.where}: {q.expr}"
        for q in read_ratio_queries()
        if not re.search(r"/ (on \(\w+\) )?\(.*> 0\)\s*$", q.expr, re.DOTALL)
    ]
    assert unguarded == []


def test_the_job_dashboard_goes_from_a_trace_id_to_its_trace_in_tempo() -> None:
    board = read_dashboards()["gpufed-job.json"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"trace_id", "job_id"} <= variables
    traces = [p for p in walk_panels(board["panels"]) if p["type"] == "traces"]
    assert [t["query"] for p in traces for t in p["targets"]] == ["${trace_id}"]
    assert all(t["datasource"]["uid"] == "${tempo}" for p in traces for t in p["targets"])
    explore = [link["url"] for link in board["links"] if link["url"].startswith("/explore")]
    assert explore and "%22${tempo}%22" in explore[0] and "${trace_id}" in explore[0]


def read_mounts(service: dict[str, Any]) -> dict[str, str]:
    """host path -> container path of a compose service's bind mounts."""
    return dict(v.removesuffix(":ro").split(":", 1) for v in service.get("volumes", []))


def test_compose_mounts_what_grafana_and_prometheus_are_configured_to_read() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "gpufed.yaml").read_text())
    grafana = read_mounts(services["grafana"])
    assert grafana["./grafana/dashboards"] == providers["providers"][0]["options"]["path"]
    assert grafana["./grafana/provisioning"] == "/etc/grafana/provisioning"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).relative_to(grafana["./grafana/dashboards"])).is_file()
    prometheus = read_mounts(services["prometheus"])
    config = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    in_container = Path(config.removeprefix("--config.file="))
    assert (DEPLOY / "prometheus" / in_container.relative_to(prometheus["./prometheus"])).is_file()
    sources = yaml.safe_load((PROVISIONING / "datasources" / "gpufed.yaml").read_text())
    for source in sources["datasources"]:
        match = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"])
        assert match is not None, source["url"]
        host, port = match.groups()
        assert any(p.startswith(f"{port}:") for p in services[host]["ports"]), source["url"]


REQUIRED_ALERTS = {
    "GpufedAgentDisconnected",
    "GpufedSchedulingDecisionSlow",
    "GpufedGPUsStrandedByFragmentation",
    "GpufedJobsPendingTooLong",
    "GpufedGPUsUnhealthy",
    "GpufedGPUFailures",
    "GpufedNodeCordonedForGPUFailures",
}


def test_alert_rules_carry_duration_severity_and_annotations() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [rule for group in groups for rule in group["rules"] if "alert" in rule]
    assert {rule["alert"] for rule in alerts} >= REQUIRED_ALERTS
    for rule in alerts:
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for"))), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    for name in recorded_names():
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", name), f"{name}: level:metric:ops"


def run_promtool(*args: str) -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run(
        [promtool, *args], check=False, cwd=RULES.parent, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("check", "rules", "alerts.yaml"), id="check rules"),
        pytest.param(("test", "rules", "alerts_test.yaml"), id="alerts fire when they should"),
        pytest.param(("check", "config", "prometheus.yaml"), id="scrape config"),
        pytest.param(("check", "config", "prometheus.compose.yaml"), id="compose scrape config"),
    ],
)
def test_promtool_accepts_the_rules_and_configs(args: tuple[str, ...]) -> None:
    assert "SUCCESS" in run_promtool(*args)
