#!/usr/bin/env bash
# Regenerate deploy/manifests/{broker,member-agent}.yaml: each chart rendered by deploy/render
# (Helm's template engine: Go's text/template with Debian's sprig) for its ci/example-values.yaml.
# Each file keeps its opening comment block; everything from its first `---` is the renderer's.
# Needs: apt-get install golang-go golang-github-masterminds-sprig-dev
# tests/integration/test_helm_render.py fails when a committed file differs from this output.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
GO111MODULE=off GOPATH=/usr/share/gocode GOFLAGS= GOPROXY=off CGO_ENABLED=0 \
    GOCACHE="${GOCACHE:-$work/gocache}" go build -o "$work/render" ./deploy/render
for chart in broker member-agent; do
    out="deploy/manifests/$chart.yaml"
    {
        sed -n '/^---$/q;p' "$out"
        "$work/render" --name gpufed --namespace gpufed-system \
            -f "deploy/helm/$chart/ci/example-values.yaml" "deploy/helm/$chart"
    } >"$work/$chart.yaml"
    mv "$work/$chart.yaml" "$out"
    echo "wrote $out"
done
