"""The gateway's own Prometheus metrics, on a registry per gateway instance (tests run several).

Counters and histograms record events where they happen (:class:`Counter` and :class:`Histogram`: lock-free
on the event loop, exposed as prometheus-client's own). Gauges are never pushed: :class:`StateGauges` reads
them from whoever holds the state (set as its ``source`` by the server), at scrape time.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


# name -> (help, label names). In a sidecar vLLM listens on 127.0.0.1 only, so the engine's own load is
# re-exported here: Prometheus can reach it through kvgate alone.
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvgate_gate_open": ("1 while the hysteresis gate admits, 0 while closed", ()),
    "kvgate_kv_usage_observed": ("KV cache usage (0..1) in the latest upstream sample", ()),
    "kvgate_kv_usage_projected": ("Projected KV usage (0..1): sample plus what the ledger adds", ()),
    "kvgate_reserved_blocks": ("KV blocks reserved by in-flight requests", ()),
    "kvgate_inflight_requests": ("Requests admitted and not yet finished", ()),
    "kvgate_queue_depth": ("Requests waiting for admission", ()),
    "kvgate_tenant_queue_depth": ("Requests waiting for admission, per tenant", ("tenant",)),
    "kvgate_upstream_metrics_age_seconds": ("Age of the latest good upstream sample", ()),
    "kvgate_upstream_requests_running": ("vllm:num_requests_running in the latest sample", ()),
    "kvgate_upstream_requests_waiting": ("vllm:num_requests_waiting in the latest sample", ()),
    "kvgate_ready": ("1 when the upstream is reachable and its metrics fresh", ()),
    "kvgate_redis_up": ("1 while the shared limit store answers", ()),
    "kvgate_limits_degraded": (
        "1 while limits are enforced per replica (Redis down, on_failure: open) or refused (closed)",
        (),
    ),
    "kvgate_policy_version": ("Reloads applied since start, plus one", ()),
    "kvgate_output_estimate_quantile": (
        "Quantile of learned output lengths reserved now (1 = the whole budget; rises after preemptions)",
        (),
    ),
    "kvgate_output_tokens_expected": (
        "Learned output tokens per sequence at a quantile, over all finished requests",
        ("quantile",),
    ),
    "kvgate_pool_engines": (
        "Engines in the pool, by state (placeable, ejected, leaving, other_block_size)",
        ("state",),
    ),
    "kvgate_engine_kv_usage_observed": ("KV cache usage (0..1) in an engine's latest sample", ("engine",)),
    "kvgate_engine_kv_usage_projected": ("An engine's projected KV usage (0..1)", ("engine",)),
    "kvgate_engine_reserved_blocks": ("KV blocks reserved on an engine by its in-flight requests", ("engine",)),
    "kvgate_engine_inflight_requests": ("Requests placed on an engine and not yet finished", ("engine",)),
    "kvgate_engine_gate_open": ("1 while an engine's hysteresis gate admits", ("engine",)),
    "kvgate_engine_ejected": ("1 while an engine is ejected (refused connections or failing scrapes)", ("engine",)),
    "kvgate_engine_num_blocks": ("An engine's KV pool in blocks (vllm:cache_config_info)", ("engine",)),
    "kvgate_tokenizer_disagrees": (
        "1 while most recent prompts counted by the local tokenizer disagree with the engine's usage.prompt_tokens "
        "(a tokenizer of another model)",
        (),
    ),
    "kvgate_tokenizer_info": (
        "1 for the tokenizer counting prompt tokens: kind (hf, tiktoken, vllm, heuristic) and source (model_dir, "
        "hf_cache, hf_download, path, tiktoken_cache, engine, builtin; pending until auto has chosen)",
        ("kind", "source"),
    ),
}
# Counters kept by pure code (no prometheus inside it), read the same way.
STATE_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvgate_engine_placements": ("Requests placed on an engine (admitted there)", ("engine",)),
    "kvgate_engine_ejections": ("Times an engine was ejected, by reason (scrape, connect)", ("engine", "reason")),
    "kvgate_engine_restarts": ("Restarts seen on an engine (its counters went back)", ("engine",)),
    "kvgate_requests_outran_estimate": ("Requests that outran their expected output and grew their reservation", ()),
    "kvgate_prefix_affinity_placements": (
        "Requests placed on the engine that took their prompt's prefix rather than the one with most headroom",
        (),
    ),
    "kvgate_tokenize_cache_lookups": (
        "Engine /tokenize counts looked up in the whole-request cache, by result (hit: no round trip)",
        ("result",),
    ),
    "kvgate_prompts_priced": (
        "Requests priced, by how their prompt was counted (estimate: the tokenizer skipped; conversation: an "
        "earlier turn's count and the new messages' estimate; tokenizer; token_ids)",
        ("by",),
    ),
    "kvgate_prompts_near_limit": (
        "Text prompts counted exactly: their estimate was too close to a limit, or its band too wide for the pool",
        (),
    ),
    "kvgate_arrivals_deferred": (
        "Requests that waited for a later event-loop iteration to be priced (listen.arrivals_per_tick, a burst)",
        (),
    ),
    "kvgate_prompt_estimate_above_band": (
        "Served prompts whose engine count was above the estimate's band (the fast path would have priced short)",
        (),
    ),
}
# Histograms kept by pure code: (name, label values, cumulative (upper bound, count) pairs, sum).
STATE_HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvgate_prompt_estimate_ratio": ("The engine's prompt tokens over the learned estimate, per served prompt", ()),
}
HistogramReading = tuple[str, tuple[str, ...], list[tuple[float, int]], float]

Reading = tuple[str, tuple[str, ...], float]  # gauge name, label values, value


class StateGauges(Collector):
    """The gauges of :data:`GAUGES`, each read from ``source`` when Prometheus scrapes."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[Reading]] = lambda: ()
        self.histograms: Callable[[], Iterable[HistogramReading]] = lambda: ()

    def describe(self) -> Iterator[Metric]:
        return iter([*self._families().values(), *self._histograms().values()])

    def collect(self) -> Iterator[Metric]:
        families, histograms = self._families(), self._histograms()
        for name, labels, value in self.source():
            families[name].add_metric(list(labels), value)
        for name, labels, buckets, total in self.histograms():
            histograms[name].add_metric(list(labels), [(_le(bound), float(n)) for bound, n in buckets], total)
        return iter([*families.values(), *histograms.values()])

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            name: GaugeMetricFamily(name, doc, labels=list(labels)) for name, (doc, labels) in GAUGES.items()
        }
        for name, (doc, labels) in STATE_COUNTERS.items():
            families[name] = CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))
        return families

    @staticmethod
    def _histograms() -> dict[str, HistogramMetricFamily]:
        return {
            name: HistogramMetricFamily(name, doc, labels=list(labels))
            for name, (doc, labels) in STATE_HISTOGRAMS.items()
        }


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _created_series() -> bool:
    """prometheus-client's own switch for the ``_created`` series (PROMETHEUS_DISABLE_CREATED_SERIES); a private
    attribute, so a release without it means the series stay, as they do by default."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class CounterChild:
    """One labelled series of a :class:`Counter`: a float, with the time it was created (``_created``)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class Counter(Collector):
    """A counter as prometheus-client exposes it (``_total`` and ``_created``), without its lock: that one takes
    a lock on every ``inc`` and ``labels()``, and the hot path counts several times a request. Every increment
    and every scrape (``/metrics`` is served by the app on the same loop) run on the event loop's one thread."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        self._only = CounterChild() if not self.labelnames else None
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        """The child of these label values, created on first use (as prometheus-client's ``labels()``)."""
        child = self._children.get(values)
        if child is None:
            if not self.labelnames or len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected label values for {self.labelnames}, got {values!r}")
            child = self._children.setdefault(tuple(str(v) for v in values), CounterChild())
        return child

    def inc(self, amount: float = 1) -> None:
        assert self._only is not None, f"{self.name} has labels: inc() a child of labels()"
        self._only.inc(amount)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        children = [((), self._only)] if self._only is not None else list(self._children.items())
        for values, child in children:
            created = child.created if _created_series() else None
            family.add_metric(list(values), child.value, created=created)
        return iter([family])


class Histogram(Collector):
    """An unlabelled histogram as prometheus-client exposes it (``_bucket``, ``_count``, ``_sum``,
    ``_created``), without a lock per bucket and sum on each ``observe``; see :class:`Counter` for why."""

    def __init__(self, name: str, documentation: str, *, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = [*map(float, buckets), *([] if buckets[-1] == float("inf") else [float("inf")])]
        self._les: list[str] = [floatToGoString(bound) for bound in self._bounds]  # type: ignore[no-untyped-call]
        self._counts = [0.0] * len(self._bounds)
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._sum += amount
        i = bisect_left(self._bounds, amount)  # the first bucket with amount <= its bound
        if i < len(self._bounds) and amount <= self._bounds[i]:  # NaN falls in none, as in prometheus-client
            self._counts[i] += 1

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, total = [], 0.0
        for le, count in zip(self._les, self._counts, strict=True):
            total += count
            cumulative.append((le, total))
        family.add_metric([], cumulative, self._sum)
        if _created_series():
            family.samples.append(Sample(self.name + "_created", {}, self._created, None, None))
        return iter([family])


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.gauges = StateGauges()
        r.register(self.gauges)
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time a request waited for admission, admitted or not (timed out, shed, refused, its client gone); "
            "0 when admitted at once",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.projected_at_admission = Histogram(
            "kvgate_admission_projected_usage",
            "Projected KV usage (0..1) right after each admission: never above the high watermark",
            buckets=(0.25, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0),
            registry=r,
        )
        self.admitted = Counter("kvgate_requests_admitted", "Requests admitted to the engine", registry=r)
        self.rejected = Counter(
            "kvgate_requests_rejected",
            "Requests answered with an error by the gateway",
            ["reason"],
            registry=r,
        )
        self.upstream_busy = Counter(
            "kvgate_upstream_busy",
            "Engine 'busy' rejections seen (vLLM --max-num-queued-reqs)",
            ["form"],
            registry=r,
        )
        self.prompt_tokens_estimated = Counter(
            "kvgate_prompt_tokens_estimated",
            "Prompt tokens estimated at admission (requests with usage)",
            registry=r,
        )
        self.prompt_tokens_actual = Counter(
            "kvgate_prompt_tokens_actual", "Prompt tokens the engine reported in usage", registry=r
        )
        self.completion_tokens = Counter(
            "kvgate_completion_tokens", "Completion tokens the engine reported in usage", registry=r
        )
        self.ttft = Histogram(
            "kvgate_upstream_ttft_seconds",
            "Time from sending a request to the engine to the first events of its streamed answer (200 streams; "
            "an answer sent whole has only kvgate_upstream_latency_seconds)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "kvgate_upstream_latency_seconds",
            "Upstream request duration",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_stale_connections = Counter(
            "kvgate_upstream_stale_connections",
            "Pooled connections the engine had closed, discarded before a request was written on them",
            registry=r,
        )
        self.scrape_errors = Counter("kvgate_scrape_errors", "Failed scrapes of the upstream /metrics", registry=r)
        self.upstream_preemptions = Counter(
            "kvgate_upstream_preemptions", "Preemptions the engine reported (vllm:num_preemptions_total)", registry=r
        )
        self.loop_lag = Histogram(
            "kvgate_event_loop_lag_seconds",
            "How late the event loop ran a timer",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.released = Counter(
            "kvgate_reservations_released",
            "Reservations released, by how the request ended",
            ["outcome"],
            registry=r,
        )
        self.connections_refused = Counter(
            "kvgate_connections_refused",
            "Requests answered 503 because listen.max_connections connections or requests were open",
            registry=r,
        )
        self.requests = Counter(
            "kvgate_requests",
            "Proxied requests, once each when they end, by the class of their answer's status (2xx, 4xx, 429, "
            "5xx, a 200 stream cut by an error counted as 5xx; none: the client went away, before or during its "
            "answer)",
            ["code"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvgate_client_disconnects", "Clients that went away, by stage", ["stage"], registry=r
        )

        # --- tenants, priorities, shared limits, policy reloads ---
        self.tenant_admitted_tokens = Counter(
            "kvgate_tenant_admitted_tokens",
            "Tokens (prompt + reserved output) admitted, by tenant and priority class",
            ["tenant", "priority"],
            registry=r,
        )
        self.shed = Counter(
            "kvgate_requests_shed",
            "Queued requests pushed out of a full queue by a higher class",
            ["priority"],
            registry=r,
        )
        self.redis_errors = Counter(
            "kvgate_redis_errors",
            "Redis calls that failed or took longer than redis.timeout_s (the request fell back or was refused)",
            registry=r,
        )
        self.policy_reloads = Counter(
            "kvgate_policy_reloads", "Config reloads, by result (applied, rejected)", ["result"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
