"""The one reader of Prometheus text (``/metrics``) for tests and load tests.

``parse_metrics`` flattens a scrape into ``{"name{label=value,...}": value}`` (labels sorted, values unquoted,
as tests write the keys they assert on). ``metric_sum`` adds up one metric over the samples whose labels include
the given ones. A regular expression rather than prometheus_client's parser: the sampler parses 20 scrapes a
second on two shared cores, and this is six times faster. Standard library only.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Collection, Mapping

# name, optional {labels} (up to the last brace on the line), value, optional timestamp
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?[ \t]*$", re.MULTILINE)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value) if "\\" in value else value


def parse_metrics(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """Every sample of an exposition text (or only those named in ``names``: 5x faster on vLLM's 600 lines),
    keyed ``name`` or ``name{k=v,...}`` with the labels sorted by name."""
    out: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(text):
        if names is not None and name not in names:
            continue
        if labels:
            pairs = sorted((k, _unescape(v)) for k, v in _LABEL.findall(labels))
            if pairs:
                name = f"{name}{{{','.join(f'{k}={v}' for k, v in pairs)}}}"
        out[name] = float(value)
    return out


def metric_sum(series: Mapping[str, float], name: str, /, *, default: float | None = None, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``.

    No such sample is a KeyError unless ``default`` is given: a labelled counter has no sample until its first
    increment, but a missing gauge is usually a renamed one that an assertion on 0 would silently accept.
    """
    wanted = {f"{k}={v}" for k, v in labels.items()}
    prefix = name + "{"
    total, found = 0.0, False
    for key, value in series.items():
        if key == name:
            if wanted:
                continue
        elif not key.startswith(prefix) or not wanted <= set(key[len(prefix) : -1].split(",")):
            continue
        total += value
        found = True
    if found:
        return total
    if default is None:
        raise KeyError(f"{name}{labels or ''}")
    return default


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """``parse_metrics`` of ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode())


def assert_ledger_empty(gateway_url: str) -> dict[str, float]:
    """Every reservation the gateway made was released exactly once, and nothing is held."""
    m = scrape(gateway_url)
    released = metric_sum(m, "kvgate_reservations_released_total", default=0.0)
    assert m["kvgate_reserved_blocks"] == 0, m
    assert m["kvgate_inflight_requests"] == 0, m
    assert released == m["kvgate_requests_admitted_total"], (released, m["kvgate_requests_admitted_total"])
    return m
