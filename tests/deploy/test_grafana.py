"""The Grafana dashboard plots only metrics the processes expose."""

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from epd.decode.metrics import DecodeMetrics
from epd.encode.metrics import EncodeMetrics
from epd.prefill.metrics import PrefillMetrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "epd.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exposed(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry exposes, labelled families without children included."""
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


def test_every_metric_the_dashboard_plots_exists():
    names = set().union(
        *(exposed(m().registry) for m in (PrefillMetrics, EncodeMetrics, DecodeMetrics))
    )
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    plotted = {name for expr in exprs for name in re.findall(r"epd:[a-z0-9_]+", expr)}
    assert plotted and plotted <= names, plotted - names
    assert len(plotted) >= 20  # requests, latencies, encode, wire, decode, peers
    for name in ("epd:time_to_first_token_seconds_bucket", "epd:peer_up"):
        assert name in plotted


def test_the_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["refId"] for t in panel["targets"])
        assert panel["datasource"]["uid"] == "${datasource}"
