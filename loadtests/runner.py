"""Run one scenario against a target URL: send every planned request, record its outcome, and sample the
backend's /metrics (and the gateway's, when there is one) at 20 Hz real time, from a separate process."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.sim.api import SIM_OUTPUT_FIELD
from loadtests.scenario import Arrival
from loadtests.stats import RETRYABLE, RequestRecord, Sample
from tests.support.sampler import Sampler

SAMPLE_HZ = 20.0
BACKEND_SERIES = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "kvgate_sim_oom_crashes_total",
    "kvgate_sim_lag_seconds_total",
    "kvgate_sim_clock_seconds",
}
GATEWAY_SERIES = {
    "kvgate_queue_depth",
    "kvgate_output_estimate_quantile",
    "kvgate_requests_outran_estimate_total",
}
EXPECTED_HEADER = "x-kvgate-expected-output-tokens"
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "tempor")


def request_body(a: Arrival, model: str, rid: int) -> dict[str, Any]:
    """Completions carry token ids (exact counts for engine and gateway); chat carries ~4 chars per token.

    A natural length travels as the simulator-only ``sim_output_tokens`` (the plan's draw, so a scenario's
    lengths are reproducible); without one the request sends ``ignore_eos`` and runs to its cap.
    """
    common: dict[str, Any] = {"model": model}
    if a.sent_max_tokens is not None:
        common["max_tokens"] = a.sent_max_tokens
    common["stream"] = True
    if a.output_tokens is None:
        common["ignore_eos"] = True
    else:
        common[SIM_OUTPUT_FIELD] = a.output_tokens
    common["stream_options"] = {"include_usage": True}
    if a.api == "chat":
        words = [WORDS[(rid + i) % len(WORDS)] for i in range(a.prompt_tokens)]
        return {**common, "messages": [{"role": "user", "content": " ".join(words)[: a.prompt_tokens * 4]}]}
    return {**common, "prompt": [(rid * 7919 + i) % 32000 + 100 for i in range(a.prompt_tokens)]}


class Clock:
    """Simulated seconds since the run started."""

    def __init__(self, time_scale: float) -> None:
        self.scale = time_scale
        self.t0 = time.monotonic()

    def now(self) -> float:
        return self.at(time.monotonic())

    def at(self, monotonic: float) -> float:
        """The simulated time of a ``time.monotonic()`` reading."""
        return (monotonic - self.t0) / self.scale

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t * self.scale - (time.monotonic() - self.t0)))


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    a: Arrival,
    rid: int,
    model: str,
    clock: Clock,
    api_keys: dict[str, str],
    body: bytes | None = None,
    attempt: int = 0,
) -> RequestRecord:
    rec = RequestRecord(rid, a.cls, a.tenant, clock.now(), a.prompt_tokens, a.max_tokens, attempt=attempt)
    path = "/v1/chat/completions" if a.api == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_keys[a.tenant]}"} if a.tenant in api_keys else {}
    headers["x-stainless-retry-count"] = str(attempt)  # as the OpenAI SDKs number their attempts
    if a.max_wait_s is not None:  # the budget in the gateway's (real) seconds
        rec.max_wait_s = a.max_wait_s
        headers["x-kvgate-max-wait-s"] = f"{a.max_wait_s * clock.scale:g}"
    start = rec.sent
    try:
        async with session.post(
            url + path,
            data=body if body is not None else orjson.dumps(request_body(a, model, rid)),
            headers={"Content-Type": "application/json", **headers},
        ) as resp:
            rec.status = resp.status
            rec.retry_after = resp.headers.get("Retry-After")
            expected = resp.headers.get(EXPECTED_HEADER)
            rec.expected_output = int(expected) if expected is not None else None
            if resp.status != 200:
                body = await resp.read()
                rec.error_code = _error_code(body)
                rec.queue_eta_s, rec.waited_s, rec.estimated_wait_s = _refusal_times(body, clock.scale)
            else:
                await _read_stream(resp, rec, clock, start)
    except (TimeoutError, aiohttp.ClientError) as exc:
        rec.error_code = rec.error_code or type(exc).__name__
        if rec.status == 200:
            rec.stream_error = True
    rec.finished = clock.now()
    rec.latency = rec.finished - start
    return rec


async def send_with_retry(
    session: aiohttp.ClientSession,
    url: str,
    a: Arrival,
    rid: int,
    model: str,
    clock: Clock,
    api_keys: dict[str, str],
    body: bytes | None = None,
) -> list[RequestRecord]:
    """One planned request, and for a ``retry_once`` class its one retry after the Retry-After of a 429/503."""
    first = await send_one(session, url, a, rid, model, clock, api_keys, body)
    if not (a.retry_once and first.status in RETRYABLE and first.retry_after is not None):
        return [first]
    await asyncio.sleep(retry_after_s(first.retry_after))  # real seconds, as the gateway means them
    return [first, await send_one(session, url, a, rid, model, clock, api_keys, body, attempt=1)]


def retry_after_s(value: str) -> float:
    """Retry-After as seconds (the gateway sends delta-seconds; an HTTP date is not expected here)."""
    try:
        return max(0.0, float(value))
    except ValueError:
        return 1.0


def _refusal_times(body: bytes, time_scale: float) -> tuple[float | None, float | None, float | None]:
    """``queue_eta_s``, ``waited_s`` and ``estimated_wait_s`` of a refusal body, in simulated seconds (None
    where absent)."""
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None, None, None
    if not isinstance(err, dict):
        return None, None, None

    def sim(key: str) -> float | None:
        v = err.get(key)
        return float(v) / time_scale if isinstance(v, (int, float)) else None

    return sim("queue_eta_s"), sim("waited_s"), sim("estimated_wait_s")


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, clock: Clock, start: float) -> None:
    counted = 0
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = orjson.loads(line[6:])
        if "error" in event:
            rec.stream_error = True
            rec.error_code = _code_of(event["error"])
            continue
        if event.get("choices"):
            counted += 1
            if rec.ttft is None:
                rec.ttft = clock.now() - start
        if event.get("usage"):
            rec.completion_tokens = int(event["usage"]["completion_tokens"])
    rec.completion_tokens = rec.completion_tokens or counted


def _code_of(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("code") or err.get("type") or "error")
    return str(err)


def _error_code(body: bytes) -> str:
    try:
        return _code_of(orjson.loads(body).get("error"))
    except (orjson.JSONDecodeError, AttributeError):
        return "non-json"


def _backend_sample(t: float, v: dict[str, float] | None) -> Sample:
    if v is None:
        return Sample(t, up=False)
    return Sample(
        t,
        True,
        v.get("vllm:kv_cache_usage_perc", math.nan),
        v.get("vllm:num_requests_running", math.nan),
        v.get("vllm:num_requests_waiting", math.nan),
        v.get("vllm:num_preemptions_total", math.nan),
        v.get("vllm:generation_tokens_total", math.nan),
        v.get("kvgate_sim_oom_crashes_total", math.nan),
        lag=v.get("kvgate_sim_lag_seconds_total", math.nan),
        clock=v.get("kvgate_sim_clock_seconds", math.nan),
    )


class MetricsSampler:
    """The shared 20 Hz sampler (tests/support/sampler.py) on the backend and, if any, the gateway; its readings
    become ``Sample``s on the run's clock.

    A backend scrape that fails or takes over 2 s is a sample with the backend down. The gateway's queue depth
    is merged in afterwards: each backend sample carries the latest gateway answer received before it."""

    def __init__(self, backend: str, gateway: str | None, clock: Clock) -> None:
        self._clock = clock
        targets = [(backend, BACKEND_SERIES)] + ([(gateway, GATEWAY_SERIES)] if gateway else [])
        self._sampler = Sampler(targets, SAMPLE_HZ)

    async def start(self) -> None:
        await asyncio.to_thread(self._sampler.start)

    async def stop(self) -> list[Sample]:
        backend, *gateway = await asyncio.to_thread(self._sampler.stop)
        sim_time = self._clock.at
        samples = [_backend_sample(sim_time(t), v) for t, v in backend]
        queue = [(sim_time(t), v) for t, v in (gateway[0] if gateway else []) if v is not None]
        gi, latest = 0, dict.fromkeys(GATEWAY_SERIES, math.nan)
        for s in samples:
            while gi < len(queue) and queue[gi][0] <= s.t:
                latest = queue[gi][1]
                gi += 1
            s.gateway_queue = latest["kvgate_queue_depth"]
            s.estimate_quantile = latest["kvgate_output_estimate_quantile"]
            s.outran = latest["kvgate_requests_outran_estimate_total"]
        return samples


async def run(
    arrivals: Sequence[Arrival],
    target: str,
    backend_metrics: str,
    *,
    model: str,
    time_scale: float,
    gateway_metrics: str | None = None,
    api_keys: dict[str, str] | None = None,
) -> tuple[list[RequestRecord], list[Sample]]:
    """Open loop: each request leaves at its planned time whatever happened to the others."""
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        clock = Clock(time_scale)
        sampler = MetricsSampler(backend_metrics, gateway_metrics, clock)
        await sampler.start()
        # Bodies are built before the run starts, so a burst leaves at once instead of waiting for the
        # harness to serialize hundreds of long prompts.
        bodies = [orjson.dumps(request_body(a, model, i)) for i, a in enumerate(arrivals)]
        await asyncio.sleep(0.2)  # a few idle samples first
        clock_offset = clock.now()

        async def planned(i: int, a: Arrival) -> list[RequestRecord]:
            await clock.sleep_until(clock_offset + a.at)
            return await send_with_retry(session, target, a, i, model, clock, api_keys or {}, bodies[i])

        attempts = await asyncio.gather(*(planned(i, a) for i, a in enumerate(arrivals)))
        records = [rec for recs in attempts for rec in recs]
        await asyncio.sleep(0.3)
        samples = await sampler.stop()
    return records, samples


async def closed_loop(
    target: str,
    backend_metrics: str,
    shape: Arrival | Callable[[int], Arrival],
    concurrency: int,
    duration_s: float,
    *,
    model: str,
    time_scale: float,
    stagger_s: float = 0.0,
) -> tuple[list[RequestRecord], list[Sample]]:
    """``concurrency`` clients, each sending its next request when the previous one ends (for the sweep).

    ``shape`` is one fixed request, or a function of the request number that draws one. Client ``i`` sends its
    first request at ``stagger_s * i / concurrency`` (simulated seconds), so the clients do not all prefill,
    decode and finish in lockstep."""
    draw = shape if callable(shape) else (lambda _n: shape)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        clock = Clock(time_scale)
        sampler = MetricsSampler(backend_metrics, None, clock)
        await sampler.start()
        records: list[RequestRecord] = []
        ids = iter(range(10**9))
        start = clock.now()  # the sampler process took a moment to start

        async def client(i: int) -> None:
            await clock.sleep_until(start + stagger_s * i / concurrency)
            while clock.now() < start + duration_s:
                n = next(ids)
                records.append(await send_one(session, target, draw(n), n, model, clock, {}))

        await asyncio.gather(*(client(i) for i in range(concurrency)))
        samples = await sampler.stop()
    return records, samples


def save(out_dir: Path, records: Sequence[RequestRecord], samples: Sequence[Sample], summary: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    with open(out_dir / "samples.csv", "w") as f:
        f.write(
            "t,up,kv,running,waiting,preemptions,generation_tokens,oom_total,gateway_queue,lag,clock,"
            "estimate_quantile,outran\n"
        )
        for s in samples:
            f.write(
                f"{s.t:.4f},{int(s.up)},{s.kv},{s.running},{s.waiting},{s.preemptions},"
                f"{s.generation_tokens},{s.oom_total},{s.gateway_queue},{s.lag},{s.clock},"
                f"{s.estimate_quantile},{s.outran}\n"
            )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
