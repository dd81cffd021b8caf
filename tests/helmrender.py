"""Helm's template engine for the tests: deploy/render built with Go against Debian's sprig.

No Helm binary can be installed here, but Helm's engine is Go's text/template with the sprig
functions, and Debian packages both; deploy/render adds Helm's own functions and objects.
`build_renderer` builds it (offline, GOPATH mode), `run_renderer` renders one chart, and
`render_chart` renders a chart for its ci/example-values.yaml plus an override, after checking
the merged values against values.schema.json as Helm does first. Without Go, `MISSING` says
what to install and the callers skip.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml

GOPATH = Path("/usr/share/gocode")  # where Debian's golang-*-dev packages put their sources
GO = shutil.which("go")
MISSING = (
    None
    if GO is not None and (GOPATH / "src/github.com/Masterminds/sprig").is_dir()
    else "Helm render tests need Go and sprig: "
    "apt-get install golang-go golang-github-masterminds-sprig-dev"
)
ROOT = Path(__file__).resolve().parents[1]
CHARTS = ROOT / "deploy" / "helm"
RELEASE, NAMESPACE = "gpufed", "gpufed-system"


def go_env(cache: Path) -> dict[str, str]:
    """GOPATH mode against Debian's packages: no module proxy, no network, no C compiler."""
    env = dict(os.environ)
    env.update(
        GO111MODULE="off",
        GOPATH=str(GOPATH),
        GOFLAGS="",
        GOPROXY="off",
        GOTOOLCHAIN="local",
        GOWORK="off",
        CGO_ENABLED="0",
    )
    if not any(env.get(var) for var in ("GOCACHE", "XDG_CACHE_HOME", "HOME")):
        env["GOCACHE"] = str(cache)
    return env


def build_renderer(work: Path) -> Path:
    """deploy/render built into `work`."""
    binary = work / "render"
    assert GO is not None, MISSING
    built = subprocess.run(
        [GO, "build", "-o", str(binary), "./deploy/render"],
        cwd=ROOT,
        env=go_env(work / "gocache"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    return binary


def run_renderer(
    renderer: Path, chart: Path, value_files: list[Path], *extra: str
) -> subprocess.CompletedProcess[str]:
    files = [arg for path in value_files for arg in ("-f", str(path))]
    return subprocess.run(
        [str(renderer), "--name", RELEASE, "--namespace", NAMESPACE, *files, *extra, str(chart)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's values merge: maps merge recursively, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def chart_values(chart: str, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """values.yaml, ci/example-values.yaml and `override`, merged and checked by the schema."""
    directory = CHARTS / chart
    example = yaml.safe_load((directory / "ci" / "example-values.yaml").read_text())
    values = merged(
        merged(yaml.safe_load((directory / "values.yaml").read_text()), example), override or {}
    )
    schema = json.loads((directory / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    return values


class Renderer:
    """A built renderer and the charts it rendered (by chart and override)."""

    def __init__(self, work: Path, *, keep: object = None) -> None:
        self._work = work
        self._keep = keep  # what must live as long as the renderer (its directory)
        self._binary = build_renderer(work)
        self._cache: dict[str, tuple[str, dict[str, Any]]] = {}

    def render(
        self, chart: str, override: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """The rendered text and the values it was rendered with."""
        key = json.dumps([chart, override], sort_keys=True)
        if key not in self._cache:
            values = chart_values(chart, override)
            directory = CHARTS / chart
            overrides = self._work / f"override-{len(self._cache)}.yaml"
            overrides.write_text(yaml.safe_dump(override or {}))
            done = run_renderer(
                self._binary, directory, [directory / "ci" / "example-values.yaml", overrides]
            )
            assert done.returncode == 0, done.stderr
            self._cache[key] = (done.stdout, values)
        return self._cache[key]


@functools.cache
def shared_renderer() -> Renderer:
    """One renderer for the whole test process, built on first use (callers check `MISSING`)."""
    work = tempfile.TemporaryDirectory(prefix="gpufed-render-")  # removed when the process ends
    return Renderer(Path(work.name), keep=work)


def render_chart(chart: str, override: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The objects `chart` renders for its example values plus `override`."""
    text, _ = shared_renderer().render(chart, override)
    return [doc for doc in yaml.safe_load_all(text) if doc]
