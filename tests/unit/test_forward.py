"""The upstream client against a real socket server that misbehaves the way real ones do."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.metrics import GatewayMetrics
from gateway.protocol.errors import GatewayError
from gateway.server.response import ResponseWriter
from gateway.upstream.forwarder import Forwarder, is_engine_busy, parse_usage
from gateway.upstream.session import UpstreamSession

BODY = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


async def closing_server() -> tuple[asyncio.Server, list[int]]:
    """Answers the first request on each connection with keep-alive, then resets the connection when a
    second request arrives on it: a pooled connection the server has just given up on."""
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
    """One request through the hot path (``inference``, the lean client) or ``passthrough`` (aiohttp)."""
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
async def test_a_connection_reset_before_any_response_is_retried_once(path: str) -> None:
    server, served = await closing_server()
    port = server.sockets[0].getsockname()[1]
    metrics = GatewayMetrics()
    session = UpstreamSession(8)
    forwarder = Forwarder(f"http://127.0.0.1:{port}", session, metrics, timeout_s=5, connect_timeout_s=1)
    for _ in range(3):
        usage, sent = await call(forwarder, path)
        assert usage is not None and usage.prompt_tokens == 3
        assert sent[0]["status"] == 200 and b"".join(m.get("body", b"") for m in sent[1:]) == BODY
    await forwarder.close()
    await session.close()
    server.close()
    assert len(served) == 3
    assert metrics.upstream_retries._value.get() == 2  # the 2nd and 3rd calls met a dead pooled connection


async def test_unreachable_engine_is_503_with_retry_after() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    session = UpstreamSession(8)
    forwarder = Forwarder(f"http://127.0.0.1:{port}", session, GatewayMetrics(), timeout_s=5, connect_timeout_s=1)
    with pytest.raises(GatewayError) as err:
        await call(forwarder)
    await forwarder.close()
    await session.close()
    assert err.value.status == 503 and err.value.retry_after_s is not None


def test_engine_busy_and_usage_parsing() -> None:
    assert is_engine_busy(b'{"error":{"message":"The engine is currently busy","type":"x","code":503}}')
    assert not is_engine_busy(b'{"error":{"message":"bad","code":400}}')
    assert not is_engine_busy(b"<html>")
    assert parse_usage(BODY) is not None and parse_usage(b'{"usage": null}') is None
