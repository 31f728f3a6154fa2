"""The upstream client against a real socket server that misbehaves the way real ones do."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from gateway.admission.queue import PRIORITIES, engine_priority, priority_rank
from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError
from gateway.server.request_path import request_ids
from gateway.server.response import ResponseWriter
from gateway.upstream.forwarder import Forwarder, is_engine_busy, parse_usage, relayed_headers, upstream_headers

BODY = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


async def read_request(reader: asyncio.StreamReader) -> None:
    """One request's head and its content-length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
    await reader.readexactly(length)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def engine_answering(handle: Handler) -> AsyncIterator[Forwarder]:
    """A fake engine that answers each connection with ``handle``, and kvgate's forwarder to it: both closed
    afterwards."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    forwarder = Forwarder(f"http://127.0.0.1:{port}", GatewayMetrics(), timeout_s=5, connect_timeout_s=1)
    try:
        yield forwarder
    finally:
        await forwarder.close()
        server.close()
        await server.wait_closed()


def recorder() -> tuple[list[dict[str, Any]], ResponseWriter]:
    """What the client is sent, and the writer that sends it there."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return sent, ResponseWriter(send)


async def closing_server() -> tuple[asyncio.Server, list[int]]:
    """Answers the first request on each connection with keep-alive, then reads a second one and resets the
    connection without answering it: an engine that received a request and dropped it."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        on_this_connection = 0
        while True:
            await read_request(reader)
            on_this_connection += 1
            if on_this_connection > 1:
                writer.transport.abort()  # RST, no response
                return
            served.append(1)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(BODY)).encode()
                + b"\r\n\r\n"
                + BODY
            )
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, served


async def call(forwarder: Forwarder, path: str = "inference") -> tuple[Any, list[dict[str, Any]]]:
    """One request through the generation path (``inference``) or a read-only route (``passthrough``)."""
    sent, writer = recorder()
    body = b'{"prompt":"x"}'
    if path == "inference":
        relayed = await forwarder.inference("/v1/completions", body, [], writer, [], lambda _: None)
        usage = relayed.usage
    else:
        await forwarder.passthrough("POST", "/v1/completions", body, [], writer, [])
        usage = parse_usage(b"".join(m.get("body", b"") for m in sent[1:]))
    return usage, sent


@pytest.mark.parametrize("path", ["inference", "passthrough"])
async def test_a_request_the_engine_received_and_dropped_is_not_sent_again(path: str) -> None:
    """A 502 for the client, and the engine saw the request once: a generation must never run twice."""
    server, served = await closing_server()
    port = server.sockets[0].getsockname()[1]
    forwarder = Forwarder(f"http://127.0.0.1:{port}", GatewayMetrics(), timeout_s=5, connect_timeout_s=1)
    usage, sent = await call(forwarder, path)
    assert usage is not None and usage.prompt_tokens == 3
    assert sent[0]["status"] == 200 and b"".join(m.get("body", b"") for m in sent[1:]) == BODY
    with pytest.raises(GatewayError) as err:
        await call(forwarder, path)  # the reused connection: read by the engine, then reset
    assert err.value.status == 502 and err.value.code == "upstream_disconnected"
    await forwarder.close()
    server.close()
    assert len(served) == 1  # the dropped request was not sent again on a fresh connection


async def test_redirects_are_relayed_not_followed_and_the_target_is_sent_as_checked() -> None:
    targets: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        targets.append(head.split(b" ")[1])
        writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://evil.example/x\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    sent, writer = recorder()
    async with engine_answering(handle) as forwarder:
        await forwarder.passthrough("GET", "/v1/models?x=%2F..", b"", [], writer, [])
    assert sent[0]["status"] == 307 and (b"location", b"http://evil.example/x") in sent[0]["headers"]
    assert targets == [b"/v1/models?x=%2F.."]


async def test_unreachable_engine_is_503_with_retry_after() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    forwarder = Forwarder(f"http://127.0.0.1:{port}", GatewayMetrics(), timeout_s=5, connect_timeout_s=1)
    with pytest.raises(GatewayError) as err:
        await call(forwarder)
    await forwarder.close()
    assert err.value.status == 503 and err.value.retry_after_s is not None
    assert str(port) not in err.value.message  # the engine's address is kvgate's to log, not the client's to see


@pytest.mark.parametrize(
    ("head", "retry_after_s"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n", 1.0),  # no JSON, no Retry-After
        (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 7\r\n", 7.0),
        (b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 86400\r\n", 60.0),  # not longer than a minute
        (b"HTTP/1.1 429 Too Many Requests\r\nretry-after: Wed, 21 Oct 2026 07:28:00 GMT\r\n", 1.0),
    ],
)
async def test_an_engine_or_ingress_refusal_is_told_in_openais_shape_with_a_retry_after(
    head: bytes, retry_after_s: float
) -> None:
    """Not only vLLM's own busy answer: a 429 or 503 from whatever sits in front of the engine is a refusal to
    retry later, with a Retry-After (the SDKs honour it), not a body in another shape relayed as it came."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head + b"content-length: 4\r\n\r\nbusy")
        await writer.drain()
        writer.close()

    async with engine_answering(handle) as forwarder:
        with pytest.raises(GatewayError) as err:
            await call(forwarder)
    assert err.value.status == 503 and err.value.code == "engine_busy"
    assert err.value.retry_after_s == retry_after_s


def test_only_headers_the_engine_needs_are_forwarded() -> None:
    """An allow-list: headers vLLM would act on past kvgate's decisions (a data-parallel rank, an adapter that
    rewrites the model, the client's own request id) never reach it; the client's key does only when kvgate
    has none of its own for the engine."""
    client = [  # names in lower case, as an ASGI server gives them
        (b"host", b"gw"),
        (b"content-type", b"multipart/form-data; boundary=x"),
        (b"accept", b"text/event-stream"),
        (b"traceparent", b"00-abc-def-01"),
        (b"authorization", b"Bearer sk-tenant"),
        (b"x-request-id", b"client-id"),
        (b"x-data-parallel-rank", b"3"),
        (b"x-amzn-sagemaker-adapter-identifier", b"other-model"),
        (b"x-forwarded-for", b"10.0.0.1"),
        (b"connection", b"keep-alive"),
        (b"content-length", b"10"),
    ]
    kept = [
        (b"content-type", b"multipart/form-data; boundary=x"),
        (b"accept", b"text/event-stream"),
        (b"traceparent", b"00-abc-def-01"),
    ]
    engine_id = (b"x-request-id", b"engine-id")
    assert upstream_headers(client, "engine-id", "engine-key") == [
        *kept,
        engine_id,
        (b"authorization", b"Bearer engine-key"),
    ]
    assert upstream_headers(client, "engine-id", None) == [
        *kept[:3],
        (b"authorization", b"Bearer sk-tenant"),
        engine_id,
    ]
    # a client's own X-Vllm-Priority never goes through; kvgate's (for a priority-scheduling engine) does
    assert upstream_headers([*client, (b"x-vllm-priority", b"-9")], "engine-id", "engine-key") == [
        *kept,
        engine_id,
        (b"authorization", b"Bearer engine-key"),
    ]
    assert upstream_headers(client, "engine-id", "engine-key", priority=-1)[-1] == (b"x-vllm-priority", b"-1")
    # what the client's Connection: names is for its hop to kvgate alone (RFC 9110 7.6.1)
    hop = [*client, (b"connection", b"traceparent, Accept")]
    assert upstream_headers(hop, "engine-id", "engine-key") == [
        kept[0],
        engine_id,
        (b"authorization", b"Bearer engine-key"),
    ]


def test_the_engine_priority_of_each_class_keeps_the_class_order_around_vllms_default() -> None:
    ranks = [priority_rank(name) for name in PRIORITIES]
    assert [engine_priority(r) for r in ranks] == [-1, 0, 1]  # lower is served first; standard is vLLM's 0
    assert engine_priority(priority_rank(None)) == 0


def test_the_engine_gets_its_own_request_id_and_the_client_its_own_back() -> None:
    given = [(b"x-request-id", b"abc-1")]
    (echo, first), (_, second) = request_ids(given), request_ids(given)
    assert echo == "abc-1" and first.startswith("abc-1-") and second.startswith("abc-1-") and first != second
    generated, engine = request_ids([])
    assert generated == engine and len(generated) == 16


def test_headers_named_in_connection_are_not_relayed_down() -> None:
    engine = [(b"Connection", b"x-internal"), (b"X-Internal", b"1"), (b"x-fine", b"2")]
    assert relayed_headers(engine) == [(b"x-fine", b"2")]


def test_engine_busy_and_usage_parsing() -> None:
    assert is_engine_busy(b'{"error":{"message":"The engine is currently busy","type":"x","code":503}}')
    assert not is_engine_busy(b'{"error":{"message":"bad","code":400}}')
    assert not is_engine_busy(b"<html>")
    assert parse_usage(BODY) is not None and parse_usage(b'{"usage": null}') is None


async def test_a_stream_cut_after_its_head_ends_with_an_error_event() -> None:
    """The engine dies mid-stream: the client's event stream ends with an OpenAI-shaped error event, not by
    just stopping; a JSON response or a finished stream takes no event."""
    from gateway.protocol.errors import GatewayError
    from gateway.server.response import ResponseWriter

    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    err = GatewayError(
        502, "The inference engine dropped the connection.", type="upstream_error", code="upstream_disconnected"
    )
    writer = ResponseWriter(send)
    await writer.start(200, [(b"content-type", b"text/event-stream; charset=utf-8")])
    await writer.body(b'data: {"choices": []}\n\n', more=True)
    assert await writer.stream_error(err)
    assert sent[-2]["body"] == b"data: " + err.body() + b"\n\n" and sent[-1] == {
        "type": "http.response.body",
        "body": b"",
        "more_body": False,
    }
    assert not await writer.stream_error(err)  # finished: nothing more
    plain = ResponseWriter(send)
    await plain.start(200, [(b"content-type", b"application/json")])
    assert not await plain.stream_error(err)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}', (7, 3)),
        (b'{"usage": {"prompt_tokens": 7, "total_tokens": 7}}', (7, 0)),  # pooling: no output
        (b'{"object": "response", "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}}', (7, 3)),
        (b'{"type": "message", "usage": {"input_tokens": 7, "output_tokens": 3}}', (7, 3)),
        (b'{"usage": {"total_tokens": 10}}', None),  # no prompt count: unknown, not zero
        (b'{"usage": {"prompt_tokens": 0, "completion_tokens": 0}}', None),
        (b'{"usage": null}', None),
        (b"[1, 2]", None),
    ],
)
def test_usage_in_every_shape_vllm_answers_with(payload: bytes, expected: tuple[int, int] | None) -> None:
    usage = parse_usage(payload)
    assert (None if usage is None else (usage.prompt_tokens, usage.completion_tokens)) == expected


@pytest.mark.parametrize(
    ("tail", "broke_off"),
    [
        (b'data: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: {"error": {"message": "x", "code": 500}}\n\n'
         b"data: [DONE]\n\n", True),
        (b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}\n\n', True),
        (b'data: {"choices": [{"delta": {"content": "error"}}]}\n\ndata: [DONE]\n\n', False),
        (b'event: message_stop\ndata: {"type": "message_stop"}\n\n', False),
    ],
)  # fmt: skip
def test_a_stream_that_ends_in_an_error_event_broke_off(tail: bytes, broke_off: bool) -> None:
    from gateway.upstream.forwarder import _ends_in_error

    assert _ends_in_error(tail) is broke_off


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        (b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\ndata: [DONE]\n\n', (7, 3)),
        # a Responses stream: event lines, and response.completed repeats the whole answer (its start cut off)
        (b'event: response.completed\ndata: {"type":"response.completed","response":{"output":[{"text":"..."}],'
         b'"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":0},"output_tokens":3,'
         b'"total_tokens":10}},"sequence_number":9}\n\n', (7, 3)),
        (b'pped answer text"}]}, "usage": {"input_tokens": 7, "output_tokens": 3}}}\n\n', (7, 3)),
        # Anthropic: message_delta carries it; input_tokens leaves out what the prefix cache served
        (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
         b'"usage":{"input_tokens":2,"output_tokens":3,"cache_read_input_tokens":5}}\n\n'
         b'event: message_stop\ndata: {"type":"message_stop"}\n\n', (7, 3)),
        (b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\ndata: [DONE]\n\n', None),
        (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', None),
    ],
)  # fmt: skip
def test_usage_at_the_end_of_every_kind_of_stream(tail: bytes, expected: tuple[int, int] | None) -> None:
    from gateway.upstream.forwarder import _usage_from_tail

    usage = _usage_from_tail(tail)
    assert (None if usage is None else (usage.prompt_tokens, usage.completion_tokens)) == expected


def test_the_engines_request_id_is_not_relayed_down() -> None:
    """vLLM echoes the id it was given (kvgate's suffixed one) with --enable-request-id-headers: the client is
    told its own, once."""
    assert relayed_headers([(b"x-request-id", b"abc-1f2e3d4c"), (b"x-fine", b"2")]) == [(b"x-fine", b"2")]


async def test_the_forwarder_says_a_stream_that_ended_in_an_error_event_broke_off() -> None:
    """What the engine really sends when a generation fails midway (a 200 stream: a token, the error event,
    ``[DONE]``) comes back from the forwarder as broken off, with the events relayed as they came."""
    stream = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n'
        b"data: [DONE]\n\n"
    )

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + stream)
        await writer.drain()
        writer.close()

    sent, writer = recorder()
    async with engine_answering(handle) as forwarder:
        relayed = await forwarder.inference("/v1/chat/completions", b"{}", [], writer, [], lambda _: None)
    assert relayed.broke_off and relayed.usage is None
    assert b"".join(m.get("body", b"") for m in sent[1:]) == stream


async def test_a_streams_events_are_counted_by_their_data_lines_wherever_the_chunks_cut_them() -> None:
    """The progress a stream reports (the ledger's growth, a stream's length without usage) counts events by
    the start of their data lines: not text of the answer that says "data:", and once for an event whose start
    falls across two chunks (the stream's own start counts as a line's)."""
    events = [
        b'data: {"choices":[{"delta":{"content":"<img src=\\"data:image/png;base64,AAAA\\">"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"data: data:"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    cut = len(events[0]) + len(events[1]) + 3  # inside the third event's "data:"
    chunks = [stream[: len(events[0]) - 1], stream[len(events[0]) - 1 : cut], stream[cut:]]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for chunk in chunks:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            await asyncio.sleep(0.05)  # each its own read
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    sent, writer = recorder()
    progress: list[int] = []
    async with engine_answering(handle) as forwarder:
        await forwarder.inference("/v1/chat/completions", b"{}", [], writer, [], progress.append)
    assert b"".join(m.get("body", b"") for m in sent[1:]) == stream
    assert progress[-1] == len(events) and progress == sorted(progress)
