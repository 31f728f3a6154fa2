"""A client that goes away frees its place: queued, it leaves the queue; in flight, the engine is told."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.support.promtext import assert_ledger_empty, scrape

pytestmark = pytest.mark.e2e


def open_request(url: str, path: str, body: dict[str, object]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = orjson.dumps(body)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def wait_for(predicate: Callable[[], bool], limit_s: float = 10.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > limit_s:
            raise AssertionError("condition not met")
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_in_flight_cancels_upstream_within_1s(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], stream: bool
) -> None:
    upstream = mini_vllm(token_delay_ms=50)
    gw = gateway(upstream, {"tokenizer": "heuristic"})
    sock = open_request(gw, "/v1/completions", {"prompt": "hello", "max_tokens": 200, "stream": stream})
    wait_for(lambda: httpx.get(upstream + "/debug/stats").json()["active"] == 1)
    if stream:  # it is streaming: the head, then events, may come in separate segments
        received = b""
        while b"data: {" not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    time.sleep(0.2)
    closed_at = time.monotonic()
    sock.close()
    wait_for(lambda: len(httpx.get(upstream + "/debug/stats").json()["cancelled"]) == 1)
    stats = httpx.get(upstream + "/debug/stats").json()
    # the engine's clock is the same monotonic clock on the same machine
    assert stats["cancelled"][0] - closed_at < 1.0
    assert stats["active"] == 0 and stats["completed"] == 0
    wait_for(lambda: scrape(gw)["kvgate_reserved_blocks"] == 0)
    m = assert_ledger_empty(gw)
    assert m["kvgate_reservations_released_total{outcome=client_disconnect}"] == 1
    # a client that went away, mid-stream too, is nobody's error: not a 5xx for the rejection alert
    assert m["kvgate_requests_total{code=none}"] == 1 and "kvgate_requests_total{code=5xx}" not in m


def test_disconnect_while_queued_leaves_the_queue(mini_vllm: Callable[..., str], gateway: Callable[..., str]) -> None:
    upstream = mini_vllm(token_delay_ms=10, num_blocks=100, block_size=16)
    gw = gateway(upstream, {"tokenizer": "heuristic"})
    blocker = open_request(gw, "/v1/completions", {"prompt": [1] * 16, "max_tokens": 80 * 16, "stream": True})
    wait_for(lambda: httpx.get(upstream + "/debug/stats").json()["active"] == 1)
    queued = open_request(gw, "/v1/completions", {"prompt": [1] * 16, "max_tokens": 16 * 20})
    wait_for(lambda: scrape(gw)["kvgate_queue_depth"] == 1)
    closed_at = time.monotonic()
    queued.close()
    left_after = wait_for(lambda: scrape(gw)["kvgate_queue_depth"] == 0)
    assert time.monotonic() - closed_at < 1.0 and left_after < 1.0
    blocker.close()
    wait_for(lambda: httpx.get(upstream + "/debug/stats").json()["active"] == 0)
    assert len(httpx.get(upstream + "/debug/stats").json()["started"]) == 1  # the queued one never reached it
    wait_for(lambda: scrape(gw)["kvgate_inflight_requests"] == 0)
    m = assert_ledger_empty(gw)
    assert m["kvgate_client_disconnects_total{stage=queued}"] == 1
    assert m.get("kvgate_client_disconnects_total{stage=waiting}", 0) == 0  # counted once, where it happened
    assert m["kvgate_requests_admitted_total"] == 1
