from pathlib import Path

import pytest

from gateway.tokens.cost import KvGeometry
from gateway.upstream.engine_metrics import MetricsFormatError, filter_text, parse_engine_metrics

DATA = Path(__file__).resolve().parents[1] / "data"


def test_real_vllm_sample_saturated() -> None:
    m = parse_engine_metrics((DATA / "metrics-sample-saturated.txt").read_text())
    assert m.usage == pytest.approx(0.9921568627450981)
    assert m.geometry == KvGeometry(block_size=128, num_blocks=256)
    assert (m.running, m.waiting, m.engines) == (23.0, 41.0, 1)


def test_real_vllm_sample_idle() -> None:
    m = parse_engine_metrics((DATA / "metrics-sample.txt").read_text())
    assert m.usage == 0.0 and m.geometry is not None


def test_filter_keeps_only_what_we_read() -> None:
    kept = filter_text((DATA / "metrics-sample-saturated.txt").read_text())
    names = {line.split("{")[0] for line in kept.splitlines() if line and not line.startswith("#")}
    assert names == {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
        "vllm:request_success_total",  # goes back when the engine restarts
    }


def test_legacy_metric_name_before_vllm_0_12() -> None:
    text = '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
    m = parse_engine_metrics(text)
    assert m.usage == 0.42 and m.geometry is None


def test_data_parallel_engines_aggregate_by_blocks() -> None:
    text = (
        "\n".join(
            [
                "# TYPE vllm:kv_cache_usage_perc gauge",
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.9',
                'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3',
                "# TYPE vllm:num_requests_running gauge",
                'vllm:num_requests_running{engine="0",model_name="m"} 5',
                'vllm:num_requests_running{engine="1",model_name="m"} 2',
                "# TYPE vllm:cache_config_info gauge",
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0',
                'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="300"} 1.0',
                "# TYPE vllm:num_preemptions_total counter",
                'vllm:num_preemptions_total{engine="0",model_name="m"} 3',
                'vllm:num_preemptions_total{engine="1",model_name="m"} 4',
            ]
        )
        + "\n"
    )
    m = parse_engine_metrics(text)
    assert m.usage == pytest.approx((0.9 * 100 + 0.3 * 300) / 400)
    assert m.geometry == KvGeometry(16, 400)
    assert (m.running, m.preemptions, m.engines) == (7, 7, 2)


def test_not_a_vllm_server() -> None:
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics("# TYPE up gauge\nup 1\n")
