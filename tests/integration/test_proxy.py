"""The gateway as a real process in front of a real (small, vLLM-like) HTTP server, driven by the OpenAI SDK."""

from __future__ import annotations

import base64
import itertools
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from tests.support.promtext import assert_ledger_empty, metric_sum, scrape

pytestmark = pytest.mark.e2e


@pytest.fixture
def pair(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> tuple[str, str]:
    upstream = mini_vllm(token_delay_ms=1)
    return upstream, gateway(upstream, {"tokenizer": "heuristic"})


def test_sdk_chat_and_completions_unchanged_through_the_gateway(pair: tuple[str, str]) -> None:
    upstream, gw = pair
    direct = openai.OpenAI(base_url=upstream + "/v1", api_key="x")
    via = openai.OpenAI(base_url=gw + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Say something"}]
    for client in (direct, via):
        chat = client.chat.completions.create(model="mini", messages=msgs, max_tokens=5)  # type: ignore[arg-type]
        assert chat.choices[0].message.content == " tok" * 5
        assert chat.usage is not None and chat.usage.completion_tokens == 5
        comp = client.completions.create(model="mini", prompt="hello there", max_tokens=4)
        assert comp.choices[0].text == " tok" * 4
        stream = client.chat.completions.create(
            model="mini",
            messages=msgs,
            max_tokens=6,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " tok" * 6
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(model="mini", prompt=[1, 2, 3], max_tokens=3, stream=True)
        )
        assert text == " tok" * 3
    m = assert_ledger_empty(gw)
    assert m["kvgate_requests_admitted_total"] == 4
    assert m["kvgate_prompt_tokens_estimated_total"] == m["kvgate_prompt_tokens_actual_total"] > 0


def test_passthrough_keeps_status_body_and_headers(pair: tuple[str, str]) -> None:
    upstream, gw = pair
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "abcdefgh"}),
    ]:
        a = httpx.request(method, upstream + path, json=body)
        b = httpx.request(method, gw + path, json=body)
        assert (a.status_code, a.content) == (b.status_code, b.content)
        assert a.headers.get("x-upstream") == b.headers.get("x-upstream")
        assert "transfer-encoding" not in b.headers or "content-length" not in b.headers
    # a route kvgate does not know is its own OpenAI-shaped 404, though the engine would answer it
    assert httpx.get(upstream + "/nope").status_code == 200
    unknown = httpx.get(gw + "/nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


def test_streams_are_relayed_chunk_by_chunk(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    """With 50 ms between tokens, the client must see each event when it is produced, not at the end."""
    upstream = mini_vllm(token_delay_ms=50)
    gw = gateway(upstream, {"tokenizer": "heuristic"})
    arrivals = []
    import time

    with httpx.stream("POST", gw + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) == 8
    # buffered relaying would deliver everything at once: gaps ~0. Each gap is one token delay.
    assert sorted(gaps)[len(gaps) // 2] > 0.5 * 0.050


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, None),
        (b'{"prompt": 12}', 400, None),
        (b'{"prompt": [' + b",".join([b"1"] * 4100) + b'], "max_tokens": 5}', 400, "context_length_exceeded"),
        (b'{"prompt": "x", "max_tokens": 4000, "n": 2}', 400, "kv_cache_capacity_exceeded"),  # twice the pool
        (b'{"prompt": "x", "max_tokens": 5000}', 400, None),  # larger than the context: vLLM's 400 too
        (b'{"prompt": "x", "max_tokens": 5, "model": "other"}', 404, None),
    ],
)
def test_errors_are_openai_shaped(pair: tuple[str, str], body: bytes, status: int, code: str | None) -> None:
    _, gw = pair
    r = httpx.post(gw + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    if code is not None:
        assert error["code"] == code
    assert_ledger_empty(gw)


def test_a_chat_without_max_tokens_is_served_on_a_pool_of_one_context(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """The engine's pool holds exactly one context (256 blocks of 16, max_model_len 4096: what vLLM's
    ``--max-model-len -1`` makes), so a chat without max_tokens may fill all of it: past the watermark, short
    of the pool. vLLM serves it; kvgate refused it (a 400) and now serves it too, alone."""
    gw = gateway(mini_vllm(token_delay_ms=0), {"tokenizer": "heuristic"})
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x")
    msgs = [{"role": "user", "content": "Say something"}]
    for _ in range(2):
        chat = client.chat.completions.create(model="mini", messages=msgs)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.total_tokens == 4096  # the whole context
        comp = client.completions.create(model="mini", prompt="x", max_tokens=4096)  # clamped to the context
        assert comp.usage is not None and comp.usage.total_tokens == 4096
    m = assert_ledger_empty(gw)
    assert m["kvgate_requests_admitted_total"] == 4


def test_an_image_on_the_anthropic_and_responses_routes_is_not_priced_as_text(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """A 300 KB base64 image was counted as ~75k tokens of text: a 400 (longer than the 4,096-token context) for
    a request the engine serves. It is an image part now, as vLLM converts it."""
    gw = gateway(mini_vllm(token_delay_ms=0), {"tokenizer": "heuristic"})
    data = base64.b64encode(bytes(range(256)) * 900).decode()
    bodies = {
        "/v1/messages": {
            "model": "mini",
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                    ],
                }
            ],
        },
        "/v1/responses": {
            "model": "mini",
            "max_output_tokens": 8,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": f"data:image/png;base64,{data}"},
                    ],
                }
            ],
        },
    }
    for path, body in bodies.items():
        r = httpx.post(gw + path, json=body, timeout=30)
        assert r.status_code == 200, (path, r.text)
    assert assert_ledger_empty(gw)["kvgate_requests_admitted_total"] == 2


def test_a_prompt_longer_than_the_context_is_served_when_the_client_truncates_it(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """``truncate_prompt_tokens`` (and the Responses API's ``truncation: auto``): vLLM keeps that many of the
    prompt's tokens and serves it; kvgate refused it as longer than the 4,096-token context."""
    gw = gateway(mini_vllm(token_delay_ms=0), {"tokenizer": "heuristic"})
    long = "word " * 8000  # 10,000 tokens at the heuristic's 4 characters each
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x")
    truncated = {"truncate_prompt_tokens": 100}
    comp = client.completions.create(model="mini", prompt=long, max_tokens=4, extra_body=truncated)
    assert comp.usage is not None and comp.usage.prompt_tokens == 100
    chat = client.chat.completions.create(
        model="mini",
        messages=[{"role": "user", "content": long}],
        max_tokens=4,
        extra_body={"truncate_prompt_tokens": -1},  # the context, less the one token it generates
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 4095
    r = httpx.post(gw + "/v1/completions", json={"model": "mini", "prompt": long, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input_tokens"  # vLLM's name for it, on a route without messages
    assert assert_ledger_empty(gw)["kvgate_requests_admitted_total"] == 2


def test_a_chats_documents_are_prompt(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    """vLLM renders a chat's ``documents`` and ``chat_template_kwargs`` into its prompt: kvgate prices them with
    it (a RAG request whose documents fill the context is refused, not admitted as a two-word chat), and its
    estimate of a chat carrying them is what the engine counted."""
    upstream = mini_vllm(token_delay_ms=0)
    gw = gateway(upstream, {"tokenizer": "heuristic"})
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x")
    question = [{"role": "user", "content": "what does it say?"}]
    docs = [{"title": "manual", "text": "word " * 1000}]  # ~1,250 tokens at the heuristic's 4 characters each
    answer = client.chat.completions.create(
        model="mini",
        messages=question,
        max_tokens=4,
        extra_body={"documents": docs, "chat_template_kwargs": {"persona": "terse"}},
    )
    assert answer.usage is not None and answer.usage.prompt_tokens > 1250
    metrics = scrape(gw)
    assert metrics["kvgate_prompt_tokens_estimated_total"] == metrics["kvgate_prompt_tokens_actual_total"]
    whole = [{"title": "manual", "text": "word " * 4000}]  # 5,000 tokens: past the 4,096-token context
    rid = "rag-too-long"
    r = httpx.post(
        gw + "/v1/chat/completions",
        json={"model": "mini", "messages": question, "documents": whole, "max_tokens": 4},
        headers={"x-request-id": rid},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert all(seen[2].rpartition("-")[0] != rid for seen in httpx.get(upstream + "/debug/requests").json())
    assert_ledger_empty(gw)


def test_oversized_body_is_413(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    gw = gateway(mini_vllm(), {"tokenizer": "heuristic", "limits": {"max_body_bytes": 2048}})
    r = httpx.post(gw + "/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    # a body said to be larger is refused on its head alone: nothing of it is waited for
    host, port = gw.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{")
        answer = conn.makefile("rb").read()  # the answer, then the close: the rest is never read
    assert answer.startswith(b"HTTP/1.1 413 ") and b"payload_too_large" in answer


def test_sdk_backs_off_on_429_retry_after(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    """600 tokens/minute refill 10 per second. A request for 1 + 304 tokens leaves 295; the next one is short by
    10 tokens, so it gets a 429 with Retry-After of about 1 s. The SDK waits that long by itself and succeeds."""
    gw = gateway(
        mini_vllm(),
        {"tokenizer": "heuristic", "tenants": [{"name": "a", "api_keys": ["key-a"], "tokens_per_minute": 600}]},
    )
    body = {"prompt": "x", "max_tokens": 304}
    raw = httpx.post(gw + "/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert raw.status_code == 200 and raw.headers["x-ratelimit-limit-tokens"] == "600"
    limited = httpx.post(gw + "/v1/completions", json=body, headers={"authorization": "Bearer key-a"})
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["retry-after"]) <= 2 and 0 < int(limited.headers["retry-after-ms"]) <= 2000
    client = openai.OpenAI(base_url=gw + "/v1", api_key="key-a", max_retries=3)
    out = client.completions.create(model="mini", prompt="x", max_tokens=304)
    assert out.choices[0].text == " tok" * 304
    m = scrape(gw)
    assert m["kvgate_requests_rejected_total{reason=rate_limit_exceeded}"] >= 2  # the raw one and the SDK's first try
    assert_ledger_empty(gw)


def test_a_budget_larger_than_the_tenants_minute_waits_for_a_whole_minute_and_a_prompt_larger_is_refused(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """1,000 tokens per minute, a 4,096-token context. A chat without max_tokens may generate the rest of the
    context: it pre-charges the minute's whole allowance (it was a 429 on every try, with a Retry-After no wait
    could honour), and what it used beyond is a debt the tenant waits off; a prompt larger than the allowance
    can never be let in: a 400, which the SDKs do not retry."""
    gw = gateway(
        mini_vllm(),
        {"tokenizer": "heuristic", "tenants": [{"name": "a", "api_keys": ["key-a"], "tokens_per_minute": 1000}]},
    )
    key = {"authorization": "Bearer key-a"}
    chat = {"model": "mini", "messages": [{"role": "user", "content": "hi"}]}
    served = httpx.post(gw + "/v1/chat/completions", json=chat, headers=key, timeout=60)
    assert served.status_code == 200, served.text
    usage = served.json()["usage"]
    assert usage["completion_tokens"] > 1000 and served.headers["x-ratelimit-remaining-tokens"] == "0"
    spent = httpx.post(gw + "/v1/chat/completions", json=chat, headers=key)
    debt_minutes = (usage["total_tokens"] - 1000) / 1000  # used beyond the charge: taken when it settled
    assert spent.status_code == 429 and int(spent.headers["retry-after"]) >= 60 * (1 + debt_minutes) - 2
    too_large = httpx.post(gw + "/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1}, headers=key)
    assert too_large.status_code == 400 and "retry-after" not in too_large.headers
    assert too_large.json()["error"]["code"] == "request_too_large"
    assert_ledger_empty(gw)


def test_an_engine_busy_for_longer_than_the_wait_budget_in_both_forms_is_a_503_with_retry_after(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """Each form of vLLM's busy answer (a 503, or an error event opening a 200 stream) is a refusal that ran
    nothing: the request waits for room, and when its wait budget runs out first, its client hears 503
    engine_busy with Retry-After, billed nothing; it was not sent again at every scrape meanwhile. (One gateway
    each: after a refusal, a gateway sends the engine nothing more while it is as full as it was then.)"""
    upstream = mini_vllm(busy_after=0)  # vLLM with a full --max-num-queued-reqs queue: rejects everything
    config = {"tokenizer": "heuristic", "admission": {"queue_max_wait_s": 2.0}, "telemetry": {"scrape_interval_s": 0.1}}
    for stream, form in ((False, "status"), (True, "sse")):
        gw = gateway(upstream, config)
        r = httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_busy"  # what kept it waiting was the engine's own queue
        assert "retry-after" in r.headers and "retry-after-ms" in r.headers
        m = assert_ledger_empty(gw)
        assert m[f"kvgate_upstream_busy_total{{form={form}}}"] == 1  # sent once, then held: never every scrape
        assert m["kvgate_reservations_released_total{outcome=upstream_busy}"] == 1
        assert m["kvgate_requests_total{code=5xx}"] == 1
        assert m["kvgate_upstream_ttft_seconds_count"] == 0  # a refusal is no first token


def test_requests_an_engine_turns_away_as_busy_wait_for_room_instead_of_failing(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """vLLM's own queue is smaller than the KV cache allows (--max-num-queued-reqs): a request it turns away
    ran nothing, so kvgate holds it, and the ones queued behind it, until the engine has room, and all are
    served. (Before: each busy answer freed its reservation, the next in line was sent to be turned away too,
    and the queue emptied into 503s: 25 of 30 on the simulator.)"""
    upstream = mini_vllm(busy_after=2, token_delay_ms=10)
    gw = gateway(upstream, {"tokenizer": "heuristic", "telemetry": {"scrape_interval_s": 0.1}})

    def one(i: int) -> int:
        body = {"prompt": f"request {i}", "max_tokens": 8, "stream": i % 2 == 0}
        return httpx.post(gw + "/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(8)))
    assert statuses == [200] * 8
    m = assert_ledger_empty(gw)
    busy = metric_sum(m, "kvgate_upstream_busy_total", default=0.0)
    assert m["kvgate_reservations_released_total{outcome=upstream_busy}"] == busy
    assert m["kvgate_requests_total{code=2xx}"] == 8 and m["kvgate_reservations_released_total{outcome=completed}"] == 8


def test_each_request_is_counted_once_and_logged_with_the_ids_it_went_by(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list
) -> None:
    """One access line per proxied request, whatever its end, with the id the client knows it by and the one
    the engine was sent; and each counted once, by the class of what its client got."""
    gw = gateway(mini_vllm(), {"tokenizer": "heuristic"})
    served = httpx.post(
        gw + "/v1/completions?trace=secret-in-the-query",
        json={"model": "mini", "prompt": "hello there", "max_tokens": 3},
        headers={"x-request-id": "trace-1"},
    )
    streamed = httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    invalid = httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
    unknown = httpx.get(gw + "/v1/nothing-here")
    assert [r.status_code for r in (served, streamed, invalid, unknown)] == [200, 200, 400, 404]
    m = scrape(gw)
    assert metric_sum(m, "kvgate_requests_total") == 4
    assert m["kvgate_requests_total{code=2xx}"] == 2 and m["kvgate_requests_total{code=4xx}"] == 2
    assert m["kvgate_upstream_ttft_seconds_count"] == 1  # the stream's; an answer sent whole has no first token

    def access_lines() -> list[dict[str, object]]:
        return [orjson.loads(line) for line in procs[-1].log().splitlines() if '"logger":"kvgate.access"' in line]

    deadline = time.monotonic() + 30
    while len(access_lines()) < 4 and time.monotonic() < deadline:  # written in batches, a moment later
        time.sleep(0.05)
    log = procs[-1].log()
    lines = access_lines()
    assert len(lines) == 4, log
    by_id = {line["request_id"]: line for line in lines}
    first = by_id["trace-1"]
    assert (first["method"], first["path"], first["status"], first["reason"]) == ("POST", "/v1/completions", 200, None)
    assert first["engine_request_id"].startswith("trace-1-") and first["model"] == "mini"
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] == 3 and first["duration_ms"] >= 0
    assert "secret-in-the-query" not in log
    refused = by_id[invalid.headers["x-request-id"]]
    assert refused["status"] == 400 and refused["reason"] and "engine_request_id" not in refused
    assert by_id[unknown.headers["x-request-id"]]["status"] == 404


def test_log_requests_false_writes_no_access_line(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list
) -> None:
    upstream = mini_vllm()
    quiet = gateway(upstream, {"tokenizer": "heuristic", "log_requests": False})
    logged = gateway(upstream, {"tokenizer": "heuristic"})
    for gw in (quiet, logged):
        assert httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        assert scrape(gw)["kvgate_requests_total{code=2xx}"] == 1
    deadline = time.monotonic() + 30  # the other gateway's line is written within its batch's wait
    while '"logger":"kvgate.access"' not in procs[-1].log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert '"logger":"kvgate.access"' in procs[-1].log()
    assert '"logger":"kvgate.access"' not in procs[-2].log()


def test_an_engine_not_sampled_yet_has_no_metrics_age(gateway: Callable[..., str]) -> None:
    """An engine still loading its model (up to 30 minutes for vLLM) is not one whose metrics went stale: no
    age is exported until the first sample, so the staleness alert waits for one."""
    with socket.socket() as nothing:  # a port nobody answers on
        nothing.bind(("127.0.0.1", 0))
        gw = gateway(f"http://127.0.0.1:{nothing.getsockname()[1]}", {"tokenizer": "heuristic"}, ready=False)
        m = scrape(gw)
    assert m["kvgate_ready"] == 0
    assert "kvgate_upstream_metrics_age_seconds" not in m and "kvgate_kv_usage_observed" not in m


def test_request_id_is_propagated(pair: tuple[str, str]) -> None:
    _, gw = pair
    r = httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "abc-1"})
    assert r.headers["x-request-id"] == "abc-1"
    assert len(httpx.post(gw + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).headers["x-request-id"]) == 16
    for body in ({"prompt": "x", "max_tokens": 1}, {"prompt": "x", "max_tokens": -1}):  # answered, and refused
        r = httpx.post(gw + "/v1/completions", json=body, headers={"x-request-id": b"\xe9t\xe9"})
        assert (b"x-request-id", b"\xe9t\xe9") in r.headers.raw  # byte for byte, not re-encoded as UTF-8


def test_health_and_readiness(mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list) -> None:
    """A sidecar's readiness follows its engine (the Service routes around the pod); a tier of gateways in front
    of a shared engine (``listen.readiness: gateway``) stays ready while the engine is down, and its clients
    hear 503 with Retry-After rather than finding no endpoint."""
    upstream = mini_vllm()
    config = {"tokenizer": "heuristic", "admission": {"stale_after_s": 0.5}}
    gw = gateway(upstream, config)
    tier = gateway(upstream, {**config, "listen": {"readiness": "gateway"}})
    assert httpx.get(gw + "/healthz").status_code == 200
    assert httpx.get(gw + "/readyz").json()["ready"] is True
    procs[0].stop()  # the engine dies
    import time

    deadline = time.monotonic() + 10
    while httpx.get(gw + "/readyz").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    ready = httpx.get(gw + "/readyz")
    assert ready.status_code == 503 and "stale" in ready.json()["reason"]
    assert httpx.get(gw + "/healthz").status_code == 200
    m = scrape(gw)
    assert m["kvgate_scrape_errors_total"] >= 1 and m["kvgate_upstream_metrics_age_seconds"] > 0.5
    # a dead engine's last sample is no reading of it: the usage alerts must not fire on it
    for frozen in ("kvgate_kv_usage_observed", "kvgate_upstream_requests_running", "kvgate_engine_kv_usage_observed"):
        assert not any(name.startswith(frozen) for name in m), m
    while True:  # the tier scrapes on its own clock: its last sample may still be fresh for a moment
        still = httpx.get(tier + "/readyz")
        assert still.status_code == 200 and still.json()["ready"] is True, still.text
        if "stale" in still.json()["reason"]:
            break
        assert time.monotonic() < deadline + 10, still.text
        time.sleep(0.1)
    refused = httpx.post(tier + "/v1/completions", json={"model": "mini", "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and "retry-after" in refused.headers


def test_a_client_that_closes_on_done_has_had_its_whole_answer(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """The OpenAI SDK closes its connection as it reads ``data: [DONE]``, before the engine's response has
    ended (here 300 ms later). Each such stream completed: its usage is learned and settled, not counted as a
    client gone mid-answer (which cancelled it: no output length learned, billed as cut short)."""
    upstream = mini_vllm(eof_delay_ms=300)
    gw = gateway(upstream, {"tokenizer": "heuristic"})
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
    for _ in range(3):
        stream = client.completions.create(
            model="mini", prompt="hello there", max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        assert [c.usage.completion_tokens for c in stream if c.usage is not None] == [5]
    deadline = time.monotonic() + 60  # each exchange ends when the engine's response does, 300 ms after [DONE]
    while metric_sum(metrics := scrape(gw), "kvgate_reservations_released_total", default=0.0) < 3:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert metric_sum(metrics, "kvgate_reservations_released_total", outcome="completed") == 3
    assert metric_sum(metrics, "kvgate_completion_tokens_total") == 15
    assert metric_sum(metrics, "kvgate_client_disconnects_total", default=0.0) == 0
    assert_ledger_empty(gw)


def test_a_pool_counts_tokens_on_an_engine_that_takes_requests(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """``tokenizer: vllm`` in a pool whose first engine is gone: prompts are counted by the engine that takes
    requests (the /tokenize URL was fixed at start-up to the first engine, or to upstream.url when discovery
    found the engines: a 503 for every request, for good)."""
    from tests.support.procs import free_port

    live = mini_vllm()
    gone = f"http://127.0.0.1:{free_port()}"
    gw = gateway(gone, {"tokenizer": "vllm"}, extra_args=["--upstream", live])
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
    for i in range(3):
        assert (
            client.completions.create(model="mini", prompt=f"count me {i}", max_tokens=2).usage.completion_tokens == 2
        )
    tokenized = [target for _, target, _ in httpx.get(live + "/debug/requests").json() if target == "/tokenize"]
    assert len(tokenized) >= 3


def test_a_stream_without_usage_is_counted_by_its_usage_and_the_client_gets_none(
    mini_vllm: Callable[..., str], gateway: Callable[..., str]
) -> None:
    """The OpenAI SDK streams without usage by default, and an engine's events are no count of tokens (here 4
    tokens each, as vLLM sends them with --stream-interval, under speculative decoding or when its API server
    lags). kvgate asks the engine for the usage, learns and bills the exact length, and the client's stream is
    what it asked for: the same text, no usage chunk (a chunk without choices would break ``choices[0]``)."""
    upstream = mini_vllm(stream_interval=4)
    gw = gateway(upstream, {"tokenizer": "heuristic", "upstream": {"stream_interval": 4}})

    def stream(base: str) -> list[tuple[object, ...]]:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "count to thirty"}]
        chunks = client.chat.completions.create(model="mini", messages=messages, max_tokens=30, stream=True)  # type: ignore[arg-type]
        # every chunk has a choice; the final one carries the engine's fingerprint (vLLM moves it onto the usage
        # event when usage is asked for: kvgate gives it back)
        return [(c.choices[0].delta.content, c.choices[0].finish_reason, c.system_fingerprint, c.usage) for c in chunks]

    direct = stream(upstream)
    assert direct[-1][2] == "fp-mini"
    assert stream(gw) == direct
    deadline = time.monotonic() + 60
    while metric_sum(metrics := scrape(gw), "kvgate_reservations_released_total", default=0.0) < 1:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert metric_sum(metrics, "kvgate_completion_tokens_total") == 30  # the engine's count, not 8 events
    assert metric_sum(metrics, "kvgate_client_disconnects_total", default=0.0) == 0
