"""The ASGI application: routes each request to the proxy path or the gateway's own endpoints.

The proxy path is plain ASGI (no Starlette middleware, no per-request framework objects): it is the hot
path, and it must see client disconnects the moment they happen. ``/healthz``, ``/readyz`` and ``/metrics``
are a small FastAPI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.admission import AdmissionController
from gateway.admitter import Admitter
from gateway.config import GatewayConfig
from gateway.cost import KvGeometry, RequestCost, estimate_cost
from gateway.counting import TokenCounter, build_counter
from gateway.disconnect import ClientDisconnected, DisconnectWatch
from gateway.errors import GatewayError, shutting_down
from gateway.forward import Forwarder, ResponseWriter
from gateway.http_client import KEEPALIVE_S
from gateway.limits import Charge, SharedLimits
from gateway.metrics import GatewayMetrics
from gateway.parse import Endpoint, InferenceRequest
from gateway.policy import Policy, TenantPolicy
from gateway.proxy import handle_inference, handle_passthrough
from gateway.reload import ConfigWatcher
from gateway.scraper import ModelInfo, Scraper
from gateway.tokenizer import HeuristicTokenizer

log = logging.getLogger("kvgate")

# Codes whose rejection is already counted where it is raised.
_COUNTED_CODES = frozenset(
    {None, "queue_full", "queue_timeout", "rate_limit_exceeded", "shed", "tenant_queue_full", "limits_unavailable"}
)
INFERENCE_PATHS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
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
        self.policy = Policy(config.auth, config.tenants)
        self.limits = SharedLimits(config.redis, self.metrics, clock)
        self.session: aiohttp.ClientSession | None = None
        self.forwarder: Forwarder
        self.scraper: Scraper
        self.counter = TokenCounter(HeuristicTokenizer())
        self.draining = False
        self.active_requests = 0  # proxied requests in progress (inference and passthrough): what a drain waits for
        self._idle = asyncio.Event()  # set when a drain sees the last of them finish
        self._tasks: list[asyncio.Task[None]] = []
        self._control = self._control_app()

    # --- the steps the request path calls ------------------------------------------------------------

    async def estimate_cost(self, request: InferenceRequest) -> RequestCost:
        geometry = self.controller.geometry
        if geometry is None:
            raise GatewayError(
                503,
                "The gateway does not know the engine's KV-cache size yet (no vllm:cache_config_info scraped).",
                type="service_unavailable",
                code="upstream_not_ready",
                retry_after_s=1.0,
            )
        prompt_tokens = await self.counter.count(request)
        return estimate_cost(
            prompt_tokens,
            max_tokens=request.max_tokens,
            sequences_per_prompt=request.sequences_per_prompt,
            max_model_len=self.config.model.max_model_len or self.scraper.model.max_model_len,
            geometry=geometry,
            high_watermark=self.config.admission.high_watermark,
        )

    async def check_rate_limit(self, tenant: TenantPolicy, cost: RequestCost) -> Charge:
        """Pre-charge the tenant's per-minute limits (429 over a limit); see :mod:`gateway.limits`."""
        return await self.limits.check(tenant, cost.total_tokens)

    def apply_policy(self, config: GatewayConfig) -> None:
        """A reloaded, valid config: swap in its tenants and auth as one new snapshot, between requests."""
        self.policy = Policy(config.auth, config.tenants, self.policy.version + 1)
        self.metrics.policy_version.set(self.policy.version)

    # --- ASGI ---------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in CONTROL_PATHS:
            await self._control(scope, receive, send)
            return
        request_id = _request_id(scope["headers"])
        writer = ResponseWriter(send)
        endpoint = INFERENCE_PATHS.get(path) if scope["method"] == "POST" else None
        watch = DisconnectWatch(receive, lambda: writer.finished)
        self.active_requests += 1
        try:
            if self.draining:
                raise shutting_down(1.0)
            if endpoint is None:
                await handle_passthrough(self, scope, receive, writer, request_id)
            else:
                await handle_inference(self, endpoint, scope, receive, writer, request_id, watch)
        except GatewayError as exc:
            if exc.code not in _COUNTED_CODES:
                self.metrics.rejected.labels(exc.code or "error").inc()
            if not writer.started:
                await writer.error(exc, [(b"x-request-id", request_id.encode())])
            else:
                log.warning("request %s failed after the response started: %s", request_id, exc.message)
        except ClientDisconnected:
            self.metrics.client_disconnects.labels("body").inc()
        except asyncio.CancelledError:
            if not watch.fired:
                raise  # not a disconnect: the server itself is cancelling us
            current = asyncio.current_task()
            assert current is not None
            current.uncancel()
            self.metrics.client_disconnects.labels("streaming" if writer.started else "waiting").inc()
        finally:
            self.active_requests -= 1
            if self.draining and self.active_requests == 0:
                self._idle.set()
            watch.stop()

    # --- lifecycle ----------------------------------------------------------------------------------

    async def startup(self) -> None:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=cfg.upstream.max_connections, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.forwarder = Forwarder(
            cfg.upstream.url,
            self.session,
            self.metrics,
            timeout_s=cfg.upstream.timeout_s,
            connect_timeout_s=cfg.upstream.connect_timeout_s,
            api_key=cfg.upstream.api_key,
            max_connections=cfg.upstream.max_connections,
        )
        self.scraper = Scraper(
            cfg.upstream.url,
            self.session,
            self.admitter,
            self.metrics,
            interval_s=cfg.telemetry.scrape_interval_s,
            timeout_s=cfg.telemetry.scrape_timeout_s,
            geometry_override=self.controller.geometry,
            clock=self.clock,
            on_model=self._on_model,
        )
        if self.config.tokenizer != "auto":
            await self._resolve_tokenizer()  # an explicit tokenizer that cannot load stops start-up, loudly
        await self.scraper.scrape_once()
        self._tasks.append(asyncio.create_task(self.scraper.run(), name="kvgate-scraper"))
        await self.limits.start()
        if self.config_path is not None and cfg.reload.enabled:
            watcher = ConfigWatcher(self.config_path, cfg.reload.interval_s, self.apply_policy, self.metrics)
            self._tasks.append(asyncio.create_task(watcher.run(), name="kvgate-config-watcher"))

    async def _on_model(self, model: ModelInfo) -> None:
        """The engine answered /v1/models: now ``auto`` can see its model path and its /tokenize."""
        if self.config.tokenizer == "auto":
            await self._resolve_tokenizer()

    async def _resolve_tokenizer(self) -> None:
        assert self.session is not None
        self.counter = await build_counter(
            self.config.tokenizer,
            session=self.session,
            upstream=self.config.upstream.url,
            model_root=self.scraper.model.root,
            offload_chars=self.config.limits.offload_tokenize_chars,
        )
        log.info("counting prompt tokens with %s", self.counter.name)

    def begin_drain(self) -> None:
        """SIGTERM: report not-ready, refuse new requests, answer queued ones with 503 + Retry-After."""
        if self.draining:
            return
        self.draining = True
        self.metrics.ready.set(0)
        self.admitter.fail_all_queued(shutting_down)
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
        await self.limits.close()
        if hasattr(self, "forwarder"):
            await self.forwarder.close()
        if self.session is not None:
            await self.session.close()

    async def _lifespan(self, receive: Any, send: Any) -> None:
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

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="kvgate", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "alive"}

        @app.get("/readyz")
        async def readyz() -> JSONResponse:
            ready, reason = self.is_ready()
            self.metrics.ready.set(1 if ready else 0)
            c = self.controller
            body = {
                "ready": ready,
                "reason": reason,
                "gate_open": c.gate.is_open,
                "kv_usage": c.sample.usage if c.sample else None,
                "metrics_age_s": None if self.scraper.last_success is None else round(self.scraper.age(), 3),
                "queue_depth": len(c.queue),
                "inflight": len(c.ledger),
                "tokenizer": self.counter.name,
                "limits": self.limits.status(),
                "policy_version": self.policy.version,
            }
            return JSONResponse(body, status_code=200 if ready else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            self.admitter.refresh_gauges()
            self.metrics.metrics_age.set(min(self.scraper.age(), 1e9))
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        return app


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for key, value in headers:
        if key == b"x-request-id" and value:
            return value.decode("latin-1")[:128]
    return os.urandom(8).hex()
