"""kvgate's lock-free Counter and Histogram expose exactly what prometheus-client's own would, sample for
sample, for the same increments and observations (their ``_created`` times aside, which differ by birth)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram

from gateway.metrics import Counter, GatewayMetrics, Histogram


def _render(registry: CollectorRegistry) -> list[str]:
    """The exposition, minus the values of ``_created`` samples."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rsplit(" ", 1)[0] if "_created" in line.split(" ", 1)[0] else line for line in lines]


def test_counters_render_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    plain = Counter("kvgate_things", "Things", registry=ours), PromCounter("kvgate_things", "Things", registry=theirs)
    labelled = (
        Counter("kvgate_outcomes", "By outcome", ["outcome", "tenant"], registry=ours),
        PromCounter("kvgate_outcomes", "By outcome", ["outcome", "tenant"], registry=theirs),
    )
    empty = (
        Counter("kvgate_none", "Never", ["x"], registry=ours),
        PromCounter("kvgate_none", "Never", ["x"], registry=theirs),
    )
    assert empty
    for counter in plain:
        counter.inc()
        counter.inc(2.5)
    for counter in labelled:
        counter.labels("completed", "a").inc()
        counter.labels("client_disconnect", "b").inc(3)
        counter.labels("completed", "a").inc(7)
    assert _render(ours) == _render(theirs)
    assert labelled[0].labels("completed", "a").value == 8


def test_histograms_render_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    pair = (
        Histogram("kvgate_wait_seconds", "Waits", buckets=(0.005, 0.01, 1, 60), registry=ours),
        PromHistogram("kvgate_wait_seconds", "Waits", buckets=(0.005, 0.01, 1, 60), registry=theirs),
    )
    for histogram in pair:
        for value in (0.0, 0.005, 0.0051, 0.5, 1, 59.9, 60, 61, 1e9, math.nan):
            histogram.observe(value)
    assert _render(ours) == _render(theirs)


def test_wrong_use_is_refused_as_prometheus_client_refuses_it() -> None:
    registry = CollectorRegistry()
    plain, labelled = Counter("a", "A", registry=registry), Counter("b", "B", ["x"], registry=registry)
    with pytest.raises(ValueError):
        plain.inc(-1)
    with pytest.raises(ValueError):
        plain.labels("x")
    with pytest.raises(ValueError):
        labelled.labels("x", "y")


def test_the_gateway_registry_renders() -> None:
    text = GatewayMetrics().render().decode()
    assert "kvgate_requests_admitted_total 0.0" in text
    assert 'kvgate_queue_wait_seconds_bucket{le="+Inf"} 0.0' in text
