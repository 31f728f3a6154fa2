"""Read a Prometheus endpoint into a flat dict: ``{"name{label=value}": value}``."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text)


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def assert_ledger_empty(gateway_url: str) -> dict[str, float]:
    """Every reservation the gateway made was released exactly once, and nothing is held."""
    m = scrape(gateway_url)
    released = sum(v for k, v in m.items() if k.startswith("kvgate_reservations_released_total"))
    assert m["kvgate_reserved_blocks"] == 0, m
    assert m["kvgate_inflight_requests"] == 0, m
    assert released == m["kvgate_requests_admitted_total"], (released, m["kvgate_requests_admitted_total"])
    return m
