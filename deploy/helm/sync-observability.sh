#!/usr/bin/env bash
# Copy gpufed's Grafana dashboards and Prometheus rules into the broker chart: Helm reads no
# file outside a chart, and the chart renders them as ConfigMaps (grafana.dashboards) and a
# PrometheusRule (metrics.prometheusRule). deploy/grafana/dashboards/ and
# deploy/prometheus/alerts.yaml stay the one source: edit them, then run this (and
# deploy/render/regenerate.sh). tests/integration/test_helm_observability.py fails while a
# copy differs from its source.
set -euo pipefail
cd "$(dirname "$0")/../.."
chart=deploy/helm/broker
rm -f "$chart"/dashboards/*.json
mkdir -p "$chart/dashboards" "$chart/rules"
cp deploy/grafana/dashboards/*.json "$chart/dashboards/"
cp deploy/prometheus/alerts.yaml "$chart/rules/alerts.yaml"
echo "copied $(ls deploy/grafana/dashboards/*.json | wc -l) dashboards and alerts.yaml into $chart"
