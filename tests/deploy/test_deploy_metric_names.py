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


def kvgate_exported() -> set[str]:
    metrics = pytest.importorskip("gateway.metrics", reason="gateway/metrics.py not importable")
    return series_names(metrics.GatewayMetrics().registry.collect())


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
