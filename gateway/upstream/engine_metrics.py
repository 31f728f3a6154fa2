"""Reading vLLM's ``/metrics``: pure parsing and aggregation, no I/O.

vLLM exposes several hundred series; we need five families. Lines of other families are dropped before the
text reaches prometheus_client's parser, which keeps a scrape well under a millisecond of CPU.

Data-parallel engines each report their own series, told apart by the ``engine`` label. Usage aggregates as
used blocks over total blocks when each engine's ``num_gpu_blocks`` is known, else as a plain mean.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.tokens.cost import KvGeometry

USAGE_METRIC = "vllm:kv_cache_usage_perc"
LEGACY_USAGE_METRIC = "vllm:gpu_cache_usage_perc"  # removed in vLLM 0.12
RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"
PREEMPTIONS_METRIC = "vllm:num_preemptions"  # family name; the sample is ``..._total``
CACHE_CONFIG_METRIC = "vllm:cache_config_info"
SUCCESS_METRIC = "vllm:request_success"  # family name; the samples are ``..._total``, one per finish reason
START_TIME_METRIC = "process_start_time_seconds"  # the API server process: changes when the engine restarts

_WANTED = (
    USAGE_METRIC,
    LEGACY_USAGE_METRIC,
    RUNNING_METRIC,
    WAITING_METRIC,
    PREEMPTIONS_METRIC,
    CACHE_CONFIG_METRIC,
    SUCCESS_METRIC,
    START_TIME_METRIC,
)
_WANTED_SAMPLES = frozenset(
    {
        USAGE_METRIC,
        LEGACY_USAGE_METRIC,
        RUNNING_METRIC,
        WAITING_METRIC,
        PREEMPTIONS_METRIC + "_total",
        PREEMPTIONS_METRIC,
        CACHE_CONFIG_METRIC,
        SUCCESS_METRIC,
        SUCCESS_METRIC + "_total",
        START_TIME_METRIC,
    }
)


class MetricsFormatError(ValueError):
    """The upstream's /metrics text has no KV usage metric: wrong URL, or not a vLLM server."""


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    usage: float
    geometry: KvGeometry | None
    running: float
    waiting: float
    preemptions: float
    engines: int
    served: float = 0.0  # vllm:request_success_total over every finish reason
    started_at: float | None = None  # process_start_time_seconds


def _keep(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) >= 3 and parts[2] in _WANTED_SAMPLES
    end = len(line)
    for sep in ("{", " "):
        i = line.find(sep)
        if 0 <= i < end:
            end = i
    return line[:end] in _WANTED_SAMPLES


def filter_text(text: str) -> str:
    """Only the lines of the families we read (and their HELP/TYPE lines)."""
    return "\n".join(line for line in text.splitlines() if line.startswith(("vllm:", "# ")) and _keep(line)) + "\n"


def parse_engine_metrics(text: str) -> EngineMetrics:
    usage: dict[str, float] = {}
    legacy: dict[str, float] = {}
    blocks: dict[str, int] = {}
    block_size: int | None = None
    totals: dict[str, float] = defaultdict(float)
    started_at: float | None = None
    for family in text_string_to_metric_families(filter_text(text)):
        for sample in family.samples:
            engine = sample.labels.get("engine", "0")
            if sample.name == USAGE_METRIC:
                usage[engine] = sample.value
            elif sample.name == LEGACY_USAGE_METRIC:
                legacy[engine] = sample.value
            elif sample.name in (RUNNING_METRIC, WAITING_METRIC):
                totals[sample.name] += sample.value
            elif sample.name == PREEMPTIONS_METRIC + "_total":
                totals[PREEMPTIONS_METRIC] += sample.value
            elif sample.name == SUCCESS_METRIC + "_total":
                totals[SUCCESS_METRIC] += sample.value
            elif sample.name == START_TIME_METRIC:
                started_at = sample.value
            elif sample.name == CACHE_CONFIG_METRIC:
                if _int_label(sample.labels, "num_gpu_blocks") is not None:
                    blocks[engine] = _int_label(sample.labels, "num_gpu_blocks") or 0
                block_size = _int_label(sample.labels, "block_size") or block_size
    per_engine = usage or legacy
    if not per_engine:
        raise MetricsFormatError(f"no {USAGE_METRIC} (or {LEGACY_USAGE_METRIC}) in the upstream's /metrics")
    geometry = None
    if block_size and blocks:
        geometry = KvGeometry(block_size=block_size, num_blocks=sum(blocks.values()))
    if blocks and all(e in blocks for e in per_engine):
        used = sum(u * blocks[e] for e, u in per_engine.items())
        aggregate = used / max(1, sum(blocks[e] for e in per_engine))
    else:
        aggregate = sum(per_engine.values()) / len(per_engine)
    return EngineMetrics(
        usage=aggregate,
        geometry=geometry,
        running=totals[RUNNING_METRIC],
        waiting=totals[WAITING_METRIC],
        preemptions=totals[PREEMPTIONS_METRIC],
        engines=len(per_engine),
        served=totals[SUCCESS_METRIC],
        started_at=started_at,
    )


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None
