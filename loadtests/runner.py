"""Run one scenario against a target URL: send every planned request, record its outcome, and sample the
backend's /metrics (and the gateway's, when there is one) at 20 Hz real time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.promtext import read_series
from loadtests.scenario import Arrival
from loadtests.stats import RequestRecord, Sample

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
GATEWAY_SERIES = {"kvgate_queue_depth"}
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "tempor")


def request_body(a: Arrival, model: str, rid: int) -> dict[str, Any]:
    """Completions carry token ids (exact counts for engine and gateway); chat carries ~4 chars per token."""
    common = {
        "model": model,
        "max_tokens": a.max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
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
        return (time.monotonic() - self.t0) / self.scale

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t * self.scale - (time.monotonic() - self.t0)))


async def send_one(
    session: aiohttp.ClientSession, url: str, a: Arrival, rid: int, model: str, clock: Clock, api_keys: dict[str, str]
) -> RequestRecord:
    rec = RequestRecord(rid, a.cls, a.tenant, clock.now(), a.prompt_tokens, a.max_tokens)
    path = "/v1/chat/completions" if a.api == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_keys[a.tenant]}"} if a.tenant in api_keys else {}
    start = rec.sent
    try:
        async with session.post(
            url + path,
            data=orjson.dumps(request_body(a, model, rid)),
            headers={"Content-Type": "application/json", **headers},
        ) as resp:
            rec.status = resp.status
            rec.retry_after = resp.headers.get("Retry-After")
            if resp.status != 200:
                body = await resp.read()
                rec.error_code = _error_code(body)
            else:
                await _read_stream(resp, rec, clock, start)
    except (TimeoutError, aiohttp.ClientError) as exc:
        rec.error_code = rec.error_code or type(exc).__name__
        if rec.status == 200:
            rec.stream_error = True
    rec.latency = clock.now() - start
    return rec


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


async def _scrape(session: aiohttp.ClientSession, url: str, wanted: set[str]) -> dict[str, float] | None:
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=0.5)) as r:
            if r.status == 200:
                return read_series(await r.text(), wanted)
    except (TimeoutError, aiohttp.ClientError):
        pass
    return None


async def sample_loop(
    session: aiohttp.ClientSession,
    backend: str,
    gateway: str | None,
    clock: Clock,
    out: list[Sample],
    stop: asyncio.Event,
) -> None:
    """Scrape the backend (and the gateway, concurrently) every 1/SAMPLE_HZ real seconds."""
    period = 1.0 / SAMPLE_HZ
    next_at = time.monotonic()
    while not stop.is_set():
        t = clock.now()
        gw_task = asyncio.create_task(_scrape(session, gateway, GATEWAY_SERIES)) if gateway else None
        v = await _scrape(session, backend, BACKEND_SERIES)
        s = Sample(t, up=False)
        if v is not None:
            s = Sample(
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
        if gw_task is not None:
            g = await gw_task
            if g is not None:
                s.gateway_queue = g.get("kvgate_queue_depth", math.nan)
        out.append(s)
        next_at = max(next_at + period, time.monotonic() - period)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))


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
        samples: list[Sample] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_loop(session, backend_metrics, gateway_metrics, clock, samples, stop))
        await asyncio.sleep(0.2)  # a few idle samples first
        clock_offset = clock.now()

        async def planned(i: int, a: Arrival) -> RequestRecord:
            await clock.sleep_until(clock_offset + a.at)
            return await send_one(session, target, a, i, model, clock, api_keys or {})

        records = list(await asyncio.gather(*(planned(i, a) for i, a in enumerate(arrivals))))
        await asyncio.sleep(0.3)
        stop.set()
        await sampler
    return records, samples


async def closed_loop(
    target: str,
    backend_metrics: str,
    arrival: Arrival,
    concurrency: int,
    duration_s: float,
    *,
    model: str,
    time_scale: float,
    stagger_s: float = 0.0,
) -> tuple[list[RequestRecord], list[Sample]]:
    """``concurrency`` clients, each sending its next request when the previous one ends (for the sweep)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        clock = Clock(time_scale)
        samples: list[Sample] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_loop(session, backend_metrics, None, clock, samples, stop))
        records: list[RequestRecord] = []
        ids = iter(range(10**9))

        async def client(i: int) -> None:
            await clock.sleep_until(stagger_s * i / concurrency)
            while clock.now() < duration_s:
                records.append(await send_one(session, target, arrival, next(ids), model, clock, {}))

        await asyncio.gather(*(client(i) for i in range(concurrency)))
        stop.set()
        await sampler
    return records, samples


def save(out_dir: Path, records: Sequence[RequestRecord], samples: Sequence[Sample], summary: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    with open(out_dir / "samples.csv", "w") as f:
        f.write("t,up,kv,running,waiting,preemptions,generation_tokens,oom_total,gateway_queue,lag,clock\n")
        for s in samples:
            f.write(
                f"{s.t:.4f},{int(s.up)},{s.kv},{s.running},{s.waiting},{s.preemptions},"
                f"{s.generation_tokens},{s.oom_total},{s.gateway_queue},{s.lag},{s.clock}\n"
            )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
