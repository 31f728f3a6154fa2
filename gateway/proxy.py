"""The request path, top to bottom, in one function: :func:`handle_inference`.

authenticate -> parse -> estimate cost -> rate limit -> admit (or queue / reject) -> forward and stream
-> settle and release. Each step lives in the module named after it; this file only strings them together.
Errors anywhere become an OpenAI-shaped response in :mod:`gateway.app`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from gateway.disconnect import ClientDisconnected, DisconnectWatch
from gateway.errors import GatewayError, payload_too_large
from gateway.forward import ResponseWriter, Send, upstream_headers
from gateway.parse import Endpoint, InferenceRequest, parse_request
from gateway.ratelimit import ratelimit_headers
from gateway.settle import settle

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("kvgate.request")

_PARSE_OFFLOAD_BYTES = 256 * 1024

Receive = Any


async def handle_inference(
    gw: Gateway,
    endpoint: Endpoint,
    scope: dict[str, Any],
    receive: Receive,
    writer: ResponseWriter,
    request_id: str,
    watch: DisconnectWatch,
) -> None:
    headers = scope["headers"]
    # 1. authenticate (against one policy snapshot for the whole request: a reload swaps it between requests)
    policy = gw.policy
    tenant = policy.authenticate(_header(headers, b"authorization"))
    # 2. parse (large bodies on a worker thread)
    raw = await read_body(receive, gw.config.limits.max_body_bytes)
    watch.start()  # from here on, a client that goes away cancels this request wherever it is
    request = await _parse(endpoint, raw)
    # 3. estimate cost (tokenizing long prompts off the event loop)
    cost = await gw.estimate_cost(request)
    # 4. rate limit (pre-charges prompt + reserved output; shared across replicas when Redis is configured)
    tp = policy.resolve(tenant, request.model)
    charge = await gw.check_rate_limit(tp, cost)
    reply_headers = [(b"x-request-id", request_id.encode()), *ratelimit_headers(charge.decision)]
    max_wait = tp.max_queue_wait_s or gw.config.admission.queue_max_wait_s
    generated = 0
    reached_engine = False
    usage = None
    try:
        # 5. take a concurrency slot of the tenant, then admit, or wait in the queue, or be turned away
        async with (
            gw.limits.slot(tp, max_wait, lambda: gw.controller.queue.tenant_len(tenant)) as slot_wait,
            gw.admitter.reserve(cost, tenant, max(0.0, max_wait - slot_wait), tp.qclass) as admission,
        ):
            if admission.waited_s > 0 or slot_wait > 0:
                reply_headers += _queue_headers(
                    admission.queue_position, slot_wait + admission.waited_s, admission.eta_s
                )

            def on_progress(events: int) -> None:
                nonlocal generated
                generated = events
                gw.admitter.progress(admission.reservation, events)

            # 6. forward and stream
            reached_engine = True
            try:
                usage = await gw.forwarder.inference(
                    scope["path"],
                    raw,
                    upstream_headers(headers, request_id, gw.config.upstream.api_key),
                    writer,
                    reply_headers,
                    on_progress,
                )
            except GatewayError as exc:
                admission.outcome = "upstream_busy" if exc.code == "engine_busy" else "upstream_error"
                raise
    finally:
        # 7. settle (the reservation itself was released when the `async with` exited)
        settle(
            charge=charge,
            cost=cost,
            usage=usage,
            generated_events=generated,
            reached_engine=reached_engine,
            limits=gw.limits,
            metrics=gw.metrics,
        )
    log.debug(
        "done tenant=%s blocks=%d generated=%d",
        tenant,
        cost.blocks,
        generated,
        extra={"request_id": request_id},
    )


async def handle_passthrough(
    gw: Gateway, scope: dict[str, Any], receive: Receive, writer: ResponseWriter, request_id: str
) -> None:
    body = await read_body(receive, gw.config.limits.max_body_bytes)
    path_qs = scope["path"] + (("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else "")
    headers = upstream_headers(scope["headers"], request_id, gw.config.upstream.api_key)
    await gw.forwarder.passthrough(scope["method"], path_qs, body, headers, writer)


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


def _queue_headers(position: int, waited_s: float, eta_s: float | None = None) -> list[tuple[bytes, bytes]]:
    """Where the request stood in line on arrival, the ETA estimated then, and how long it really waited."""
    headers = [
        (b"x-kvgate-queue-position", str(position).encode()),
        (b"x-kvgate-queue-wait-ms", str(round(waited_s * 1000)).encode()),
    ]
    if eta_s is not None:
        headers.append((b"x-kvgate-queue-eta-ms", str(round(eta_s * 1000)).encode()))
    return headers


__all__ = ["Send", "handle_inference", "handle_passthrough", "read_body"]
