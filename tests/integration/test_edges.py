"""The client-facing server's edges, through the real HTTP stack with raw sockets: a connection that is silent or
trickles a request is closed (slowloris), a slow but steady body is not, idle keep-alive ends, connections beyond
``max_connections`` get 503, and an ``Upgrade`` request gets a prompt plain-HTTP answer.

Deadlines are 1 s; every wait is generous (3-5 s), and a test asserts what happened, never how fast."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import orjson
import pytest

pytestmark = pytest.mark.e2e

FAST = {"listen": {"header_timeout_s": 1, "body_timeout_s": 1}, "tokenizer": "heuristic"}
WAIT_S = 3.0  # 3x the configured timeout
COMPLETION = orjson.dumps({"model": "mini", "prompt": "hello there", "max_tokens": 2})


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def read_until_closed(sock: socket.socket, limit_s: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open after ``limit_s``."""
    data = b""
    deadline = time.monotonic() + limit_s
    try:
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:
        return data
    except TimeoutError:
        raise AssertionError(f"connection still open after {limit_s} s; received {data!r}") from None
    finally:
        sock.close()


def read_response_head(sock: socket.socket) -> bytes:
    """One response's head (and whatever followed it in the same reads), the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@pytest.fixture
def fast_gateway(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> str:
    return gateway(mini_vllm(), FAST)


def test_silent_connection_is_closed(fast_gateway: str) -> None:
    received = read_until_closed(connect(fast_gateway))
    assert received == b"" or status(received) == 408


@pytest.mark.parametrize("keepalive", [False, True], ids=["first-request", "after-a-response"])
def test_partial_head_is_closed_with_408(fast_gateway: str, keepalive: bool) -> None:
    sock = connect(fast_gateway)
    if keepalive:  # the head deadline applies to every request on a keep-alive connection, not only the first
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(read_response_head(sock)) == 200
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert status(read_until_closed(sock)) == 408


def test_partial_body_is_closed_with_408(fast_gateway: str) -> None:
    sock = connect(fast_gateway)
    sock.sendall(post_head(len(COMPLETION)) + COMPLETION[:10])
    assert status(read_until_closed(sock)) == 408


def test_body_finished_after_an_early_response_then_silence_is_closed(fast_gateway: str) -> None:
    """The app answers before the body is in (405 here, as a 401 or a 413 would be): the rest of the body is not
    read, and the connection closes after the answer rather than staying open for good."""
    sock = connect(fast_gateway)
    sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n0123456789")
    assert status(read_response_head(sock)) == 405
    sock.sendall(b"0123456789")
    assert b"HTTP/1.1" not in read_until_closed(sock)


def test_slow_steady_body_is_served_while_a_silent_one_is_cut(fast_gateway: str) -> None:
    """The body timeout is about silence, not speed: bytes every 0.3 s for ~3 s (body timeout 1 s) are served,
    while a body that stops half way, sent at the same time, is cut."""
    silent = connect(fast_gateway)
    silent.sendall(post_head(len(COMPLETION)) + COMPLETION[:10])
    steady = connect(fast_gateway)
    steady.sendall(post_head(len(COMPLETION)))
    started = time.monotonic()
    for i in range(0, len(COMPLETION), 5):
        time.sleep(0.3)
        steady.sendall(COMPLETION[i : i + 5])
    assert time.monotonic() - started > 2.0  # well beyond the 1 s body timeout in total
    response = read_response_head(steady)
    assert status(response) == 200, response
    steady.close()
    assert status(read_until_closed(silent, limit_s=1.0)) == 408  # its deadline passed ~2 s ago


def test_idle_keepalive_connection_is_closed(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    gw = gateway(mini_vllm(), {"listen": {"keepalive_timeout_s": 1}, "tokenizer": "heuristic"})
    sock = connect(gw)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    response = read_response_head(sock)
    assert status(response) == 200
    assert b"HTTP/1.1" not in read_until_closed(sock)  # the rest of that response, nothing more, then closed


def test_connections_beyond_max_connections_get_503(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    gw = gateway(mini_vllm(), {"listen": {"max_connections": 4, "header_timeout_s": 30}, "tokenizer": "heuristic"})
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    held: list[socket.socket] = []
    try:
        for _ in range(3):  # open keep-alive connections, each known to the server: it answered on it
            held.append(connect(gw))
            held[-1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status(read_response_head(held[-1])) == 200
        probe = connect(gw)
        probe.sendall(request)
        assert status(read_until_closed(probe)) == 200  # the 4th connection is still served
        held.append(connect(gw))
        held[-1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status(read_response_head(held[-1])) == 200
        probe = connect(gw)
        probe.sendall(request)
        assert status(read_until_closed(probe)) == 503  # the 5th is not
        held.pop().close()
        time.sleep(0.2)  # the server notices the close
        probe = connect(gw)
        probe.sendall(request)
        assert status(read_until_closed(probe)) == 200  # a place freed up
    finally:
        for sock in held:
            sock.close()


WEBSOCKET = (
    b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        (b"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\n" + WEBSOCKET + b"\r\n", 404),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + WEBSOCKET + b"\r\n", 200),
        # uvicorn drops what follows an upgrade head in the same read: the app sees an empty body, a 400
        (post_head(len(COMPLETION))[:-2] + WEBSOCKET + b"\r\n" + COMPLETION, 400),
    ],
    ids=["unknown-path", "passthrough", "post-with-body"],
)
def test_upgrade_request_gets_a_prompt_plain_http_answer(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], request_bytes: bytes, expected: int
) -> None:
    """No websocket routes: an Upgrade request is plain HTTP, answered at once, and the connection then closes
    (uvicorn drops what followed an upgrade head, so the connection may be out of step)."""
    gw = gateway(mini_vllm(), {"tokenizer": "heuristic"})  # default timeouts: the close is not a read deadline
    sock = connect(gw)
    sock.sendall(request_bytes)
    response = read_until_closed(sock, limit_s=5.0)
    assert status(response) == expected, response
