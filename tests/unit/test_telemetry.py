from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gateway.tokens.cost import KvGeometry
from gateway.upstream.engine_metrics import WANTED_SAMPLES, MetricsFormatError, parse_engine_metrics, samples

DATA = Path(__file__).resolve().parents[1] / "data"


def test_real_vllm_sample_saturated() -> None:
    m = parse_engine_metrics((DATA / "metrics-sample-saturated.txt").read_text())
    assert m.usage == pytest.approx(0.9921568627450981)
    assert m.geometry == KvGeometry(block_size=128, num_blocks=256)
    assert (m.running, m.waiting, m.engines) == (23.0, 41.0, 1)


def test_real_vllm_sample_idle() -> None:
    m = parse_engine_metrics((DATA / "metrics-sample.txt").read_text())
    assert m.usage == 0.0 and m.geometry is not None


def _oracle(text: str) -> list[tuple[str, dict[str, str], float]]:
    """What prometheus_client's own parser reads of the series we want."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in WANTED_SAMPLES
    ]


@pytest.mark.parametrize("name", ["metrics-sample.txt", "metrics-sample-saturated.txt"])
def test_reads_what_prometheus_client_reads_of_real_vllm(name: str) -> None:
    text = (DATA / name).read_text()
    assert samples(text) == _oracle(text)
    assert {n for n, _, _ in samples(text)} == {
        "process_start_time_seconds",  # changes when the engine restarts
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
        "vllm:request_success_total",  # goes back when the engine restarts
        "vllm:prompt_tokens_total",  # with the generated ones, orders two samples of one engine process
        "vllm:generation_tokens_total",
    }


def test_the_api_servers_start_time_is_read() -> None:
    # a line-filter that kept only "vllm:" lines dropped it, and restarts were noticed by counters alone
    assert parse_engine_metrics((DATA / "metrics-sample.txt").read_text()).started_at == pytest.approx(1.79532285013e9)


def test_the_tokens_processed_mark_the_sample() -> None:
    """Prompt plus generated tokens: two replicas' samples of one engine process are ordered by it."""
    m = parse_engine_metrics((DATA / "metrics-sample-saturated.txt").read_text())
    assert m.tokens == 30831.0 + 4551.0


_label_values = st.text(alphabet=st.sampled_from(list('ab{}" =,\\\n\u00e9')), max_size=8)
_names = st.sampled_from(
    [*WANTED_SAMPLES, "vllm:num_requests_running_extra", "vllm:request_success_created", "vllm:other"]
)


def _escaped(value: str) -> str:
    """A label value as the exposition format writes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def _exposition(draw: st.DrawFn) -> str:
    lines = []
    for name in draw(st.lists(_names, max_size=6)):
        lines.append(f"# TYPE {name} gauge")
        for _ in range(draw(st.integers(1, 3))):
            labels = draw(st.dictionaries(st.sampled_from(["engine", "model_name", "block_size"]), _label_values))
            body = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
            value = draw(st.sampled_from(["0", "1.5", "-2e3", "NaN", "+Inf", "7"]))
            stamp = draw(st.sampled_from(["", " 1700000000000"]))
            lines.append(f"{name}{{{body}}} {value}{stamp}" if labels else f"{name} {value}{stamp}")
    return "\n".join(lines) + "\n"


@given(_exposition())
def test_reads_what_prometheus_client_reads(text: str) -> None:
    def comparable(rows: list[tuple[str, dict[str, str], float]]) -> list[tuple[str, dict[str, str], str]]:
        return [(n, labels, repr(float(v))) for n, labels, v in rows]  # NaN != NaN; "0" may read as int 0

    assert comparable(samples(text)) == comparable(_oracle(text))


def test_legacy_metric_name_before_vllm_0_12() -> None:
    text = '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
    m = parse_engine_metrics(text)
    assert m.usage == 0.42 and m.geometry is None


def test_data_parallel_engines_share_one_pool_figure() -> None:
    """vLLM's API server sums its data-parallel ranks' blocks and repeats that total on each rank's
    ``cache_config_info`` row: summing the rows again counted a pool of 2 x 1000 blocks as 4000 (N^2), and
    admitted up to 180% of it between two scrapes."""
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
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2000"} 1.0',
                'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="2000"} 1.0',
                "# TYPE vllm:num_preemptions_total counter",
                'vllm:num_preemptions_total{engine="0",model_name="m"} 3',
                'vllm:num_preemptions_total{engine="1",model_name="m"} 4',
            ]
        )
        + "\n"
    )
    m = parse_engine_metrics(text)
    assert m.usage == pytest.approx((0.9 + 0.3) / 2)
    assert m.geometry == KvGeometry(16, 2000)
    assert (m.running, m.preemptions, m.engines) == (7, 7, 2)


def test_not_a_vllm_server() -> None:
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics("# TYPE up gauge\nup 1\n")


def test_an_unknown_escape_is_kept_as_prometheus_client_keeps_it() -> None:
    text = 'vllm:cache_config_info{block_size="16",path="C:\\\\tmp\\tx",q="say \\"hi\\"\\n"} 1.0\n'
    assert samples(text) == _oracle(text)
    assert samples(text)[0][1]["path"] == "C:\\tmp\\tx"


def test_a_value_that_is_not_a_number_fails_the_scrape() -> None:
    """As prometheus_client's parser did: the scrape counts as failed rather than read a gauge as absent."""
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:num_requests_running{engine="0"} abc\n')


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_value_that_is_not_finite_fails_the_scrape(value: str) -> None:
    """A NaN usage made every admission decision raise (round(nan)) until the sample went stale; a NaN start
    time would read as a restart at every scrape, dropping every reservation."""
    for series in ("vllm:kv_cache_usage_perc", "process_start_time_seconds"):
        text = f'vllm:kv_cache_usage_perc{{engine="0"}} 0.5\n{series}{{engine="0"}} {value}\n'
        with pytest.raises(MetricsFormatError, match="not a finite value"):
            parse_engine_metrics(text)


def test_an_engine_with_speculative_decoding_says_so_through_its_counters() -> None:
    """vLLM exposes vllm:spec_decode_* only with --speculative-config (and vllm:diffusion_* for a diffusion
    model): then a step may emit several tokens per sequence, and a stream's events are a floor of its tokens."""
    plain = (DATA / "metrics-sample.txt").read_text()
    assert not parse_engine_metrics(plain).multi_token_steps
    drafts = '# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total{engine="0"} 12.0\n'
    assert parse_engine_metrics(plain + drafts).multi_token_steps
    diffusion = 'vllm:diffusion_num_committed_tokens_total{engine="0",model_name="m"} 0.0\n'
    assert parse_engine_metrics(plain + diffusion).multi_token_steps
