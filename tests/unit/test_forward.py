"""The upstream client against a real socket server that misbehaves the way real ones do."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError
from gateway.server.response import ResponseWriter
from gateway.upstream.forwarder import Forwarder, is_engine_busy, parse_usage, relayed_headers, upstream_headers

BODY = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


async def closing_server() -> tuple[asyncio.Server, list[int]]:
    """Answers the first request on each connection with keep-alive, then reads a second one and resets the
    connection without answering it: an engine that received a request and dropped it."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        on_this_connection = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
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
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    body = b'{"prompt":"x"}'
    if path == "inference":
        usage = await forwarder.inference("/v1/completions", body, [], ResponseWriter(send), [], lambda _: None)
    else:
        await forwarder.passthrough("POST", "/v1/completions", body, [], ResponseWriter(send))
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

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    forwarder = Forwarder(f"http://127.0.0.1:{port}", GatewayMetrics(), timeout_s=5, connect_timeout_s=1)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await forwarder.passthrough("GET", "/v1/models?x=%2F..", b"", [], ResponseWriter(send))
    await forwarder.close()
    server.close()
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


def test_headers_named_in_connection_are_not_forwarded_either_way() -> None:
    client = [(b"connection", b"keep-alive, X-Secret"), (b"x-secret", b"1"), (b"x-kept", b"2")]
    up = upstream_headers(client, "rid", None)
    assert (b"x-kept", b"2") in up and all(k.lower() not in (b"x-secret", b"connection") for k, _ in up)
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
