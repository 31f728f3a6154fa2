"""Telemetry loop: scrape the engine's /metrics every interval and publish each sample to its subscribers
(the admitter is one).

Also learns what /v1/models says about the served model (``max_model_len``, and its path on disk, which lets
``--tokenizer auto`` find the exact tokenizer), and measures the event loop's lag as a by-product of its own
timer. /v1/models is asked with the engine's key (``upstream.api_key``): vLLM run with ``--api-key`` guards
``/v1``, and without the model's length every chat without ``max_tokens`` would be a 400.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import orjson

from gateway.admission.controller import UsageSample
from gateway.metrics import GatewayMetrics
from gateway.tokens.cost import KvGeometry
from gateway.tokens.counting import engine_headers
from gateway.upstream.engine_metrics import MetricsFormatError, parse_engine_metrics
from gateway.upstream.session import UpstreamSession

log = logging.getLogger("kvgate.scraper")


class SampleSubscriber(Protocol):
    """Told when a scrape starts (what is in flight now is inside the sample), how it ended, and what it saw."""

    def scrape_started(self) -> None: ...

    def sample(self, sample: UsageSample) -> None: ...

    def scrape_failed(self, refused: bool = False) -> None:
        """``refused``: the engine refused the connection (down), not a slow or wrong answer (overloaded)."""


@dataclass(slots=True)
class ModelInfo:
    id: str | None = None
    max_model_len: int | None = None
    root: str | None = None
    names: tuple[str, ...] = ()  # every name the base model answers to (--served-model-name), not LoRA adapters


class Scraper:
    def __init__(
        self,
        upstream: str,
        session: UpstreamSession,
        metrics: GatewayMetrics,
        *,
        interval_s: float,
        timeout_s: float,
        geometry_override: KvGeometry | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_model: Callable[[ModelInfo], Awaitable[None]] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.session = session
        self.subscribers: list[SampleSubscriber] = []
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.geometry_override = geometry_override
        self.clock = clock
        self.last_success: float | None = None
        self.last_error: str | None = None
        self.model = ModelInfo()
        self.latest: UsageSample | None = None
        self.preemptions: float | None = None
        self.on_model = on_model
        self._discovery_headers = engine_headers(api_key)
        self._discovery_warned: set[int] = set()  # statuses /v1/models answered that were logged already
        self._model_stale = True  # /v1/models to be read (again): at start, after a restart or a failure

    def subscribe(self, subscriber: SampleSubscriber) -> None:
        self.subscribers.append(subscriber)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            await self.scrape_once()
            next_tick += self.interval_s
            delay = next_tick - loop.time()
            if delay < 0:  # fell behind (slow upstream): don't burst to catch up
                next_tick = loop.time()
                delay = 0
            await asyncio.sleep(delay)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - next_tick))

    def _tell(self, what: str, *args: object) -> None:
        """Each subscriber's ``what`` (scrape_started, scrape_failed, sample): an exception in one is logged,
        never let end this engine's scrapes for good (nothing would restart them)."""
        for subscriber in self.subscribers:
            try:
                getattr(subscriber, what)(*args)
            except Exception:
                log.exception("a subscriber's %s failed for %s", what, self.upstream)

    async def scrape_once(self) -> bool:
        self._tell("scrape_started")
        started = self.clock()
        try:
            async with self.session().get(f"{self.upstream}/metrics", timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise MetricsFormatError(f"/metrics answered HTTP {resp.status}")
                text = await resp.text()
            engine = parse_engine_metrics(text)
        except (aiohttp.ClientError, TimeoutError, MetricsFormatError, ValueError) as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            refused = isinstance(exc, aiohttp.ClientConnectorError)  # nothing listening, or no route to it
            self._tell("scrape_failed", refused)
            return False
        previous = self.latest
        self.latest = sample = UsageSample(
            usage=engine.usage,
            taken_at=started,
            geometry=self.geometry_override or engine.geometry,
            running=engine.running,
            waiting=engine.waiting,
            preemptions=engine.preemptions,
            served=engine.served,
            started_at=engine.started_at,
            tokens=engine.tokens,
            multi_token_steps=engine.multi_token_steps,
        )
        self._tell("sample", sample)
        recovered = self.last_error is not None
        if recovered:
            log.info("upstream metrics recovered after: %s", self.last_error)
        self.last_success = started
        self.last_error = None
        self._count_preemptions(engine.preemptions)
        # asked again whenever the engine may have come back another (restarted, or answering again after a
        # failure: a rolling update's new --max-model-len or model), not only until it first answers
        if recovered or (previous is not None and sample.restarted_since(previous)):
            self._model_stale = True
        if self._model_stale:
            await self.discover_model()  # until it answers: one failed read does not keep the old model
        return True

    def _count_preemptions(self, preemptions: float) -> None:
        if self.preemptions is not None:
            # an engine restart resets its counter: count what it reports since then
            delta = preemptions - self.preemptions if preemptions >= self.preemptions else preemptions
            if delta > 0:
                self.metrics.upstream_preemptions.inc(delta)
        self.preemptions = preemptions

    def _failed(self, reason: str) -> None:
        self.metrics.scrape_errors.inc()
        if reason != self.last_error:
            log.warning("scraping %s/metrics failed: %s", self.upstream, reason)
        self.last_error = reason

    async def discover_model(self) -> None:
        url = f"{self.upstream}/v1/models"
        try:
            async with self.session().get(url, headers=self._discovery_headers, timeout=self.timeout) as resp:
                if resp.status != 200:
                    self._discovery_failed(url, resp.status)
                    return
                self._discovery_warned.clear()  # a refusal after this one (a rotated key) is logged again
                data = orjson.loads(await resp.read()).get("data") or []
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        if data:
            first = data[0]
            names = tuple(m["id"] for m in data if isinstance(m.get("id"), str) and not m.get("parent"))
            self.model = ModelInfo(first.get("id"), first.get("max_model_len"), first.get("root"), names)
            self._model_stale = False
            if self.on_model is not None:
                await self.on_model(self.model)

    def _discovery_failed(self, url: str, status: int) -> None:
        """Logged once per status, not per scrape: discovery is retried every interval until it succeeds."""
        if status in self._discovery_warned:
            return
        self._discovery_warned.add(status)
        hint = " (set upstream.api_key to the engine's --api-key)" if status in (401, 403) else ""
        log.warning(
            "%s answered HTTP %d: the served model's max_model_len (and, for tokenizer auto, its tokenizer) stays "
            "unknown%s",
            url,
            status,
            hint,
        )

    def age(self) -> float:
        return float("inf") if self.last_success is None else self.clock() - self.last_success
