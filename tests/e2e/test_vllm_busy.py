"""vLLM's own admission limit (``--max-num-queued-reqs``) behind kvgate, against the real engine.

vLLM 0.32 rejects with "The engine is currently busy" in two forms and never sends Retry-After: a plain
HTTP 503 (non-streaming), and, for streams, an HTTP 200 whose first SSE event is ``data: {"error": {...,
"code": 503}}``. An SDK client sees the second as an in-band stream error, not a retryable status. kvgate must
turn both into an OpenAI-shaped 503 with Retry-After, so that clients back off by themselves.

The first test pins down the engine's behaviour (if a vLLM upgrade changes the forms, it says so); the
others check kvgate's translation of each form. One engine for the module. Needs setup.sh; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.vllm_cpu.engine import MODEL_NAME, VllmEngine, missing, model_dir
from tests.support.procs import Proc, start_gateway
from tests.support.promtext import metric_sum, scrape

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

# The burst must overfill the engine whatever its speed: at most RUNNING sequences run and QUEUE_LIMIT wait,
# and the first of them only finishes after MAX_TOKENS decode steps, so whether the other arrivals are rejected
# depends on N outrunning MAX_TOKENS engine steps, not on the scheduler being slower than the API server (with
# room for 64 running sequences, a fast machine scheduled a whole burst of 32 and rejected none).
RUNNING = 2
QUEUE_LIMIT = 4
N = 32  # concurrent requests: far more than RUNNING + QUEUE_LIMIT
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmEngine]:
    extra = ("--max-num-queued-reqs", str(QUEUE_LIMIT))
    with VllmEngine(blocks=256, max_num_seqs=RUNNING, extra_args=extra, name="vllm-busy") as eng:
        yield eng


@pytest.fixture(scope="module")
def gateway(engine: VllmEngine) -> Iterator[Proc]:
    # Small requests: KV admission lets every one of them through, so the engine's own limit is what bites.
    with start_gateway(engine.base_url, {}, tokenizer=f"hf:{model_dir()}") as gw:
        yield gw


def busy_rejections(gw: Proc, form: str) -> float:
    """kvgate_upstream_busy_total{form=...} (0 before the first rejection of that form)."""
    return metric_sum(scrape(gw.url, timeout_s=10), "kvgate_upstream_busy_total", default=0.0, form=form)


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": list(range(100 + i, 160 + i)),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


async def _raw_burst(base_url: str, stream: bool) -> list[tuple[str, dict[str, str], str]]:
    """(form, headers, first part of the body) per request, sent all at once with a plain HTTP client."""

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict[str, str], str]:
        async with client.stream("POST", f"{base_url}/v1/completions", json=_body(i, stream)) as r:
            text = (await r.aread()).decode()
        if r.status_code == 200 and stream and text.lstrip().startswith('data: {"error"'):
            return "200+sse-error", dict(r.headers), text.strip().split("\n\n")[0]
        return str(r.status_code), dict(r.headers), text[:500]

    limits = httpx.Limits(max_connections=N + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(N))))


def test_engine_rejects_in_both_forms(engine: VllmEngine) -> None:
    plain = asyncio.run(_raw_burst(engine.base_url, stream=False))
    streamed = asyncio.run(_raw_burst(engine.base_url, stream=True))
    forms = Counter(f for f, _, _ in plain), Counter(f for f, _, _ in streamed)
    assert forms[0]["503"] > 0 and forms[0]["200"] > 0, forms
    assert forms[1]["200+sse-error"] > 0, f"streams no longer get the in-band error form: {forms}"
    for form, _headers, text in plain + streamed:
        if form == "503":
            assert json.loads(text)["error"]["code"] == 503
        elif form == "200+sse-error":
            assert json.loads(text.removeprefix("data:"))["error"]["code"] == 503


def _check_openai_503(exc: openai.APIStatusError) -> None:
    """What an OpenAI SDK client needs to back off: status 503, Retry-After, an OpenAI error object."""
    assert exc.status_code == 503
    retry_after = exc.response.headers.get("retry-after")
    assert retry_after is not None and int(retry_after) >= 1
    assert int(exc.response.headers["retry-after-ms"]) >= 1
    error = exc.response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == "engine_busy" and error["message"]


async def _sdk_burst(base_url: str, stream: bool) -> list[BaseException | int]:
    """Completion tokens per success, or the exception the SDK raised."""
    sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> int:
        body = _body(i, stream)
        kwargs: dict[str, Any] = {"extra_body": {"ignore_eos": True}}
        if stream:
            chunks = await sdk.completions.create(
                model=MODEL_NAME,
                prompt=body["prompt"],
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
                **kwargs,
            )
            tokens = -1
            async for chunk in chunks:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens
        response = await sdk.completions.create(
            model=MODEL_NAME, prompt=body["prompt"], max_tokens=MAX_TOKENS, **kwargs
        )
        assert response.usage is not None
        return response.usage.completion_tokens

    try:
        return list(await asyncio.gather(*(one(i) for i in range(N)), return_exceptions=True))
    finally:
        await sdk.close()


BURSTS = 3  # a stream's in-band refusal is vLLM's race (several pass its check before any is added): a few tries


@pytest.mark.parametrize(("stream", "form"), [(False, "status"), (True, "sse")], ids=["plain-503", "sse-error"])
def test_kvgate_turns_engine_busy_into_openai_503(gateway: Proc, stream: bool, form: str) -> None:
    forms = ("status", "sse")
    met = dict.fromkeys(forms, 0.0)
    for _ in range(BURSTS):
        seen0 = {f: busy_rejections(gateway, f) for f in forms}
        results = asyncio.run(_sdk_burst(gateway.url, stream))
        seen = {f: busy_rejections(gateway, f) - seen0[f] for f in forms}

        served = [r for r in results if isinstance(r, int)]
        rejected = [r for r in results if isinstance(r, openai.APIStatusError)]
        other = [r for r in results if isinstance(r, BaseException) and not isinstance(r, openai.APIStatusError)]
        assert not other, f"not an HTTP status the SDK can act on (e.g. an in-band stream error): {other[:3]}"
        assert served and rejected, f"{len(served)} served, {len(rejected)} rejected"
        assert all(tokens == MAX_TOKENS for tokens in served)
        for exc in rejected:
            _check_openai_503(exc)
        # Which form a stream's rejection takes is vLLM's timing (one run: 10 in-band, 18 plain; a CI run met
        # 24 plain and none in-band in one burst): every rejection must be recognised in one form or the other,
        # and this case's form must be met in one of the bursts.
        assert seen["status"] + seen["sse"] == len(rejected), f"kvgate counted {seen} for {len(rejected)} rejections"
        if not stream:
            assert seen["sse"] == 0, seen
        met = {f: met[f] + seen[f] for f in forms}
        if met[form] > 0:
            break
    assert met[form] > 0, f"no busy rejection of form {form!r} was met in {BURSTS} bursts: {met}"
    ready = httpx.get(f"{gateway.url}/readyz", timeout=5).json()
    assert ready["inflight"] == 0 and ready["queue_depth"] == 0
