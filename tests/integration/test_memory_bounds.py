"""Memory that grows with client input is bounded: bodies held by queued requests count against
``admission.queue_max_bytes``. Measured on the real process: its RSS while clients keep trying."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.procs import Proc
from tests.support.promtext import scrape

pytestmark = pytest.mark.e2e

FILLER = 1_000_000  # bytes of a field kvgate does not read: large in memory, cheap in tokens


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send(url: str, body: dict[str, object]) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = orjson.dumps(body)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}"
    )
    sock.sendall(head.encode() + b"\r\n\r\n" + payload)
    return sock


def status_of(sock: socket.socket) -> int:
    return int(sock.recv(65536).split(b" ", 2)[1])


def test_queued_bodies_are_bounded_in_bytes(
    mini_vllm: Callable[..., str], gateway: Callable[..., str], procs: list[Proc]
) -> None:
    upstream = mini_vllm(token_delay_ms=20, num_blocks=100, block_size=16)
    gw = gateway(upstream, {"tokenizer": "heuristic", "admission": {"queue_max_bytes": 3 * 1024 * 1024}})
    pid = procs[-1].pid
    blocker = send(gw, {"prompt": [1] * 16, "max_tokens": 80 * 16, "stream": True})  # holds the KV pool
    deadline = time.monotonic() + 30
    while httpx.get(upstream + "/debug/stats").json()["active"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = rss_bytes(pid)
    queued: list[socket.socket] = []
    refused = 0
    for _ in range(20):  # 20 MB offered, 3 MB may wait
        sock = send(gw, {"prompt": [1] * 16, "max_tokens": 16 * 20, "user": "x" * FILLER})
        sock.settimeout(0.05)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # either it is queued now, or it has its answer
            if scrape(gw)["kvgate_queue_depth"] > len(queued):
                queued.append(sock)
                break
            try:
                assert status_of(sock) == 429
            except TimeoutError:
                continue
            refused += 1
            sock.close()
            break
        else:
            raise AssertionError("the request was neither queued nor answered")
    grown = rss_bytes(pid) - before
    assert len(queued) == 3 and refused == 17
    assert scrape(gw)["kvgate_requests_rejected_total{reason=queue_full}"] == 17
    assert grown < 12 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB while 20 MB were offered"
    for sock in [blocker, *queued]:
        sock.close()
