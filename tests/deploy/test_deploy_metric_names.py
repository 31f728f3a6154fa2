"""Every metric the alerts and the dashboard query is one that kvgate or vLLM actually exports.

kvgate's names come from instantiating the gateway's own metrics object (gateway/metrics.py), so renaming a
metric there fails this test until the dashboard and the rules follow. vLLM's names come from a real
``/metrics`` scrape of vLLM 0.32 (fixtures/vllm-metrics.txt, taken from the CPU engine).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import pytest
from deploy_support import FIXTURES, Manifest, dashboard, prometheus_rule_groups
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords or labels."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', "", expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers (and Grafana's $variables inside them)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries, $__rate_interval included
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\w+", " ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the exponent or unit of a number literal such as 1e3
        names.add(m.group())
    return names


def template_metric_names(query: str) -> set[str]:
    """Grafana template queries: label_values(metric, label) selects a metric; label_values(label) does not."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
    if m:
        return metric_names(m.group(1))
    m = re.fullmatch(r"\s*(?:query_result|metrics)\((.*)\)\s*", query)
    return metric_names(m.group(1)) if m else set()


def rule_exprs(groups: list[Manifest]) -> Iterable[tuple[str, str]]:
    for g in groups:
        for r in g["rules"]:
            yield r.get("alert") or r.get("record"), str(r["expr"])


def dashboard_exprs(board: dict[str, Any]) -> Iterable[tuple[str, str]]:
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


def dashboard_template_queries(board: dict[str, Any]) -> Iterable[tuple[str, str]]:
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            yield var["name"], q["query"] if isinstance(q, dict) else q


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}


def series_names(families: Iterable[Metric]) -> set[str]:
    """Series names a scrape can carry, from each family's type: a labelled counter that has not been
    incremented yet exposes no sample, but it is exported all the same."""
    names = set()
    for family in families:
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
        names |= {s.name for s in family.samples}
    return names


def state_series(metrics: Any) -> set[str]:
    """The series StateGauges exposes: each gauge by its name, each state counter (labelled ones included)
    with the ``_total`` suffix prometheus_client gives a counter sample. No ``_created``: a counter read from
    state has no creation time. test_state_series_are_what_a_scrape_shows proves this against a real render."""
    return set(metrics.GAUGES) | {name.removesuffix("_total") + "_total" for name in metrics.STATE_COUNTERS}


def kvgate_exported() -> set[str]:
    metrics = pytest.importorskip("gateway.metrics", reason="gateway/metrics.py not importable")
    state_families = set(metrics.GAUGES) | {name.removesuffix("_total") for name in metrics.STATE_COUNTERS}
    native = [f for f in metrics.GatewayMetrics().registry.collect() if f.name not in state_families]
    return series_names(native) | state_series(metrics)


def vllm_exported() -> set[str]:
    return series_names(text_string_to_metric_families((FIXTURES / "vllm-metrics.txt").read_text()))


def unknown_names(queries: Iterable[tuple[str, str]], exported: set[str]) -> list[str]:
    missing = []
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        missing += [f"{where}: {n}" for n in sorted(names - exported)]
    return missing


def test_extractor() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (namespace, le) (rate(kvgate_queue_wait_seconds_bucket"
        '{namespace="$namespace", reason=~"a|b"}[$__rate_interval]))) > 1e3 and on (pod) '
        "max_over_time(vllm:kv_cache_usage_perc[5m:1m] offset 5m) > bool 0.9 unless absent(kvgate_ready)"
    )
    assert metric_names(expr) == {"kvgate_queue_wait_seconds_bucket", "vllm:kv_cache_usage_perc", "kvgate_ready"}
    assert template_metric_names("label_values(kvgate_ready, namespace)") == {"kvgate_ready"}
    assert template_metric_names("label_values(namespace)") == set()


def test_unknown_names_are_reported() -> None:
    """The check can fail: a misspelled or invented metric is named in the failure."""
    exported = vllm_exported() | {"kvgate_gate_open"}
    bad = [("typo", "max(kvgate_gate_opn) == 0"), ("old vLLM", "vllm:gpu_cache_usage_perc > 0.9")]
    assert unknown_names(bad, exported) == ["typo: kvgate_gate_opn", "old vLLM: vllm:gpu_cache_usage_perc"]
    assert unknown_names([("ok", "max(kvgate_gate_open) == 0")], exported) == []


def test_vllm_fixture_has_the_metrics_kvgate_reads() -> None:
    names = vllm_exported()
    assert {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:cache_config_info"} <= names


def test_alert_and_dashboard_metrics_are_exported(rendered: dict[str, list[Manifest]]) -> None:
    exported = kvgate_exported() | vllm_exported()
    docs = rendered["standalone"]
    board = dashboard(docs)
    queries = [
        *(("alert " + w, e) for w, e in rule_exprs(prometheus_rule_groups(docs))),
        *(("panel " + w, e) for w, e in dashboard_exprs(board)),
    ]
    assert unknown_names(queries, exported) == []
    for var, query in dashboard_template_queries(board):
        assert template_metric_names(query) <= exported, var
    # The dashboard and the alerts query both sides: the gateway and the engine.
    used = set().union(*(metric_names(e) for _, e in queries))
    assert any(n.startswith("kvgate_") for n in used) and any(n.startswith("vllm:") for n in used)


def test_state_series_are_what_a_scrape_shows() -> None:
    """Give every state gauge and counter a reading, render /metrics, parse it back: the series names are
    exactly those the checks above accept, so a labelled state counter is queried as ``..._total``."""
    metrics = pytest.importorskip("gateway.metrics", reason="gateway/metrics.py not importable")
    state = {**metrics.GAUGES, **metrics.STATE_COUNTERS}
    gm = metrics.GatewayMetrics()
    gm.gauges.source = lambda: [
        (name, tuple(f"{label}-value" for label in labels), 1.0) for name, (_, labels) in state.items()
    ]
    families = {name.removesuffix("_total") for name in state}
    exposed = {
        s.name for f in text_string_to_metric_families(gm.render().decode()) if f.name in families for s in f.samples
    }
    assert exposed == state_series(metrics)
    assert {"kvgate_engine_placements_total", "kvgate_engine_ejections_total"} <= exposed
    assert not {"kvgate_engine_placements", "kvgate_engine_ejections_created"} & kvgate_exported()


# The per-engine and pool series of issue 12, each with the place that must show it.
POOL_DASHBOARD_SERIES = {
    "kvgate_pool_engines",
    "kvgate_engine_kv_usage_observed",
    "kvgate_engine_kv_usage_projected",
    "kvgate_engine_reserved_blocks",
    "kvgate_engine_inflight_requests",
    "kvgate_engine_gate_open",
    "kvgate_engine_ejected",
    "kvgate_engine_num_blocks",
    "kvgate_engine_placements_total",
    "kvgate_engine_ejections_total",
    "kvgate_engine_restarts_total",
}
POOL_ALERT_SERIES = {
    "kvgate_engine_ejected",
    "kvgate_pool_engines",
    "kvgate_engine_restarts_total",
    "kvgate_engine_kv_usage_observed",
}


def test_pool_series_are_exported_and_shown(rendered: dict[str, list[Manifest]]) -> None:
    """Every per-engine series kvgate exports is on the dashboard, and the pool alerts query their series."""
    metrics = pytest.importorskip("gateway.metrics", reason="gateway/metrics.py not importable")
    pool_series = {n for n in state_series(metrics) if n.startswith(("kvgate_engine_", "kvgate_pool_"))}
    assert pool_series == POOL_DASHBOARD_SERIES, "a per-engine metric was added or renamed: show it, then list it"
    docs = rendered["pool"]
    on_board = set().union(*(metric_names(e) for _, e in dashboard_exprs(dashboard(docs))))
    assert on_board >= POOL_DASHBOARD_SERIES, sorted(POOL_DASHBOARD_SERIES - on_board)
    in_alerts = set().union(*(metric_names(e) for _, e in rule_exprs(prometheus_rule_groups(docs))))
    assert in_alerts >= POOL_ALERT_SERIES, sorted(POOL_ALERT_SERIES - in_alerts)
