"""The request path, top to bottom: :meth:`RequestPath.handle`, then :meth:`RequestPath.inference`.

route (allow-list, canonical path; a refusal is told only to a caller with a key) -> authenticate -> take a
turn -> parse -> estimate cost -> rate limit -> tenant slot -> admit (or queue / reject) -> forward and stream
-> settle and release. Each step lives in the module named after it; this file only strings them together.
:meth:`RequestPath.handle` wraps every proxied request: it opens the request's
:class:`~gateway.server.exchange.Exchange`, answers errors in OpenAI's shape, and is the one place where
rejections and client disconnects are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gateway.admission.admitter import NO_ENGINE, Admitter
from gateway.admission.queue import engine_priority
from gateway.config import RequestLimitsConfig
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.paths import BodyKind
from gateway.protocol.bodies import parse_body
from gateway.protocol.cache_salt import salted
from gateway.protocol.errors import GatewayError, payload_too_large, shutting_down, upstream_unavailable
from gateway.protocol.requests import InferenceRequest
from gateway.protocol.routes import route
from gateway.protocol.stream_usage import asking_usage
from gateway.server.disconnect import ClientDisconnected, DisconnectWatch, Receive, connection_loss
from gateway.server.exchange import Exchange
from gateway.server.hints import client_hints
from gateway.server.pacing import ArrivalPacer
from gateway.server.response import ResponseWriter, Send
from gateway.tenants.counters import TenantCounters
from gateway.tenants.policy import Policy
from gateway.tokens.estimator import CostEstimator
from gateway.upstream.broadcast import Reply, agreed
from gateway.upstream.forwarder import EngineBusy, EngineUnreachable, upstream_headers
from gateway.upstream.pool import EnginePool

log = logging.getLogger("kvgate.request")

_PARSE_OFFLOAD_BYTES = 256 * 1024
T = TypeVar("T")


class RequestPath:
    def __init__(
        self,
        *,
        policy: Callable[[], Policy],
        costs: CostEstimator,
        counters: TenantCounters,
        admitter: Admitter,
        engines: EnginePool,
        limits: RequestLimitsConfig,
        upstream_api_key: str | None,
        metrics: GatewayMetrics,
        draining: Callable[[], bool],
        arrivals: ArrivalPacer,
        priority_scheduling: bool = False,
        stream_interval: int = 1,
        access: AccessLog | None = None,
    ) -> None:
        self.policy = policy  # the current snapshot: a reload swaps it between requests
        self.costs = costs
        self.counters = counters
        self.admitter = admitter
        self.engines = engines
        self.limits = limits
        self.upstream_api_key = upstream_api_key
        self.metrics = metrics
        self.draining = draining
        self.arrivals = arrivals
        self.priority_scheduling = priority_scheduling  # the engines order and preempt by vLLM's priority
        self.stream_interval = stream_interval  # the engines' --stream-interval: tokens per streamed event
        self.access = access  # an access line per request (None: log_requests is off)

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """One proxied request, from arrival to its last byte: route, authenticate, then the generation path
        or a passthrough."""
        started = time.monotonic()
        reason: str | None = None  # the error code it was answered with, if any
        writer = ResponseWriter(send)
        request_id, engine_request_id = request_ids(scope["headers"])
        watch = DisconnectWatch(receive, lambda: writer.finished, connection_loss(scope))
        exchange = Exchange(
            request_id,
            writer,
            engine_request_id=engine_request_id,
            admitter=self.admitter,
            counters=self.counters,
            metrics=self.metrics,
        )
        raw_path = raw_path_of(scope)
        try:
            async with exchange:
                if self.draining():
                    raise shutting_down(1.0)
                policy = self.policy()
                authorization = _header(scope["headers"], b"authorization")
                try:
                    where = route(scope["method"], raw_path, policy.allowed)
                except GatewayError:
                    policy.holds_a_key(authorization)  # which paths exist is not for strangers: 401 first
                    raise
                query = scope.get("query_string")
                target = raw_path + "?" + query.decode("latin-1") if query else raw_path
                if where.kind == "allowed":
                    # the engine's admin routes answer to the admin keys alone, or else to a tenant's key:
                    # never to an anonymous caller, whatever auth.require_api_key says
                    if policy.admin_keys:
                        policy.holds_a_key(authorization)  # a stranger hears 401, as for a path that is not open
                        policy.admin_keys.check(authorization)
                    else:
                        policy.authenticate(authorization, anonymous=False)
                    await self.passthrough(exchange, target, scope, receive, watch, every_engine=True)
                    return
                tenant = policy.authenticate(authorization)
                if where.kind == "generation":
                    assert where.body is not None
                    await self.inference(exchange, where.body, target, policy, tenant, scope, receive, watch)
                else:
                    await self.passthrough(exchange, target, scope, receive, watch)
        except GatewayError as exc:
            reason = exc.code or f"http_{exc.status}"
            self.metrics.rejected.labels(reason).inc()
            if not writer.started:
                await writer.error(exc, [(b"x-request-id", request_id.encode("latin-1"))])
            else:
                log.warning("request %s failed after the response started: %s", request_id, exc.message)
                with contextlib.suppress(OSError, ClientDisconnected):  # the client may be gone as well
                    await writer.stream_error(exc)
        except ClientDisconnected:
            reason = "client_disconnect"
            self.metrics.client_disconnects.labels("body").inc()
        except asyncio.CancelledError:
            if not watch.fired and not self.draining():
                raise  # not a disconnect nor the drain's end: the server itself is cancelling us
            current = asyncio.current_task()
            assert current is not None
            current.uncancel()
            if watch.fired:
                reason = "client_disconnect"
                self.metrics.client_disconnects.labels(exchange.stage).inc()
            else:  # the drain's deadline passed: what still runs ends in words, a stream with an error event
                reason = "shutting_down"
                with contextlib.suppress(OSError, ClientDisconnected):
                    await self._ended_by_drain(writer, request_id)
        finally:
            watch.stop()
            self._ended(exchange, scope["method"], raw_path, reason, started)

    def _ended(self, exchange: Exchange, method: str, raw_path: str, reason: str | None, started: float) -> None:
        """Counted once, by what the client got, and its access line (``log_requests``)."""
        writer = exchange.writer
        status = writer.status if writer.started else 0
        if not status or reason == "client_disconnect":
            answered = "none"  # the client went away, before its answer or during it: nobody's error
        elif status == 200 and (reason is not None or exchange.outcome == "upstream_error"):
            answered = "5xx"  # a 200 stream that ended in an error event: a 5xx told in-band
        else:
            answered = "429" if status == 429 else f"{status // 100}xx"
        self.metrics.requests.labels(answered).inc()
        access = self.access
        if access is None or not access.enabled:
            return
        admission, usage, tenant = exchange.admission, exchange.usage, exchange.tenant
        path = raw_path[:256]  # never the query: it can carry what a key or a client's secret is
        fields: dict[str, object] = {
            "method": method,
            "path": path,
            "status": status,
            "reason": reason or (exchange.outcome if exchange.outcome not in (None, "completed") else None),
            "duration_ms": round((time.monotonic() - started) * 1000, 1),
        }
        if tenant is not None:
            fields["tenant"] = tenant.tenant
        if exchange.key:
            fields["model"] = exchange.key[0][:128]  # the client's own string: bounded, as its request id is
        if admission is not None:
            fields["engine"] = admission.reservation.engine
            fields["queue_wait_ms"] = round((admission.waited_s + exchange.slot_wait_s) * 1000, 1)
        if exchange.reached_engine:
            fields["engine_request_id"] = exchange.engine_request_id
        if usage is not None:
            fields["prompt_tokens"], fields["completion_tokens"] = usage.prompt_tokens, usage.completion_tokens
        access.write(exchange.request_id, f"{method} {path} {status}", fields)

    async def _ended_by_drain(self, writer: ResponseWriter, request_id: str) -> None:
        self.metrics.rejected.labels("shutting_down").inc()
        if not writer.started:
            await writer.error(shutting_down(1.0), [(b"x-request-id", request_id.encode("latin-1"))])
        elif not await writer.stream_error(shutting_down(1.0)):
            log.warning("request %s was cut off by the end of the drain", request_id)

    async def inference(
        self,
        exchange: Exchange,
        body_kind: BodyKind,
        target: str,
        policy: Policy,
        tenant: str,
        scope: dict[str, Any],
        receive: Receive,
        watch: DisconnectWatch,
    ) -> None:
        # 1. authenticated already (against one policy snapshot for the whole request)
        exchange.client = client_hints(scope["headers"])
        # 2. parse (large bodies on a worker thread), once this arrival's turn has come
        raw = await read_body(receive, self.limits.max_body_bytes, _header(scope["headers"], b"content-length"))
        exchange.body_read(len(raw))
        watch.start()  # from here on, a client that goes away cancels this request wherever it is
        await self.arrivals.turn()  # in a burst, a few per loop iteration: the admitted ones' I/O goes on
        content_type = _header(scope["headers"], b"content-type") if body_kind == "audio" else None
        request = await _parse(body_kind, raw, content_type)
        if request.usage_hidden:  # a stream's usage is its exact length: asked for, and kept from the client
            raw = await _off_the_loop_if_large(len(raw), asking_usage, raw, request.stream_options_given)
        if policy.isolate_prefix_cache and body_kind != "audio":
            raw = salted(raw, tenant)  # the engine's prefix cache is shared by the tenant's requests alone
        exchange.stream_interval = max(request.stream_interval, self.stream_interval)  # vLLM takes the larger
        exchange.chat = request.messages is not None
        exchange.whole_answer = request.whole_answer
        # 3. estimate cost (tokenizing long prompts off the event loop), against the pool's engines: none left
        #    (discovery finds none) is a prompt 503, not "the KV-cache size is not known yet"
        if not self.engines.engines:
            raise upstream_unavailable(NO_ENGINE, 1.0)
        cost = await self.costs.estimate(request)
        # 4. rate limit (pre-charges prompt + reserved output; shared across replicas when Redis is configured)
        tenant_policy = policy.resolve(tenant, request.model, self.engines.model.names)
        await exchange.charge_rate_limits(tenant_policy, cost, (request.model or "", body_kind, tenant_policy.key))
        # 5. take a concurrency slot of the tenant, then admit, or wait in the queue, or be turned away
        if self.draining():  # a drain began while this one was being read or tokenized: it holds nothing yet
            raise shutting_down(1.0)
        await exchange.take_slot()
        # in a pool: the engine whose prefix cache has it (the tenant's own cache, when they are kept apart)
        exchange.prefix = self.admitter.prefix_of(request, tenant if policy.isolate_prefix_cache else "")
        await exchange.admit()
        # 6. forward and stream, on the engine it was placed on. An engine that refused the connection got
        #    nothing of it: that engine is ejected and the request placed again (a pool of one answers 503).
        #    One that turned it away as busy ran nothing of it either: it waits for room there and goes again
        priority = engine_priority(tenant_policy.qclass.priority) if self.priority_scheduling else None
        headers = upstream_headers(scope["headers"], exchange.engine_request_id, self.upstream_api_key, priority)
        while True:
            exchange.sending()
            try:
                relayed = await self.engines.forwarder(exchange.engine).inference(
                    target,
                    raw,
                    headers,
                    exchange.writer,
                    exchange.reply_headers(),
                    exchange.progress,
                    hide_usage=request.usage_hidden,
                )
                exchange.usage, exchange.broke_off = relayed.usage, relayed.broke_off
                break
            except EngineUnreachable:
                if not await exchange.place_again():
                    raise
            except EngineBusy:  # turned away unrun: it waits for room and goes again, within its budget
                if not await exchange.wait_again_after_busy():
                    raise
        # 7. learn what the engine counted for this prompt (the estimate of the next ones); settle and release
        #    when the exchange closes, however the request ended
        if exchange.usage is not None and exchange.writer.status == 200:
            self.costs.learn(request, cost, exchange.usage.prompt_tokens)

    async def passthrough(
        self,
        exchange: Exchange,
        target: str,
        scope: dict[str, Any],
        receive: Receive,
        watch: DisconnectWatch,
        every_engine: bool = False,
    ) -> None:
        """A read-only route, to one engine of the pool; an allow-listed admin route (``every_engine``), to each
        of them: it changes an engine's state (an adapter loaded on one engine would be missing on the rest)."""
        body = await read_body(receive, self.limits.max_body_bytes, _header(scope["headers"], b"content-length"))
        exchange.body_read(len(body))
        watch.start()
        headers = upstream_headers(scope["headers"], exchange.engine_request_id, self.upstream_api_key)
        exchange.sending()
        echo = [(b"x-request-id", exchange.request_id.encode("latin-1"))]
        forwarders = self.engines.every_forwarder() if every_engine else []
        if len(forwarders) < 2:
            forwarder = self.engines.any_forwarder()
            await forwarder.passthrough(scope["method"], target, body, headers, exchange.writer, echo)
            return
        calls = [f.fetch(scope["method"], target, body, headers) for f in forwarders]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for failed in replies:
            if isinstance(failed, BaseException) and not isinstance(failed, GatewayError):
                raise failed  # a bug, not an engine's answer
        reply = agreed([r for r in replies if isinstance(r, Reply | GatewayError)])
        said = [(b"x-kvgate-engines", b"%d" % len(calls)), (b"content-length", b"%d" % len(reply.body))]
        await exchange.writer.start(reply.status, [*reply.headers, *echo, *said])
        await exchange.writer.body(reply.body)


def raw_path_of(scope: dict[str, Any]) -> str:
    """The path exactly as the client sent it (percent-encoding and all): what routing decides on."""
    raw = scope.get("raw_path")
    if raw is None:  # a server that does not report it: the decoded path is all there is
        return str(scope["path"])
    return bytes(raw).split(b"?", 1)[0].decode("latin-1")


async def read_body(receive: Receive, limit: int, declared: bytes | None = None) -> bytes:
    """The request's body, at most ``limit`` bytes (413). ``declared``: its Content-Length, which refuses a body
    said to be larger before any of it is waited for."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise payload_too_large(limit)
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


async def _parse(kind: BodyKind, raw: bytes, content_type: bytes | None = None) -> InferenceRequest:
    return await _off_the_loop_if_large(len(raw), parse_body, kind, raw, content_type)


async def _off_the_loop_if_large(size: int, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` on a body of ``size`` bytes, on a worker thread when it is large (parsing or copying
    megabytes would stall the loop)."""
    if size <= _PARSE_OFFLOAD_BYTES:
        return work(*args)
    return await asyncio.get_running_loop().run_in_executor(None, work, *args)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first ``name`` header (ASGI gives header names in lower case)."""
    for key, value in headers:
        if key == name:
            return value
    return None


def request_ids(headers: list[tuple[bytes, bytes]]) -> tuple[str, str]:
    """(the id the client and kvgate's logs know the request by, the id the engine is told). A client's own
    ``x-request-id`` (its first 128 bytes: a bound on what kvgate logs and sends on) is echoed byte for byte
    (Latin-1 both ways), but the engine gets it with a suffix of its own: vLLM aborts
    requests by that id, so two clients sending the same one (or one sending another's) must not share it."""
    for key, value in headers:
        if key == b"x-request-id" and value:
            given = value.decode("latin-1")[:128]
            return given, f"{given}-{os.urandom(4).hex()}"
    generated = os.urandom(8).hex()
    return generated, generated
