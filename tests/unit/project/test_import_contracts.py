"""The import contracts of `.importlinter` hold on the tree, and each one fails the build when
a deliberately wrong import is added (to a copy of the packages, never to the checkout)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = {"broker": ROOT / "broker", "gpufed": ROOT / "gpufed", "kits": ROOT / "kits"}
PACKAGES["member_agent"] = ROOT / "member-agent" / "member_agent"


def run_contracts(where: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(where / ".importlinter")],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def copy_tree(to: Path) -> Path:
    for name, source in PACKAGES.items():
        shutil.copytree(source, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", to / ".importlinter")
    return to


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    result = run_contracts(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        pytest.param(
            "broker/planning/fitting.py", "import logging", "Pure cores", id="planning logs"
        ),
        pytest.param(
            "broker/planning/quotas.py",
            "from broker.planning.backlog import budget",
            "the backlog sits on the planner",
            id="the planner imports the backlog",
        ),
        pytest.param(
            "member_agent/placement/gang.py",
            "import time",
            "Pure cores",
            id="placement reads a clock",
        ),
        pytest.param(
            "broker/jobs/book.py",
            "from broker.http import keys",
            "The broker's layers",
            id="jobs reach up into http",
        ),
        pytest.param(
            "broker/api/jobs.py",
            "from broker.state import store",
            "broker.api (the wire contract)",
            id="the wire contract imports the store",
        ),
        pytest.param(
            "member_agent/jobs/__init__.py",
            "from broker.jobs import book",
            "The member agent imports only broker.api",
            id="the agent imports the broker's job book",
        ),
        pytest.param(
            "member_agent/inventory/summary.py",
            "from member_agent.placement import gang",
            "Inventory measures",
            id="inventory imports placement",
        ),
        pytest.param(
            "member_agent/session/connecting.py",
            "import kubernetes_asyncio",
            "kubernetes_asyncio is imported only",
            id="kubernetes outside cluster/",
        ),
        pytest.param(
            "member_agent/cluster/simulated/pods.py",
            "import kubernetes_asyncio",
            "kubernetes_asyncio is imported only",
            id="the simulated backend imports kubernetes_asyncio",
        ),
        pytest.param(
            "member_agent/cluster/base.py",
            "from member_agent.cluster.kubernetes import backend",
            "kubernetes_asyncio is imported only",
            id="the protocol reaches kubernetes_asyncio through the Kubernetes backend",
        ),
        pytest.param(
            "member_agent/cluster/simulated/backend.py",
            "from member_agent.cluster.kubernetes import health",
            "The agent's backends",
            id="the simulated backend imports the Kubernetes one",
        ),
        pytest.param(
            "member_agent/cluster/kubernetes/state.py",
            "from member_agent.cluster.simulated import pods",
            "The agent's backends",
            id="the Kubernetes backend imports the simulated one",
        ),
        pytest.param(
            "kits/tables.py",
            "from broker.api import jobs",
            "kits (the runtime kits",
            id="a kit imports the wire contract",
        ),
        pytest.param(
            "broker/api/jobs.py",
            "from kits import tables",
            "The wire contract (broker.api) is plain models",
            id="the wire contract keeps a table of its own",
        ),
        pytest.param(
            "gpufed/sim/traces.py",
            "from gpufed import cli",
            "gpufed: the CLI on top",
            id="the simulator imports the CLI",
        ),
    ],
)
def test_a_wrong_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    where = copy_tree(tmp_path)
    target = where / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately wrong\n")
    result = run_contracts(where)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout


def test_a_planning_module_on_neither_side_breaks_the_backlog_contract(tmp_path: Path) -> None:
    where = copy_tree(tmp_path)
    (where / "broker/planning/undeclared.py").write_text('"""Neither planner nor backlog."""\n')
    result = run_contracts(where)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert "the backlog sits on the planner" in broken, result.stdout
    assert "broker.planning.undeclared" in broken, result.stdout


def test_no_import_circle_inside_gpufed_or_between_broker_rooms() -> None:
    graph = grimp.build_graph("gpufed", "broker")
    circles = []
    for package in ("gpufed",):
        modules = sorted(m for m in graph.modules if m.startswith(package))
        for a, b in itertools.combinations(modules, 2):
            if graph.chain_exists(a, b, as_packages=False) and graph.chain_exists(
                b, a, as_packages=False
            ):
                circles.append((a, b))
    rooms = sorted(m for m in graph.modules if m.count(".") == 1 and m.startswith("broker."))
    for a, b in itertools.combinations(rooms, 2):
        if graph.chain_exists(a, b, as_packages=True) and graph.chain_exists(
            b, a, as_packages=True
        ):
            circles.append((a, b))
    assert circles == []
