"""The request path, top to bottom: :meth:`RequestPath.inference`.

authenticate -> parse -> estimate cost -> rate limit -> tenant slot -> admit (or queue / reject) -> forward and
stream -> settle and release. Each step lives in the module named after it; this file only strings them
together. :meth:`RequestPath.handle` wraps every proxied request: it opens the request's
:class:`~gateway.server.exchange.Exchange`, answers errors in OpenAI's shape, and is the one place where
rejections and client disconnects are counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from gateway.admission.admitter import Admitter
from gateway.config import RequestLimitsConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, payload_too_large, shutting_down
from gateway.protocol.requests import Endpoint, InferenceRequest, parse_request
from gateway.server.disconnect import ClientDisconnected, DisconnectWatch, Receive
from gateway.server.exchange import Exchange
from gateway.server.response import ResponseWriter, Send
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import Policy
from gateway.tokens.estimator import CostEstimator
from gateway.upstream.forwarder import Forwarder, upstream_headers

log = logging.getLogger("kvgate.request")

_PARSE_OFFLOAD_BYTES = 256 * 1024


class RequestPath:
    def __init__(
        self,
        *,
        policy: Callable[[], Policy],
        costs: CostEstimator,
        counters: TenantCounters,
        admitter: Admitter,
        forwarder: Forwarder,
        limits: RequestLimitsConfig,
        upstream_api_key: str | None,
        metrics: GatewayMetrics,
        draining: Callable[[], bool],
    ) -> None:
        self.policy = policy  # the current snapshot: a reload swaps it between requests
        self.costs = costs
        self.counters = counters
        self.admitter = admitter
        self.forwarder = forwarder
        self.limits = limits
        self.upstream_api_key = upstream_api_key
        self.metrics = metrics
        self.draining = draining

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send, endpoint: Endpoint | None) -> None:
        """One proxied request (``endpoint`` None: a passthrough path), from arrival to its last byte."""
        writer = ResponseWriter(send)
        request_id = _request_id(scope["headers"])
        watch = DisconnectWatch(receive, lambda: writer.finished)
        exchange = Exchange(request_id, writer, admitter=self.admitter, counters=self.counters, metrics=self.metrics)
        try:
            async with exchange:
                if self.draining():
                    raise shutting_down(1.0)
                if endpoint is None:
                    await self.passthrough(exchange, scope, receive)
                else:
                    await self.inference(exchange, endpoint, scope, receive, watch)
        except GatewayError as exc:
            self.metrics.rejected.labels(exc.code or f"http_{exc.status}").inc()
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
            self.metrics.client_disconnects.labels(exchange.stage).inc()
        finally:
            watch.stop()

    async def inference(
        self, exchange: Exchange, endpoint: Endpoint, scope: dict[str, Any], receive: Receive, watch: DisconnectWatch
    ) -> None:
        headers = scope["headers"]
        # 1. authenticate (against one policy snapshot for the whole request)
        policy = self.policy()
        tenant = policy.authenticate(_header(headers, b"authorization"))
        # 2. parse (large bodies on a worker thread)
        raw = await read_body(receive, self.limits.max_body_bytes)
        exchange.body_read()
        watch.start()  # from here on, a client that goes away cancels this request wherever it is
        request = await _parse(endpoint, raw)
        # 3. estimate cost (tokenizing long prompts off the event loop)
        cost = await self.costs.estimate(request)
        # 4. rate limit (pre-charges prompt + reserved output; shared across replicas when Redis is configured)
        await exchange.charge_rate_limits(policy.resolve(tenant, request.model), cost)
        # 5. take a concurrency slot of the tenant, then admit, or wait in the queue, or be turned away
        await exchange.take_slot()
        await exchange.admit()
        # 6. forward and stream
        exchange.sending()
        exchange.usage = await self.forwarder.inference(
            scope["path"],
            raw,
            upstream_headers(headers, exchange.request_id, self.upstream_api_key),
            exchange.writer,
            exchange.reply_headers(),
            exchange.progress,
        )
        # 7. settle and release: when the exchange closes, however the request ended

    async def passthrough(self, exchange: Exchange, scope: dict[str, Any], receive: Receive) -> None:
        body = await read_body(receive, self.limits.max_body_bytes)
        exchange.body_read()
        query = scope.get("query_string")
        path_qs = scope["path"] + (("?" + query.decode("latin-1")) if query else "")
        headers = upstream_headers(scope["headers"], exchange.request_id, self.upstream_api_key)
        await self.forwarder.passthrough(scope["method"], path_qs, body, headers, exchange.writer)


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _parse(endpoint: Endpoint, raw: bytes) -> InferenceRequest:
    if len(raw) <= _PARSE_OFFLOAD_BYTES:
        return parse_request(endpoint, raw)
    return await asyncio.get_running_loop().run_in_executor(None, parse_request, endpoint, raw)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for key, value in headers:
        if key == b"x-request-id" and value:
            return value.decode("latin-1")[:128]
    return os.urandom(8).hex()
