"""Forwarding: send the request to the engine and relay its answer, chunk by chunk, as it arrives.

Non-streaming bodies pass byte for byte. SSE streams are relayed without buffering; on the way we count
events to tell the ledger how far each request has got, and keep the tail to read the final ``usage``.

vLLM's ``--max-num-queued-reqs`` rejections ("engine busy") come in two forms: a plain 503, and for
streams often an HTTP 200 whose first event is ``data: {"error": {..., "code": 503}}``. We hold the
response head until the first chunk has arrived so that both can become a proper 503 with Retry-After.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import orjson

from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError, engine_busy
from gateway.protocol.stream_usage import UsageEventFilter
from gateway.upstream.broadcast import Reply
from gateway.upstream.http_client import ConnectFailed, Pool, Response, UpstreamError

log = logging.getLogger("kvgate.upstream")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# What of the client's head reaches the engine: an allow-list, not a deny-list. vLLM acts on more request
# headers than the body says (``X-data-parallel-rank`` pins a data-parallel rank, past kvgate's placement; a
# SageMaker adapter header rewrites the body's model after kvgate priced and rate-limited it; ``X-Request-Id``
# becomes the id vLLM aborts by), and a header vLLM learns to read next release must not reach it unvetted.
# content-type carries a multipart body's boundary; traceparent/tracestate join the engine's spans (vLLM's
# OpenTelemetry tracing) to the client's trace; authorization only when kvgate has no key of its own for the
# engine (then the engine checks the client's).
_FORWARDED_UP = frozenset({b"content-type", b"accept", b"traceparent", b"tracestate"})
_FORWARDED_UP_WITH_KEY = _FORWARDED_UP | {b"authorization"}
# x-request-id: the engine's is kvgate's suffixed one (vLLM echoes it with --enable-request-id-headers); the
# client is told its own (or kvgate's) id, once.
_NOT_RELAYED_DOWN = HOP_BY_HOP | {b"content-length", b"date", b"server", b"x-request-id"}
_TAIL_BYTES = 4096
# a data line's start: what the events of a stream are counted by. Not "data:" alone, which an answer's own
# text can hold ("data:image/png;base64,..."); a JSON string holds no raw newline
_EVENT = b"\ndata:"
_DONE = b"data: [DONE]\n\n"  # the last event of a chat or completions stream
BUSY_RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


class Downstream(Protocol):
    """Where an answer goes: the client's response (:class:`gateway.server.response.ResponseWriter`)."""

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None: ...

    async def body(self, chunk: bytes, more: bool = False) -> None: ...


def _connection_named(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names a ``Connection:`` header lists: hop-by-hop for this one connection only (RFC 9110 7.6.1)."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    return frozenset(named)


def upstream_headers(
    client_headers: list[tuple[bytes, bytes]],
    engine_request_id: str,
    api_key: str | None,
    priority: int | None = None,
) -> list[tuple[bytes, bytes]]:
    """What the engine is told: the client's headers kvgate forwards (see ``_FORWARDED_UP``; names are
    lower-case, as ASGI servers give them), the client's key when kvgate has none of its own for the engine,
    the request id the engine knows this request by, kvgate's engine key if it has one, and the request's
    ``priority`` for an engine that schedules by it (``X-Vllm-Priority``, which vLLM reads before the body's
    field on chat, completions and responses). Headers the client's ``Connection:`` names were for kvgate's hop
    alone, and stay here."""
    forwarded = _FORWARDED_UP if api_key is not None else _FORWARDED_UP_WITH_KEY
    headers = [(k, v) for k, v in client_headers if k in forwarded]
    connection = [v for k, v in client_headers if k == b"connection"]
    if connection and connection != [b"keep-alive"]:  # the usual value names nothing forwarded
        named = _connection_named(client_headers)
        headers = [(k, v) for k, v in headers if k not in named]
    headers.append((b"x-request-id", engine_request_id.encode("latin-1")))
    if api_key is not None:
        headers.append((b"authorization", b"Bearer " + api_key.encode("latin-1")))
    if priority is not None:
        headers.append((b"x-vllm-priority", str(priority).encode()))
    return headers


def relayed_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The engine's headers as it sent them (duplicates such as set-cookie kept), minus hop-by-hop ones."""
    named = _connection_named(headers)
    return [(k.lower(), v) for k, v in headers if (n := k.lower()) not in _NOT_RELAYED_DOWN and n not in named]


def retry_after_of(headers: list[tuple[bytes, bytes]]) -> float:
    """An engine's (or its ingress's) refusal is passed on with its own Retry-After in seconds, within 1 to 60;
    without one (vLLM sends none), ``BUSY_RETRY_AFTER_S``."""
    for name, value in headers:
        if name.lower() == b"retry-after":
            try:
                return min(60.0, max(1.0, float(value)))
            except ValueError:  # an HTTP date: not worth a clock of the engine's to read
                break
    return BUSY_RETRY_AFTER_S


def is_engine_busy(body: bytes) -> bool:
    """vLLM's admission rejection: ``{"error": {..., "code": 503}}`` or a top-level 503 code."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict):
        return False
    error = data.get("error", data)
    return isinstance(error, dict) and str(error.get("code")) == "503"


def _first_event_is_busy(chunk: bytes) -> bool:
    stripped = chunk.lstrip()
    if not stripped.startswith(b"data:"):
        return False
    event = stripped[5:].split(b"\n\n", 1)[0].strip()
    return event.startswith(b'{"error"') and is_engine_busy(event)


def parse_usage(payload: bytes) -> Usage | None:
    """The engine's count of a request's tokens in a whole (not streamed) answer: see :func:`_usage_of`."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return _usage_of(data.get("usage")) if isinstance(data, dict) else None


def _usage_of(usage: object) -> Usage | None:
    """A ``usage`` object in any of vLLM's shapes: ``prompt_tokens`` and ``completion_tokens`` (completions,
    chat, pooling), ``input_tokens`` and ``output_tokens`` (``/v1/responses``, ``/v1/messages``). None when it
    says no prompt count: an absent count is not a zero one (it would refund the whole charge and teach the
    output estimate a zero)."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    # Anthropic's input_tokens leaves out what the prefix cache served (vLLM reports those apart): the engine
    # held them all the same
    for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):
        if isinstance(extra := usage.get(cached), int):
            prompt += extra
    return Usage(prompt, completion) if prompt > 0 else None


def _usage_from_tail(tail: bytes) -> Usage | None:
    """The last ``usage`` object of a stream's tail that says a prompt count: vLLM sends it last (a chat or
    completions chunk with ``include_usage``, a Responses ``response.completed`` event, an Anthropic
    ``message_delta``), in ``data:`` lines that may follow an ``event:`` line. Only the object itself is parsed:
    ``response.completed`` repeats the whole answer, and its start may have left the tail."""
    end = len(tail)
    while (at := tail.rfind(b'"usage"', 0, end)) >= 0:
        end = at
        start = tail.find(b"{", at + 7, at + 16)
        if start < 0:
            continue  # "usage": null, or cut off
        # its closing brace, from brace to brace (a usage object holds numbers and objects of numbers, no
        # strings that could hold a brace): a few finds, not a Python step per byte
        depth, i = 0, start
        while (close := tail.find(b"}", i)) >= 0:
            depth += tail.count(b"{", i, close) - 1
            i = close + 1
            if depth <= 0:
                try:
                    usage = _usage_of(orjson.loads(tail[start:i]))
                except orjson.JSONDecodeError:
                    usage = None
                if usage is not None:
                    return usage
                break
    return None


def _ends_in_error(tail: bytes) -> bool:
    """Whether a stream's last event (``[DONE]`` aside) is an error: vLLM ends a generation that failed midway
    with ``data: {"error": ...}`` then ``data: [DONE]`` on a 200 (``event: error`` on ``/v1/messages``), and
    such an answer is cut short, not a measure of how long answers are."""
    if b"error" not in tail:
        return False
    for event in reversed(tail.split(b"\n\n")):
        data = event.strip().rpartition(b"data:")[2].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            last = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        return isinstance(last, dict) and ("error" in last or last.get("type") == "error")
    return False


@dataclass(slots=True)
class Relayed:
    """What the client was sent, as the settlement needs it: the engine's usage, if it said, and whether the
    answer (a 200 stream) ended in an error event."""

    usage: Usage | None
    broke_off: bool = False


class Forwarder:
    """Sends requests to the engine through the lean client of :mod:`gateway.upstream.http_client`: once each,
    on the target exactly as the router checked it, and relays the answer as it comes (redirects included:
    they are the client's to follow, never ours)."""

    def __init__(
        self,
        base_url: str,
        metrics: GatewayMetrics,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int = 1024,
        max_header_bytes: int = 64 * 1024,
    ) -> None:
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.base_url = base_url
        self.pool = Pool(
            base_url,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            max_header_bytes=max_header_bytes,
            on_stale=metrics.upstream_stale_connections.inc,
        )

    async def close(self) -> None:
        await self.pool.close()

    def _failure(self, exc: BaseException) -> GatewayError:
        log.warning("engine %s: %s: %s", self.base_url, type(exc).__name__, exc)
        return _upstream_failure(exc)

    async def inference(
        self,
        target: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        writer: Downstream,
        extra_headers: list[tuple[bytes, bytes]],
        on_progress: Callable[[int], None],
        hide_usage: bool = False,
    ) -> Relayed:
        """Forward one admitted request. ``hide_usage``: kvgate asked for a stream's usage the client did not
        ask for: its event is read, not relayed."""
        started = time.perf_counter()
        try:
            async with await self.pool.request("POST", target, headers, body, self.timeout_s) as resp:
                media_type = resp.media_type
                if resp.status == 200 and media_type == "text/event-stream":
                    hidden = UsageEventFilter() if hide_usage else None
                    return await self._relay_stream(resp, writer, extra_headers, on_progress, started, hidden)
                payload = await resp.read()
                if resp.status in (429, 503):  # vLLM's busy answer, or a proxy's in front of it: retry later
                    self.metrics.upstream_busy.labels("status").inc()
                    raise EngineBusy(retry_after_of(resp.headers))
                await writer.start(resp.status, [*relayed_headers(resp.headers), *extra_headers, _length(payload)])
                await writer.body(payload)
                self.metrics.latency.observe(time.perf_counter() - started)
                return Relayed(
                    parse_usage(payload) if resp.status == 200 and media_type == "application/json" else None
                )
        except (UpstreamError, TimeoutError) as exc:
            raise self._failure(exc) from exc

    async def _relay_stream(
        self,
        resp: Response,
        writer: Downstream,
        extra_headers: list[tuple[bytes, bytes]],
        on_progress: Callable[[int], None],
        started: float,
        hidden: UsageEventFilter | None = None,
    ) -> Relayed:
        """``hidden``: drops the usage event from what the client gets (the engine's bytes are read whole)."""
        first = await resp.next_chunk() or b""
        if _first_event_is_busy(first):
            self.metrics.upstream_busy.labels("sse").inc()
            raise EngineBusy(BUSY_RETRY_AFTER_S)
        self.metrics.ttft.observe(time.perf_counter() - started)  # a refusal is no first token
        await writer.start(200, [*relayed_headers(resp.headers), *extra_headers])
        opened = b"\n" + first  # the stream's start is a line's
        events = opened.count(_EVENT)
        tail = opened[-_TAIL_BYTES:]
        # The answer is whole at [DONE]: the client's response ends with the chunk that carries it. An SDK
        # closes its connection as it reads [DONE], often before the engine's own response has ended, and that
        # close must not count as a client gone mid-answer (cancelled: no usage learned, billed as cut short).
        done = tail.endswith(_DONE)
        out = first if hidden is None else hidden.feed(first)
        if out or done:
            await writer.body(out, more=not done)
        on_progress(events)
        while not done and (chunk := await resp.next_chunk()) is not None:
            joined = tail + chunk
            # from the seam on (less the marker's length, one byte short): an event's start cut by it counts once
            events += joined.count(_EVENT, max(0, len(tail) - len(_EVENT) + 1))
            tail = joined[-_TAIL_BYTES:]
            done = tail.endswith(_DONE)
            out = chunk if hidden is None else hidden.feed(chunk)
            if out or done:  # an event cut by the chunk's end waits for its rest
                await writer.body(out, more=not done)
            on_progress(events)
        if not done:
            await writer.body(b"" if hidden is None else hidden.flush())
        self.metrics.latency.observe(time.perf_counter() - started)
        if done:  # nothing follows [DONE]: read the engine's response to its end, for its connection's reuse
            with contextlib.suppress(UpstreamError, TimeoutError):  # the answer is whole whatever happens now
                while await resp.next_chunk() is not None:
                    pass
        return Relayed(_usage_from_tail(tail), _ends_in_error(tail))

    async def passthrough(
        self,
        method: str,
        target: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        writer: Downstream,
        extra_headers: list[tuple[bytes, bytes]],
    ) -> None:
        """A read-only or allow-listed route: same status, same body, same headers minus hop-by-hop ones (and
        the engine's request id: ``extra_headers`` say kvgate's)."""
        try:
            async with await self.pool.request(method, target, headers, body, self.timeout_s) as resp:
                length = resp.header(b"content-length")
                extra = extra_headers if length is None else [*extra_headers, (b"content-length", length)]
                await writer.start(resp.status, [*relayed_headers(resp.headers), *extra])
                async for chunk in resp.chunks():
                    await writer.body(chunk, more=True)
                await writer.body(b"")
        except (UpstreamError, TimeoutError) as exc:
            raise self._failure(exc) from exc

    async def fetch(self, method: str, target: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> Reply:
        """An admin call's whole answer, to be compared with the other engines' (see :mod:`.broadcast`)."""
        try:
            async with await self.pool.request(method, target, headers, body, self.timeout_s) as resp:
                chunks = [chunk async for chunk in resp.chunks()]
                return Reply(resp.status, relayed_headers(resp.headers), b"".join(chunks))
        except (UpstreamError, TimeoutError) as exc:
            raise self._failure(exc) from exc


class EngineBusy(GatewayError):
    """The engine turned the request away before running any of it (vLLM's queue of requests is full, or a
    proxy in front of it said 429/503): it may wait for room and be sent again. Told to the client, it is a
    503 ``engine_busy``."""

    def __init__(self, retry_after_s: float) -> None:
        busy = engine_busy(retry_after_s)
        super().__init__(busy.status, busy.message, type=busy.type, code=busy.code, retry_after_s=retry_after_s)


class EngineUnreachable(GatewayError):
    """The engine refused (or never answered) the connection: nothing of the request was sent, so it may be
    placed on another engine of the pool. Told to the client, it is a 503 ``upstream_unavailable``."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, type="service_unavailable", code="upstream_unavailable", retry_after_s=1.0)


def _upstream_failure(exc: BaseException) -> GatewayError:
    """What the client is told when the engine could not be reached or broke off (503, 504 or 502): what
    happened, never where (the engine's address and the OS error go to kvgate's log)."""
    if isinstance(exc, ConnectFailed):
        return EngineUnreachable("The inference engine is unreachable.")
    if isinstance(exc, TimeoutError):
        return GatewayError(
            504, "The inference engine did not answer in time.", type="upstream_error", code="upstream_timeout"
        )
    return GatewayError(
        502, "The inference engine dropped the connection.", type="upstream_error", code="upstream_disconnected"
    )


def _length(payload: bytes) -> tuple[bytes, bytes]:
    return (b"content-length", str(len(payload)).encode())
