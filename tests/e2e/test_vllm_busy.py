"""vLLM's own admission limit (``--max-num-queued-reqs``) behind kvgate, against the real engine.

vLLM 0.32 rejects with "The engine is currently busy" in two forms and never sends Retry-After: a plain
HTTP 503 (non-streaming), and, for streams, an HTTP 200 whose first SSE event is ``data: {"error": {...,
"code": 503}}``. An SDK client sees the second as an in-band stream error, not a retryable status. Either way
the engine ran nothing of the request, so kvgate holds it (and those queued behind it) until the engine has
room, and sends it again: a burst the engine's own queue cannot take is served whole, in both forms. (When a
request's wait budget runs out first, its client gets an OpenAI-shaped 503 with Retry-After: see
``tests/integration/test_proxy.py``.)

The first test pins down the engine's behaviour (if a vLLM upgrade changes the forms, it says so); the
other checks that kvgate recognises each form. One engine for the module. Needs setup.sh; skipped otherwise.
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
WAIT_S = 1800.0  # the clients' and kvgate's wait budget: longer than any machine takes for a burst


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmEngine]:
    extra = ("--max-num-queued-reqs", str(QUEUE_LIMIT))
    with VllmEngine(blocks=256, max_num_seqs=RUNNING, extra_args=extra, name="vllm-busy") as eng:
        yield eng


@pytest.fixture
def gateway(engine: VllmEngine) -> Iterator[Proc]:
    # Small requests: KV admission lets every one of them through, so the engine's own limit is what bites.
    # Waits as long as the engine takes on this machine (no deadline tuned to its speed). One per test: a
    # gateway that was turned away sends the engine no more than it then held, for a while.
    config = {"admission": {"queue_max_wait_s": WAIT_S}}
    with start_gateway(engine.base_url, config, tokenizer=f"hf:{model_dir()}") as gw:
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


async def _sdk_burst(base_url: str, stream: bool) -> list[BaseException | int]:
    """Completion tokens per success, or the exception the SDK raised."""
    sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)

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
def test_kvgate_serves_whole_a_burst_the_engine_turns_away_in_part(gateway: Proc, stream: bool, form: str) -> None:
    """Every request of a burst the engine's queue cannot hold is served in full through kvgate, its clients
    never seeing the engine's refusals, which kvgate counts by form and gives back (none is billed or counted
    as a finish)."""
    forms = ("status", "sse")
    met = dict.fromkeys(forms, 0.0)
    for _ in range(BURSTS):
        seen0 = {f: busy_rejections(gateway, f) for f in forms}
        results = asyncio.run(_sdk_burst(gateway.url, stream))
        seen = {f: busy_rejections(gateway, f) - seen0[f] for f in forms}
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of {N} failed, e.g. {failed[:3]}"
        assert all(tokens == MAX_TOKENS for tokens in results), results
        if not stream:
            assert seen["sse"] == 0, seen
        met = {f: met[f] + seen[f] for f in forms}
        if met[form] > 0:
            break
    assert met[form] > 0, f"no busy refusal of form {form!r} was met in {BURSTS} bursts: {met}"
    m = scrape(gateway.url, timeout_s=10)
    released = metric_sum(m, "kvgate_reservations_released_total", default=0.0, outcome="upstream_busy")
    assert released == metric_sum(m, "kvgate_upstream_busy_total", default=0.0)  # each refusal given back once
    ready = httpx.get(f"{gateway.url}/readyz", timeout=5).json()
    assert ready["inflight"] == 0 and ready["queue_depth"] == 0
