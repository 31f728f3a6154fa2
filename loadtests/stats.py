"""Pure summaries of one run: request outcomes, sampled engine state, throughput over time."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Clients that honour these get told when to come back; the issue requires them on every 429/503.
RETRYABLE = (429, 503)


@dataclass
class RequestRecord:
    rid: int
    cls: str
    tenant: str | None
    sent: float  # simulated seconds from run start
    prompt_tokens: int
    max_tokens: int
    status: int = 0  # HTTP status; 0 when the connection failed
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int = 0
    error_code: str | None = None  # error.code (or type) from the body or the SSE error event
    stream_error: bool = False  # HTTP 200 whose stream carried an error event
    retry_after: str | None = None
    attempt: int = 0  # 1: the retry of request ``rid`` after its Retry-After
    max_wait_s: float | None = None  # the wait budget the client sent (simulated s)
    queue_eta_s: float | None = None  # a refusal body's queue_eta_s (the gateway's predicted wait)
    waited_s: float | None = None  # a refusal body's waited_s (queued this long before it was refused)
    estimated_wait_s: float | None = None  # a refusal body's estimated_wait_s (the wait it was told on arrival)
    expected_output: int | None = None  # x-kvgate-expected-output-tokens: output kvgate reserved at admission
    finished: float | None = None  # simulated seconds from run start when the response ended

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.stream_error and self.completion_tokens >= self.max_tokens

    def outcome(self) -> str:
        if self.ok:
            return "ok"
        if self.status == 0:
            return f"connection error ({self.error_code})"
        if self.stream_error:
            return f"200 + SSE error {self.error_code}"
        if self.status == 200:
            return "200 truncated"
        return f"{self.status} {self.error_code}"


@dataclass
class Sample:
    t: float  # simulated seconds from run start
    up: bool
    kv: float = math.nan
    running: float = math.nan
    waiting: float = math.nan
    preemptions: float = math.nan
    generation_tokens: float = math.nan
    oom_total: float = math.nan
    gateway_queue: float = math.nan
    lag: float = math.nan  # the simulator's cumulative real-time lag (kvgate_sim_lag_seconds_total)
    clock: float = math.nan  # the simulator's virtual clock (kvgate_sim_clock_seconds)
    estimate_quantile: float = math.nan  # kvgate_output_estimate_quantile (gateway)
    outran: float = math.nan  # kvgate_requests_outran_estimate_total (gateway)


def engine_clock(samples: Sequence[Sample]) -> Callable[[float], float] | None:
    """Harness time -> the simulator's virtual clock, interpolated between samples and aligned at the first
    one; None without a clock (a real vLLM)."""
    pts = sorted((s.t, s.clock) for s in samples if not math.isnan(s.clock))
    if len(pts) < 2:
        return None
    xs = [p[0] for p in pts]
    base = pts[0][1] - pts[0][0]

    def f(t: float) -> float:
        i = bisect.bisect_right(xs, t)
        if i == 0:
            return pts[0][1] - base - (xs[0] - t)
        if i == len(xs):
            return pts[-1][1] - base + (t - xs[-1])
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 - base + (y1 - y0) * (t - x0) / (x1 - x0 or 1.0)

    return f


def to_engine_time(
    records: Sequence[RequestRecord], samples: Sequence[Sample]
) -> tuple[list[RequestRecord], list[Sample]]:
    """Re-express client-side times on the simulator's virtual clock (interpolated between samples).

    The simulator keeps its modelled time even when the CPU cannot keep up with the time scale; measuring
    clients in that same time base keeps results independent of machine load. Without a clock (a real vLLM)
    nothing changes.
    """
    f = engine_clock(samples)
    if f is None:
        return list(records), list(samples)
    return retime_records(f, records), [dataclasses.replace(s, t=f(s.t)) for s in samples]


def retime_records(f: Callable[[float], float], records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Each record's times through ``f`` (durations as differences of retimed instants)."""
    out = []
    for r in records:
        sent = f(r.sent)
        out.append(
            dataclasses.replace(
                r,
                sent=sent,
                ttft=None if r.ttft is None else f(r.sent + r.ttft) - sent,
                latency=None if r.latency is None else f(r.sent + r.latency) - sent,
                finished=None if r.finished is None else f(r.finished),
            )
        )
    return out


def counter_increase(values: Sequence[float]) -> float:
    """Total increase of a counter that may reset (a restarted engine starts from zero)."""
    total, prev = 0.0, None
    for v in values:
        if math.isnan(v):
            continue
        if prev is not None:
            total += v - prev if v >= prev else v
        prev = v
    return total


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def time_fraction(samples: Sequence[Sample], lo: float, hi: float) -> tuple[float, float]:
    """Simulated seconds, and fraction of sampled time, with ``lo <= kv <= hi`` (down time counts as outside)."""
    inside = total = 0.0
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        total += dt
        if a.up and lo <= a.kv <= hi:
            inside += dt
    return inside, (inside / total if total else math.nan)


def throughput_series(samples: Sequence[Sample], window: float) -> list[tuple[float, float]]:
    """Engine generation tokens per simulated second over a sliding window (reset aware)."""
    pts = [s for s in samples if s.up and not math.isnan(s.generation_tokens)]
    out: list[tuple[float, float]] = []
    j = 0
    cumulative: list[float] = []
    acc, prev = 0.0, None
    for s in pts:
        if prev is not None:
            acc += s.generation_tokens - prev if s.generation_tokens >= prev else s.generation_tokens
        prev = s.generation_tokens
        cumulative.append(acc)
    for i, s in enumerate(pts):
        while pts[j].t < s.t - window:
            j += 1
        if i > j:
            out.append((s.t, (cumulative[i] - cumulative[j]) / (s.t - pts[j].t)))
    return out


def saturated_throughput(samples: Sequence[Sample]) -> tuple[float, float]:
    """Engine output tok/s while demand was queued (engine waiting or kvgate queue > 0), and that window's
    length: the part of a finite burst that admission control can influence, without the drain tail that
    every policy has once the last request is running."""
    busy = [
        s
        for s in samples
        if s.up
        and ((not math.isnan(s.waiting) and s.waiting > 0) or (not math.isnan(s.gateway_queue) and s.gateway_queue > 0))
    ]
    if len(busy) < 2:
        return math.nan, 0.0
    t0, t1 = busy[0].t, busy[-1].t
    window = [s for s in samples if s.up and t0 <= s.t <= t1]
    span = t1 - t0
    return (counter_increase([s.generation_tokens for s in window]) / span if span > 0 else math.nan), span


def summarize(
    records: Sequence[RequestRecord], samples: Sequence[Sample], ttft_slo_s: float, oom_crashes: int
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    start = min((r.sent for r in records), default=0.0)
    ends = [r.sent + r.latency for r in records if r.latency is not None]
    makespan = (max(ends) - start) if ends else math.nan
    tokens = sum(r.completion_tokens for r in ok)
    up = [s for s in samples if s.up]
    above_s, above_frac = time_fraction(samples, 0.90 + 1e-12, math.inf)
    band_s, band_frac = time_fraction(samples, 0.80, 0.90)
    rejected = [r for r in records if not r.ok]
    retry_ok = all(r.retry_after is not None for r in rejected if r.status in RETRYABLE)
    return {
        "requests": len(records),
        "served": len(ok),
        "oom_crashes": oom_crashes,
        "preemptions": counter_increase([s.preemptions for s in samples]),
        "peak_kv_usage": max((s.kv for s in up), default=math.nan),
        "time_above_90_s": above_s,
        "time_above_90_frac": above_frac,
        "time_in_80_90_s": band_s,
        "time_in_80_90_frac": band_frac,
        "goodput": sum(1 for r in ok if r.ttft is not None and r.ttft <= ttft_slo_s),
        "ttft_slo_s": ttft_slo_s,
        "makespan_s": makespan,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / makespan if makespan and makespan > 0 else math.nan,
        "saturated_tok_per_s": saturated_throughput(samples)[0],
        "saturated_window_s": saturated_throughput(samples)[1],
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "outcomes": dict(Counter(r.outcome() for r in records)),
        "rejections_with_retry_after": retry_ok,
        "by_class": {
            c: {
                "sent": sum(1 for r in records if r.cls == c),
                "served": sum(1 for r in ok if r.cls == c),
                "goodput": sum(1 for r in ok if r.cls == c and r.ttft is not None and r.ttft <= ttft_slo_s),
                "ttft_p50_s": percentile([r.ttft for r in ok if r.cls == c and r.ttft is not None], 0.5),
            }
            for c in sorted({r.cls for r in records})
        },
        "mean_running": _mean([s.running for s in up]),
        "backend_down_s": sum(b.t - a.t for a, b in itertools.pairwise(samples) if not a.up),
        "sim_lag_real_s": max((s.lag for s in samples if not math.isnan(s.lag)), default=math.nan),
        "samples": len(samples),
        "sample_hz": (len(samples) - 1) / (samples[-1].t - samples[0].t) if len(samples) > 1 else math.nan,
    }
