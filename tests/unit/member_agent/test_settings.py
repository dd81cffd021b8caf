"""The agent's settings and its limits file."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from gpufed import cli, daemons
from member_agent import app


@pytest.mark.parametrize(
    ("text", "namespace", "expected"),
    [
        pytest.param("", "any", None, id="empty file: no limit"),
        pytest.param("namespace_gpus: {a: 8}", "a", 8, id="listed namespace"),
        pytest.param("namespace_gpus: {a: 8}", "b", None, id="unlisted namespace"),
        pytest.param(
            "namespace_gpus: {a: 8}\ndefault_namespace_gpus: 2", "b", 2, id="default limit"
        ),
    ],
)
def test_the_limits_file_sets_namespace_gpu_limits(
    tmp_path: Path, text: str, namespace: str, expected: int | None
) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    assert app.load_limits(path).gpu_limit(namespace) == expected


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param("namespace_gpus: {a: -1}", "namespace_gpus.a", id="negative"),
        pytest.param("namespace_gpu: {a: 1}", "namespace_gpu", id="typo"),
        pytest.param("default_namespace_gpus: many", "default_namespace_gpus", id="not a number"),
    ],
)
def test_a_bad_limits_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    with pytest.raises(app.LimitsFileError, match=field):
        app.load_limits(path)


def test_the_example_limits_file_loads() -> None:
    root = Path(__file__).resolve().parents[3]
    example = app.load_limits(root / "config" / "agent-limits.example.yaml")
    assert example.gpu_limit("team-llm") == 512


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        pytest.param({"backend": "simulated"}, "nodes_file", id="simulated without nodes"),
        pytest.param({"broker_url": "broker:8080"}, "broker_url", id="no scheme"),
        pytest.param({"cluster": "H100 cluster"}, "cluster", id="cluster not a DNS label"),
        pytest.param({"metrics_port": 70000}, "metrics_port", id="port out of range"),
    ],
)
def test_bad_settings_name_the_field(settings: dict[str, object], field: str) -> None:
    values = {"broker_url": "http://broker:8080", "cluster": "h100", "nodes_file": "n.yaml"}
    if "backend" in settings:
        del values["nodes_file"]
    with pytest.raises(pydantic.ValidationError, match=field):
        app.AgentSettings.model_validate({**values, **settings})


def test_cluster_labels_are_repeatable_or_comma_separated() -> None:
    argv = ["agent", "--broker", "http://b", "--cluster", "c", "--backend", "kubernetes"]
    argv += ["--token-file", "t"]
    argv += ["--cluster-label", "region=eu-west,tier=spot", "--cluster-label", "zone=a"]
    settings = daemons.agent_settings(cli.build_parser().parse_args(argv))
    assert settings.cluster_labels == {"region": "eu-west", "tier": "spot", "zone": "a"}
    with pytest.raises(SystemExit):  # not KEY=VALUE: argparse says so and exits 2
        cli.build_parser().parse_args([*argv, "--cluster-label", "region"])
    with pytest.raises(pydantic.ValidationError, match="cluster label"):
        app.AgentSettings(
            broker_url="http://b", cluster="c", backend="kubernetes", cluster_labels={"a b": "x"}
        )
