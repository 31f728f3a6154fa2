"""Run one scenario against a target URL: send every planned request, record its outcome, and sample the
backend's /metrics (and the gateway's, when there is one) at 20 Hz real time, from a separate process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
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
    session: aiohttp.ClientSession,
    url: str,
    a: Arrival,
    rid: int,
    model: str,
    clock: Clock,
    api_keys: dict[str, str],
    body: bytes | None = None,
) -> RequestRecord:
    rec = RequestRecord(rid, a.cls, a.tenant, clock.now(), a.prompt_tokens, a.max_tokens)
    path = "/v1/chat/completions" if a.api == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {api_keys[a.tenant]}"} if a.tenant in api_keys else {}
    start = rec.sent
    try:
        async with session.post(
            url + path,
            data=body if body is not None else orjson.dumps(request_body(a, model, rid)),
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


SCRAPE_TIMEOUT_S = 2.0  # real seconds; a scrape that takes longer counts as the backend being down
MAX_IN_FLIGHT = 8  # scrapes of one target outstanding at once; beyond that a tick is skipped (and missing)


async def _scrape(session: aiohttp.ClientSession, url: str, wanted: set[str]) -> dict[str, float] | None:
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as r:
            if r.status == 200:
                return read_series(await r.text(), wanted)
    except (TimeoutError, aiohttp.ClientError):
        pass
    return None


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


async def sample_loop(
    session: aiohttp.ClientSession,
    backend: str,
    gateway: str | None,
    clock: Clock,
    out: list[Sample],
    stop: asyncio.Event,
) -> None:
    """Scrape the backend (and, independently, the gateway) on a fixed 1/SAMPLE_HZ real-second schedule.

    Each tick starts its scrapes as tasks and does not wait for them, so one slow answer (a simulator busy
    with a large step, or starved of CPU) delays only its own sample, not the schedule. A successful sample
    is stamped when its answer arrives (the simulator renders /metrics when it handles the request); a
    failed one when it was sent. The gateway's queue depth is merged in afterwards: each backend sample
    gets the latest gateway answer received before it.
    """
    period = 1.0 / SAMPLE_HZ
    backend_out: list[Sample] = []
    gateway_out: list[tuple[float, float]] = []
    in_flight: dict[str, set[asyncio.Task[None]]] = {"b": set(), "g": set()}

    async def one_backend() -> None:
        sent = clock.now()
        v = await _scrape(session, backend, BACKEND_SERIES)
        backend_out.append(_backend_sample(clock.now() if v is not None else sent, v))

    async def one_gateway() -> None:
        assert gateway is not None
        g = await _scrape(session, gateway, GATEWAY_SERIES)
        if g is not None:
            gateway_out.append((clock.now(), g.get("kvgate_queue_depth", math.nan)))

    def launch(key: str, fn: Any) -> None:
        if len(in_flight[key]) >= MAX_IN_FLIGHT:
            return
        task = asyncio.create_task(fn())
        in_flight[key].add(task)
        task.add_done_callback(in_flight[key].discard)

    next_at = time.monotonic()
    while not stop.is_set():
        launch("b", one_backend)
        if gateway:
            launch("g", one_gateway)
        next_at = max(next_at + period, time.monotonic() - period)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
    pending = in_flight["b"] | in_flight["g"]
    if pending:
        await asyncio.wait(pending)
    backend_out.sort(key=lambda s: s.t)
    gateway_out.sort()
    gi, latest = 0, math.nan
    for s in backend_out:
        while gi < len(gateway_out) and gateway_out[gi][0] <= s.t:
            latest = gateway_out[gi][1]
            gi += 1
        s.gateway_queue = latest
    out.extend(backend_out)


def _sampler_main(
    backend: str,
    gateway: str | None,
    t0: float,
    time_scale: float,
    ready: Any,
    stop: Any,
    results: Any,
) -> None:
    """Body of the sampler process: its own interpreter and event loop, so hundreds of streaming clients in
    the harness process cannot delay a scrape. Times are taken against the parent's ``t0`` (CLOCK_MONOTONIC is
    system-wide on Linux), so samples and request records share one time base."""

    async def main() -> list[Sample]:
        clock = Clock(time_scale)
        clock.t0 = t0
        out: list[Sample] = []
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (stop.wait(), loop.call_soon_threadsafe(stop_event.set)))
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            ready.set()
            await sample_loop(session, backend, gateway, clock, out, stop_event)
        return out

    results.put(asyncio.run(main()))


class SamplerProcess:
    """``/metrics`` sampling in a separate process (``spawn``ed, so it shares nothing with the harness's loop).

    Run inline on the harness's event loop the sampler fell below 10 Hz when hundreds of streams were being
    parsed in the same loop; in its own process it holds ~20 Hz (``sample_hz_real`` in each summary)."""

    def __init__(self, backend: str, gateway: str | None, clock: Clock) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self._results: Any = ctx.Queue()
        self._proc = ctx.Process(
            target=_sampler_main,
            args=(backend, gateway, clock.t0, clock.scale, self._ready, self._stop, self._results),
            daemon=True,
        )

    async def start(self) -> None:
        self._proc.start()
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + 60.0
        while not await loop.run_in_executor(None, self._ready.wait, 0.2):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the /metrics sampler process did not start (exit {self._proc.exitcode})")

    async def stop(self) -> list[Sample]:
        self._stop.set()
        loop = asyncio.get_running_loop()
        samples: list[Sample] = await loop.run_in_executor(None, self._results.get, True, 60.0)
        await loop.run_in_executor(None, self._proc.join, 10.0)
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
        sampler = SamplerProcess(backend_metrics, gateway_metrics, clock)
        await sampler.start()
        # Bodies are built before the run starts, so a burst leaves at once instead of waiting for the
        # harness to serialize hundreds of long prompts.
        bodies = [orjson.dumps(request_body(a, model, i)) for i, a in enumerate(arrivals)]
        await asyncio.sleep(0.2)  # a few idle samples first
        clock_offset = clock.now()

        async def planned(i: int, a: Arrival) -> RequestRecord:
            await clock.sleep_until(clock_offset + a.at)
            return await send_one(session, target, a, i, model, clock, api_keys or {}, bodies[i])

        records = list(await asyncio.gather(*(planned(i, a) for i, a in enumerate(arrivals))))
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
        sampler = SamplerProcess(backend_metrics, None, clock)
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
        f.write("t,up,kv,running,waiting,preemptions,generation_tokens,oom_total,gateway_queue,lag,clock\n")
        for s in samples:
            f.write(
                f"{s.t:.4f},{int(s.up)},{s.kv},{s.running},{s.waiting},{s.preemptions},"
                f"{s.generation_tokens},{s.oom_total},{s.gateway_queue},{s.lag},{s.clock}\n"
            )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
