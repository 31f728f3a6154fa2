"""The simulator's HTTP surface against vLLM's: OpenAI shapes, error bodies, /metrics, queue limit, OOM."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.api import SIM_OUTPUT_FIELD, token_text
from tests.sim.conftest import StartSim
from tests.support.promtext import metric_sum, parse_metrics

REFERENCE = Path(__file__).resolve().parent / "reference"  # real vLLM 0.32 /metrics samples
MODEL = "llama3-8b"
FAST = ("--time-scale", "0.02")


def families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """By family, with prometheus_client's own parser: the exposition must be one it reads as vLLM's."""
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(s.name, dict(s.labels), s.value) for s in fam.samples]
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """One series of a scrape (KeyError if the simulator does not export it)."""
    return metric_sum(parse_metrics(text), name, **labels)


def ends(texts: list[str]) -> list[int]:
    """The token (1-based) each event's text ends with: the simulator's words, one per token."""
    out, tokens = [], 0
    for text in texts:
        tokens += len(re.findall(r" \w+|\.", text))
        out.append(tokens)
    return out


async def burst(url: str, n: int, prompt_len: int, max_tokens: int, stream: bool = False) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {"model": MODEL, "prompt": list(range(prompt_len)), "max_tokens": max_tokens, "stream": stream}
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n))))


def test_metrics_parse_and_match_reference_names(sim: StartSim) -> None:
    proc = sim(*FAST, "--kv-scale", "0.05", "--legacy-gpu-cache-metric")
    asyncio.run(burst(proc.url, 4, 200, 20))
    text = httpx.get(proc.url + "/metrics").text
    ours = families(text)
    ref_names: set[str] = set()
    for sample in ("metrics-sample.txt", "metrics-sample-saturated.txt"):
        ref_names |= set(families((REFERENCE / sample).read_text()))
    ours_vllm = {n for n in ours if n.startswith("vllm:")}
    required = {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:admission_rejections",
        "vllm:request_success",
    }
    assert required <= ours_vllm
    # Every vllm family is one the real engine exports, except the opt-in pre-V1 gauge.
    assert ours_vllm - ref_names == {"vllm:gpu_cache_usage_perc"}
    for name in ours_vllm:
        for sample_name, labels, _ in ours[name]:
            assert labels.get("model_name") == MODEL, sample_name
            if not name.startswith("vllm:admission_rejections"):
                assert labels.get("engine") == "0", sample_name
    info = ours["vllm:cache_config_info"][0][1]
    assert info["block_size"] == "16"
    blocks = int(info["num_gpu_blocks"])
    assert blocks == round(31_743 * 0.05) + 1
    assert metric(text, "vllm:generation_tokens_total") == 80
    assert metric(text, "vllm:prompt_tokens_total") == 800
    assert metric(text, "vllm:time_to_first_token_seconds_count") == 4
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 4
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize("server_interval", [None, 8])
def test_a_stream_interval_batches_tokens_into_events_as_vllm_does(sim: StartSim, server_interval: int | None) -> None:
    """vLLM's stream_interval (the request's, raised to the server's --stream-interval): the first token at
    once, then an event per interval, the rest in the last; the same text and usage as one event per token."""
    flags = () if server_interval is None else ("--stream-interval", str(server_interval))
    proc = sim(*FAST, "--kv-scale", "0.05", *flags)
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)

    def stream(interval: int | None) -> list[str]:
        chunks = client.completions.create(
            model=MODEL,
            prompt=list(range(40)),
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **({"stream_interval": interval} if interval else {})},
        )
        texts, usage = [], None
        for c in chunks:
            if c.choices:
                texts.append(c.choices[0].text)
            usage = c.usage or usage
        assert usage is not None and usage.completion_tokens == 50
        return texts

    # Where events end, in tokens: each at a bound of the interval (the first token at once, then every 8th,
    # then the last), though not at every bound: the events a reader has not yet taken are merged, as vLLM's
    # output collector merges them (how many depends on how fast this test reads).
    plain, batched = stream(None), stream(8)
    text = "".join(map(token_text, range(1, 51)))
    assert "".join(plain) == "".join(batched) == text
    bounds = {1, 9, 17, 25, 33, 41, 49, 50}
    assert set(ends(batched)) <= bounds and ends(batched)[-1] == 50
    if server_interval is None:
        assert len(plain) > len(batched)  # one event per token as far as the reader keeps up
    else:  # the server batches every stream alike
        assert set(ends(plain)) <= bounds
    bad = httpx.post(proc.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "stream_interval": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_interval"


def test_openai_client_shapes_and_vllm_errors(sim: StartSim) -> None:
    proc = sim(*FAST, "--kv-scale", "0.05", "--max-model-len", "2048")
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
    models = httpx.get(proc.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 2048

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello " * 40}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    content = [c for c in chunks if c.choices]  # as vLLM: the role first, with no token, then the tokens
    assert content[0].choices[0].delta.role == "assistant" and content[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in content) == "".join(map(token_text, range(1, 8)))
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    counted = httpx.post(
        proc.url + "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}]}
    ).json()
    assert chunks[-1].usage.prompt_tokens == counted["count"] > 40

    done = client.completions.create(model=MODEL, prompt=list(range(100)), max_tokens=5)
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (100, 5)
    # No max_tokens: vLLM's completions default of 16; a cap past the context is clamped to what is left of it.
    short = client.completions.create(model=MODEL, prompt=list(range(100)))
    assert short.usage is not None and short.usage.completion_tokens == 16
    long = client.completions.create(model=MODEL, prompt=list(range(2000)), max_tokens=2000)
    assert long.usage is not None and long.usage.completion_tokens == 48
    assert long.choices[0].finish_reason == "length"

    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    assert nf.value.status_code == 404
    assert nf.value.body == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model=MODEL, prompt=list(range(2049)), max_tokens=5)
    assert "maximum context length is 2048 tokens" in str(br.value)
    assert br.value.body["param"] == "input_tokens"  # type: ignore[index]  # as vLLM's, kvgate's
    raw = httpx.post(proc.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(2048))})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == 400
    assert raw.json()["error"]["message"] == "max_tokens must be at least 1, got 0."  # fits, nothing left


async def queue_limit_round(url: str, stream: bool) -> list[httpx.Response]:
    """One long request occupies the only slot; then five arrive: two can wait, three hit the limit."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        long = asyncio.create_task(
            client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 500})
        )
        running = 0.0
        while running < 1:  # polling a remote server: there is no event to wait on
            await asyncio.sleep(0.01)
            running = metric((await client.get("/metrics")).text, "vllm:num_requests_running")
        body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 30, "stream": stream}
        rest = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(5)))
        assert (await long).status_code == 200
        return list(rest)


def test_max_num_queued_reqs_rejects_like_vllm(sim: StartSim) -> None:
    # vLLM counts every unfinished request against the limit, running and waiting: one runs, two may wait
    proc = sim("--time-scale", "0.2", "--kv-scale", "0.05", "--max-num-seqs", "1", "--max-num-queued-reqs", "3")
    for stream in (False, True):  # checked before the response starts: streams get the plain 503 too
        answers = asyncio.run(queue_limit_round(proc.url, stream=stream))
        assert sorted(r.status_code for r in answers) == [200, 200, 503, 503, 503]
        rejected = next(r for r in answers if r.status_code == 503)
        assert rejected.headers["content-type"].startswith("application/json")
        error = rejected.json()["error"]
        assert error["code"] == 503 and error["type"] == "Service Unavailable"
        assert error["message"].startswith("The engine is currently busy and cannot accept new requests.")
        assert "retry-after" not in rejected.headers
    text = httpx.get(proc.url + "/metrics").text
    assert metric(text, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 6


def test_kv_pressure_preempts_and_counts(sim: StartSim) -> None:
    proc = sim(*FAST, "--kv-scale", "0.02", "--no-oom")  # 636 blocks x 16 tokens
    responses = asyncio.run(burst(proc.url, 12, 700, 400))
    assert all(r.status_code == 200 for r in responses)
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r in responses)
    text = httpx.get(proc.url + "/metrics").text
    assert metric(text, "vllm:num_preemptions_total") > 0
    assert metric(text, "vllm:prompt_tokens_total") == 12 * 700
    assert metric(text, "kvgate_sim_oom_crashes_total") == 0


def test_oom_restart_fails_running_requests_with_500(sim: StartSim) -> None:
    # 636 blocks, 164-token steps: 40 prompts of 19 blocks, growing by 7 each, overfill the pool while
    # later prompts are still prefilling.
    proc = sim(*FAST, "--kv-scale", "0.02", "--restart-delay", "5")
    started = metric(httpx.get(proc.url + "/metrics").text, "process_start_time_seconds")
    responses = asyncio.run(burst(proc.url, 40, 300, 100))
    failed = [r for r in responses if r.status_code == 500]
    assert failed, [r.status_code for r in responses]
    assert failed[0].json()["error"]["message"].startswith("EngineCore encountered an issue")
    assert "CUDA out of memory" in proc.log()
    deadline = time.monotonic() + 30
    while httpx.get(proc.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    text = httpx.get(proc.url + "/metrics").text
    assert metric(text, "kvgate_sim_oom_crashes_total") >= 1
    assert metric(text, "kvgate_sim_engine_restarts_total") >= 1
    assert metric(text, "vllm:generation_tokens_total") == 0  # a restarted engine's counters start again
    assert metric(text, "process_start_time_seconds") > started  # and it is a new process, as vLLM's would be


def test_oom_exit_mode_kills_the_process(sim: StartSim) -> None:
    proc = sim(*FAST, "--kv-scale", "0.02", "--oom-mode", "exit")
    responses = asyncio.run(burst(proc.url, 40, 300, 100))
    assert any(r.status_code == 500 for r in responses)
    assert proc.popen.wait(timeout=30) == 1
    assert "CUDA out of memory" in proc.log()


@pytest.mark.parametrize("engine_interval", [1, 8])
def test_kvgate_learns_a_batched_streams_length_from_the_usage_it_asks_for(
    sim: StartSim, gateway: Callable[..., str], engine_interval: int
) -> None:
    """vLLM's stream_interval (the request's, or the engine's --stream-interval) puts many tokens in one SSE
    event: streams that stop at 60 of a 400-token budget, batched by 8, come as 9 events. Counted as tokens
    they taught ~9 per stream (reserving 1/7th of what they produce). kvgate asks the engine for the usage of a
    stream whose client did not, so it learns 60 either way, and the client that asked for none gets none."""
    flags = () if engine_interval == 1 else ("--stream-interval", str(engine_interval))
    proc = sim(*FAST, "--kv-scale", "0.05", *flags)
    config = {
        "tokenizer": "heuristic",
        "upstream": {"stream_interval": engine_interval},
        "admission": {"output_estimate": {"min_samples": 4}},
    }
    gw = gateway(proc.url, config)
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
    body = {SIM_OUTPUT_FIELD: 60, **({} if engine_interval > 1 else {"stream_interval": 8})}
    sent = 0

    def settled() -> None:
        """Every stream's exchange has ended (after [DONE], with the engine's response) and been learned, and an
        engine sample taken since has refreshed the estimate's cached answers."""
        deadline = time.monotonic() + 60
        while metric_sum(parse_metrics(httpx.get(gw + "/metrics").text), "kvgate_reservations_released_total") < sent:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        learned_at = time.monotonic()
        while True:  # the gateway's latest sample was taken after learned_at: asked_at - age is before it
            asked_at = time.monotonic()
            age = httpx.get(gw + "/readyz").json()["metrics_age_s"]
            if age is not None and asked_at - age > learned_at:
                return
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def expected_after(usage: bool) -> str:
        nonlocal sent
        for _ in range(6):
            sent += 1
            options = {"stream_options": {"include_usage": True}} if usage else {}
            chunks = list(
                client.completions.create(
                    model=MODEL, prompt=list(range(40)), max_tokens=400, stream=True, extra_body=body, **options
                )
            )
            assert sum(bool(c.choices) for c in chunks) == 9  # 60 tokens: 1, seven of 8, 3
            assert sum(c.usage is not None for c in chunks) == (1 if usage else 0)  # what the client asked for
        settled()
        sent += 1
        reply = client.completions.with_raw_response.create(model=MODEL, prompt=list(range(40)), max_tokens=400)
        return reply.headers["x-kvgate-expected-output-tokens"]

    assert expected_after(usage=False) == "60"
    assert expected_after(usage=True) == "60"


def test_a_completions_batch_is_one_engine_request_per_prompt(sim: StartSim) -> None:
    """A list of prompts, as vLLM serves it: each its own engine request with its own budget (what its context
    leaves), one choice per prompt in order, usage summed; streamed, each prompt's events carry its index."""
    proc = sim(*FAST, "--kv-scale", "0.05", "--max-model-len", "2048")
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
    prompts = [list(range(100)), list(range(2040)), list(range(10))]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == ["".join(map(token_text, range(1, n + 1))) for n in (20, 8, 20)]
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (2150, 48)
    text = httpx.get(proc.url + "/metrics").text
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 3

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["hello there", "a longer prompt, of more words than the first"],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    by_prompt: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            by_prompt[choice.index] = by_prompt.get(choice.index, "") + choice.text
    assert by_prompt == {0: "".join(map(token_text, range(1, 6))), 1: "".join(map(token_text, range(1, 6)))}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10

    mixed = httpx.post(proc.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", [1, 2]]})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"
    too_long = httpx.post(proc.url + "/v1/completions", json={"model": MODEL, "prompt": [[1], list(range(2049))]})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input_tokens"


def test_kvgate_admits_and_settles_a_completions_batch_as_the_engine_serves_it(
    sim: StartSim, gateway: Callable[..., str]
) -> None:
    """A batch of prompts through kvgate: priced and reserved prompt by prompt, relayed whole (every choice, in
    order), streamed with each prompt's index, and settled from the engine's summed usage; nothing held after."""
    proc = sim(*FAST, "--kv-scale", "0.05", "--max-model-len", "2048")
    gw = gateway(proc.url, {"tokenizer": "heuristic"})
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
    prompts = [list(range(100)), list(range(300)), list(range(10))]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.text == "".join(map(token_text, range(1, 21))) for c in done.choices)
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (410, 60)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompts[:2], max_tokens=7, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert all(c.usage is None for c in chunks)  # kvgate asked for the usage; the client did not, and gets none
    deadline = time.monotonic() + 60
    while (m := parse_metrics(httpx.get(gw + "/metrics").text))["kvgate_inflight_requests"] > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert m["kvgate_reserved_blocks"] == 0
    assert metric_sum(m, "kvgate_completion_tokens_total") == 60 + 14  # the engine's usage, both answers
    assert metric_sum(m, "kvgate_prompt_tokens_actual_total") == 410 + 400
