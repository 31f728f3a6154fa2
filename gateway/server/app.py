"""The ASGI application: wires the parts of one gateway together and routes each request.

Proxied requests go to :class:`~gateway.server.request_path.RequestPath`, which is plain ASGI (no Starlette
middleware, no per-request framework objects): it is the hot path, and it must see client disconnects the
moment they happen. ``/healthz``, ``/readyz`` and ``/metrics`` are a small FastAPI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway.admission.admitter import Admitter
from gateway.admission.controller import AdmissionController
from gateway.admission.engine import EngineBook
from gateway.admission.output_lengths import BEYOND
from gateway.config import ConfigFile, GatewayConfig
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics, HistogramReading, Reading
from gateway.paths import CONTROL_PATHS
from gateway.protocol.errors import shutting_down
from gateway.server.disconnect import Receive
from gateway.server.pacing import ArrivalPacer
from gateway.server.request_path import RequestPath, raw_path_of
from gateway.server.response import Send
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import Policy
from gateway.tenants.reload import ConfigWatcher
from gateway.tenants.shared_books import RedisEngineBooks
from gateway.tokens.agreement import CountAgreement
from gateway.tokens.cost import KvGeometry
from gateway.tokens.count_cache import CountCache
from gateway.tokens.counting import TokenCounter
from gateway.tokens.estimator import CostEstimator
from gateway.tokens.media import MediaTokens
from gateway.tokens.resolve import build_counter
from gateway.tokens.tokenizers import HeuristicTokenizer
from gateway.upstream.pool import EnginePool
from gateway.upstream.scraper import ModelInfo
from gateway.upstream.session import UpstreamSession

log = logging.getLogger("kvgate")

AUTO_RETRY_DELAYS_S = (5.0, 10.0, 20.0, 40.0, 60.0)  # tokenizer auto, asked again after settling for the heuristic


class Gateway:
    """All the parts of one gateway, wired together; an ASGI application."""

    def __init__(
        self,
        config: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        config_file: ConfigFile | None = None,
    ) -> None:
        self.config = config
        self.config_file = config_file  # the file it was read from, watched for policy changes
        self.clock = clock
        self.metrics = GatewayMetrics()
        m = config.model
        override = KvGeometry(m.block_size, m.num_gpu_blocks) if m.block_size and m.num_gpu_blocks else None
        self.policy = self._policy(config, version=1)
        self.counters = TenantCounters(
            config.redis, self.metrics, clock, default_max_waiters=config.admission.queue_max_length
        )
        redis = self.counters.redis
        # a replica restates its queue after every scrape of an engine, good or failed: four missed, it is gone
        telemetry = config.telemetry
        waiting_ttl_s = 4 * telemetry.scrape_interval_s + telemetry.scrape_timeout_s
        shared = (
            RedisEngineBooks(redis, config.redis.reservation_lease_s, waiting_ttl_s)
            if redis is not None and config.redis.share_engine_reservations
            else None
        )
        self.controller = AdmissionController(config.admission, override, engines=(), shared_books=shared is not None)
        self.admitter = Admitter(self.controller, self.metrics, clock, shared)
        self.session = UpstreamSession(config.upstream.max_connections)
        self.pool = EnginePool(
            config,
            self.admitter,
            self.metrics,
            self.session,
            geometry_override=override,
            clock=clock,
            on_model=self._on_model,
        )
        self.tokenize_cache = CountCache()  # outlives the counters: its hit/miss totals are counters
        self.costs = CostEstimator(
            TokenCounter(HeuristicTokenizer(), source="pending"),
            geometry=lambda: self.controller.geometry,
            max_model_len=lambda: config.model.max_model_len or self.pool.model.max_model_len,
            fast_path=config.tokenizer_fast_path,
            reserve_quantile=config.tokenizer_fast_path_quantile,
            media=MediaTokens(prior=config.tokenizer_media_tokens),
        )
        self.draining = False
        self.arrivals = ArrivalPacer(config.listen.arrivals_per_tick)
        self.access_log = AccessLog() if config.log_requests else None
        self.requests = RequestPath(
            policy=lambda: self.policy,
            costs=self.costs,
            counters=self.counters,
            admitter=self.admitter,
            engines=self.pool,
            limits=config.limits,
            upstream_api_key=config.upstream.api_key,
            metrics=self.metrics,
            draining=lambda: self.draining,
            arrivals=self.arrivals,
            priority_scheduling=config.upstream.priority_scheduling,
            stream_interval=config.upstream.stream_interval,
            access=self.access_log,
        )
        self.metrics.gauges.source = self._gauge_readings
        self.metrics.gauges.histograms = self._histogram_readings
        self.active_requests = 0  # proxied requests in progress (inference and passthrough): what a drain waits for
        self._idle = asyncio.Event()  # set when a drain sees the last of them finish
        self._watcher: ConfigWatcher | None = None  # the config file's, once started (reload enabled)
        self._auto_retry: asyncio.Task[None] | None = None  # tokenizer auto asked again (see _retry_auto)
        self._resolutions = 0  # tokenizer choices begun (see _resolve_tokenizer)
        self._tasks: list[asyncio.Task[None]] = []
        self._tenants_seen: set[str] = set()  # tenants whose queue-depth gauge exists (0 when none waits)
        self._control = self._control_app()
        self._control_port = config.listen.control_port

    @staticmethod
    def _policy(config: GatewayConfig, version: int, default_wait_s: float | None = None) -> Policy:
        wait_s = config.admission.queue_max_wait_s if default_wait_s is None else default_wait_s
        return Policy(config.auth, config.tenants, wait_s, version, config.passthrough)

    def apply_policy(self, config: GatewayConfig) -> None:
        """A reloaded, valid config: swap in its tenants, auth and passthrough as one new snapshot, between
        requests. The rest stays as started (``admission`` too: its default wait budget is the running one,
        as the reload's warning says)."""
        self.policy = policy = self._policy(config, self.policy.version + 1, self.config.admission.queue_max_wait_s)
        self.counters.limits_changed(lambda tenant, model: policy.resolve(tenant, model).max_concurrent)

    # --- ASGI ---------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self._is_control(scope):
            await self._control(scope, receive, send)
            return
        self.active_requests += 1
        try:
            await self.requests.handle(scope, receive, send)
        finally:
            self.active_requests -= 1
            if self.draining and self.active_requests == 0:
                self._idle.set()

    def _is_control(self, scope: dict[str, Any]) -> bool:
        """kvgate's own endpoints: on the client port, unless ``listen.control_port`` gives them a port of
        their own, where nothing else is served (its unknown paths are the control app's 404). ``/healthz``
        tells nothing and stays on the client port too (a container health check that knows that port alone).
        A request whose local address is unknown is not proxied."""
        if self._control_port is None:
            return raw_path_of(scope) in CONTROL_PATHS
        server = scope.get("server")
        return server is None or server[1] == self._control_port or raw_path_of(scope) == "/healthz"

    # --- lifecycle ----------------------------------------------------------------------------------

    async def startup(self) -> None:
        if self.config.tokenizer != "auto":
            await self._resolve_tokenizer()  # an explicit tokenizer that cannot load stops start-up, loudly
        await self.pool.start()
        await self.counters.start()
        file = self.config_file
        if file is not None and self.config.reload.enabled:
            self._watcher = ConfigWatcher(
                file.path, self.config.reload.interval_s, self.apply_policy, self.metrics, file
            )
            self._tasks.append(asyncio.create_task(self._watcher.run(), name="kvgate-config-watcher"))
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            # SIGHUP means "reload" to operators (and systemd's ExecReload): by default it would end kvgate at once
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self) -> None:
        watcher = self._watcher
        if watcher is None:
            log.warning("SIGHUP: nothing to reload (no config file, or reload.enabled is false)")
            return
        log.info("SIGHUP: reading %s now", watcher.path)
        self._tasks = [t for t in self._tasks if not t.done()]  # earlier SIGHUPs' reads, finished
        self._tasks.append(asyncio.create_task(watcher.reload_now(), name="kvgate-sighup-reload"))

    async def _on_model(self, model: ModelInfo) -> None:
        """The engine answered /v1/models: now ``auto`` can see its model path and its /tokenize."""
        if self.config.tokenizer == "auto":
            await self._resolve_tokenizer()
            if self.costs.counter.source == "builtin" and self._auto_retry is None:
                self._auto_retry = asyncio.create_task(self._retry_auto(), name="kvgate-tokenizer-auto-retry")
                self._tasks.append(self._auto_retry)

    async def _retry_auto(self) -> None:
        """``auto`` settled for the heuristic: no local tokenizer, and the engine's /tokenize did not answer its
        one probe (a timeout while the engine was busy starting, say). The heuristic is inexact, so auto is
        asked again a few times, further apart each time (5 s to a minute), before the heuristic is kept."""
        try:
            for delay in AUTO_RETRY_DELAYS_S:
                await asyncio.sleep(delay)
                if self.costs.counter.source != "builtin":
                    return  # chosen since: by the last try, or because the engine's model changed meanwhile
                await self._resolve_tokenizer()
        finally:
            self._auto_retry = None

    async def _resolve_tokenizer(self) -> None:
        """Choose the tokenizer (again). Of two resolutions that overlap (an auto retry while the engine's
        model changes), the one begun last wins: an earlier one finishing later is dropped."""
        self._resolutions += 1
        resolution = self._resolutions
        counter = await build_counter(
            self.config.tokenizer,
            session=self.session(),
            upstream=first.url if (first := self.pool.first) is not None else self.config.upstream.url,
            model_root=self.pool.model.root,
            model_id=self.pool.model.id,
            api_key=self.config.upstream.api_key,
            download=self.config.tokenizer_download,
            offload_chars=self.config.limits.offload_tokenize_chars,
            cache=self.tokenize_cache,
            tokenize_at=self._tokenize_url,
        )
        if resolution != self._resolutions:
            return  # a later resolution has begun: its answer is the one that stands
        previous, self.costs.counter = self.costs.counter, counter
        self.tokenize_cache.clear()  # counts of another model, or of an engine since restarted
        self.costs.conversations.clear()
        if (counter.name, counter.source) != (previous.name, previous.source):
            self.costs.agreement = CountAgreement()  # a new tokenizer is judged afresh; the same one is not
        log.info("counting prompt tokens with %s (source: %s)", counter.name, counter.source)

    def _tokenize_url(self) -> str:
        """Whose /tokenize counts a prompt: an engine of the pool that takes requests, in turn (engines come
        and go; the one there at start-up may be gone, and a discovered pool has none at start-up); the
        configured URL while the pool knows no engine yet."""
        return self.pool.any_forwarder().base_url if self.pool.engines else self.config.upstream.url

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
        await self.pool.close()
        await self.session.close()
        if self.access_log is not None:
            self.access_log.flush()

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
        """Ready to take traffic; with ``listen.readiness: gateway``, stale engines leave it ready (it says
        why in the reason), as its clients are better off with its 503s than with no endpoint."""
        if self.draining:
            return False, "draining"
        if self.controller.geometry is None:
            if not self.pool.engines and self.pool.left_after_a_sample:
                # discovery finds no engine (scaled to zero, the last pod of a rollout gone): with readiness
                # gateway, clients get 503 no_engine with Retry-After rather than a Service without endpoints
                return self.config.listen.readiness == "gateway", "no engine in the pool (discovery finds none)"
            return False, "KV-cache geometry unknown (no vllm:cache_config_info yet)"
        if self.controller.is_stale(self.clock()):
            stale = f"upstream metrics stale ({self.pool.last_error or 'no sample yet'})"
            seen = self.pool.age() < float("inf")  # not only configured (model.num_gpu_blocks): sampled, once
            return self.config.listen.readiness == "gateway" and seen, stale
        return True, "ok"

    def _gauge_readings(self) -> Iterator[Reading]:
        """Every gauge, read from the state that owns it (see :class:`gateway.metrics.StateGauges`). The
        unlabelled engine gauges are the pool's (a pool of one: its engine's); ``kvgate_engine_*`` are each
        engine's, labelled by its URL, and leave with it."""
        c = self.controller
        now = self.clock()
        books = list(c.engines.values())
        # what the engines' samples say, of the engines sampled lately: a dead or leaving engine's last sample
        # is no reading of it (kvgate_upstream_metrics_age_seconds and kvgate_ready say how stale it is)
        fresh = [b for b in books if not b.leaving and not b.is_stale(now)]
        yield "kvgate_gate_open", (), 1.0 if any(b.gate.is_open for b in books) else 0.0
        observed = pool_usage(fresh)
        if observed is not None:
            yield "kvgate_kv_usage_observed", (), observed
        projections = {b.name: b.projected_usage(now) for b in books}  # a lockstep peak each: once per scrape
        known = [u for u in projections.values() if u is not None]
        if known:
            yield "kvgate_kv_usage_projected", (), max(known)
        yield "kvgate_reserved_blocks", (), float(sum(b.ledger.reserved_blocks for b in books))
        yield "kvgate_inflight_requests", (), float(c.in_flight())
        yield "kvgate_queue_depth", (), float(len(c.queue))
        depths = c.queue.tenant_lengths()
        # a tenant's series stays at 0 once its queue empties, until a reload removes the tenant
        self._tenants_seen = {t for t in self._tenants_seen if t in self.policy.tenant_names} | depths.keys()
        for tenant in sorted(self._tenants_seen):
            yield "kvgate_tenant_queue_depth", (tenant,), float(depths.get(tenant, 0))
        age = self.pool.age()
        if age < float("inf"):  # from the first sample on: an engine still loading its model has no age yet
            yield "kvgate_upstream_metrics_age_seconds", (), age
        samples = [b.sample for b in fresh if b.sample is not None]
        if samples:
            yield "kvgate_upstream_requests_running", (), sum(x.running for x in samples)
            yield "kvgate_upstream_requests_waiting", (), sum(x.waiting for x in samples)
        for state in ("placeable", "ejected", "leaving", "other_block_size"):
            yield "kvgate_pool_engines", (state,), float(sum(1 for b in books if engine_state(b) == state))
        for b in books:
            yield from engine_readings(b, projections[b.name], fresh=b in fresh)
        yield "kvgate_ready", (), 1.0 if self.is_ready()[0] else 0.0
        redis = self.counters.redis
        yield "kvgate_redis_up", (), 1.0 if redis is not None and redis.healthy else 0.0
        yield "kvgate_limits_degraded", (), 1.0 if self.counters.degraded else 0.0
        yield "kvgate_policy_version", (), float(self.policy.version)
        yield "kvgate_output_estimate_quantile", (), c.caution.quantile
        for q in (0.5, 0.9, 0.99):
            expected = c.lengths.quantile((), q)
            if expected is not None and expected < BEYOND:
                yield "kvgate_output_tokens_expected", (str(q),), float(expected)
        yield "kvgate_requests_outran_estimate", (), float(c.outran)
        yield "kvgate_prefix_affinity_placements", (), float(c.affinity_placements)
        yield "kvgate_tokenizer_info", (self.costs.counter.kind, self.costs.counter.source), 1.0
        yield "kvgate_tokenizer_disagrees", (), float(self.costs.agreement.disagrees)
        yield "kvgate_tokenize_cache_lookups", ("hit",), float(self.tokenize_cache.hits)
        yield "kvgate_tokenize_cache_lookups", ("miss",), float(self.tokenize_cache.misses)
        tally = self.costs.tally
        yield "kvgate_prompts_priced", ("estimate",), float(tally.by_estimate)
        yield "kvgate_prompts_priced", ("conversation",), float(tally.by_conversation)
        yield "kvgate_prompts_priced", ("tokenizer",), float(tally.by_tokenizer)
        yield "kvgate_prompts_priced", ("token_ids",), float(tally.by_token_ids)
        yield "kvgate_prompts_near_limit", (), float(tally.near_limit)
        yield "kvgate_prompt_estimate_above_band", (), float(tally.errors.above_high)
        yield "kvgate_arrivals_deferred", (), float(self.arrivals.deferred)

    def _histogram_readings(self) -> Iterator[HistogramReading]:
        errors = self.costs.tally.errors
        yield "kvgate_prompt_estimate_ratio", (), errors.cumulative(), errors.total

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="kvgate", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> dict[str, str]:
            return {"status": "alive"}

        @app.get("/readyz")
        async def readyz() -> JSONResponse:
            ready, reason = self.is_ready()
            c = self.controller
            books = list(c.engines.values())
            age = self.pool.age()
            body = {
                "ready": ready,
                "reason": reason,
                "gate_open": any(b.gate.is_open for b in books),
                "kv_usage": pool_usage(books),
                "metrics_age_s": None if age == float("inf") else round(age, 3),
                "queue_depth": len(c.queue),
                "inflight": c.in_flight(),
                "engines": [
                    {
                        "url": b.name,
                        "state": engine_state(b),
                        "kv_usage": b.sample.usage if b.sample else None,
                        "inflight": len(b.ledger),
                    }
                    for b in books
                ],
                "tokenizer": self.costs.counter.name,
                "limits": self.counters.status(),
                "policy_version": self.policy.version,
            }
            return JSONResponse(body, status_code=200 if ready else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        return app


def pool_usage(books: list[EngineBook]) -> float | None:
    """The pool's KV usage: used blocks over all blocks of the engines that reported (a plain mean while a
    pool size is unknown)."""
    seen = [(b.sample.usage, b.geometry) for b in books if b.sample is not None]
    if not seen:
        return None
    if all(g is not None for _, g in seen):
        total = sum(g.num_blocks for _, g in seen if g is not None)
        return sum(u * g.num_blocks for u, g in seen if g is not None) / max(1, total)
    return sum(u for u, _ in seen) / len(seen)


def engine_state(book: EngineBook) -> str:
    if book.leaving:
        return "leaving"
    return "ejected" if book.ejected else "other_block_size" if book.other_block_size else "placeable"


def engine_readings(book: EngineBook, projected: float | None, fresh: bool = True) -> Iterator[Reading]:
    """One engine's gauges and counters, labelled by its URL; its observed usage only while its sample is
    ``fresh``."""
    label = (book.name,)
    if book.sample is not None and fresh:
        yield "kvgate_engine_kv_usage_observed", label, book.sample.usage
    if projected is not None:
        yield "kvgate_engine_kv_usage_projected", label, projected
    if book.geometry is not None:
        yield "kvgate_engine_num_blocks", label, float(book.geometry.num_blocks)
    yield "kvgate_engine_reserved_blocks", label, float(book.ledger.reserved_blocks)
    yield "kvgate_engine_inflight_requests", label, float(len(book.ledger))
    yield "kvgate_engine_gate_open", label, 1.0 if book.gate.is_open else 0.0
    yield "kvgate_engine_ejected", label, 1.0 if book.ejected else 0.0
    yield "kvgate_engine_placements", label, float(book.placements)
    yield "kvgate_engine_restarts", label, float(book.restarts)
    for reason, count in book.ejections.items():
        yield "kvgate_engine_ejections", (book.name, reason), float(count)
