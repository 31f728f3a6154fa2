"""kvgate's HTTP/1.1 server protocol over real sockets, in-process: framing, keep-alive, pipelining, HEAD,
HTTP/1.0, ``Expect: 100-continue``, flow control of a large body, a head written with its body, response
splitting refused, a dropped connection told to the request. The deadlines (slowloris) are covered through the
whole gateway in ``tests/integration/test_edges.py``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.config import ListenConfig
from gateway.server.disconnect import connection_loss
from gateway.server.http_server import MAX_PIPELINED, MAX_STALL_BYTES, configured_protocol
from gateway.server.request_path import read_body

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class Served:
    """A listening socket served by the protocol, and what the app saw."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.port = 0
        self.state = ServerState()

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers it back with a content-length."""
    body = await read_body(receive, 1 << 30)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serve(
    app: App, limit_concurrency: int | None = None, on_over_limit: Callable[[], None] = lambda: None, **listen: float
) -> AsyncIterator[Served]:
    served = Served()

    async def recording(scope: dict[str, Any], receive: Any, send: Any) -> None:
        served.scopes.append(scope)
        await app(scope, receive, send)

    config = Config(
        recording, lifespan="off", timeout_keep_alive=30, proxy_headers=False, limit_concurrency=limit_concurrency
    )
    config.load()
    protocol = configured_protocol(ListenConfig(**listen), on_over_limit)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: protocol(config, served.state, {}), "127.0.0.1", 0)
    served.port = server.sockets[0].getsockname()[1]
    try:
        yield served
    finally:
        server.close()
        for connection in list(served.state.connections):
            connection.shutdown()
        await server.wait_closed()


@pytest.fixture
async def echo_server() -> AsyncIterator[Served]:
    async with serve(echo) as served:
        yield served


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One response: status line, headers (lower-case names), body by content-length or chunks."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head[:-4].split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    headers = {name.lower(): value for name, value in headers.items()}
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
        return status, headers, body
    return status, headers, await reader.read()


def post(body: bytes, path: bytes = b"/echo", extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b\r\n%b" % (path, len(body), extra, body)


async def test_keep_alive_connection_serves_requests_in_turn(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    for body in (b"one", b"", b"three" * 1000):
        writer.write(post(body))
        status, headers, answer = await read_response(reader)
        assert status == b"HTTP/1.1 200 OK"
        assert answer == body
        assert b"connection" not in headers
    assert len(echo_server.state.connections) == 1
    writer.close()


async def test_scope_carries_path_query_and_connection_loss(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"GET /v1/a%20b?x=1&y=2 HTTP/1.1\r\nHost: x\r\nX-Thing: Yes\r\n\r\n")
    await read_response(reader)
    scope = echo_server.scopes[0]
    assert (scope["method"], scope["path"], scope["raw_path"], scope["query_string"]) == (
        "GET",
        "/v1/a b",
        b"/v1/a%20b",
        b"x=1&y=2",
    )
    assert (b"x-thing", b"Yes") in scope["headers"]
    assert scope["client"][0] == "127.0.0.1"
    assert connection_loss(scope) is not None
    writer.close()


async def test_pipelined_requests_are_answered_in_order(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"".join(post(b"%d" % i) for i in range(5)))
    answers = [(await read_response(reader))[2] for _ in range(5)]
    assert answers == [b"0", b"1", b"2", b"3", b"4"]
    writer.close()


async def test_large_body_is_read_whole_under_flow_control(echo_server: Served) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: reading pauses and resumes many times
    reader, writer = await echo_server.connect()
    writer.write(post(body))
    assert (await read_response(reader))[2] == body
    writer.close()


async def test_expect_100_continue_is_answered_when_the_body_is_read(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    assert (await read_response(reader))[2] == b"hello"
    writer.close()


async def test_an_http_1_0_expect_is_ignored(echo_server: Served) -> None:
    """RFC 9110 10.1.1: an HTTP/1.0 client knows no 100 Continue; it would read one as its answer."""
    reader, writer = await echo_server.connect()
    writer.write(b"POST /echo HTTP/1.0\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhello")
    raw = await reader.read()
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.endswith(b"hello") and b"100 Continue" not in raw


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", b"400"),  # no Host
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"400"),  # two, which may disagree
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", b"501"),
    ],
    ids=["no-host", "two-hosts", "gzip-chunked"],
)
async def test_a_request_framed_or_addressed_ambiguously_is_refused(
    echo_server: Served, head: bytes, status: bytes
) -> None:
    """RFC 9112: an HTTP/1.1 request has exactly one Host (3.2); a transfer coding other than chunked is not
    served (6.1): the parser would take the chunking off and pass gzip bytes on as the body."""
    reader, writer = await echo_server.connect()
    writer.write(head)
    assert (await reader.read()).startswith(b"HTTP/1.1 " + status + b" ")
    assert echo_server.scopes == []


async def test_http_1_0_gets_its_answer_then_the_close() -> None:
    async def no_length(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await send({"type": "http.response.body", "body": b"def"})

    async with serve(no_length) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        raw = await reader.read()  # until the close: no chunked encoding in HTTP/1.0
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"transfer-encoding" not in raw
        assert raw.endswith(b"connection: close\r\n\r\nabcdef")


async def test_streamed_response_is_chunked_and_head_goes_out_with_the_first_chunk() -> None:
    first_read: list[bytes] = []

    async def stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with serve(stream) as served:
        reader, writer = await served.connect()
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        first_read.append(await reader.read(65536))  # the head and the first event: one write, one read
        assert first_read[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
        assert b"transfer-encoding: chunked\r\n" in first_read[0]
        rest = await reader.readuntil(b"0\r\n\r\n")
        assert rest == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"
        writer.close()


async def test_a_head_with_no_body_behind_it_still_goes_out() -> None:
    release = asyncio.Event()

    async def slow_body(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late"})

    async with serve(slow_body) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)  # not held for the body
        assert head.startswith(b"HTTP/1.1 200 OK")
        release.set()
        assert await reader.readuntil(b"0\r\n\r\n") == b"4\r\nlate\r\n0\r\n\r\n"
        writer.close()


async def test_head_request_gets_headers_and_no_body() -> None:
    async def same_as_get(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["method"] != "HEAD":
            return await echo(scope, receive, send)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})  # what a GET would say: not on the wire

    async with serve(same_as_get) as served:
        reader, writer = await served.connect()
        writer.write(b"HEAD /x HTTP/1.1\r\nHost: x\r\n\r\n" + post(b"after"))
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"content-length: 5" in head
        assert await read_response(reader) == (b"HTTP/1.1 200 OK", {b"content-length": b"5"}, b"after")
        writer.close()


async def test_header_value_with_a_line_break_is_refused_not_sent() -> None:
    async def splitting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"x-evil", b"a\r\nset-cookie: b"), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    async with serve(splitting) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == b"HTTP/1.1 500 Internal Server Error"
        assert b"set-cookie" not in body


async def test_invalid_request_gets_400_and_close(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    raw = await reader.read()
    assert raw.startswith(b"HTTP/1.1 400 ")
    assert echo_server.scopes == []
    head, _, body = raw.partition(b"\r\n\r\n")  # in OpenAI's shape, as every error a client sees
    assert b"content-type: application/json" in head
    assert orjson.loads(body)["error"]["code"] == "bad_http_request"


async def test_app_that_fails_before_answering_gets_500() -> None:
    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise ValueError("boom")

    async with serve(failing) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 500 ")


async def test_dropped_connection_is_told_to_the_request() -> None:
    told = asyncio.Event()
    started = asyncio.Event()

    async def waiting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        started.set()
        assert (await receive())["type"] == "http.disconnect"  # nothing more comes until the client is gone
        told.set()

    async with serve(waiting) as served:
        _reader, writer = await served.connect()
        writer.write(post(b"x"))
        await asyncio.wait_for(started.wait(), timeout=30)
        writer.close()
        await asyncio.wait_for(told.wait(), timeout=30)
        assert served.state.connections == set()


async def test_answer_before_the_body_is_in_closes_the_connection(echo_server: Served) -> None:
    async def early(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async with serve(early) as served:
        reader, writer = await served.connect()
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 10)
        raw = await reader.read()  # the answer, then the close: the other 99,990 bytes are never read
        assert raw.startswith(b"HTTP/1.1 401 ")
        assert raw.endswith(b"connection: close\r\n\r\n")


async def test_oversized_head_gets_431_and_trailers_are_not_kept(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_STALL_BYTES + 1024))
    assert (await reader.read()).startswith(b"HTTP/1.1 431 ")
    # a head that arrives whole, in one read, is measured too (no stall in between to count it by)
    for big in (b"X-Big: " + b"a" * (MAX_STALL_BYTES + 1) + b"\r\n", b"X-Many: aaaa\r\n" * (MAX_STALL_BYTES // 14)):
        reader, writer = await echo_server.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 431 ")
    reader, writer = await echo_server.connect()  # just under the limit: served
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_STALL_BYTES - 100) + b"\r\n\r\n")
    assert (await read_response(reader))[0].startswith(b"HTTP/1.1 200 ")
    writer.close()
    reader, writer = await echo_server.connect()
    chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
    writer.write(chunked + b"Authorization: Bearer smuggled\r\n\r\n")
    assert (await read_response(reader))[2] == b"hello"
    assert all(name != b"authorization" for name, _ in echo_server.scopes[-1]["headers"])
    writer.close()


async def test_a_request_target_too_long_gets_414(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"GET /" + b"a" * (MAX_STALL_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.read()).startswith(b"HTTP/1.1 414 ")


async def test_pipelined_requests_past_the_limit_are_not_read(echo_server: Served) -> None:
    reader, writer = await echo_server.connect()
    writer.write(b"".join(post(b"%d" % i) for i in range(MAX_PIPELINED + 20)))
    answers = [await read_response(reader) for _ in range(MAX_PIPELINED + 1)]  # the first, then those queued
    assert [body for _, _, body in answers] == [b"%d" % i for i in range(MAX_PIPELINED + 1)]
    assert answers[-1][1].get(b"connection") == b"close"
    assert await reader.read() == b""


async def test_app_failing_after_its_answer_leaves_the_connection_serving() -> None:
    async def answers_then_fails(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await echo(scope, receive, send)
        raise ValueError("cleanup failed")

    async with serve(answers_then_fails) as served:
        reader, writer = await served.connect()
        for body in (b"first", b"second"):
            writer.write(post(body))
            assert (await read_response(reader))[2] == body
        writer.close()


async def test_503_past_the_limit_waits_its_turn_behind_a_stream() -> None:
    release, started = asyncio.Event(), asyncio.Event()

    async def stream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        started.set()
        await release.wait()
        await send({"type": "http.response.body", "body": b"two"})

    async with serve(stream, limit_concurrency=2) as served:
        reader, writer = await served.connect()
        writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), timeout=30)
        _other = await served.connect()  # a second connection: the pipelined request is now past the limit
        while len(served.state.connections) < 2:  # noqa: ASYNC110  (uvicorn's set has no event to wait on)
            await asyncio.sleep(0.01)
        release.set()
        status, _, body = await read_response(reader)
        assert (status, body) == (b"HTTP/1.1 200 OK", b"onetwo")  # the stream ends whole, then the 503
        refused = await reader.read()
        assert refused.startswith(b"HTTP/1.1 503 ") and b"\r\nretry-after: 1\r\n" in refused
        assert orjson.loads(refused.partition(b"\r\n\r\n")[2])["error"]["type"] == "service_unavailable"


async def test_503s_past_the_limit_are_counted_each_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An overload refuses thousands: a counter says how many, and the log says so once a minute, not once each."""
    refused: list[int] = []
    with caplog.at_level(logging.WARNING, logger="kvgate"):
        async with serve(echo, limit_concurrency=2, on_over_limit=lambda: refused.append(1)) as served:
            _idle = await served.connect()  # holds a place: every other connection is the one past the limit
            for _ in range(5):
                reader, writer = await served.connect()
                writer.write(post(b"x"))
                assert (await read_response(reader))[0].startswith(b"HTTP/1.1 503 ")
                writer.close()
    assert len(refused) == 5
    reports = [r.getMessage() for r in caplog.records if "max_connections" in r.getMessage()]
    assert len(reports) == 1 and "answered 1 request(s) with 503" in reports[0]


async def test_pipelined_body_deadline_waits_for_its_turn() -> None:
    """A request queued behind a slow answer is not timed while it waits (the answer in front of it would be
    cut by its 408); its body deadline runs from its turn."""
    release, started = asyncio.Event(), asyncio.Event()

    async def slow_then_echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            loss = connection_loss(scope)
            assert loss is not None
            loss.resume_reading()  # what the gateway's disconnect watch does: the queued request's bytes come in
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            started.set()
            await release.wait()
            await send({"type": "http.response.body", "body": b"b"})
        else:
            await echo(scope, receive, send)

    async with serve(slow_then_echo, body_timeout_s=0.3) as served:
        reader, writer = await served.connect()
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + post(b"0123456789")[:-8])  # 2 of 10 body bytes
        await asyncio.wait_for(started.wait(), timeout=30)
        await asyncio.sleep(1.0)  # > 3 body timeouts of silence while /slow is still being answered
        release.set()
        status, _, body = await read_response(reader)
        assert (status, body) == (b"HTTP/1.1 200 OK", b"ab")
        assert (await reader.read()).startswith(b"HTTP/1.1 408 ")  # now its turn came, and its body stalled


async def test_client_reading_nothing_of_its_response_is_cut_off() -> None:
    ended = asyncio.Event()

    async def flood(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * 65536
        for _ in range(2000):  # 128 MiB: far more than socket buffers hold; once cut off, send() writes nothing
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        ended.set()

    async with serve(flood, body_timeout_s=0.5) as served:
        _reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
        await asyncio.wait_for(ended.wait(), timeout=60)
        await asyncio.sleep(0.1)
        assert served.state.connections == set()
        writer.close()


async def test_a_slow_but_steady_reader_gets_a_whole_answer_before_the_close() -> None:
    body = bytes(range(256)) * 65536  # 16 MiB, far more than the socket buffers hold

    async def big(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"%d" % len(body)), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})  # all of it at once: no drain() bounds it

    async with serve(big, body_timeout_s=1.0) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := await reader.read(65536):
            received += chunk
            await asyncio.sleep(0.01)  # ~6 MiB/s at most: ~3 body timeouts in all, never silent for one
        assert received.endswith(b"\r\n\r\n" + body)


async def test_a_malformed_request_behind_an_answer_owed_is_refused_after_it() -> None:
    release, started = asyncio.Event(), asyncio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        loss = connection_loss(scope)
        assert loss is not None
        loss.resume_reading()  # as the gateway's disconnect watch does: what follows is read
        started.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"slow"})

    async with serve(slow) as served:
        reader, writer = await served.connect()
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGARBAGE\r\n\r\n")
        await asyncio.wait_for(started.wait(), timeout=30)
        await asyncio.sleep(0.1)  # the garbage has been read
        release.set()
        status, headers, body = await read_response(reader)
        assert (status, body) == (b"HTTP/1.1 200 OK", b"slow")  # the answer owed comes first, whole
        assert headers.get(b"connection") == b"close"
        assert (await reader.read()).startswith(b"HTTP/1.1 400 ")


async def test_a_content_length_that_is_not_digits_is_refused() -> None:
    async def signed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"-1")]})
        await send({"type": "http.response.body", "body": b"x"})

    async with serve(signed) as served:
        reader, writer = await served.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 500 ")
