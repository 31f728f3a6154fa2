"""``/metrics`` with vLLM's names, labels and buckets (as scraped from vLLM 0.32, see docs/simulator.md).

Gauges and counters are read from the engine at scrape time; the latency histograms are observed by the
server when requests finish. Every ``vllm:`` series carries ``engine="0"`` and ``model_name``, except
``vllm:admission_rejections_total``, which (as in vLLM) has ``model_name`` and ``reason`` only. A restarted
engine gets a fresh :class:`SimMetrics`, so its counters start again from zero and ``process_start_time_seconds``
moves on, as a restarted vLLM's do.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.sim.config import SimConfig
from gateway.sim.engine import Engine, SimRequest

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
REJECT_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
LABELS = ("engine", "model_name")


class _EngineCollector(Collector):
    """Reads the engine's live state on every scrape."""

    def __init__(self, owner: SimMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        o = self.owner
        eng, base = o.engine, [o.engine_label, o.model_name]
        created = o.created

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(base, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(base, value, created=created)
            return c

        # prometheus-client's process collector in vLLM's API server; a new incarnation is a new process
        yield GaugeMetricFamily(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", value=created
        )
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(eng.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(eng.waiting))
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            labels=(*LABELS, "reason"),
        )
        by_reason.add_metric([*base, "capacity"], len(eng.waiting))
        by_reason.add_metric([*base, "deferred"], 0)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.usage())
        if o.legacy_gpu_cache_metric:
            yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", eng.usage())
        s = eng.stats
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"),
        )
        for reason in FINISHED_REASONS:
            success.add_metric([*base, reason], s.finished_by_reason[reason], created=created)
        yield success
        rejections = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=("model_name", "reason"),
        )
        for reason in REJECT_REASONS:
            rejections.add_metric([o.model_name, reason], o.rejections[reason], created=created)
        yield rejections
        cfg = o.cfg
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=(
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "gpu_memory_utilization",
                "kv_cache_memory_bytes",
                "kv_cache_size_tokens",
                "model_name",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "num_gpu_blocks_override",
            ),
        )
        info.add_metric(
            [
                str(cfg.block_size),
                "auto",
                "False",  # shared prefixes are not modelled: each request holds its own blocks
                o.engine_label,
                str(cfg.gpu_memory_utilization),
                str(cfg.num_gpu_blocks * cfg.block_bytes),
                str(cfg.num_gpu_blocks * cfg.block_size),
                o.model_name,
                "None",
                str(cfg.num_gpu_blocks),
                str(cfg.num_gpu_blocks),
            ],
            1.0,
        )
        yield info
        iters = CounterMetricFamily(
            "kvgate_sim_engine_steps", "Engine steps run by this engine incarnation.", labels=LABELS
        )
        iters.add_metric(base, s.iterations, created=created)
        yield iters
        yield gauge(
            "kvgate_sim_peak_step_memory_bytes",
            "Largest step memory (KV in use + activations + fixed).",
            s.peak_memory_bytes,
        )


class SimMetrics:
    """One engine incarnation's registry."""

    def __init__(
        self,
        cfg: SimConfig,
        engine: Engine,
        *,
        legacy_gpu_cache_metric: bool = False,
        supervisor: Iterable[Collector] = (),
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.model_name = cfg.served_model_name
        self.engine_label = "0"
        self.legacy_gpu_cache_metric = legacy_gpu_cache_metric
        self.created = time.time()
        self.rejections: collections.Counter[str] = collections.Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(self))
        for collector in supervisor:
            self.registry.register(collector)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            registry=self.registry,
            buckets=E2E_BUCKETS,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LABELS,
            registry=self.registry,
            buckets=E2E_BUCKETS,
        )

    def observe_first_token(self, req: SimRequest) -> None:
        if req.first_token is not None:
            self.ttft.labels(self.engine_label, self.model_name).observe(req.first_token - req.arrival)
        if req.first_scheduled is not None:
            self.queue.labels(self.engine_label, self.model_name).observe(req.first_scheduled - req.arrival)

    def observe_finished(self, req: SimRequest) -> None:
        if req.finished_at is not None and req.finish_reason in ("length", "stop"):
            self.e2e.labels(self.engine_label, self.model_name).observe(req.finished_at - req.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
