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


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def test_every_metric_the_dashboard_plots_exists():
    names = set().union(
        *(exposed(m("tiny").registry) for m in (PrefillMetrics, EncodeMetrics, DecodeMetrics))
    )
    plotted = {name for expr in expressions() for name in re.findall(r"epd:[a-z0-9_]+", expr)}
    assert plotted and plotted <= names, plotted - names
    assert len(plotted) >= 20  # requests, latencies, encode, wire, decode, peers
    for name in (
        "epd:time_to_first_token_seconds_bucket",
        "epd:request_time_per_output_token_seconds_bucket",
        "epd:request_decode_time_seconds_bucket",
        "epd:request_prompt_tokens_bucket",
        "epd:request_generation_tokens_bucket",
        "epd:kv_cache_usage_perc",  # each decoder's own, and as decoders report it to prefill
        "epd:num_preemptions_total",
        "epd:encode_batch_size_count",
        "epd:peer_up",
    ):
        assert name in plotted, name


def test_every_series_is_chosen_by_the_model_name_variable():
    """And by a role, where two roles expose the same metric."""
    chosen = re.compile(r'\{model_name=~"\$model_name"(, role="(encode|prefill|decode)")?\}')
    for expr in expressions():
        selectors = re.findall(r"epd:[a-z0-9_]+(\{[^}]*\})?", expr)
        assert selectors and all(chosen.fullmatch(s) for s in selectors), expr
    dashboard = json.loads(DASHBOARD.read_text())
    names = [variable["name"] for variable in dashboard["templating"]["list"]]
    assert names == ["datasource", "model_name"]


def test_the_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["refId"] for t in panel["targets"])
        assert panel["datasource"]["uid"] == "${datasource}"
