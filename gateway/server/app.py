"""The ASGI application: wires the parts of one gateway together and routes each request.

Proxied requests go to :class:`~gateway.server.request_path.RequestPath`, which is plain ASGI (no Starlette
middleware, no per-request framework objects): it is the hot path, and it must see client disconnects the
moment they happen. ``/healthz``, ``/readyz`` and ``/metrics`` are a small FastAPI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.admission.admitter import Admitter
from gateway.admission.controller import AdmissionController
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics, Reading
from gateway.protocol.errors import shutting_down
from gateway.server.disconnect import Receive
from gateway.server.request_path import RequestPath, raw_path_of
from gateway.server.response import Send
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import Policy
from gateway.tenants.reload import ConfigWatcher
from gateway.tokens.cost import KvGeometry
from gateway.tokens.count_cache import CountCache
from gateway.tokens.counting import TokenCounter
from gateway.tokens.estimator import CostEstimator
from gateway.tokens.resolve import build_counter
from gateway.tokens.tokenizers import HeuristicTokenizer
from gateway.upstream.forwarder import Forwarder
from gateway.upstream.scraper import ModelInfo, Scraper
from gateway.upstream.session import UpstreamSession

log = logging.getLogger("kvgate")

CONTROL_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class Gateway:
    """All the parts of one gateway, wired together; an ASGI application."""

    def __init__(
        self,
        config: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.clock = clock
        self.metrics = GatewayMetrics()
        m = config.model
        override = KvGeometry(m.block_size, m.num_gpu_blocks) if m.block_size and m.num_gpu_blocks else None
        self.controller = AdmissionController(config.admission, override)
        self.admitter = Admitter(self.controller, self.metrics, clock)
        self.policy = self._policy(config, version=1)
        self.counters = TenantCounters(
            config.redis, self.metrics, clock, default_max_waiters=config.admission.queue_max_length
        )
        self.session = UpstreamSession(config.upstream.max_connections)
        self.forwarder = Forwarder(
            config.upstream.url,
            self.metrics,
            timeout_s=config.upstream.timeout_s,
            connect_timeout_s=config.upstream.connect_timeout_s,
            max_connections=config.upstream.max_connections,
            max_header_bytes=config.upstream.max_response_header_bytes,
        )
        self.scraper = Scraper(
            config.upstream.url,
            self.session,
            self.metrics,
            interval_s=config.telemetry.scrape_interval_s,
            timeout_s=config.telemetry.scrape_timeout_s,
            geometry_override=override,
            clock=clock,
            on_model=self._on_model,
        )
        self.scraper.subscribe(self.admitter)
        self.tokenize_cache = CountCache()  # outlives the counters: its hit/miss totals are counters
        self.costs = CostEstimator(
            TokenCounter(HeuristicTokenizer(), source="pending"),
            geometry=lambda: self.controller.geometry,
            max_model_len=lambda: config.model.max_model_len or self.scraper.model.max_model_len,
            high_watermark=config.admission.high_watermark,
        )
        self.draining = False
        self.requests = RequestPath(
            policy=lambda: self.policy,
            costs=self.costs,
            counters=self.counters,
            admitter=self.admitter,
            forwarder=self.forwarder,
            limits=config.limits,
            passthrough=config.passthrough,
            upstream_api_key=config.upstream.api_key,
            metrics=self.metrics,
            draining=lambda: self.draining,
        )
        self.metrics.gauges.source = self._gauge_readings
        self.active_requests = 0  # proxied requests in progress (inference and passthrough): what a drain waits for
        self._idle = asyncio.Event()  # set when a drain sees the last of them finish
        self._tasks: list[asyncio.Task[None]] = []
        self._tenants_seen: set[str] = set()  # tenants whose queue-depth gauge exists (0 when none waits)
        self._control = self._control_app()

    @staticmethod
    def _policy(config: GatewayConfig, version: int) -> Policy:
        return Policy(config.auth, config.tenants, config.admission.queue_max_wait_s, version)

    def apply_policy(self, config: GatewayConfig) -> None:
        """A reloaded, valid config: swap in its tenants and auth as one new snapshot, between requests."""
        self.policy = self._policy(config, self.policy.version + 1)

    # --- ASGI ---------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if raw_path_of(scope) in CONTROL_PATHS:
            await self._control(scope, receive, send)
            return
        self.active_requests += 1
        try:
            await self.requests.handle(scope, receive, send)
        finally:
            self.active_requests -= 1
            if self.draining and self.active_requests == 0:
                self._idle.set()

    # --- lifecycle ----------------------------------------------------------------------------------

    async def startup(self) -> None:
        if self.config.tokenizer != "auto":
            await self._resolve_tokenizer()  # an explicit tokenizer that cannot load stops start-up, loudly
        await self.scraper.scrape_once()
        self._tasks.append(asyncio.create_task(self.scraper.run(), name="kvgate-scraper"))
        await self.counters.start()
        if self.config_path is not None and self.config.reload.enabled:
            watcher = ConfigWatcher(self.config_path, self.config.reload.interval_s, self.apply_policy, self.metrics)
            self._tasks.append(asyncio.create_task(watcher.run(), name="kvgate-config-watcher"))

    async def _on_model(self, model: ModelInfo) -> None:
        """The engine answered /v1/models: now ``auto`` can see its model path and its /tokenize."""
        if self.config.tokenizer == "auto":
            await self._resolve_tokenizer()

    async def _resolve_tokenizer(self) -> None:
        self.tokenize_cache.clear()  # counts of another model, or of an engine since restarted
        self.costs.counter = await build_counter(
            self.config.tokenizer,
            session=self.session(),
            upstream=self.config.upstream.url,
            model_root=self.scraper.model.root,
            model_id=self.scraper.model.id,
            download=self.config.tokenizer_download,
            offload_chars=self.config.limits.offload_tokenize_chars,
            cache=self.tokenize_cache,
        )
        counter = self.costs.counter
        log.info("counting prompt tokens with %s (source: %s)", counter.name, counter.source)

    def begin_drain(self) -> None:
        """SIGTERM: report not-ready, refuse new requests, answer queued ones with 503 + Retry-After."""
        if self.draining:
            return
        self.draining = True
        self.admitter.fail_all_queued(shutting_down)
        self.counters.fail_waiters(shutting_down)  # and those waiting for a tenant slot; later ones: see RequestPath
        log.info("draining: %d request(s) in flight", self.active_requests)

    async def drained(self, deadline_s: float) -> bool:
        """Wait until no proxied request is in progress, or the deadline passes; True if all finished."""
        if self.active_requests > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), deadline_s)
        return self.active_requests == 0

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.counters.close()
        await self.forwarder.close()
        await self.session.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    raise
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- the gateway's own endpoints ----------------------------------------------------------------

    def is_ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.controller.geometry is None:
            return False, "KV-cache geometry unknown (no vllm:cache_config_info yet)"
        if self.controller.is_stale(self.clock()):
            return False, f"upstream metrics stale ({self.scraper.last_error or 'no sample yet'})"
        return True, "ok"

    def _gauge_readings(self) -> Iterator[Reading]:
        """Every gauge, read from the state that owns it (see :class:`gateway.metrics.StateGauges`)."""
        c = self.controller
        yield "kvgate_gate_open", (), 1.0 if c.gate.is_open else 0.0
        if c.sample is not None:
            yield "kvgate_kv_usage_observed", (), c.sample.usage
        projected = c.projected_usage(self.clock())
        if projected is not None:
            yield "kvgate_kv_usage_projected", (), projected
        yield "kvgate_reserved_blocks", (), float(c.ledger.reserved_blocks)
        yield "kvgate_inflight_requests", (), float(len(c.ledger))
        yield "kvgate_queue_depth", (), float(len(c.queue))
        depths = c.queue.tenant_lengths()
        self._tenants_seen |= depths.keys()
        for tenant in sorted(self._tenants_seen):
            yield "kvgate_tenant_queue_depth", (tenant,), float(depths.get(tenant, 0))
        yield "kvgate_upstream_metrics_age_seconds", (), min(self.scraper.age(), 1e9)
        latest = self.scraper.latest
        if latest is not None:
            yield "kvgate_upstream_requests_running", (), latest.running
            yield "kvgate_upstream_requests_waiting", (), latest.waiting
        yield "kvgate_ready", (), 1.0 if self.is_ready()[0] else 0.0
        redis = self.counters.redis
        yield "kvgate_redis_up", (), 1.0 if redis is not None and redis.healthy else 0.0
        yield "kvgate_limits_degraded", (), 1.0 if self.counters.degraded else 0.0
        yield "kvgate_policy_version", (), float(self.policy.version)
        yield "kvgate_output_estimate_quantile", (), c.caution.quantile
        for q in (0.5, 0.9, 0.99):
            expected = c.lengths.quantile((), q)
            if expected is not None:
                yield "kvgate_output_tokens_expected", (str(q),), float(expected)
        yield "kvgate_requests_outran_estimate", (), float(c.outran)
        yield "kvgate_tokenizer_info", (self.costs.counter.kind, self.costs.counter.source), 1.0
        yield "kvgate_tokenize_cache_lookups", ("hit",), float(self.tokenize_cache.hits)
        yield "kvgate_tokenize_cache_lookups", ("miss",), float(self.tokenize_cache.misses)

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="kvgate", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "alive"}

        @app.get("/readyz")
        async def readyz() -> JSONResponse:
            ready, reason = self.is_ready()
            c = self.controller
            body = {
                "ready": ready,
                "reason": reason,
                "gate_open": c.gate.is_open,
                "kv_usage": c.sample.usage if c.sample else None,
                "metrics_age_s": None if self.scraper.last_success is None else round(self.scraper.age(), 3),
                "queue_depth": len(c.queue),
                "inflight": len(c.ledger),
                "tokenizer": self.costs.counter.name,
                "limits": self.counters.status(),
                "policy_version": self.policy.version,
            }
            return JSONResponse(body, status_code=200 if ready else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        return app
